"""A tool call cut at `max_tokens` (issue 45 §1): its unterminated JSON never reaches a provider,
llama.cpp's "Failed to parse tool call arguments as JSON" is not retried, and the session stays
usable. `busctl fake-llm` plays llama.cpp: `strict_tool_json` refuses a history holding invalid
tool-call JSON with HTTP 500, `cut_at_max_tokens` cuts a reply (a call mid-arguments) there."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.bus.messages import (
    AssistantMessage,
    LlmRequest,
    TextPart,
    ToolCall,
    ToolResultMessage,
    user_text,
)
from tests.cli.conftest import Topology, json_lines, running_up
from tests.gateway.conftest import FAST_RETRY, TOOLS, RetryLog, engine_for
from tests.support import busctl

StartServer = Callable[[ScriptLike], FakeLLMServer]
CUT = '{"path": "story.txt", "content": "Once upon a time there was a lighthouse keep'
PARSE_ERROR = ("Failed to parse tool call arguments as JSON: [json.exception.parse_error.101] parse "
               "error at line 1, column 67: syntax error while parsing value - invalid string: "
               "missing closing quote; last read: '\"Once upon a time'")


def cut_history() -> list:
    """What the loop keeps after a reply cut mid-call: the call verbatim, the error beside it."""
    call = ToolCall(id="call_1", name="read_file", arguments=CUT)
    return [
        user_text("write a story to story.txt"),
        AssistantMessage(content=[TextPart("Writing."), call], stop_reason="length"),
        ToolResultMessage(tool_call_id="call_1", tool_name="read_file", is_error=True,
                          content=[TextPart('Tool call "read_file" was not executed: truncated')]),
        user_text("and now?"),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_a_history_holding_a_cut_call_goes_out_as_valid_json(
        fake_server: StartServer, provider: str) -> None:
    server = fake_server({"strict_tool_json": True, "rules": [{"reply": {"text": "fine"}}]})
    request = LlmRequest(messages=cut_history(), tools=TOOLS, retry=FAST_RETRY)
    async with engine_for(server, provider) as engine:
        reply = await engine.complete(request)
    assert reply.stop_reason == "stop" and reply.text == "fine", reply.error
    assert server.tool_json_refusals == 0 and len(server.requests) == 1
    sent = json.dumps(server.bodies[0])
    assert "lighthouse" not in sent  # the cut text is not sent on: `{}` stands for it
    assert "was not executed: truncated" in sent  # with the error result beside it
    if provider == "openai":
        calls = [m for m in server.bodies[0]["messages"] if m.get("tool_calls")]
        assert calls[0]["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.anyio
@pytest.mark.parametrize("status", [400, 500])
async def test_a_request_the_server_could_not_parse_is_not_retried(
        fake_server: StartServer, status: int) -> None:
    server = fake_server([{"fail": {"status": status, "message": PARSE_ERROR}}] * 4)
    retries = RetryLog()
    async with engine_for(server) as engine:
        reply = await engine.complete(LlmRequest(messages=[user_text("hi")], retry=FAST_RETRY),
                                      on_retry=retries)
    assert reply.stop_reason == "error" and "Failed to parse tool call arguments" in (reply.error or "")
    assert len(server.requests) == 1 and retries.calls == []


@pytest.mark.anyio
async def test_other_server_errors_are_still_retried(fake_server: StartServer) -> None:
    """A 500 about the model's own output (llama.cpp's "Failed to parse input at pos N" when the
    model wrote a call it could not place) may go another way next time: retried as before."""
    server = fake_server([{"fail": {"status": 500, "message": "Failed to parse input at pos 13: ```"}},
                          {"reply": {"text": "ok"}}])
    async with engine_for(server) as engine:
        reply = await engine.complete(LlmRequest(messages=[user_text("hi")], retry=FAST_RETRY))
    assert reply.text == "ok" and len(server.requests) == 2


# --- whole processes: the reproduction (an agent with write_file, max_tokens = 40) ----

SCRIPT = {
    "strict_tool_json": True,
    "cut_at_max_tokens": True,
    "close_after_stream": True,
    "rules": [
        {"contains": ["long sentence"], "reply": {"text": "", "tool_calls": [
            {"name": "write_file", "arguments": {
                "path": "sentence.txt",
                "content": "This is a long sentence about a lighthouse keeper " * 8}}]}},
        {"tool_result": True, "reply": {"text": "It was too long to write."}},
    ],
    "echo": True,
}
TOPOLOGY = """
[[agents]]
name = "writer"
tools = ["write_file"]
max_tokens = 40
"""


@pytest.fixture
def llama_like() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(SCRIPT) as srv:
        yield srv


@pytest.fixture
def topo(tmp_path: Path, llama_like: FakeLLMServer) -> Iterator[Topology]:
    (tmp_path / "topology.toml").write_text(TOPOLOGY)
    env = {"OPENAI_BASE_URL": llama_like.base_url, "OPENAI_API_KEY": ""}
    with running_up(tmp_path, "-c", "topology.toml", env=env) as topology:
        yield topology


def run(topo: Topology, *args: str) -> tuple[int, list[dict]]:
    done = subprocess.run(busctl("run", "--hub", topo.endpoint, "--agent", "writer", "--json", *args),
                          capture_output=True, text=True, timeout=60, cwd=topo.cwd)
    return done.returncode, json_lines(done.stdout)


def test_a_call_cut_at_max_tokens_leaves_the_session_usable(
        topo: Topology, llama_like: FakeLLMServer) -> None:
    code, events = run(topo, "Write a long sentence to sentence.txt with write_file.")
    end = next(e for e in events if e["type"] == "agent_end")
    results = [e for e in events if e["type"] == "tool_execution_end"]
    assert code == 0 and end.get("stop_reason", "stop") == "stop", (code, end.get("error"), end)
    assert len(results) == 1 and "output token limit" in json.dumps(results[0]["result"])
    assert not (topo.cwd / "sentence.txt").exists()  # the cut call never ran
    assert not any(e["type"] == "llm_retry" for e in events)
    code, events = run(topo, "-c", "are you still there?")  # the same session, its cut call in it
    end = next(e for e in events if e["type"] == "agent_end")
    assert code == 0 and end["final_text"] == "echo: are you still there?", (code, end.get("error"), end)
    assert llama_like.tool_json_refusals == 0
    cut = llama_like.bodies[0]["max_tokens"] == 40 and llama_like.bodies[-1]["messages"]
    assert cut and [m["tool_calls"][0]["function"]["arguments"] for m in cut if m.get("tool_calls")] == ["{}"]
