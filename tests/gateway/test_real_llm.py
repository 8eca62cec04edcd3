"""The key behaviours against a real local model (llama.cpp's server, e.g. the recipe in
`../shared/local-llm/`): skipped unless AGENT_BUS_REAL_LLM names its OpenAI-compatible base URL.

    AGENT_BUS_REAL_LLM=http://127.0.0.1:8081/v1 python -m pytest -m real_llm tests/gateway/test_real_llm.py

Nothing here hands the model a window or a model name: both are discovered, as for a new user.
A small model is weak, so prompts are direct and asserts check the product (events, stop reasons,
history size), not the model's wording.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.conftest import Topology, json_lines, pid_alive, start_up
from tests.support import Proc, busctl

URL = os.environ.get("AGENT_BUS_REAL_LLM", "")
pytestmark = [pytest.mark.real_llm,
              pytest.mark.skipif(not URL, reason="set AGENT_BUS_REAL_LLM to a running OpenAI-compatible "
                                                 "server's base URL (see ../shared/local-llm/README.md)")]
RUN_TIMEOUT = 300  # a 0.5B model on 2 cores: ~45 tokens/s, prefill ~160 tokens/s
# How a long answer that ran its course ends: `stop`, or `length` when the model wrote up to the
# topology's reply cap (OPENAI_MAX_TOKENS below): asked for "about 250 words", the 0.5B model wrote
# past 600 tokens on its first run, on 2026-12-02, with that session's tree and the one before.
# Anything else (`error`, `aborted`) fails.
RAN_ITS_COURSE = ("stop", "length")


@contextlib.contextmanager
def _running(cwd: Path, env: dict[str, str]) -> Iterator[Topology]:
    """`busctl up` in `cwd` with `env`, stopped after (and any child it left, killed)."""
    proc, ready = start_up(cwd, env=env)
    topology = Topology(proc, cwd, ready)
    pids = topology.child_pids()
    try:
        yield topology
    finally:
        proc.stop(timeout=8)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    cwd = tmp_path_factory.mktemp("real")
    (cwd / "alpha.txt").write_text("The secret word is PINEAPPLE.\n")
    (cwd / "beta.txt").write_text("The other word is MANGO.\n")
    # OPENAI_MAX_TOKENS: the 0.5B model now and then repeats itself until the window is full (one run of
    # ten took 245 s that way); a reply cap is what a user of a small local model sets too.
    with _running(cwd, {"OPENAI_BASE_URL": URL, "OPENAI_API_KEY": "",
                        "OPENAI_MAX_TOKENS": "600"}) as topology:
        yield topology


def run(topo: Topology, *args: str) -> tuple[int, list[dict], float]:
    started = time.monotonic()
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "--json", *args), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, cwd=topo.cwd, env=dict(os.environ))
    took = time.monotonic() - started
    print(f"run {args[-1][:40]!r}: {took:.1f}s")  # the figures of the report (pytest -s)
    return done.returncode, json_lines(done.stdout), took


def end_of(events: list[dict]) -> dict:
    return next(e for e in events if e["type"] == "agent_end")


def test_plain_answer(topo: Topology) -> None:
    code, events, _ = run(topo, "Reply with one short sentence: what is 2 + 2?")
    end = end_of(events)
    assert code == 0 and end.get("stop_reason", "stop") == "stop" and end["final_text"].strip()


def test_tool_using_run(topo: Topology) -> None:
    code, events, _ = run(topo, "--max-turns", "4",
                          "Use the read_file tool to read alpha.txt, then tell me the secret word.")
    calls = [e["tool_name"] for e in events if e["type"] == "tool_execution_start"]
    assert code == 0 and "read_file" in calls, calls


@pytest.mark.xfail(strict=False, reason="measured: Qwen2.5-Coder-0.5B with the recipe's template makes one "
                   "call per turn even with parallel_tool_calls: true; a stronger model should pass")
def test_two_parallel_calls_in_one_turn(topo: Topology) -> None:
    code, events, _ = run(topo, "--max-turns", "3",
                          "Call read_file twice in one turn, in parallel: once with path alpha.txt and "
                          "once with path beta.txt. Then say both words.")
    turns = [e for e in events if e["type"] == "turn_end"]
    assert code == 0 and any(len(t.get("tool_results", [])) >= 2 for t in turns), turns


@pytest.mark.timeout(1200)
def test_ten_runs_back_to_back(topo: Topology) -> None:
    times = []
    for i in range(10):
        code, events, took = run(topo, *(["-c"] if i else []), f"Say the number {i}.")
        assert code == 0 and end_of(events).get("stop_reason", "stop") == "stop", events[-1:]
        times.append(took)
    print("ten runs:", " ".join(f"{t:.1f}" for t in times))


def test_abort_mid_answer_keeps_its_partial_text(topo: Topology) -> None:
    args = busctl("run", "--hub", topo.endpoint, "--json",
                  "Write a long story about a lighthouse keeper, at least 400 words.")
    proc = Proc(args, cwd=topo.cwd)
    try:
        proc.wait_line(lambda s: '"message_update"' in s, RUN_TIMEOUT)
        proc.wait_line(lambda s: '"message_update"' in s, 30)  # a few deltas in
        proc.signal(signal.SIGINT)
        assert proc.popen.wait(30) == 130
        end = json.loads(proc.wait_line(lambda s: '"agent_end"' in s, 10))
        message = json.loads(proc.wait_line(lambda s: '"message_end"' in s and '"aborted"' in s, 10))
    finally:
        proc.stop()
    assert end["stop_reason"] == "aborted"
    text = "".join(p.get("text", "") for p in message["message"]["content"])
    assert text.strip() and message["message"]["model"] not in ("", "unknown")


@pytest.mark.timeout(1800)
def test_compaction_on_the_discovered_window_keeps_history_under_half(topo: Topology) -> None:
    compactions: list[dict] = []
    for i in range(12):
        code, events, _ = run(topo, *(["-c"] if i else []),
                              f"Write about 250 words on topic number {i}: the history of bread.")
        assert code == 0 and end_of(events).get("stop_reason", "stop") in RAN_ITS_COURSE, \
            events[-1:]
        compactions += [e for e in events if e["type"] == "compaction_complete"]
        if compactions:
            break
    assert compactions, "12 runs never filled the 4,096-token window"
    assert all(c["compacted"] and c["tokens_after"] < 2048 for c in compactions), compactions


# --- a file bigger than the window, through both providers (issue 34, acceptance 2) ----------

FILE_QUESTION = ('Call read_file with exactly these arguments: {"path": "%s"}. '
                 "Then tell me the last line.")
TOO_SMALL = "does not fit the model's context window"


def _numbered_file(lines: int) -> str:
    """~95 bytes a line, each with its own code word (`cw0042`): an answer quoting any of them
    comes from the file."""
    return "".join(f"Line {i:04d} of {lines:04d}: the code word of this line is cw{i:04d}, "
                   "nothing else matters here.\n" for i in range(1, lines + 1))


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def provider_topo(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    """One topology per provider against the same server: OpenAI's /v1/chat/completions and
    llama.cpp's Anthropic-compatible /v1/messages (its window discovered the same way)."""
    cwd = tmp_path_factory.mktemp(f"real-{request.param}")
    (cwd / "mid13.txt").write_text(_numbered_file(140))  # 13 KB
    (cwd / "mid26.txt").write_text(_numbered_file(280))  # 26 KB
    prefix = request.param.upper()
    base = URL if request.param == "openai" else URL.removesuffix("/v1")
    with _running(cwd, {f"{prefix}_BASE_URL": base, f"{prefix}_API_KEY": "",
                        f"{prefix}_MAX_TOKENS": "600"}) as topology:
        yield topology


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", ["mid13.txt", "mid26.txt"])
def test_a_file_bigger_than_the_window_is_answered_from_it_or_fails_clearly(
        provider_topo: Topology, name: str) -> None:
    """Ten runs (AGENT_BUS_REAL_LLM_RUNS): a run answers from the file (quotes a code word of it)
    or fails with the error that says the question and the result do not fit; the others are
    the weak model's slips, counted and shown (e.g. a read_file call with arguments it made up)."""
    tally = {"from the file": 0, "clear error": 0, "model misused read_file": 0}
    others: list[str] = []
    for _ in range(int(os.environ.get("AGENT_BUS_REAL_LLM_RUNS", "10"))):
        code, events, _ = run(provider_topo, "--new-session", FILE_QUESTION % name)
        end = end_of(events)
        # not the arguments it was given (an invented offset/limit: past the end, out of range)
        misused = any(e["type"] == "tool_execution_start" and e["tool_name"] == "read_file"
                      and e.get("args") != {"path": name} for e in events)
        if code == 0 and any(f"cw{i:04d}" in end["final_text"] for i in range(1, 281)):
            tally["from the file"] += 1
        elif code != 0 and TOO_SMALL in (end.get("error") or ""):
            tally["clear error"] += 1
        elif misused:
            tally["model misused read_file"] += 1
        else:
            called = [(e["tool_name"], e.get("args")) for e in events
                      if e["type"] == "tool_execution_start"]
            others.append(f"exit {code}, calls {called}, {end.get('stop_reason')}: "
                          f"{end['final_text'][:150]!r} {end.get('error') or ''}"[:400])
    print(f"{name}: {tally}, others: {len(others)}", *others, sep="\n  ")
    # Measured (issue 34, 2026-12-01, 10 runs a case, openai/anthropic x 13/26 KB): 8, 8, 8, 7
    # quote the file (6-8 before read_file past the end showed the last line); the rest are the
    # 0.5B model's own slips (read_file with an offset it made up, "line 0001" as the last),
    # never a refused prompt or a lost question. Half is the floor a regression would break.
    runs = sum(tally.values()) + len(others)
    assert tally["from the file"] + tally["clear error"] >= runs / 2, (tally, others)
