"""The key behaviours against a real local model (llama.cpp's server, e.g. the recipe in
`../shared/local-llm/`): skipped unless AGENT_BUS_REAL_LLM names its OpenAI-compatible base URL.

    AGENT_BUS_REAL_LLM=http://127.0.0.1:8081/v1 python -m pytest -m real_llm tests/gateway/test_real_llm.py

Nothing here hands the model a window or a model name: both are discovered, as for a new user.
A small model is weak, so prompts are direct and asserts check the product (events, stop reasons,
history size), not the model's wording.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.cli.conftest import Topology, json_lines, pid_alive, start_up
from tests.gateway.conftest import FAILED
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


class RealTopology(Topology):
    """A topology with a state folder of its own (its event log, sessions, process logs): kept
    when one of its tests failed, for the diagnosis, and removed when all passed."""

    state: Path


@contextlib.contextmanager
def _running(cwd: Path, env: dict[str, str], *args: str) -> Iterator[RealTopology]:
    """`busctl up` in `cwd` with `env`, stopped after (and any child it left, killed)."""
    state = cwd.parent / f"{cwd.name}-state"
    proc, ready = start_up(cwd, *args, env={**env, "BUSCTL_STATE_HOME": str(state)})
    topology = RealTopology(proc, cwd, ready)
    topology.state = state
    pids = topology.child_pids()
    failed = len(FAILED)
    try:
        yield topology
    finally:
        proc.stop(timeout=8)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)
        if len(FAILED) == failed:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"\nstate folder of the failed test(s) kept: {state}")


def why(code: int, events: list[dict], topo: RealTopology, stderr: str = "") -> str:
    """What a failed assertion shows: exit code, stop reason, error, the answer's start, the
    last lines of stderr, and the state folder (kept)."""
    end = next((e for e in events if e["type"] == "agent_end"), {})
    tail = " | ".join(stderr.strip().splitlines()[-5:])
    return (f"exit {code}, stop_reason {end.get('stop_reason', '(no agent_end)')!r}, "
            f"error {end.get('error')!r}, final_text {str(end.get('final_text', ''))[:200]!r}, "
            f"stderr: {tail[-600:]!r}; state folder (kept): {topo.state}")


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealTopology]:
    cwd = tmp_path_factory.mktemp("real")
    (cwd / "alpha.txt").write_text("The secret word is PINEAPPLE.\n")
    (cwd / "beta.txt").write_text("The other word is MANGO.\n")
    # OPENAI_MAX_TOKENS: the 0.5B model now and then repeats itself until the window is full (one run of
    # ten took 245 s that way); a reply cap is what a user of a small local model sets too.
    with _running(cwd, {"OPENAI_BASE_URL": URL, "OPENAI_API_KEY": "",
                        "OPENAI_MAX_TOKENS": "600"}) as topology:
        yield topology


class Ran:
    """One `busctl run --json`: its exit code, events, seconds, and `why` it failed."""

    def __init__(self, topo: RealTopology, done: subprocess.CompletedProcess[str], took: float) -> None:
        self.code, self.events, self.took = done.returncode, json_lines(done.stdout), took
        self.why = why(done.returncode, self.events, topo, done.stderr)

    def __iter__(self) -> Iterator[Any]:  # code, events, took = run(...)
        return iter((self.code, self.events, self.took))


def run(topo: RealTopology, *args: str) -> Ran:
    started = time.monotonic()
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "--json", *args), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, cwd=topo.cwd, env=dict(os.environ))
    took = time.monotonic() - started
    print(f"run {args[-1][:40]!r}: {took:.1f}s")  # the figures of the report (pytest -s)
    return Ran(topo, done, took)


def end_of(events: list[dict]) -> dict:
    return next(e for e in events if e["type"] == "agent_end")


def test_plain_answer(topo: RealTopology) -> None:
    ran = run(topo, "Reply with one short sentence: what is 2 + 2?")
    end = end_of(ran.events)
    assert ran.code == 0 and end.get("stop_reason", "stop") == "stop" and end["final_text"].strip(), ran.why


def test_tool_using_run(topo: RealTopology) -> None:
    ran = run(topo, "--max-turns", "4",
              "Use the read_file tool to read alpha.txt, then tell me the secret word.")
    calls = [e["tool_name"] for e in ran.events if e["type"] == "tool_execution_start"]
    assert ran.code == 0 and "read_file" in calls, (calls, ran.why)


@pytest.mark.xfail(strict=False, reason="measured: Qwen2.5-Coder-0.5B with the recipe's template makes one "
                   "call per turn even with parallel_tool_calls: true; a stronger model should pass")
def test_two_parallel_calls_in_one_turn(topo: RealTopology) -> None:
    code, events, _ = run(topo, "--max-turns", "3",
                          "Call read_file twice in one turn, in parallel: once with path alpha.txt and "
                          "once with path beta.txt. Then say both words.")
    turns = [e for e in events if e["type"] == "turn_end"]
    assert code == 0 and any(len(t.get("tool_results", [])) >= 2 for t in turns), turns


@pytest.mark.timeout(1200)
def test_ten_runs_back_to_back(topo: RealTopology) -> None:
    times = []
    for i in range(10):
        ran = run(topo, *(["-c"] if i else []), f"Say the number {i}.")
        # a tool call the model cut at the reply cap no longer poisons the session (issue 45 §1)
        assert ran.code == 0 and end_of(ran.events).get("stop_reason", "stop") == "stop", ran.why
        times.append(ran.took)
    print("ten runs:", " ".join(f"{t:.1f}" for t in times))


def test_abort_mid_answer_keeps_its_partial_text(topo: RealTopology) -> None:
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
def test_compaction_on_the_discovered_window_keeps_history_under_half(topo: RealTopology) -> None:
    compactions: list[dict] = []
    for i in range(12):
        ran = run(topo, *(["-c"] if i else []),
                  f"Write about 250 words on topic number {i}: the history of bread.")
        assert ran.code == 0 and end_of(ran.events).get("stop_reason", "stop") in RAN_ITS_COURSE, ran.why
        compactions += [e for e in ran.events if e["type"] == "compaction_complete"]
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
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealTopology]:
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
        provider_topo: RealTopology, name: str) -> None:
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


# --- issue 45, acceptance 1: the three reproductions ------------------------------------------

WRITER = """
[[agents]]
name = "writer"
tools = ["write_file"]
max_tokens = 40
"""
PARSE_REFUSAL = "Failed to parse tool call arguments"


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def writer_topo(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealTopology]:
    """An agent whose replies are cut at 40 tokens: a write_file call of a long sentence is cut
    mid-arguments (unterminated JSON)."""
    cwd = tmp_path_factory.mktemp(f"writer-{request.param}")
    (cwd / "topology.toml").write_text(WRITER)
    prefix = request.param.upper()
    base = URL if request.param == "openai" else URL.removesuffix("/v1")
    with _running(cwd, {f"{prefix}_BASE_URL": base, f"{prefix}_API_KEY": ""},
                  "-c", "topology.toml") as topology:
        yield topology


@pytest.mark.timeout(900)
def test_a_tool_call_cut_at_max_tokens_leaves_the_session_usable(writer_topo: RealTopology) -> None:
    first = run(writer_topo, "--agent", "writer", "--max-turns", "3",
                "Use write_file to write this long sentence to sentence.txt: The old lighthouse "
                "keeper climbed the spiral stairs every evening to light the great lamp that "
                "guided the fishing boats home through the fog.")
    cut = [e for e in first.events if e["type"] == "tool_execution_end"
           and "output token limit" in json.dumps(e.get("result"))]
    print(f"first run: exit {first.code}, {len(cut)} cut call(s), {first.took:.1f}s")
    assert PARSE_REFUSAL not in json.dumps(first.events), first.why
    then = run(writer_topo, "--agent", "writer", "-c", "Reply with one word: OK.")
    assert PARSE_REFUSAL not in json.dumps(then.events), then.why
    assert then.code == 0 and end_of(then.events).get("stop_reason", "stop") in RAN_ITS_COURSE, then.why
    print(f"run -c after it: exit {then.code}, {then.took:.1f}s: {end_of(then.events)['final_text'][:80]!r}")


@pytest.mark.timeout(1800)
def test_the_first_note_survives_compaction(topo: RealTopology) -> None:
    """Eight notes continued in one session, a code word in the first: compaction summarises
    every older message (`left_out` 0), and the model still answers the code word (the first
    prompt rides verbatim beside a summary that, from this model, drops it)."""
    pad = "This note is long on purpose, to fill the context window of the model. " * 30
    compactions: list[dict] = []
    for i in range(8):
        word = "The secret code word is ZEBRA-42. " if i == 0 else ""
        ran = run(topo, *(["-c"] if i else ["--new-session"]),
                  f"Note {i}: {word}{pad}Reply only with: Noted.")
        assert ran.code == 0 and end_of(ran.events).get("stop_reason", "stop") in RAN_ITS_COURSE, ran.why
        compactions += [e for e in ran.events if e["type"] == "compaction_complete"]
        if i == 0:  # the module's topology holds the other tests' sessions too
            session = next(e["session"] for e in ran.events if e["type"] == "agent_start")
    asked = run(topo, "-c", "What is the secret code word? Reply with the code word only.")
    answer = end_of(asked.events)["final_text"]
    print(f"compactions: {[(c['tokens_before'], c['tokens_after'], c.get('summary_calls'), c.get('left_out', 0)) for c in compactions]}; "
          f"the code word asked after them: {answer[:80]!r} ({'ZEBRA-42' in answer.upper()})")
    assert compactions and all(c["compacted"] and not c.get("left_out") for c in compactions), compactions
    # The product: the stored history's summary carries the first note verbatim (this model's
    # own summary of the eight notes drops it: "Summary of conversation:..." on 2026-12-06).
    summaries = stored_summaries(topo, session)
    assert summaries and "ZEBRA-42" in summaries[-1].get("first_prompt", ""), summaries
    # The model reads it: before the first prompt was kept it answered `secretcode` and
    # `1234567890123456789`; now the word, give or take a letter a 0.5B model drops (`ZEBA-42`).
    said = max((difflib.SequenceMatcher(None, "ZEBRA-42", w).ratio()
                for w in answer.upper().split()), default=0.0)
    assert asked.code == 0 and said >= 0.8, (answer, asked.why)


def stored_summaries(topo: RealTopology, session: str) -> list[dict[str, Any]]:
    """The compaction summaries of `session` in the coordinators' conversation stores."""
    found: list[dict[str, Any]] = []
    for db in sorted(topo.state.rglob("conversations.sqlite")):
        with contextlib.closing(sqlite3.connect(db)) as conn:
            rows = conn.execute("SELECT body FROM messages WHERE session = ? ORDER BY idx",
                                (session,)).fetchall()
        found += [m for m in (msgspec.msgpack.decode(body) for body, in rows)
                  if m.get("role") == "compaction_summary"]
    return found


@pytest.mark.timeout(1800)
def test_a_number_heavy_history_never_goes_above_90_percent(topo: RealTopology) -> None:
    """Notes of numbers (a tokenizer's ~2.75 bytes a token): every request's real prompt, as
    the server reports it, stays within 90% of the 4,096 window."""
    prompts: list[int] = []
    for i in range(8):
        # ~960 bytes; Qwen2.5 counts a digit a token: ~850 tokens, a fifth of the window
        digits = " ".join(f"{i:02d}{n * 7919 % 100000:05d}" for n in range(120))
        ran = run(topo, *(["-c"] if i else ["--new-session"]),
                  f"Remember these numbers: {digits}. Reply only with: Noted.")
        assert ran.code == 0 and end_of(ran.events).get("stop_reason", "stop") in RAN_ITS_COURSE, ran.why
        usages = [e["message"]["usage"] for e in ran.events if e["type"] == "message_end"
                  and e["message"].get("role") == "assistant" and e["message"].get("usage")]
        prompts += [u.get("input", 0) + u.get("cache_read", 0) for u in usages if not u.get("estimated")]
    print(f"real prompts: {prompts} (90% of 4,096: {0.9 * 4096:.0f})")
    assert prompts and max(prompts) <= 0.9 * 4096, prompts
