"""The wire of the two replay services (`busctl replay` and forks, agents/replay.py): what
the replaying client sends and what the gateway's `llm.replay` and each coordinator's
`replay@<coordinator>` take, and the keys both sides match a request or a tool call by. Small
on purpose, as agents/gateway/wire.py is for `llm`: the gateway and the coordinator import this,
not the replay client (its log reading and comparison)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated

import msgspec

from agent_bus.agents.gateway.wire import MaxTokens, Seed, Temperature, TopP
from agent_bus.bus.messages import AssistantMessage, LlmRequest, Message, TextPart, ToolResultMessage

REPLAY_SERVICE = "llm.replay"


class ReplayEntry(msgspec.Struct, array_like=True):
    key: str
    reply: AssistantMessage
    live: bool = False  # a fork at a seq: the request this answered goes to the live model


class LiveOverrides(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What a fork changes in one agent's live model requests (None: unchanged). The fields
    are the `[[agents]]` keys an `llm` request carries, with the topology file's ranges."""

    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    system_prompt: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    seed: Seed | None = None
    stop: list[str] | None = None

    def apply(self, request: LlmRequest) -> LlmRequest:
        changes = {name: value for name in self.__struct_fields__
                   if (value := getattr(self, name)) is not None}
        return msgspec.structs.replace(request, **changes)


class ReplayLoad(msgspec.Struct):
    """Body of a `llm.replay` request: answer experiment `experiment`'s model requests with
    these recorded replies (of experiment `source`)."""

    experiment: str
    source: str
    entries: list[ReplayEntry]
    live_after: int = 0  # > 0: a run's model requests after this many go to a live model
    model: str = ""  # the model alias live requests use ("": the request's own)
    #: by agent: what its live requests change (a fork's `--set`, `--system-prompt-file`)
    overrides: dict[str, LiveOverrides] = msgspec.field(default_factory=dict)
    #: a fork: a request with no logged reply left goes to the live model (pure replay: an
    #: error reply). Older gateways ignore it (they answer it with the error reply).
    fork: bool = False


class ReplayLoaded(msgspec.Struct):
    experiment: str
    replies: int


class ToolEntry(msgspec.Struct, array_like=True):
    key: str
    result: ToolResultMessage
    #: the result the loop gave a call an abort cut short, in a run that ended aborted: serving
    #: it aborts the replayed run once its turn ends (an older coordinator ignores it)
    aborted: bool = False


class ToolBook(msgspec.Struct):
    """Body of a `replay@<coordinator>` request: serve experiment `experiment`'s tool calls
    with these recorded results (of experiment `source`)."""

    experiment: str
    source: str
    entries: list[ToolEntry]
    tools: list[str] = msgspec.field(default_factory=list)  # their names


#: Tools that always run: asking an agent replays the callee's run itself; the others are local.
LIVE_TOOLS = frozenset({"publish", "tool_output"})


def replay_service(coordinator: str) -> str:
    return f"replay@{coordinator}"


def always_live(tool: str) -> bool:
    return tool.startswith("ask_") or tool in LIVE_TOOLS


def tool_key(agent: str, tool: str, arguments: str) -> str:
    """A tool call as matched on replay: agent, tool and its arguments (canonical JSON)."""
    try:
        args = json.dumps(json.loads(arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        args = arguments
    return hashlib.sha256(json.dumps([agent, tool, args]).encode()).hexdigest()[:32]


def request_key(agent: str, messages: Sequence[Message]) -> str:
    """What a model request is matched by: its agent and the messages after its last assistant
    message (role, tool name, text), hashed."""
    tail: list[list[str]] = []
    for message in reversed(messages):
        if isinstance(message, AssistantMessage):
            break
        tail.append([type(message).__struct_config__.tag or "",  # type: ignore[list-item]
                     getattr(message, "tool_name", ""), message_text(message)])
    body = json.dumps([agent, tail[::-1]], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def message_text(message: Message) -> str:
    """The text parts of any message, joined (images and tool calls left out)."""
    content = getattr(message, "content", "")
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, TextPart))


__all__ = ["LIVE_TOOLS", "REPLAY_SERVICE", "LiveOverrides", "ReplayEntry", "ReplayLoad", "ReplayLoaded",
           "ToolBook", "ToolEntry", "always_live", "message_text", "replay_service", "request_key",
           "tool_key"]
