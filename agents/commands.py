"""Bodies of requests to service `agent.<name>` (served by a coordinator) and of their replies.

`prompt` and `continue` stream: the first partial reply is a `RunStarted` (so the caller can
filter the event stream by run id at once), the final reply a `RunResult` when the run ends.
The other commands answer at once with a `CommandOk` or an `error` reply naming the problem.
"""

from __future__ import annotations

from typing import Union

import msgspec

from bus.messages import Message, Usage


class _Command(msgspec.Struct, tag_field="command", omit_defaults=True):
    pass


class Prompt(_Command, tag="prompt"):
    text: str = ""
    messages: list[Message] = msgspec.field(default_factory=list)
    experiment: str = ""
    parent_run_id: str = ""
    new_session: bool = False
    #: Agents waiting on this prompt through agent-as-tool calls, outermost first (empty for a
    #: prompt from a person or a script). The coordinator refuses the prompt when the agent is
    #: already in it (a call cycle) or when it is longer than the depth limit.
    call_chain: list[str] = msgspec.field(default_factory=list)
    #: >0: at most this many turns for this run (instead of the agent's `max_iterations`).
    max_turns: int = 0


class Continue(_Command, tag="continue"):
    experiment: str = ""


class Steer(_Command, tag="steer"):
    text: str


class FollowUp(_Command, tag="follow_up"):
    text: str


class Abort(_Command, tag="abort"):
    reason: str = ""  # why (`busctl abort AGENT TEXT`); new field with a default: old peers agree


class Reset(_Command, tag="reset"):
    pass


class GetState(_Command, tag="state"):
    pass


Command = Union[Prompt, Continue, Steer, FollowUp, Abort, Reset, GetState]


class RunStarted(msgspec.Struct, omit_defaults=True):
    run_id: str
    agent: str


class RunResult(msgspec.Struct, omit_defaults=True):
    run_id: str
    agent: str
    final_text: str = ""
    stop_reason: str = "stop"
    error: str | None = None
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)


class CommandOk(msgspec.Struct, omit_defaults=True):
    ok: bool = True
    detail: str = ""


class AgentState(msgspec.Struct, omit_defaults=True):
    name: str
    model: str
    is_running: bool
    run_id: str = ""
    message_count: int = 0
    pending_tool_calls: list[str] = msgspec.field(default_factory=list)
    error: str | None = None
    queued_steering: int = 0
    queued_follow_up: int = 0
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)
    session: str = ""


_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_command(body: bytes) -> Command:
    return _command_decoder.decode(body)


def agent_service(name: str) -> str:
    return f"agent.{name}"
