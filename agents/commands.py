"""Bodies of requests to service `agent.<name>` (served by a coordinator) and of their replies.

`prompt` and `continue` stream: the first partial reply is a `RunStarted` (so the caller can
filter the event stream by run id at once), the final reply a `RunResult` when the run ends.
The other commands answer at once with a `CommandOk` or an `error` reply naming the problem.

Sessions: an agent serves any number of conversations (sessions), each with its own transcript,
queues and run state. A `Prompt`/`Continue` names one with `session`, or asks for the agent's
last one with `continue_session`, or (neither) starts a fresh one. A session id is
`<coordinator>.<hex>`: the coordinator holding it also serves `agent.<name>@<coordinator>`
(`session_service`), so a continuation reaches it whichever coordinator serves `agent.<name>`.
`Steer`/`FollowUp`/`Abort`/`Reset` name a `run` or a `session`; without either they act on the
agent's one live run, and are refused (code `ambiguous`) when several are live, listing them.
"""

from __future__ import annotations

from typing import Union

import msgspec

from agent_bus.bus.messages import Message, RunWorkspace, Usage


class _Command(msgspec.Struct, tag_field="command", omit_defaults=True):
    pass


class Prompt(_Command, tag="prompt"):
    text: str = ""
    #: The session to continue ("" = a fresh one unless `continue_session`). With `new_session`
    #: a session of that id is created when it does not exist.
    session: str = ""
    #: No `session`: continue the agent's last session (a fresh one when it has none).
    continue_session: bool = False
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
    #: The top-level run of the tree this run joins (an agent-as-tool call; "" = it is the top):
    #: its model calls carry that run's trace id (`LlmTrace.root_run_id`).
    root_run_id: str = ""
    #: A replay of a run that was aborted in a model call (`busctl replay`): the abort is in
    #: the logged reply the replay serves; this is the reason the `agent_end` error gave, given
    #: again when this run ends aborted.
    abort_reason: str = ""
    #: A folder of the run's own on the tool workers (`RunWorkspace`): every tool call of this
    #: run, and of the runs it asks, runs in it. Refused (code `invalid`) when over its limits.
    workspace: RunWorkspace | None = None


class Continue(_Command, tag="continue"):
    experiment: str = ""
    session: str = ""  # "" = the agent's last session


class Steer(_Command, tag="steer"):
    text: str
    run: str = ""  # the run to steer ("" = the agent's one live run)
    session: str = ""  # or the session whose live run to steer


class FollowUp(_Command, tag="follow_up"):
    text: str
    run: str = ""
    session: str = ""


class Abort(_Command, tag="abort"):
    reason: str = ""  # why (`busctl abort AGENT TEXT`): in the run's `agent_end` error
    run: str = ""
    session: str = ""


class Reset(_Command, tag="reset"):
    session: str = ""  # "" = the agent's last session; refused while it runs


class GetState(_Command, tag="state"):
    pass


SESSIONS_LISTED = 50

Command = Union[Prompt, Continue, Steer, FollowUp, Abort, Reset, GetState]


class RunStarted(msgspec.Struct, omit_defaults=True):
    run_id: str
    agent: str
    session: str = ""


class RunResult(msgspec.Struct, omit_defaults=True):
    run_id: str
    agent: str
    final_text: str = ""
    stop_reason: str = "stop"
    error: str | None = None
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)
    session: str = ""


class CommandOk(msgspec.Struct, omit_defaults=True):
    ok: bool = True
    detail: str = ""


class SessionInfo(msgspec.Struct, omit_defaults=True):
    session: str
    state: str  # "running", "queued" (waiting for a run slot) or "idle"
    run_id: str = ""
    message_count: int = 0


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
    session: str = ""  # the live run's session, else the last session
    coordinator: str = ""
    #: Sessions held in memory (live runs first), at most `SESSIONS_LISTED` of them.
    sessions: list[SessionInfo] = msgspec.field(default_factory=list)
    live: int = 0  # runs in progress (queued ones included)
    queued: int = 0  # runs waiting for a slot (`max_concurrent_runs`)
    idle: int = 0  # sessions in memory without a run
    stored: int = 0  # sessions in the conversation store (idle ones included)
    max_concurrent_runs: int = 0


_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_command(body: bytes) -> Command:
    return _command_decoder.decode(body)


def agent_service(name: str) -> str:
    return f"agent.{name}"


def session_service(name: str, coordinator: str) -> str:
    """The service only the coordinator `coordinator` serves for agent `name`."""
    return f"agent.{name}@{coordinator}"


def session_coordinator(session: str) -> str:
    """The coordinator a session id names ("" for ids from before sessions were affine)."""
    return session.rpartition(".")[0]


def agent_of_service(service: str) -> str:
    """`agent.X` -> X; "" for anything else (including the affine `agent.X@coord`)."""
    if not service.startswith("agent.") or "@" in service:
        return ""
    return service[6:]
