"""Event payloads: the agent lifecycle vocabulary plus the bus's own events.

An event travels as one body frame holding one of these structs (tagged on `type`); the header
frame repeats `type`, `agent` and `run` so the hub can stamp, log and publish it without decoding
the body. Decode with `decode_event`, which turns an unknown `type` into `None` instead of raising;
a reader of the log or of the stream decodes through an `EventTally`, which also skips (counts and
names once) a body that does not decode, so one bad event never stops a reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Union

import msgspec

from agent_bus.bus.messages import AssistantDelta, AssistantMessage, Message, ToolResultMessage, Usage


class _Event(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


# --- agent lifecycle (pi / AgentCore vocabulary) -------------------------------------------


class AgentStart(_Event, tag="agent_start"):
    parent_run_id: str = ""
    session: str = ""  # the conversation the run belongs to (`busctl run -c SESSION`)


class TurnStart(_Event, tag="turn_start"):
    turn: int = 0


class MessageStart(_Event, tag="message_start"):
    message: Message


class MessageUpdate(_Event, tag="message_update"):
    delta: AssistantDelta


class MessageEnd(_Event, tag="message_end"):
    message: Message


class ToolExecutionStart(_Event, tag="tool_execution_start"):
    tool_call_id: str
    tool_name: str
    args: Any = None


class ToolExecutionUpdate(_Event, tag="tool_execution_update"):
    tool_call_id: str
    tool_name: str
    partial: Any = None


class ToolExecutionEnd(_Event, tag="tool_execution_end"):
    tool_call_id: str
    tool_name: str
    result: ToolResultMessage
    is_error: bool = False
    duration: float = 0.0


class TurnEnd(_Event, tag="turn_end"):
    message: AssistantMessage
    tool_results: list[ToolResultMessage] = msgspec.field(default_factory=list)
    turn: int = 0


class AgentEnd(_Event, tag="agent_end"):
    final_text: str = ""
    stop_reason: str = "stop"
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)
    error: str | None = None
    message_count: int = 0


class RunResumed(_Event, tag="run_resumed"):
    """A run goes on after its coordinator restarted (durable runs, docs/reliability.md):
    events before it were published by the previous process; `turn` is the last turn begun,
    `reissued` the tool call ids run again (idempotent) and `failed` those given an error
    result because they may have run; `model` is true when the model call is issued again."""

    session: str = ""
    parent_run_id: str = ""
    turn: int = 0
    reissued: list[str] = msgspec.field(default_factory=list)
    failed: list[str] = msgspec.field(default_factory=list)
    model: bool = False


class CompactionStart(_Event, tag="compaction_start"):
    tokens: int = 0


class CompactionComplete(_Event, tag="compaction_complete"):
    compacted: bool = False
    tokens_before: int = 0
    tokens_after: int = 0  # the history's estimated size after compaction (0: not compacted)
    #: What the summary calls billed, and their model (no call: empty); part of the run's totals.
    usage: Usage = msgspec.field(default_factory=Usage)
    model: str = ""
    #: Summary calls made: more than one when the older history did not fit one call (each
    #: summarised a chunk, given the summary so far).
    summary_calls: int = 0
    #: Older messages the summary does not cover (0: none): a turn alone too big for any call.
    left_out: int = 0


class LlmRetry(_Event, tag="llm_retry"):
    attempt: int
    delay: float
    status: int = 0
    error: str = ""
    provider: str = ""
    #: The failed attempt had streamed `message_update`s: they are not part of the message.
    discarded: bool = False
    #: What the failed attempt billed (estimated when its stream broke before the server sent
    #: usage; empty when nothing was generated); part of the run's totals.
    usage: Usage = msgspec.field(default_factory=Usage)
    model: str = ""


class ToolSkipped(_Event, tag="tool_skipped"):
    """A live tool an agent does not offer its model: its name or schema is one no model API
    takes (bus/toolnames.py), or its `meta` is not a ToolInfo. Said once per agent and tool."""

    tool: str
    reason: str = ""


class TopicMessage(_Event, tag="topic_message"):
    topic: str
    text: str
    sender: str = ""


# --- the experiment journal (`busctl experiment run`, agents/experiment/runner.py) ---------


class _Journal(msgspec.Struct, tag_field="type"):
    """Journal entries keep their defaults when encoded: the results file is one of them per
    line (`runner.result_rows`), and every row has every column."""

    @property
    def type(self) -> str:
        """The entry's event type (its tag), as the runner publishes it."""
        return str(self.__struct_config__.tag)


class ExperimentPlan(_Journal, tag="experiment_plan"):
    """What an experiment set out to run (published once, when it starts)."""

    experiment: str
    digest: str  # the runner's `spec_digest`: a resume with another spec or dataset is refused
    spec: str
    samples: int
    variants: list[str]
    repeats: int
    planned: int
    scorers: list[str]


class ExperimentSample(_Journal, tag="experiment_sample"):
    """One finished cell (sample x variant x repeat): the journal entry and a row of the
    results file; the latest entry of a cell is its result."""

    experiment: str
    variant: str
    sample: str
    repeat: int
    status: str  # "ok" (an answer, scored) or "error" (retries exhausted; not scored)
    answer: str = ""
    score: float | None = None  # the first scorer's
    scores: dict[str, float | None] = msgspec.field(default_factory=dict)
    tokens: int = 0
    cost: float = 0.0
    turns: int = 0
    wall: float = 0.0  # seconds, prompt to result, of the last attempt
    stop_reason: str = ""
    run_id: str = ""
    session: str = ""
    tag: str = ""  # the experiment id the session's events carry (`E.<variant>.r<repeat>`)
    # its own folder on the tool workers, `.runs/<this>/` in each one's workspace ("": shared)
    workspace: str = ""
    attempts: int = 1
    error: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.variant, self.sample, self.repeat)

    @property
    def outcome(self) -> str:
        """What the cell came to, by the one failure rule (agents/experiment/runner.py
        FAILURE_RULE): `ok` (an answer of its own), `timed_out` (run.timeout), `limited`
        (run.token_limit / cost_limit) or `error` (its retries spent). The journal keeps `status`
        ok for the first three (a resume runs only `error` cells again); readers go by this."""
        if self.status != "ok":
            return "error"
        return {"timeout": "timed_out", "limit": "limited"}.get(self.stop_reason, "ok")

    def counted(self, scorers: Iterable[str]) -> dict[str, float | None]:
        """Each scorer's score as the statistics count it: the scorer's own for an `ok` cell
        (None: it does not apply to this sample, or the grader gave no grade), 0 otherwise."""
        if self.outcome == "ok":
            return {s: self.scores.get(s) for s in scorers}
        return dict.fromkeys(scorers, 0.0)


#: The journal's event types: only the runner of experiment E writes them (the hub checks and
#: stamps `granted`, docs/protocol.md section 8), every reader may show them.
JOURNAL_TYPES: frozenset[str] = frozenset({"experiment_plan", "experiment_sample"})


# --- bus events (published by the hub and by `busctl up`) ----------------------------------


class PeerJoined(_Event, tag="peer_joined"):
    peer: str
    name: str = ""
    host: str = ""
    pid: int = 0
    session: str = ""


class PeerLeft(_Event, tag="peer_left"):
    peer: str
    name: str = ""
    reason: str = ""


class ServiceRegistered(_Event, tag="service_registered"):
    service: str
    peer: str
    capacity: int = 1


class ServiceRemoved(_Event, tag="service_removed"):
    service: str
    peer: str
    reason: str = ""


class WorkerLost(_Event, tag="worker_lost"):
    peer: str
    name: str = ""
    failed: int = 0
    redispatched: int = 0


class ProcessRestarted(_Event, tag="process_restarted"):
    process: str
    exit_code: int | None = None
    restarts: int = 0


class ProcessGaveUp(_Event, tag="process_gave_up"):
    process: str
    exit_code: int | None = None
    restarts: int = 0


class HubLeader(_Event, tag="hub_leader"):
    """A hub took the leader lease (issue 52, the standby hub): its first write as the primary,
    which also fences the previous primary (its next append, expecting the log to end before
    this event, is refused by the store). `epoch` is the lease's, as in its peers' `welcome`."""

    epoch: int
    endpoint: str = ""
    head: int = 0  # the log's last seq before this event (the new primary continues from it)


class Gap(_Event, tag="gap"):
    """Synthesised by a subscriber (never sent by the hub): seqs `first`..`last` were not seen.
    `reason` says why (e.g. the retention that pruned them from the log); empty when unknown."""

    first: int
    last: int
    reason: str = ""


Event = Union[
    AgentStart,
    TurnStart,
    MessageStart,
    MessageUpdate,
    MessageEnd,
    ToolExecutionStart,
    ToolExecutionUpdate,
    ToolExecutionEnd,
    TurnEnd,
    AgentEnd,
    RunResumed,
    CompactionStart,
    CompactionComplete,
    LlmRetry,
    TopicMessage,
    ToolSkipped,
    ExperimentPlan,
    ExperimentSample,
    PeerJoined,
    PeerLeft,
    ServiceRegistered,
    ServiceRemoved,
    WorkerLost,
    ProcessRestarted,
    ProcessGaveUp,
    HubLeader,
    Gap,
]

LIFECYCLE_TYPES: frozenset[str] = frozenset(
    {
        "agent_start",
        "turn_start",
        "message_start",
        "message_update",
        "message_end",
        "tool_execution_start",
        "tool_execution_update",
        "tool_execution_end",
        "turn_end",
        "agent_end",
    }
)

BUS_TYPES: frozenset[str] = frozenset(
    {
        "peer_joined",
        "peer_left",
        "service_registered",
        "service_removed",
        "worker_lost",
        "process_restarted",
        "process_gave_up",
        "hub_leader",
        "gap",
    }
)


def event_type(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


_AGENT_EXTRA = frozenset({"compaction_start", "compaction_complete", "llm_retry", "run_resumed"})


def event_family(type_: str) -> str:
    """The first segment of an event's topic: `agent`, `bus` or `ext` (anything else)."""
    if type_ in BUS_TYPES:
        return "bus"
    if type_ in LIFECYCLE_TYPES or type_ in _AGENT_EXTRA:
        return "agent"
    return "ext"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(body: bytes | memoryview) -> Event | None:
    """Decode one event body; an unknown `type` gives None (counted by the caller), bad bytes raise."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        if "Invalid value" in str(exc) and "$.type" in str(exc):
            return None
        raise


#: Distinct undecodable seqs an `EventTally` names; past it they are only counted.
NAMED_BAD_EVENTS = 100

_log = logging.getLogger("bus.events")


class EventTally:
    """The one tolerant decoder every reader of events uses (`busctl watch`, `export`, `replay`,
    `diff`, the web view, `busctl otel`, subscriptions): what it could not use is skipped, never
    raised, and never takes the events around it along.

    - `unknown`: events of a type this version does not know (a newer version's, docs/protocol.md
      section 10): counted and skipped quietly. Unknown fields of known types are ignored by
      the decoder itself.
    - `bad`: events whose body does not decode (bytes that are no msgpack, a required field
      missing or of the wrong type): counted, and each seq named once through `warn` (the
      first NAMED_BAD_EVENTS; the rest are counted)."""

    def __init__(self, reader: str, warn: Callable[[str], None] | None = None) -> None:
        self.reader = reader
        self.unknown = 0
        self.bad = 0
        self.bad_seqs: list[int] = []  # in the order met, each once (at most NAMED_BAD_EVENTS)
        self._warn = warn or _log.warning
        self._silenced = False

    def decode(self, seq: int, type_: str, body: bytes | memoryview) -> Event | None:
        """The event, or None (counted) for an unknown type or an undecodable body."""
        try:
            event = decode_event(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.skip(seq, type_, str(exc))
            return None
        if event is None:
            self.unknown += 1
        return event

    def skip(self, seq: int, type_: str, why: str) -> None:
        """Count an event that cannot be used; name its seq the first time it is met."""
        if seq and seq in self.bad_seqs:
            return  # met again (a range read twice): already counted and named
        self.bad += 1
        if len(self.bad_seqs) >= NAMED_BAD_EVENTS:
            if not self._silenced:
                self._silenced = True
                self._warn(f"{self.reader}: more undecodable events; counted, no longer named")
            return
        self.bad_seqs.append(seq)
        self._warn(f"{self.reader}: skipped event seq {seq} ({type_[:64] or 'no type'}): it "
                   f"does not decode ({why[:200]})")

    def summary(self) -> str:
        """"" when nothing was skipped, else one line for the reader's summary."""
        if not self.bad:
            return ""
        shown = ", ".join(map(str, self.bad_seqs[:10])) + (", ..." if self.bad > 10 else "")
        return f"{self.reader}: {self.bad} undecodable event(s) skipped (seq {shown})"


def billed(event: Event) -> tuple[str, Usage] | None:
    """(model, usage) of an event that records a billed model call: a model reply's
    `message_end`, a compaction's summary call, an attempt that failed and was retried. The
    totals of `busctl export`, `diff` and `status` are the sum of these."""
    if isinstance(event, MessageEnd) and isinstance(event.message, AssistantMessage):
        return event.message.model, event.message.usage
    if isinstance(event, (CompactionComplete, LlmRetry)) and (event.usage.total or event.usage.cost):
        return event.model, event.usage
    return None
