"""Whole runs a weak model makes, through `busctl up` and `busctl run` against `busctl fake-llm`
playing llama.cpp (one model, a 4,096-token window, HTTP 400 past it): the repeat guard,
`--max-turns`, and a conversation that outgrows the window."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import Topology, json_lines, running_up
from tests.support import busctl, running

SCRIPT = {
    "models": ["qwen-local"],
    "context_window": 4096,
    "close_after_stream": True,
    "rules": [
        # the weak model's habit: the same call, again and again
        {"contains": ["loop"], "tool_result": None,
         "reply": {"text": "Looking.", "tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}},
        # a long-winded answer: a few of these fill the 4,096-token window
        {"contains": ["essay"], "reply": {"text": "essay " + "blah " * 600}},
        {"contains": ["summarizing the conversation"], "reply": {"text": "<summary>essays were written</summary>"}},
        # a note taken: a short acknowledgement with a long-winded tail (eight of them fill the window)
        {"contains": ["take a note"], "reply": {"text": "Noted. " + "I will remember that. " * 40}},
        # an answer cut at max_tokens
        {"contains": ["cut me"], "reply": {"text": "this answer stops mid-sent", "finish": "length"}},
        # the question over a file bigger than the window (issue 34, acceptance 1)
        {"contains": ["last line"], "reply": {"text": "", "tool_calls": [
            {"name": "read_file", "arguments": {"path": "mid3.txt"}}]}},
        {"contains": ["last line"], "tool_result": True,
         "reply": {"text": "From the file: {tool_results}"}},
    ],
    "echo": True,
}


@pytest.fixture(scope="module")
def llama_like() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(SCRIPT) as srv:
        yield srv


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, llama_like: FakeLLMServer) -> Iterator[Topology]:
    cwd = tmp_path_factory.mktemp("weak")
    env = {"OPENAI_BASE_URL": llama_like.base_url, "OPENAI_API_KEY": ""}
    with running_up(cwd, env=env) as topology:
        yield topology


def run(topo: Topology, *args: str, timeout: float = 60) -> tuple[int, list[dict]]:
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "--json", *args), capture_output=True,
                          text=True, timeout=timeout, cwd=topo.cwd, env=dict(os.environ))
    return done.returncode, json_lines(done.stdout)


def end_of(events: list[dict]) -> dict:
    return next(e for e in events if e["type"] == "agent_end")


def tool_texts(events: list[dict]) -> list[str]:
    return [json.dumps(e["result"]) for e in events if e["type"] == "tool_execution_end"]


def test_max_turns_bounds_the_run(topo: Topology) -> None:
    code, events = run(topo, "--new-session", "--max-turns", "2", "loop over the files")
    assert code == 3 and end_of(events)["stop_reason"] == "max_iterations"  # busctl run: exit 3
    assert sum(e["type"] == "turn_start" for e in events) == 2


def test_the_repeat_guard_tells_the_model_then_stops_the_run(topo: Topology) -> None:
    code, events = run(topo, "--new-session", "loop over the files")
    texts = tool_texts(events)
    end = end_of(events)
    assert code == 1 and end["stop_reason"] == "error"
    assert "Stopped: the model called `list_dir` with the same arguments 6 times" in end["error"]
    assert len(texts) == 6 and "in a row" not in texts[1] and "call 3 in a row" in texts[2]


def test_max_turns_is_checked_at_the_cli(topo: Topology) -> None:
    code, _ = run(topo, "--max-turns", "0", "hi")
    assert code == 2


def test_a_conversation_that_outgrows_the_window_is_compacted_under_half_and_never_refused(
        topo: Topology, llama_like: FakeLLMServer) -> None:
    compactions: list[dict] = []
    for i in range(8):
        args = [] if i == 0 else ["--continue"]  # one conversation: each run continues the last
        code, events = run(topo, *args, f"write essay {i}")
        assert code == 0 and end_of(events).get("stop_reason", "stop") == "stop", events[-1]
        compactions += [e for e in events if e["type"] == "compaction_complete"]
        # the answer is never held back by compaction: it comes at the start of a run, not its end
        types = [e["type"] for e in events]
        assert "compaction_start" not in types[types.index("turn_end"):]
    assert compactions and all(c["compacted"] for c in compactions)
    assert all(0 < c["tokens_after"] < 2048 for c in compactions), compactions
    assert llama_like.context_refusals == 0


QUESTION = 'Call read_file with exactly these arguments: {"path": "mid3.txt"}. Then tell me the last line.'


def test_a_file_bigger_than_the_window_keeps_the_question_and_a_cut_of_the_file(
        topo: Topology, llama_like: FakeLLMServer) -> None:
    """Issue 34 §1: a 13 KB read_file on a 4,096-token window. Every request after the tool
    holds the question and a cut of the result, none exceeds the window, the answer is from it."""
    lines = [f"line {i:04d}: " + "lorem ipsum dolor sit amet " * 3 for i in range(140)]
    (topo.cwd / "mid3.txt").write_text("\n".join(lines) + "\n")
    assert 12_000 < (topo.cwd / "mid3.txt").stat().st_size < 14_000
    seen, refusals = len(llama_like.requests), llama_like.context_refusals
    code, events = run(topo, "--new-session", QUESTION)
    assert code == 0 and end_of(events).get("stop_reason", "stop") == "stop", events[-1]
    bodies = [r.body for r in llama_like.requests[seen:]]
    after_tool = [b for b in bodies if any(m.get("role") == "tool" for m in b["messages"])]
    assert after_tool, bodies
    for body in after_tool:
        text = json.dumps(body["messages"])
        assert "Then tell me the last line." in text and "line 0000: lorem" in text
        assert len(json.dumps(body["messages"])) // 4 + 1 <= 4096  # the fake's own estimate
    assert llama_like.context_refusals == refusals
    assert "From the file: - line 0000" in end_of(events)["final_text"]


def test_an_answer_cut_at_max_tokens_says_length_in_agent_end_and_on_stderr(topo: Topology) -> None:
    code, events = run(topo, "--new-session", "cut me short")
    assert code == 0 and end_of(events)["stop_reason"] == "length"
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "cut me short"), capture_output=True,
                          text=True, timeout=60, cwd=topo.cwd, env=dict(os.environ))
    assert done.returncode == 0 and done.stdout == "this answer stops mid-sent\n"
    assert "length: the answer was cut" in done.stderr and "max_tokens" in done.stderr


def test_export_totals_are_every_billed_call_with_a_compaction_an_abort_and_a_retry(
        topo: Topology, llama_like: FakeLLMServer) -> None:
    """Issue 34 §5: what the scripted server billed (the usage it sent), plus the estimates of
    the replies it sent none for (a broken stream that was retried, an aborted one), is what
    `busctl export` and `busctl diff` total; the compaction's summary does not stream as text."""
    slow = {"text": "word " * 300, "chunk_size": 5, "chunk_delay": 0.02}
    llama_like.set_script({**SCRIPT, "steps": [
        {"fail": {"kind": "drop", "after_events": 4}},  # run 1: a broken stream, retried
        {"reply": {"text": "one"}},
        {"reply": {"text": "two", "usage": {"input": 3500, "output": 5}}},  # run 2: fills the window
        {"reply": {"text": "<summary>one and two were said</summary>"}},  # run 3: compaction
        {"reply": {"text": "three"}},
        {"reply": slow},  # run 4: aborted mid-answer
    ]})
    seen = len(llama_like.requests)
    experiment = ["--experiment", "billed"]
    try:
        events: list[dict] = []
        for i, prompt in enumerate(["say one", "say two", "say three"]):
            code, run_events = run(topo, *experiment, *(["-c"] if i else []), prompt)
            assert code == 0, run_events[-1]
            events += run_events
        with running(busctl("run", "--hub", topo.endpoint, "--json", *experiment, "-c", "go on"),
                     cwd=topo.cwd) as proc:
            proc.wait_line(lambda s: '"message_update"' in s, 30)
            proc.wait_line(lambda s: '"message_update"' in s, 10)
            proc.signal(signal.SIGINT)
            assert proc.popen.wait(30) == 130
            proc.wait_line(lambda s: '"agent_end"' in s, 10)
            events += json_lines(proc.output())
    finally:
        llama_like.set_script(SCRIPT)
    sent = [r.usage for r in llama_like.requests[seen:] if r.usage is not None]
    assert len(sent) == 4  # one, two, the summary, three: all of their usage went out
    server = sum(u.input + u.cached + u.output for u in sent)
    retry = next(e for e in events if e["type"] == "llm_retry")
    aborted = next(e["message"] for e in events if e["type"] == "message_end"
                   and e["message"].get("stop_reason") == "aborted")
    compaction = next(e for e in events if e["type"] == "compaction_complete")
    estimates = [retry["usage"], aborted["usage"]]
    assert all(u["estimated"] and u["total"] > 0 for u in estimates), estimates
    assert compaction["compacted"] and compaction["usage"]["total"] == sent[2].input + sent[2].output
    summary_run = next(e["run_id"] for e in events if e["type"] == "compaction_complete")
    assert not any(e["type"] == "message_update" and "one and two" in json.dumps(e)
                   for e in events if e.get("run_id") == summary_run)  # not streamed as text
    expected = server + sum(u["total"] for u in estimates)
    exported = subprocess.run(busctl("export", "--hub", topo.endpoint, *experiment, "-o", os.devnull),
                              capture_output=True, text=True, timeout=60, cwd=topo.cwd)
    totals = json.loads(exported.stderr.strip().splitlines()[-1])
    assert totals["total"]["total"] == expected and totals["total"]["estimated"], totals
    diffed = subprocess.run(busctl("diff", "--hub", topo.endpoint, "--json", "billed", "billed"),
                            capture_output=True, text=True, timeout=60, cwd=topo.cwd)
    assert json.loads(diffed.stdout)["totals"]["a"]["tokens"] == expected


def test_compaction_summarises_the_oldest_notes_too(topo: Topology, llama_like: FakeLLMServer) -> None:
    """Issue 45 §2: eight notes continued in one session, a code word in the first, on a 4,096
    window. Every older message reaches the summariser (the first note was dropped to fit the
    call in half the window), and `compaction_complete` says nothing was left out."""
    seen = len(llama_like.requests)
    compactions: list[dict] = []
    filler = "This note is padded so that eight of them fill the window. " * 12
    for i in range(8):
        word = "The secret code word is ZEBRA-42. " if i == 0 else ""
        code, events = run(topo, *(["-c"] if i else ["--new-session"]), f"Take a note {i}: {word}{filler}")
        end = end_of(events)
        assert code == 0 and end.get("stop_reason", "stop") == "stop", (code, end.get("error"), end)
        compactions += [e for e in events if e["type"] == "compaction_complete"]
    assert compactions and all(c["compacted"] and not c.get("left_out") for c in compactions), compactions
    summaries = [json.dumps(r.body["messages"]) for r in llama_like.requests[seen:]
                 if "summarizing the conversation" in json.dumps(r.body["messages"][-1:])]
    assert summaries and "ZEBRA-42" in summaries[0], summaries[:1]
    # The scripted summariser drops the note, as Qwen2.5-0.5B did ("Summary of conversation:...");
    # the first prompt rides verbatim beside the summary, so the model still reads the code word.
    last = json.dumps(llama_like.requests[-1].body["messages"])
    assert "essays were written" in last and "ZEBRA-42" in last, last[:400]
