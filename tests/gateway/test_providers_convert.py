"""Pure provider pieces: message conversion, tool schemas and choice, Retry-After, backoff."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import msgspec
import pytest

from agent_bus.agents.gateway.engine import (
    ModelConfig,
    backoff_delay,
    provider_error_text,
    retry_after_seconds,
)
from agent_bus.agents.gateway.process import _Requests
from agent_bus.agents.gateway.providers import AnthropicProvider, OpenAIProvider, flatten_schema
from agent_bus.agents.gateway.providers.openai import Histories, convert_messages
from agent_bus.bus.messages import (
    AssistantMessage,
    ImagePart,
    LlmMessage,
    LlmRequest,
    RetryPolicy,
    TextPart,
    ThinkingPart,
    ToolCall,
    ToolResultMessage,
    ToolSpec,
    UserMessage,
    user_text,
)

CALL = ToolCall(id="c1", name="read_file", arguments='{"path": "a"}')
HISTORY: list[LlmMessage] = [
    UserMessage(content=[TextPart("look"), ImagePart(data=b"\x89PNG", mime_type="image/png")]),
    AssistantMessage(
        content=[ThinkingPart("hmm", signature="sig"), TextPart("ok"), CALL], stop_reason="tool_use"
    ),
    ToolResultMessage(tool_call_id="c1", tool_name="read_file", content=[TextPart("data")]),
    ToolResultMessage(tool_call_id="c2", tool_name="x", content=[TextPart("boom")], is_error=True),
    AssistantMessage(content=[TextPart("partial")], stop_reason="aborted"),
    user_text("next"),
]


def test_openai_messages() -> None:
    body = OpenAIProvider("http://x/v1", "m").build_body(LlmRequest(messages=HISTORY, system_prompt="sys"))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]  # aborted turn skipped
    assert body["messages"][1]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assistant = body["messages"][2]
    assert (
        assistant["content"] == "ok"
        and assistant["tool_calls"][0]["function"]["arguments"] == '{"path": "a"}'
    )
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "data"}
    assert "tools" not in body and "tool_choice" not in body


def test_anthropic_messages_merge_tool_results_and_keep_signed_thinking() -> None:
    body = AnthropicProvider("http://x", "m").build_body(
        LlmRequest(messages=HISTORY, reasoning="low", temperature=0.3)
    )
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "user"]
    assert messages[0]["content"][1]["source"]["media_type"] == "image/png"
    assert messages[1]["content"][0] == {"type": "thinking", "thinking": "hmm", "signature": "sig"}
    assert messages[1]["content"][2] == {
        "type": "tool_use",
        "id": "c1",
        "name": "read_file",
        "input": {"path": "a"},
    }
    assert [b["tool_use_id"] for b in messages[2]["content"]] == ["c1", "c2"]
    assert messages[2]["content"][1]["is_error"] is True
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024} and "temperature" not in body
    assert body["max_tokens"] > 1024


@pytest.mark.parametrize(
    ("choice", "openai", "anthropic"),
    [
        ("auto", "auto", {"type": "auto"}),
        ("none", "none", {"type": "none"}),
        ("required", "required", {"type": "any"}),
        (
            "read_file",
            {"type": "function", "function": {"name": "read_file"}},
            {"type": "tool", "name": "read_file"},
        ),
    ],
)
def test_tool_choice(choice: str, openai: object, anthropic: object) -> None:
    req = LlmRequest(messages=[user_text("x")], tools=[ToolSpec(name="read_file")], tool_choice=choice)
    assert OpenAIProvider("http://x", "m").build_body(req)["tool_choice"] == openai
    assert AnthropicProvider("http://x", "m").build_body(req)["tool_choice"] == anthropic


class Inner(msgspec.Struct):
    path: str


class Args(msgspec.Struct):
    inner: Inner
    items: list[Inner] = []


def test_flatten_schema_inlines_refs_and_forces_object_root() -> None:
    schema = msgspec.json.schema(Args)
    assert "$ref" in schema and "$defs" in schema
    flat = flatten_schema(schema)
    assert (
        flat["type"] == "object" and "$defs" not in flat and "$ref" not in msgspec.json.encode(flat).decode()
    )
    assert flat["properties"]["inner"]["properties"]["path"] == {"type": "string"}
    assert flatten_schema({"type": "string"}) == {"type": "object", "properties": {}}
    cyclic = {
        "$ref": "#/$defs/N",
        "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}},
    }
    assert flatten_schema(cyclic)["properties"]["next"] == {}


def test_tools_are_flattened_at_the_edge() -> None:
    nested = {
        "$ref": "#/$defs/A",
        "$defs": {"A": {"type": "object", "properties": {"p": {"type": "string"}}}},
    }
    req = LlmRequest(messages=[user_text("x")], tools=[ToolSpec(name="t", parameters=nested)])
    assert AnthropicProvider("http://x", "m").build_body(req)["tools"][0]["input_schema"]["properties"] == {
        "p": {"type": "string"}
    }
    assert (
        OpenAIProvider("http://x", "m").build_body(req)["tools"][0]["function"]["parameters"]["type"]
        == "object"
    )


def test_urls() -> None:
    assert OpenAIProvider("http://h/v1/", "m").url() == "http://h/v1/chat/completions"
    assert AnthropicProvider("http://h", "m").url() == "http://h/v1/messages"
    assert AnthropicProvider("http://h/v1", "m").url() == "http://h/v1/messages"
    assert ModelConfig(alias="a", provider="anthropic", model="m").endpoint() == "https://api.anthropic.com"


def test_retry_after_forms() -> None:
    assert retry_after_seconds(httpx.Headers({"retry-after": "7"})) == 7.0
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < (retry_after_seconds(httpx.Headers({"retry-after": later})) or 0) <= 30
    assert retry_after_seconds(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after_seconds(httpx.Headers()) is None


def test_backoff_is_exponential_with_jitter_and_capped() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=60.0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (8, 60.0)]:
        delay = backoff_delay(policy, attempt, None)
        assert ceiling / 2 <= delay <= ceiling
    assert backoff_delay(policy, 1, 2.5) == 2.5
    assert backoff_delay(policy, 1, 600.0) == 60.0


def test_provider_error_text() -> None:
    assert provider_error_text(b'{"error": {"type": "x", "message": "bad"}}') == "x: bad"
    assert provider_error_text(b"<html>oops</html>") == "<html>oops</html>"
    assert provider_error_text(b"") == "(empty body)"


def test_a_runs_history_converted_piecewise_is_the_history_converted_whole() -> None:
    """`Histories` (the gateway's) converts only what a run's history added since its last call,
    and whole again when an earlier message differs or for another run."""
    histories = Histories(kept=2)

    def call(messages: list[LlmMessage], run: str = "r", system: str = "sys") -> list[Any]:
        wire = msgspec.msgpack.encode(LlmRequest(messages=messages, run_id=run, system_prompt=system))
        request = msgspec.msgpack.decode(wire, type=LlmRequest)  # decoded anew, as the gateway's
        converted = histories.convert(request)
        assert converted == convert_messages(system, request.messages)
        return converted

    more = [*HISTORY, AssistantMessage(content=[TextPart("done")]), user_text("again")]
    first = call(HISTORY[:2])
    assert call(HISTORY)[1] is first[1]  # grew: the rest converted, the start kept
    call(more, system="")
    call([user_text("compacted"), *more[2:]])  # an earlier message differs
    call(more[:3], run="other")
    call(more[:1], run="third")  # `kept=2`: run "r" goes
    call(more)
    request = LlmRequest(messages=more, run_id="r")  # the same objects again (as the gateway's)
    assert histories.convert(request) == histories.convert(request) == convert_messages("", more)
    histories = Histories(messages=4)  # at most 4 messages held: run "a" goes for "b"
    first = call(HISTORY[:2], run="a")
    call(HISTORY[:3], run="b")
    assert call(HISTORY[:3], run="a")[1] is not first[1]


def test_the_gateways_requests_decode_only_what_a_runs_history_added() -> None:
    """`_Requests` (the gateway's) gives what a whole decode gives, the unchanged messages of a
    run's last request as the objects it decoded then; a malformed message fails as before."""
    requests = _Requests(messages=8)

    def decode(messages: list[LlmMessage], run: str = "r") -> LlmRequest:
        body = msgspec.msgpack.encode(LlmRequest(messages=messages, run_id=run, agent="a", seed=7))
        request = requests.decode(body)
        assert request == msgspec.msgpack.decode(body, type=LlmRequest)
        return request

    first = decode(HISTORY[:2])
    grown = decode(HISTORY)
    assert grown.messages[1] is first.messages[1] and grown.seed == 7 and grown.agent == "a"
    compacted = [user_text("compacted"), *HISTORY[1:]]
    changed = decode(compacted)  # the first differs: decoded anew
    assert changed.messages[1] is not grown.messages[1]
    assert decode(compacted).messages[1] is changed.messages[1]
    decode(HISTORY[:3], run="")  # no run: nothing kept
    decode(HISTORY[:4], run="b")  # 6 + 4 > 8 messages: run "r" goes
    assert decode(compacted).messages[1] is not changed.messages[1]
    bad = msgspec.msgpack.encode({"messages": [{"role": "user", "content": 7}], "run_id": "r"})
    with pytest.raises(msgspec.ValidationError):
        requests.decode(bad)


def test_the_gateways_requests_keep_at_most_their_bodies_budget() -> None:
    """A kept message is a view into its request's body, which it keeps alive: the bodies
    kept are bounded in bytes too, whatever the number of runs."""
    body = msgspec.msgpack.encode(LlmRequest(messages=HISTORY[:2], run_id="a"))
    requests = _Requests(body_bytes=2 * len(body) + 10)  # room for two such bodies
    first = requests.decode(body)
    assert requests.decode(body).messages[1] is first.messages[1]  # kept
    requests.decode(msgspec.msgpack.encode(LlmRequest(messages=HISTORY[:2], run_id="b")))
    requests.decode(msgspec.msgpack.encode(LlmRequest(messages=HISTORY[:2], run_id="c")))
    assert requests.decode(body).messages[1] is not first.messages[1]  # "a" went for "c"
    huge = _Requests(body_bytes=len(body) - 1)  # a body over the whole budget is not kept
    assert huge.decode(body).messages[1] is not huge.decode(body).messages[1]
