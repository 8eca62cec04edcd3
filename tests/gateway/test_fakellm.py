"""The fake LLM servers themselves: wire formats, rules/demo mode, script files, the CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike, demo_script, load_script
from agent_bus.bus.messages import (
    AssistantMessage,
    LlmRequest,
    ToolResultMessage,
    tool_result_text,
    user_text,
)
from tests.gateway.conftest import FAST_RETRY, TOOLS, engine_for, request

StartServer = Callable[[ScriptLike], FakeLLMServer]
CHAT = "/chat/completions"


def test_openai_non_streaming_json(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "hi", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]}}])
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    data = httpx.post(srv.base_url + CHAT, json=body).json()
    message = data["choices"][0]["message"]
    assert message["content"] == "hi" and data["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert data["usage"]["prompt_tokens"] > 0


def test_anthropic_non_streaming_json_and_error_format(fake_server: StartServer) -> None:
    srv = fake_server(
        [{"reply": {"text": "hey", "thinking": "hm"}}, {"fail": {"status": 429, "retry_after": "3"}}]
    )
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    data = httpx.post(srv.base_url + "/messages", json=body).json()
    assert [b["type"] for b in data["content"]] == ["thinking", "text"] and data["stop_reason"] == "end_turn"
    failed = httpx.post(srv.base_url + "/messages", json=body)
    assert failed.status_code == 429 and failed.headers["retry-after"] == "3"
    assert failed.json()["error"]["type"] == "rate_limit_error"


def test_openai_stream_wire_format(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "abcdef", "chunk_size": 2}}])
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
    response = httpx.post(srv.base_url + CHAT, json=body)
    assert response.headers["content-type"] == "text/event-stream"
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "abcdef"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_records_requests_and_echoes_when_nothing_matches(fake_server: StartServer) -> None:
    srv = fake_server(None)
    body = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}
    data = httpx.post(srv.base_url + CHAT, json=body, headers={"x-test": "1"}).json()
    assert data["choices"][0]["message"]["content"] == "echo: ping"
    assert srv.requests[0].headers["x-test"] == "1" and srv.bodies == [body]
    assert srv.max_in_flight == 1 and srv.in_flight == 0


@pytest.mark.anyio
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
async def test_demo_script_calls_three_tools_in_parallel_then_summarises(
    fake_server: StartServer, provider: str
) -> None:
    srv = fake_server(demo_script())
    async with engine_for(srv, provider) as engine:
        first = await engine.complete(request("Explore the workspace please", tools=TOOLS))
        assert first.stop_reason == "tool_use"
        assert [c.name for c in first.tool_calls] == ["list_dir", "read_file", "search_files"]
        assert json.loads(first.tool_calls[2].arguments) == {"pattern": "TODO", "path": "."}
        results: list[ToolResultMessage] = [
            tool_result_text(c, f"result of {c.name}") for c in first.tool_calls
        ]
        history: list[AssistantMessage | ToolResultMessage] = [first, *results]
        messages = [user_text("Explore the workspace please"), *history]
        second = await engine.complete(LlmRequest(messages=messages, tools=TOOLS, retry=FAST_RETRY))
        other = await engine.complete(request("what is 2+2?", tools=TOOLS))
    assert (
        second.stop_reason == "stop" and "result of search_files" in second.text and "Summary" in second.text
    )
    assert [c.name for c in other.tool_calls] == ["list_dir", "read_file", "search_files"]


@pytest.mark.anyio
async def test_rules_drop_tool_calls_the_request_does_not_offer(fake_server: StartServer) -> None:
    srv = fake_server(demo_script())
    async with engine_for(srv) as engine:
        msg = await engine.complete(request("explore the workspace"))  # no tools offered
    assert msg.stop_reason == "stop" and msg.tool_calls == [] and "look around" in msg.text


def test_toml_and_json_script_files(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[[steps]]\nfail = { status = 503 }\n[[steps]]\nreply = { text = "ok" }\n')
    script = load_script(toml)
    assert script.steps[0].fail is not None and script.steps[0].fail.status == 503
    js = tmp_path / "s.json"
    js.write_text(json.dumps([{"reply": {"text": "x"}}]))
    assert load_script(js).steps[0].reply is not None


def test_cli_serves_the_demo(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_bus.agents.gateway.fakellm", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] == "fake-llm"
        base_url = ready["base_url"]
        body = {"model": "m", "messages": [{"role": "user", "content": "yo"}]}
        data = httpx.post(base_url + CHAT, json=body, timeout=5).json()
        # The demo answers any prompt with tool calls; offered none, it just says what it would do.
        message = data["choices"][0]["message"]
        assert message["content"] == "Let me look around the workspace." and not message.get("tool_calls")
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def test_streams_leave_without_nagle_delay(fake_server: StartServer) -> None:
    """Every accepted connection has TCP_NODELAY: the fake writes each SSE event on its own, and
    with Nagle's algorithm on, the client's delayed ACK held each stream ~40 ms (asyncio sets it
    only on sockets made with proto IPPROTO_TCP, which an accepted one is not)."""
    srv = fake_server([{"reply": {"text": "hello there"}}])
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client() as client:
        assert b"[DONE]" in client.post(srv.base_url + CHAT, json=body).read()
        (connection,) = list(srv._connections)  # keep-alive: still open
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_llamacpp_refuses_a_history_with_tool_call_arguments_that_are_not_json(
        fake_server: StartServer) -> None:
    srv = fake_server({"strict_tool_json": True})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "cut'}}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "error"}]}
    refused = httpx.post(srv.base_url + CHAT, json=body)
    assert refused.status_code == 500 and srv.tool_json_refusals == 1
    assert refused.json()["error"]["message"].startswith("Failed to parse tool call arguments as JSON")
    call["function"]["arguments"] = "{}"
    assert httpx.post(srv.base_url + CHAT, json=body).status_code == 200


def test_a_reply_past_max_tokens_is_cut_mid_call_with_finish_length(fake_server: StartServer) -> None:
    long_call = {"name": "f", "arguments": {"text": "word " * 40}}
    srv = fake_server({"cut_at_max_tokens": True, "rules": [{"reply": {"text": "ok.", "tool_calls": [
        long_call, {"name": "g"}]}}]})
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("f", "g")]
    body = {"model": "m", "max_tokens": 10, "tools": tools,
            "messages": [{"role": "user", "content": "x"}]}
    data = httpx.post(srv.base_url + CHAT, json=body).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "ok."
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and len(calls[0]["function"]["arguments"]) == 40 - 3  # 4 bytes a token
    with pytest.raises(ValueError):
        json.loads(calls[0]["function"]["arguments"])
    body["max_tokens"] = 1000
    assert httpx.post(srv.base_url + CHAT, json=body).json()["choices"][0]["finish_reason"] == "tool_calls"


def test_cli_flags_turn_the_llamacpp_quirks_on() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "agent_bus.agents.gateway.fakellm", "--port", "0",
                             "--strict-tool-json", "--cut-at-max-tokens"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base_url = json.loads(proc.stdout.readline())["base_url"]
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
        body = {"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "a prompt long enough to be cut"}]}
        data = httpx.post(base_url + CHAT, json=body, timeout=5).json()
        assert data["choices"][0]["finish_reason"] == "length"
        body["messages"].append({"role": "assistant", "content": None, "tool_calls": [call]})
        assert httpx.post(base_url + CHAT, json=body, timeout=5).status_code == 500
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def test_cli_parallel_slots_queue_the_next_request_and_token_ms_paces_the_stream(tmp_path: Path) -> None:
    """`--parallel 2 --token-ms 25`: two streams are answered at once, the third waits for a slot
    (its head comes after a whole paced stream), and each stream's events are spaced 25 ms apart.
    Lower bounds only: a pause never ends early, so these hold however loaded the machine is."""
    import threading
    import time

    script = tmp_path / "s.json"
    script.write_text(json.dumps({"rules": [{"reply": {"text": "tok " * 5, "chunk_size": 4}}]}))
    proc = subprocess.Popen([sys.executable, "-m", "agent_bus.agents.gateway.fakellm", "--port", "0",
                             "--script", str(script), "--parallel", "2", "--token-ms", "25"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base_url = json.loads(proc.stdout.readline())["base_url"]
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        heads: list[float] = []
        spans: list[tuple[float, float, int]] = []  # head, end, events
        lock = threading.Lock()

        def one() -> None:
            with httpx.stream("POST", base_url + CHAT, json=body, timeout=10) as response:
                head = time.monotonic()
                events = sum(1 for line in response.iter_lines() if line.startswith("data:"))
            with lock:
                heads.append(head)
                spans.append((head, time.monotonic(), events))

        threads = [threading.Thread(target=one) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert len(spans) == 3
        events = spans[0][2]
        assert events >= 5  # the role, 5 chunks of text, the finish, [DONE]
        paced = events * 0.025
        for head, end, _ in spans:
            assert end - head >= 0.8 * paced  # every event is followed by a 25 ms pause
        first, _, third = sorted(heads)
        assert third - first >= 0.8 * paced  # the third waited for one of the two to end
    finally:
        proc.terminate()
        proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def test_fake_llm_help_names_parallel_and_token_ms() -> None:
    out = subprocess.run([sys.executable, "-m", "agent_bus.cli", "fake-llm", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--parallel N" in out and "--token-ms X" in out


def test_stamp_writes_the_servers_clock_into_each_streamed_token(fake_server: StartServer) -> None:
    """`stamp`: each `{sent_at}` becomes the clock as the event is written (bench_pace reads a
    delta's latency from it); each token's stamp lies between the request and its answer, in order."""
    import re
    import time

    srv = fake_server({"stamp": True, "rules": [{"reply": {"text": "{sent_at} " * 3, "chunk_size": 10}}]})
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    before = time.time()
    data = httpx.post(srv.base_url + CHAT, json=body).text
    after = time.time()
    stamps = [float(s) for s in re.findall(r"(\d{10}\.\d{6}) ", data)]
    assert len(stamps) == 3 and "{sent_at}" not in data
    assert before <= stamps[0] <= stamps[1] <= stamps[2] <= after
