"""The gateway as a process on the bus: deltas published in order, retries as events, no key leaks."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.agents.gateway.wire import LlmPartial
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from agent_bus.bus.messages import (
    AssistantMessage,
    LlmRequest,
    RetryPolicy,
    TextPart,
    ToolSpec,
    user_text,
)
from tests.support import Proc, busctl

pytestmark = pytest.mark.anyio

SECRET = "sk-test-7c1d9a3e5b0f4286-DO-NOT-LEAK"
TWO_CALLS = {
    "text": "Reading and searching at once.",
    "tool_calls": [
        {"name": "read_file", "arguments": {"path": "README.md"}, "id": "call_a"},
        {"name": "search_files", "arguments": {"pattern": "TODO"}, "id": "call_b"},
    ],
    "chunk_size": 2,
}
TOOLS = [ToolSpec(name="read_file", parameters={"type": "object", "properties": {"path": {"type": "string"}},
                                                "required": ["path"], "additionalProperties": False}),
         ToolSpec(name="search_files", parameters={"type": "object", "properties": {"pattern": {"type": "string"}},
                                                   "required": ["pattern"], "additionalProperties": False})]


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    script = {"steps": [
        {"reply": TWO_CALLS},
        {"fail": {"kind": "status", "status": 429, "retry_after": "0", "message": "slow down"}},
        {"reply": {"text": "after retry"}},
    ]}
    with FakeLLMServer(script) as srv:
        yield srv


@pytest.fixture
def gateway(hub: dict, fake: FakeLLMServer, tmp_path: Path) -> Iterator[Proc]:
    topology = tmp_path / "topology.toml"
    topology.write_text(
        f'[models.fake]\nprovider = "openai"\nmodel = "m"\nbase_url = "{fake.base_url}"\n'
        'api_key_env = "FAKE_PROVIDER_KEY"\n')
    proc = Proc(busctl("gateway", "--hub", hub["endpoint"], "--topology", str(topology),
                       "--name", "gw-test"), env={"FAKE_PROVIDER_KEY": SECRET})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


async def test_streamed_tool_calls_arrive_whole_and_deltas_are_published_in_order(
        hub: dict, gateway: Proc, fake: FakeLLMServer) -> None:
    async with connect(hub["endpoint"], name="test") as peer:
        seq = (await peer.status()).seq
        request = LlmRequest(messages=[user_text("go")], tools=TOOLS, agent="a1", run_id="run-1",
                             retry=RetryPolicy(base_delay=0.01))
        body = await peer.request("llm", msgspec.msgpack.encode(request), timeout=20)
        message = msgspec.msgpack.decode(body, type=AssistantMessage)
        assert message.stop_reason == "tool_use"
        assert [(c.id, c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
            ("call_a", "read_file", {"path": "README.md"}),
            ("call_b", "search_files", {"pattern": "TODO"}),
        ]
        assert fake.requests[0].headers.get("authorization") == f"Bearer {SECRET}"

        # The second call meets a 429 and succeeds on the retry: one llm_retry event.
        request2 = LlmRequest(messages=[user_text("again")], agent="a1", run_id="run-2",
                              retry=RetryPolicy(base_delay=0.01))
        reply2 = msgspec.msgpack.decode(
            await peer.request("llm", msgspec.msgpack.encode(request2), timeout=20), type=AssistantMessage)
        assert reply2.text == "after retry"

        updates: list[ev.MessageUpdate] = []
        retries: list[ev.LlmRetry] = []
        async with peer.subscribe(since=seq) as sub:
            with anyio.fail_after(10):
                async for envelope in sub:
                    if isinstance(envelope.event, ev.MessageUpdate) and envelope.header.run == "run-1":
                        assert envelope.header.agent == "a1"
                        updates.append(envelope.event)
                    if isinstance(envelope.event, ev.LlmRetry):
                        assert envelope.header.run == "run-2"
                        retries.append(envelope.event)
                    if isinstance(envelope.event, ev.MessageUpdate) and envelope.header.run == "run-2":
                        break
    text = "".join(u.delta.delta for u in updates if u.delta.kind == "text")
    assert text == TWO_CALLS["text"]
    args = {}
    for u in updates:
        if u.delta.kind == "tool_call":
            args[u.delta.index] = args.get(u.delta.index, "") + u.delta.delta
    assert [json.loads(a) for a in args.values()] == [{"path": "README.md"}, {"pattern": "TODO"}]
    assert len(retries) == 1 and retries[0].status == 429 and retries[0].attempt == 1


async def test_the_key_never_appears_in_events_logs_or_status(
        hub: dict, gateway: Proc, fake: FakeLLMServer) -> None:
    async with connect(hub["endpoint"], name="test") as peer:
        for text in ("one", "two", "three"):
            request = LlmRequest(messages=[user_text(text)], agent="a", run_id=text,
                                 retry=RetryPolicy(max_attempts=1))
            await peer.request("llm", msgspec.msgpack.encode(request), timeout=20)
        unknown = LlmRequest(messages=[user_text("x")], model="no-such-alias")
        error = msgspec.msgpack.decode(
            await peer.request("llm", msgspec.msgpack.encode(unknown), timeout=20), type=AssistantMessage)
        assert error.stop_reason == "error" and "no-such-alias" in (error.error or "")
    status = subprocess.run(busctl("status", "--hub", hub["endpoint"], "--json"),
                            capture_output=True, text=True, timeout=20)
    events = subprocess.run(busctl("watch", "--hub", hub["endpoint"], "--since", "0", "--no-follow",
                                   "--json"), capture_output=True, text=True, timeout=20)
    assert events.stdout.count("\n") > 5
    gateway.stop()
    haystacks = [status.stdout, status.stderr, events.stdout, events.stderr, gateway.output(),
                 hub["proc"].output()]
    haystacks += [p.read_text(errors="replace") for p in Path(hub["state"]).rglob("*") if p.is_file()]
    for hay in haystacks:
        assert SECRET not in hay


async def test_the_requester_gets_a_describing_first_partial_and_prefixes_of_the_reply(
        hub: dict, gateway: Proc) -> None:
    """Partials are a read's deltas joined, and those of the last read come only with the reply
    (which holds them): what they add up to is a prefix of each part of the reply."""
    request = LlmRequest(messages=[user_text("go")], tools=TOOLS, agent="a1", run_id="run-p")
    async with connect(hub["endpoint"], name="test") as peer:
        async with peer.stream("llm", msgspec.msgpack.encode(request), timeout=20) as replies:
            items = [item async for item in replies]
    message = msgspec.msgpack.decode(items[-1], type=AssistantMessage)
    partials = [msgspec.msgpack.decode(item, type=LlmPartial) for item in items[:-1]]
    assert partials and (partials[0].model, partials[0].provider) == ("m", "openai")
    streamed: dict[int, str] = {}
    for partial in partials:
        assert partial.delta is not None
        streamed[partial.delta.index] = streamed.get(partial.delta.index, "") + partial.delta.delta
    whole = [part.text if isinstance(part, TextPart) else getattr(part, "arguments", "")
             for part in message.content]
    assert all(whole[index].startswith(text) for index, text in streamed.items()), (streamed, whole)
