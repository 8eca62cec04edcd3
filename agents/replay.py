"""Replay and compare experiments from the hub's event log (`busctl replay`, `busctl diff`).

    busctl replay --experiment E --as E2     # re-run every top-level run of E as E2
    busctl replay --experiment E --live-from 2 --model B   # fork: turns 1-2 as logged, then B
    busctl diff E E2 [--json]                # per run and in total: what differs

Replay: the runs of E are read from the log (`load_experiment`); every model reply of E is sent
to the gateway (`REPLAY_SERVICE`, `ReplayLoad`) keyed by `request_key`: the agent and the
messages after the request's last assistant message (the prompt, or the tool results the reply
answers), hashed. The gateway then answers each `llm` request of experiment E2 with the next
recorded reply of the same key, in order, and never calls the model (no match: an error reply,
so the run diverges visibly; in a fork, the live model instead, see below). E's top-level runs
(no parent; `ask_<agent>` runs are made again by their callers) are prompted again, one after
another, in fresh sessions, with the same text.
A fork (`Fork`) replays part of each run and sends the rest to the live model: with `live_from`
N each run's first N model calls are replayed (0: none; a point past every run's last call is
refused: nothing would go live); with `live_from_seq` S the calls whose logged reply
has seq < S are (each run goes live at its first call answered at or after S, and stays live).
In a fork, a model request with no logged reply left (a run E did not have, such as a helper a
live turn asks something new, or a run whose requests went another way) goes live too, with the
rest of its run: the comparison reports it as a divergence, never as an error reply.
The live calls can change: `model` (another alias) and, per agent, the `[[agents]]` keys a model
request carries (`LiveOverrides`: system prompt, sampling), which the gateway puts in each live
request; `max_turns` (or `max_iterations`) bounds the runs the replay prompts.
Tool results come from the log too (`ToolBook`, sent to
every coordinator's `replay@<coordinator>` service; `RecordedTools` serves them by agent, tool
and arguments, in order), except `ask_<agent>` (the callee run is replayed itself), `publish` and
`tool_output`; with `live_tools` every tool runs again and a tool that answers differently is a
divergence. Then E and E2 are compared event by event (`compare`): the same events except ids,
seq, timestamps, durations, streamed deltas and token usage (content first: a live call's usage
is the server's, e.g. its cache split; `usage_notes` lists the differences apart), or the first
divergence. Order that means nothing
is not compared: runs are taken in call order (`in_call_order`: the runs parallel `ask_<agent>`
calls started, in the order of the calls), and a tool batch's events by call (`canonical_events`:
parallel calls end in the order they finish). `busctl diff` uses the same comparison, so both say
identical for the same pair. An aborted run is replayed aborted at the same point: in a model
call through the logged reply, in a tool batch through the results the cut calls got
(`ToolEntry.aborted`: the coordinator aborts the run when that turn ends), and with its abort's
reason (`abort_reason`).
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from agent_bus.agents.launch.topology import AgentSpec, TurnBound
from agent_bus.agents.loop.run import ABORTED_TEXT
from agent_bus.agents.replay_wire import (
    REPLAY_SERVICE,
    LiveOverrides,
    ReplayEntry,
    ReplayLoad,
    ToolBook,
    ToolEntry,
    always_live,
    message_text,
    request_key,
    tool_key,
)
from agent_bus.bus import events as ev
from agent_bus.bus.client import Peer
from agent_bus.bus.errors import ConfigError, RemoteError
from agent_bus.bus.messages import (
    AssistantMessage,
    Message,
    RunWorkspace,
    ToolResultMessage,
    Usage,
)
from agent_bus.bus.protocol import Header
from agent_bus.bus.watch import replay as logged


class StartedRun(Protocol):
    """What `replay_experiment` needs of a started run (agents.client.remote `Run`)."""

    def events(self) -> AsyncIterator[Any]: ...

    async def result(self) -> Any: ...


class PromptingBus(Protocol):
    """What `replay_experiment` needs of its bus: agents.client.remote's `AgentBus`, named by
    this protocol since that module imports this one (`connect(replay_from=...)`): the imports
    go one way."""

    peer: Peer

    async def prompt(self, agent: str, text: str = "", *, experiment: str = "",
                     max_turns: int = 0, abort_reason: str = "",
                     workspace: RunWorkspace | None = None) -> StartedRun: ...


log = logging.getLogger("agents.replay")

#: Event fields that differ between two executions of the same experiment by nature.
VOLATILE = frozenset({"timestamp", "duration", "parent_run_id", "session", "run_id"})
SKIPPED = frozenset({"message_update", "llm_retry", "run_resumed", "tool_execution_update",
                     "tool_skipped"})


# --- an experiment as logged ---------------------------------------------------------------


@dataclass
class RecordedRun:
    run_id: str
    agent: str
    parent: str = ""
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (type, body)
    messages: list[Message] = field(default_factory=list)  # message_end, in order
    end: ev.AgentEnd | None = None
    first_ts: float = 0.0
    last_ts: float = 0.0
    reply_seqs: list[int] = field(default_factory=list)  # each model reply's message_end seq
    first_seq: int = 0
    last_seq: int = 0
    publishers: set[str] = field(default_factory=set)  # the hub-stamped `peer` of its events
    distrust: str = ""  # why it may not be replayed ("" when its agent's server published it)

    @property
    def prompt(self) -> str:
        for message in self.messages:
            if not isinstance(message, AssistantMessage):
                return message_text(message)
        return ""

    @property
    def replies(self) -> list[AssistantMessage]:
        return [m for m in self.messages if isinstance(m, AssistantMessage)]

    @property
    def turns(self) -> int:
        return sum(1 for t, _ in self.events if t == "turn_start")

    @property
    def tool_calls(self) -> list[str]:
        return [f"{c.name}({c.arguments})" for m in self.replies for c in m.tool_calls]

    billed: Usage = field(default_factory=Usage)  # every billed model call (`events.billed`)

    @property
    def usage(self) -> Usage:
        return self.billed


async def load_experiment(peer: Peer, experiment: str,
                          tally: ev.EventTally | None = None) -> list[RecordedRun]:
    """The runs of `experiment` in the order they started, from the hub's log. An event that
    does not decode is skipped and counted in `tally` (which names its seq)."""
    runs: dict[str, RecordedRun] = {}

    def registration(header: Header) -> bool:
        return header.type == "service_registered" and header.peer == HUB_PEER

    servers: dict[str, set[str]] = {}  # peer id -> the agents it served
    # Two reads, each of what it needs from the hub: the bus events (few), then the
    # experiment's own (the hub reads no other experiment's)
    async for envelope in logged(peer, 0, ["bus/"], tally, registration):
        if isinstance(envelope.event, ev.ServiceRegistered):
            _note_server(servers, envelope.event.peer, envelope.event.service)
    async for envelope in logged(peer, 0, [], tally, functools.partial(_of_run, experiment),
                                 experiment):
        header, event = envelope.header, envelope.event
        run = runs.get(header.run)
        if run is None:
            run = runs[header.run] = RecordedRun(header.run, header.agent, header.parent,
                                                 first_ts=header.ts, first_seq=header.seq)
        run.last_ts, run.last_seq = header.ts, header.seq
        if isinstance(event, ev.MessageEnd) and isinstance(event.message, AssistantMessage):
            run.reply_seqs.append(header.seq)
        if header.type not in SERVER_PROGRESS:
            run.publishers.add(header.peer)
        _add(run, event)
    for info in (await peer.status()).peers:  # registrations retention may have pruned
        for load in info.services:
            _note_server(servers, info.peer, load.name)
    for run in runs.values():
        run.distrust = distrust(run, servers)
    return in_call_order(list(runs.values()))


def _of_run(experiment: str, header: Header) -> bool:
    """An event of one of `experiment`'s runs (checked here too: a hub that predates
    `ReplayRequest.experiment` sends every experiment's)."""
    return header.experiment == experiment and bool(header.run)


def in_call_order(runs: Sequence[RecordedRun]) -> list[RecordedRun]:
    """`runs` (in start order) as they are compared: each top-level run (in start order)
    followed by the runs it asked for (`ask_<agent>`, each followed by its own), in the order
    of the calls that asked them. Calls made at once (parallel tools) start their runs in
    whatever order the scheduler gives: that order means nothing, the calls' order does."""
    by_id = {r.run_id: r for r in runs}
    children: dict[str, list[RecordedRun]] = {}
    for run in runs:
        if run.parent in by_id:
            children.setdefault(run.parent, []).append(run)
    ordered: list[RecordedRun] = []

    def visit(run: RecordedRun) -> None:
        ordered.append(run)
        kids = children.get(run.run_id, [])
        asked = {run_id: i for i, run_id in enumerate(_asked_runs(run))}
        for kid in sorted(kids, key=lambda k: asked.get(k.run_id, len(asked) + kids.index(k))):
            visit(kid)

    for run in runs:
        if run.parent not in by_id:
            visit(run)
    return ordered


def _asked_runs(run: RecordedRun) -> list[str]:
    """The run ids `run`'s agent-as-tool calls were answered by, in call order (tool result
    messages are logged in call order; `details.run_id` names the callee's run)."""
    return [message.details["run_id"] for message in run.messages
            if isinstance(message, ToolResultMessage) and isinstance(message.details, dict)
            and isinstance(message.details.get("run_id"), str)]


#: A tool batch's starts and ends: parallel calls end in the order they finish, which means
#: nothing; each call's own events keep their order.
CALL_EVENTS = frozenset({"tool_execution_start", "tool_execution_end"})


def canonical_events(events: Sequence[tuple[str, dict[str, Any]]]
                     ) -> list[tuple[str, dict[str, Any]]]:
    """A run's events as they are compared (`compare`, `diff`): in each stretch of tool
    execution events, grouped by call in the order the calls started (their call order)."""
    out: list[tuple[str, dict[str, Any]]] = []
    stretch: list[tuple[str, dict[str, Any]]] = []
    for item in [*events, ("", {})]:  # the sentinel ends the last stretch
        if item[0] in CALL_EVENTS:
            stretch.append(item)
            continue
        if stretch:
            first: dict[Any, int] = {}
            for i, (_, body) in enumerate(stretch):
                first.setdefault(body.get("tool_call_id"), i)
            out.extend(sorted(stretch, key=lambda e: first[e[1].get("tool_call_id")]))
            stretch = []
        if item[0]:
            out.append(item)
    return out


# --- which runs may be replayed: only what the agent's own server published ---------------

HUB_PEER = "hub"  # the `peer` the hub stamps on its own events, which no peer can publish
#: Events about a call, published by the peer serving it (a gateway, a tool worker), not by
#: the agent's coordinator; replay reads nothing of them.
SERVER_PROGRESS = frozenset({"message_update", "llm_retry", "tool_execution_update"})


def _note_server(servers: dict[str, set[str]], peer_id: str, service: str) -> None:
    if service.startswith("agent."):
        servers.setdefault(peer_id, set()).add(service[6:].partition("@")[0])


def distrust(run: RecordedRun, servers: Mapping[str, set[str]]) -> str:
    """Why `run` may not be replayed: some of its events (its tool calls' starts included) were
    published by a peer the hub never saw serve its agent (`service_registered`, a hub event no
    peer can forge, or `hub.status` now). "" when every one came from its agent's server."""
    strangers = sorted(p or "(no peer)" for p in run.publishers
                       if run.agent not in servers.get(p, ()))
    if not strangers:
        return ""
    return (f"run {run.run_id} (agent `{run.agent}`) was published by {', '.join(strangers)}, "
            f"which never served `agent.{run.agent}`: not replayed, its tools not run")


def trusted(runs: Sequence[RecordedRun]) -> list[RecordedRun]:
    """The runs that may be replayed; each other one is reported (logged, naming it)."""
    for run in runs:
        if run.distrust:
            log.warning("skipped %s", run.distrust)
    return [run for run in runs if not run.distrust]


def _add(run: RecordedRun, event: ev.Event) -> None:
    kind = ev.event_type(event)
    billed = ev.billed(event)
    if billed is not None:
        run.billed = run.billed + billed[1]
    if isinstance(event, ev.MessageEnd):
        run.messages.append(event.message)
    elif isinstance(event, ev.AgentEnd):
        run.end = event
    if kind not in SKIPPED:
        run.events.append((kind, _normal(msgspec.to_builtins(event))))


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def tool_book(runs: Sequence[RecordedRun]) -> list[ToolEntry]:
    """Every logged tool result of `runs` but the always-live tools', keyed by its call."""
    entries: list[ToolEntry] = []
    for run in runs:
        calls = {c.id: c for m in run.replies for c in m.tool_calls}
        for message in run.messages:
            call = calls.get(getattr(message, "tool_call_id", ""))
            if isinstance(message, ToolResultMessage) and call is not None and \
                    not always_live(call.name):
                entries.append(ToolEntry(tool_key(run.agent, call.name, call.arguments),
                                         message, _cut_by_abort(run, message)))
    return entries


def _cut_by_abort(run: RecordedRun, result: ToolResultMessage) -> bool:
    """Whether `result` is the one the loop gives a call an abort cut short (in a run that
    ended aborted), rather than the tool's own."""
    return (run.end is not None and run.end.stop_reason == "aborted" and result.is_error
            and result.text == ABORTED_TEXT)


def book(runs: Sequence[RecordedRun], live_from_seq: int = 0) -> list[ReplayEntry]:
    """Every model reply of `runs`, keyed by the request it answered; with `live_from_seq`
    those logged at or after that seq are marked live (their request goes to the model)."""
    entries: list[ReplayEntry] = []
    for run in runs:
        seqs = iter(run.reply_seqs)
        for i, message in enumerate(run.messages):
            if isinstance(message, AssistantMessage):
                live = 0 < live_from_seq <= next(seqs, 0)
                entries.append(ReplayEntry(request_key(run.agent, run.messages[:i]), message,
                                           live))
    return entries


# --- a fork: where the live part starts and what it changes -------------------------------

#: `[[agents]]` keys a fork can change: those an `llm` request carries (the gateway puts them in
#: the agent's live requests) and the run's turn bound (`max_turns`, as `busctl run` has it).
REQUEST_KEYS = tuple(LiveOverrides.__struct_fields__)
TURN_KEYS = ("max_iterations", "max_turns")
SETTABLE = (*REQUEST_KEYS, *TURN_KEYS)
EXAMPLES = {"model": "b", "system_prompt": "'Be brief.'", "temperature": "0.2", "top_p": "0.9",
            "max_tokens": "1024", "seed": "7", "stop": "END (or a JSON list)",
            "max_iterations": "3", "max_turns": "3"}
KINDS = {"temperature": "a number", "top_p": "a number", "max_tokens": "a whole number",
         "seed": "a whole number", "stop": "a string or a JSON list of strings"}


class ForkError(ConfigError, ValueError):
    """A fork option that cannot apply (unknown agent or key, bad value): says which and how
    to fix it, before anything of the replay runs."""


@dataclass(frozen=True)
class Fork:
    """Where a replay goes live and what its live part changes (`busctl replay` options).

    `live_from` N: each run's first N model calls are replayed (0: none, every call is live);
    `live_from_seq` S: the calls whose logged reply has seq >= S go live (a run stays live from
    its first one). `model`: the
    alias of every live call. `system_prompt`: the prompted agents' (those of the experiment's
    top-level runs) for their live calls. `settings`: `"agent.key"` -> value (a string is
    converted), a key of `SETTABLE`."""

    live_from: int | None = None  # 0: every call live
    live_from_seq: int = 0
    model: str = ""
    system_prompt: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The problems the options show alone (the rest need the experiment: `plan_fork`)."""
        if self.live_from is not None and self.live_from_seq:
            raise ForkError("--live-from and --live-from-seq both say where the fork starts: "
                            "give one")
        if not self.forks and (self.model or self.system_prompt is not None or self.settings):
            raise ForkError("--model, --system-prompt-file and --set change the live part of a "
                            "fork: give --live-from TURN or --live-from-seq SEQ too")

    @property
    def forks(self) -> bool:
        return self.live_from is not None or bool(self.live_from_seq)

    def live_seq(self, runs: Sequence[RecordedRun]) -> int:
        """The seq from which logged replies are live (0: none by seq). `--live-from 0` is
        every call live: the first seq of the runs, at or before every reply."""
        if self.live_from == 0:
            return min((r.first_seq for r in runs), default=0) or 1
        return self.live_from_seq


@dataclass
class ForkPlan:
    """A `Fork` checked against the experiment: per agent, what its live calls change and the
    turn bound of its prompted runs."""

    overrides: dict[str, LiveOverrides] = field(default_factory=dict)
    max_turns: dict[str, int] = field(default_factory=dict)


def parse_setting(text: str) -> tuple[str, str]:
    """`AGENT.KEY=VALUE` (as `--set` takes it) -> ("AGENT.KEY", "VALUE")."""
    name, eq, value = text.partition("=")
    agent, dot, key = name.strip().rpartition(".")
    if not eq or not dot or not agent or not key:
        raise ForkError(f"--set {text}: expected AGENT.KEY=VALUE, e.g. "
                        f"--set assistant.temperature=0.2")
    return f"{agent}.{key}", value


def plan_fork(fork: Fork, runs: Sequence[RecordedRun], source: str) -> ForkPlan:
    """Check `fork` against experiment `source`'s `runs`; raises ForkError naming the option."""
    if not fork.forks:
        return ForkPlan()
    if fork.live_from_seq:
        _check_seq(fork.live_from_seq, runs, source)
    _check_goes_live(fork, runs, source)
    agents = {r.agent for r in runs}
    prompted = sorted({r.agent for r in runs if not r.parent})
    values: dict[str, dict[str, Any]] = {}
    for name, value in fork.settings.items():
        agent, key = _setting_name(name, value, agents, source)
        values.setdefault(agent, {})[key] = value
    if fork.system_prompt is not None:
        for agent in prompted:
            if "system_prompt" in values.get(agent, {}):
                raise ForkError(f"--system-prompt-file and --set {agent}.system_prompt both give "
                                f"`{agent}`'s system prompt: give one")
            values.setdefault(agent, {})["system_prompt"] = fork.system_prompt
    plan = ForkPlan()
    for agent, settings in values.items():
        _plan_agent(plan, agent, settings, prompted)
    return plan


def _check_seq(seq: int, runs: Sequence[RecordedRun], source: str) -> None:
    first, last = min(r.first_seq for r in runs), max(r.last_seq for r in runs)
    if not first <= seq <= last:
        raise ForkError(f"--live-from-seq {seq}: experiment `{source}`'s events are seqs "
                        f"{first}-{last}; give one of them (`busctl watch --experiment "
                        f"{source} --no-follow` shows each event's seq)")


def _check_goes_live(fork: Fork, runs: Sequence[RecordedRun], source: str) -> None:
    """A fork point past every run's last model call forks nothing: every call would be
    replayed, and --model / --set would change nothing (it said "identical")."""
    most = max((len(r.replies) for r in runs), default=0)
    if fork.live_from and fork.live_from >= most:
        raise ForkError(f"--live-from {fork.live_from}: no model call would go live: each run of "
                        f"`{source}` made at most {most} model calls, all replayed; give "
                        f"--live-from 0 to {max(0, most - 1)} (0: every call live)")
    last = max((seq for r in runs for seq in r.reply_seqs), default=0)
    if fork.live_from_seq > last:
        raise ForkError(f"--live-from-seq {fork.live_from_seq}: no model call would go live: the "
                        f"last model reply of `{source}` is seq {last}; give a seq at or before it")


def _setting_name(name: str, value: Any, agents: set[str], source: str) -> tuple[str, str]:
    agent, _, key = name.rpartition(".")
    shown = f"--set {name}={value}"
    if agent not in agents:
        raise ForkError(f"{shown}: experiment `{source}` has no runs of agent `{agent}` (its "
                        f"agents: {', '.join(sorted(agents))})")
    if key not in SETTABLE:
        what = ("cannot change in a fork (a run's tools and loop settings are fixed when it "
                "starts)" if key in AgentSpec.__struct_fields__ else "is not an [[agents]] key")
        raise ForkError(f"{shown}: `{key}` {what}; a fork can set: {', '.join(SETTABLE)}")
    return agent, key


def _plan_agent(plan: ForkPlan, agent: str, settings: dict[str, Any],
                prompted: Sequence[str]) -> None:
    request = {k: _typed_stop(v) if k == "stop" else v for k, v in settings.items()
               if k in REQUEST_KEYS}
    try:
        plan.overrides[agent] = msgspec.convert(request, LiveOverrides, strict=False)
    except msgspec.ValidationError as exc:
        raise ForkError(_bad_value(agent, settings, str(exc))) from None
    for key in TURN_KEYS:
        if key not in settings:
            continue
        if agent not in prompted:
            raise ForkError(f"--set {agent}.{key}: the runs of `{agent}` are started by "
                            f"`ask_{agent}` calls, which a fork does not bound; set it for an "
                            f"agent the experiment prompts ({', '.join(prompted)})")
        try:
            plan.max_turns[agent] = msgspec.convert(settings[key], TurnBound, strict=False)
        except msgspec.ValidationError:
            raise ForkError(f"--set {agent}.{key}={settings[key]}: expected a whole number of "
                            f"turns from 1 to {2**31 - 1}, e.g. --set {agent}.{key}=3") from None


def _typed_stop(value: Any) -> Any:
    if isinstance(value, str):  # `--set a.stop=END`, or a JSON list
        try:
            return json.loads(value) if value.lstrip().startswith("[") else [value]
        except json.JSONDecodeError:
            return value  # reported by the conversion
    return value


def _bad_value(agent: str, settings: dict[str, Any], error: str) -> str:
    """msgspec says `Expected `float | null`, got `str` - at `$.temperature``: name the
    --set that gave it."""
    key = error.rpartition("$.")[2].split("[")[0].rstrip("`") if "$." in error else ""
    if key not in settings:
        return f"--set {agent}.*: {error}"
    reason = error.partition(" - at ")[0]
    if "got `" in reason:  # a type error: msgspec's type names mean little on a command line
        reason = f"expected {KINDS.get(key, 'a string')}"
    else:
        reason = reason.replace("Expected `float`", "expected a finite number").replace(
            "Expected `int`", "expected a whole number").replace("Expected `str`", "expected")
    return (f"--set {agent}.{key}={settings[key]}: {reason}; e.g. --set "
            f"{agent}.{key}={EXAMPLES[key]}")


# --- replay --------------------------------------------------------------------------------


@dataclass
class Divergence:
    run: int  # index of the run (in start order)
    agent: str
    turn: int
    event: int  # index of the event in the run (streamed deltas not counted)
    type: str
    detail: str

    def __str__(self) -> str:
        return (f"diverged at run {self.run + 1} (agent `{self.agent}`), turn {self.turn}, event "
                f"{self.event + 1} ({self.type}): {self.detail}")


async def prepare(peer: Peer, source: str, target: str, *, fork: Fork | None = None,
                  live_tools: bool = False, tally: ev.EventTally | None = None
                  ) -> tuple[list[RecordedRun], ForkPlan]:
    """Put experiment `target` in replay of `source`: its model replies to the gateway and,
    unless `live_tools`, its tool results to every coordinator. Returns `source`'s runs and
    the checked `fork` (a ForkError, before anything is sent, when it cannot apply)."""
    fork = fork or Fork()
    logged_runs = await load_experiment(peer, source, tally)
    if not logged_runs:
        raise ValueError(f"experiment `{source}` has no runs in the hub's log (check the name "
                         f"with `busctl export --experiment {source}`)")
    runs = trusted(logged_runs)  # nothing of an untrusted run reaches the books either
    if not runs:
        raise ValueError(f"no run of experiment `{source}` can be trusted: "
                         + "; ".join(r.distrust for r in logged_runs))
    plan = plan_fork(fork, runs, source)
    load = ReplayLoad(experiment=target, source=source,
                      entries=book(runs, fork.live_seq(runs)), live_after=fork.live_from or 0,
                      model=fork.model, overrides=plan.overrides, fork=fork.forks)
    try:
        await peer.request(REPLAY_SERVICE, msgspec.msgpack.encode(load), timeout=10)
    except RemoteError as exc:
        if exc.code != "invalid":
            raise
        raise ForkError(f"--model / --set AGENT.model: {exc.message}") from None
    if live_tools:
        return runs, plan
    entries = tool_book(runs)
    names = sorted({e.result.tool_name for e in entries})
    tools = msgspec.msgpack.encode(ToolBook(target, source, entries, names))
    status = await peer.status()
    for service in sorted({s.name for s in status.services if s.name.startswith("replay@")}):
        await peer.request(service, tools, timeout=10)
    return runs, plan


async def replay_experiment(bus: PromptingBus, source: str, target: str, *, fork: Fork | None = None,
                            live_tools: bool = False, tally: ev.EventTally | None = None,
                            only: Collection[str] = (),
                            workspaces: Mapping[str, RunWorkspace] | None = None,
                            notes: list[str] | None = None) -> Divergence | None:
    """Replay `source` as `target` (see the module doc); the first divergence, or None.

    A `fork` replays part of each run and calls the live model for the rest (see `Fork`).
    `only`: just these top-level runs (with the runs they asked), e.g. one sample of a
    `busctl experiment`. `workspaces`: the workspace each top-level run (by its logged id) is
    prompted with (a `busctl experiment` cell's, for live tools: the log has only its id).
    Logged events that do not decode are skipped and counted in `tally`. `notes` gets the
    token usage differences, which the comparison leaves out (see `usage_notes`)."""
    if await load_experiment(bus.peer, target, tally):
        raise ValueError(f"experiment `{target}` already has runs in the log; name a new one "
                         f"with --as")
    runs, plan = await prepare(bus.peer, source, target, fork=fork, live_tools=live_tools,
                               tally=tally)
    if only:
        runs = _trees(runs, only)
        if not runs:
            raise ValueError(f"experiment `{source}` has no top-level run "
                             f"{', '.join(sorted(only))}")
    for run in runs:
        if run.parent:
            continue  # made again by the caller's ask_<agent> call
        started = await bus.prompt(run.agent, run.prompt, experiment=target,
                                   max_turns=plan.max_turns.get(run.agent, 0),
                                   abort_reason=abort_reason(run),
                                   workspace=(workspaces or {}).get(run.run_id))
        async for _ in started.events():
            pass  # to its agent_end: then it is in the log
        await started.result()
    replayed = await load_experiment(bus.peer, target, tally)
    if notes is not None:
        notes += usage_notes(runs, replayed)
    return compare(runs, replayed)


def _trees(runs: Sequence[RecordedRun], tops: Collection[str]) -> list[RecordedRun]:
    """The runs (in their order) whose top-level run is one of `tops`."""
    parent = {r.run_id: r.parent for r in runs}

    def top(run_id: str) -> str:
        while parent.get(run_id):
            run_id = parent[run_id]
        return run_id

    return [r for r in runs if top(r.run_id) in tops]


def abort_reason(run: RecordedRun) -> str:
    """Why `run` was aborted (`busctl abort AGENT REASON`), when it was aborted with a reason;
    else "". The abort itself is in the log: in a model call, the logged reply (stop reason
    `aborted`), which the replay serves again; in a tool batch, the results the cut calls got
    (`ToolEntry.aborted`), which end the replayed run after that turn. Its reason only reached
    the run's `agent_end` (`Operation aborted: REASON`), so the replayed prompt carries it."""
    end, replies = run.end, run.replies
    if end is None or end.stop_reason != "aborted" or not end.error:
        return ""
    last = replies[-1] if replies else None
    base = (last.error if last is not None and last.stop_reason == "aborted" else "") \
        or ABORTED_TEXT
    prefix = f"{base}: "
    return end.error[len(prefix):] if end.error.startswith(prefix) else ""


def compare(a: Sequence[RecordedRun], b: Sequence[RecordedRun]) -> Divergence | None:
    """The first difference between two executions, run by run in start order."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        found = _compare_run(index, x, y)
        if found is not None:
            return found
    if len(a) != len(b):
        n = min(len(a), len(b))
        agent = (a[n] if len(a) > n else b[n]).agent
        return Divergence(n, agent, 0, 0, "agent_start",
                          f"{len(a)} runs in the first, {len(b)} in the second")
    return None


def _comparable(run: RecordedRun) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, str]]:
    """`run`'s events in canonical order with each tool call id replaced by the call's number
    in the run (`#1`, `#2`, ...): ids are not compared (a replay keeps the logged ones, but two
    executions of a script do not share them). And the ids by number."""
    numbers: dict[str, str] = {}
    for reply in run.replies:
        for call in reply.tool_calls:
            numbers.setdefault(call.id, f"#{len(numbers) + 1}")
    events = [(kind, _content(body)) for kind, body in canonical_events(run.events)]
    if numbers:
        events = [(kind, _renumbered(body, numbers)) for kind, body in events]
    return events, {number: call_id for call_id, number in numbers.items()}


def _content(body: dict[str, Any]) -> dict[str, Any]:
    """An event body without its token usage (the event's, its message's): compared apart
    (`usage_notes`, `diff`'s `tokens`). A live call's usage is not the run's content: with the
    same answer, the split of cached tokens is the server's cache state (`cache_read 40 != 24`)."""
    if "usage" not in body and not isinstance(body.get("message"), dict):
        return body
    kept = {k: v for k, v in body.items() if k != "usage"}
    if isinstance(kept.get("message"), dict):
        kept["message"] = {k: v for k, v in kept["message"].items() if k != "usage"}
    return kept


def usage_notes(a: Sequence[RecordedRun], b: Sequence[RecordedRun]) -> list[str]:
    """Each pair of runs (in start order) whose billed tokens differ: `run 1 (agent): tokens
    250 -> 262 (input 200 -> 222, cache_read 40 -> 24)`."""
    notes = []
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        ux, uy = x.usage, y.usage
        parts = [f"{k} {getattr(ux, k)} -> {getattr(uy, k)}" for k in ("input", "output", "cache_read",
                                                                      "cache_write")
                 if getattr(ux, k) != getattr(uy, k)]
        if parts:
            notes.append(f"run {index + 1} ({x.agent}): tokens {ux.total} -> {uy.total} "
                         f"({', '.join(parts)})")
    return notes


def _renumbered(value: Any, numbers: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: numbers.get(v, v) if k in CALL_ID_KEYS and isinstance(v, str)
                else _renumbered(v, numbers) for k, v in value.items()}
    if isinstance(value, list):
        return [_renumbered(v, numbers) for v in value]
    return value


#: The fields that hold a tool call's id (a call part's `id`, a result's `tool_call_id`).
CALL_ID_KEYS = frozenset({"id", "tool_call_id"})


def _compare_run(index: int, x: RecordedRun, y: RecordedRun) -> Divergence | None:
    """The first difference between two runs' events in canonical order (`canonical_events`):
    `busctl replay` and `busctl diff` judge a pair of runs by this one comparison."""
    turn = 0
    (xs, ids), (ys, _) = _comparable(x), _comparable(y)
    for n, ((tx, bx), (ty, by)) in enumerate(zip(xs, ys, strict=False)):
        if tx == "turn_start":
            turn = bx.get("turn", turn)
        if (x.agent, tx, bx) != (y.agent, ty, by):
            what = _what(x.agent, tx, bx, y.agent, ty, by)
            if tx in CALL_EVENTS:  # name the call: a batch has several of the same tool
                number = str(bx.get("tool_call_id"))
                what += f" (call `{bx.get('tool_name')}` {number}, id {ids.get(number, number)})"
            return Divergence(index, x.agent, turn, n, tx, what)
    if len(xs) != len(ys):
        n = min(len(xs), len(ys))
        return Divergence(index, x.agent, turn, n, "agent_end",
                          f"{len(xs)} events in the first, {len(ys)} in the second")
    return None


def _what(ax: str, tx: str, bx: dict[str, Any], ay: str, ty: str, by: dict[str, Any]) -> str:
    if ax != ay:
        return f"agent `{ax}` != `{ay}`"
    if tx != ty:
        return f"event {tx} != {ty}"
    return _first_difference(bx, by, "$") or "differs"


def _first_difference(x: Any, y: Any, path: str) -> str:
    """Where two event bodies first differ (`$.path: first != second`), "" when equal."""
    if isinstance(x, dict) and isinstance(y, dict):
        for key in sorted(set(x) | set(y)):
            found = _first_difference(x.get(key), y.get(key), f"{path}.{key}")
            if found:
                return found
        return ""
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return ""
    if x == y:
        return ""
    return f"{path}: {json.dumps(x)[:200]} != {json.dumps(y)[:200]}"


# --- diff ----------------------------------------------------------------------------------


def run_summary(run: RecordedRun) -> dict[str, Any]:
    usage = run.usage
    end = run.end
    return {"run_id": run.run_id, "agent": run.agent, "parent": run.parent,
            "final_text": end.final_text if end else "",
            "stop_reason": end.stop_reason if end else "(no agent_end)",
            "tool_calls": run.tool_calls, "turns": run.turns,
            "tokens": {"input": usage.input, "output": usage.output, "total": usage.total},
            "cost": usage.cost, "wall_time": round(run.last_ts - run.first_ts, 3)}


COMPARED = ("agent", "final_text", "stop_reason", "tool_calls", "turns", "tokens", "cost")


#: Runs to compare with each other: a label (e.g. the sample they ran) and each side's runs
#: (paired in order; a side with fewer has none for the rest).
Paired = tuple[str, Sequence[RecordedRun], Sequence[RecordedRun]]


def diff(a: Sequence[RecordedRun], b: Sequence[RecordedRun],
         paired: Sequence[Paired] | None = None) -> dict[str, Any]:
    """Per pair of runs and in total: each side's summary and the compared fields that differ
    (ids and wall time are shown, never a difference). The pairs: `paired` (e.g. by sample,
    agents.experiment.selection), else run by run in start order."""
    if paired is None:
        paired = [("", a[i:i + 1], b[i:i + 1]) for i in range(max(len(a), len(b)))]
    runs: list[dict[str, Any]] = []
    for label, xs, ys in paired:
        for k in range(max(len(xs), len(ys))):
            runs.append(_run_diff(len(runs), label, xs[k] if k < len(xs) else None,
                                  ys[k] if k < len(ys) else None))
    totals = {side: _totals(runs_) for side, runs_ in (("a", a), ("b", b))}
    return {"runs": runs, "totals": totals,
            "identical": not any(r["differs"] or r["events"] for r in runs)}


def _run_diff(index: int, label: str, x: RecordedRun | None,
              y: RecordedRun | None) -> dict[str, Any]:
    sx = run_summary(x) if x is not None else None
    sy = run_summary(y) if y is not None else None
    differs = [k for k in COMPARED if sx is None or sy is None or sx[k] != sy[k]]
    # the replay's comparison too: "identical" means the same for both commands
    found = _compare_run(index, x, y) if x is not None and y is not None else None
    entry = {"run": index + 1, "a": sx, "b": sy, "differs": differs,
             "events": _event_difference(found)}
    if label:
        entry["sample"] = label
    return entry


def _event_difference(found: Divergence | None) -> str:
    """Where a pair of runs' events first differ ("" when they do not), for `diff`."""
    if found is None:
        return ""
    return f"turn {found.turn}, event {found.event + 1} ({found.type}): {found.detail}"


def _totals(runs: Sequence[RecordedRun]) -> dict[str, Any]:
    usage = Usage()
    for run in runs:
        usage = usage + run.usage
    return {"runs": len(runs), "turns": sum(r.turns for r in runs),
            "tool_calls": sum(len(r.tool_calls) for r in runs),
            "tokens": usage.total, "cost": usage.cost,
            "wall_time": round(sum(r.last_ts - r.first_ts for r in runs), 3)}


def diff_text(result: dict[str, Any], a: str, b: str) -> str:
    """`busctl diff` for people: the differing fields of each run (final texts as a unified
    diff), then the totals side by side."""
    lines: list[str] = []
    for run in result["runs"]:
        x, y = run["a"] or {}, run["b"] or {}
        name = x.get("agent") or y.get("agent")
        if run.get("sample"):
            name = f"{name}, {run['sample']}"
        if not run["differs"]:
            events = run.get("events")
            lines.append(f"run {run['run']} ({name}): differs in events at {events}" if events
                         else f"run {run['run']} ({name}): same")
            continue
        lines.append(f"run {run['run']} ({name}): differs in {', '.join(run['differs'])}")
        for key in run["differs"]:
            if key == "final_text":
                lines.extend(difflib.unified_diff(
                    str(x.get(key, "")).splitlines(), str(y.get(key, "")).splitlines(),
                    fromfile=f"{a} final_text", tofile=f"{b} final_text", lineterm=""))
            else:
                lines.append(f"  {key}: {json.dumps(x.get(key))} -> {json.dumps(y.get(key))}")
    for side, name in (("a", a), ("b", b)):
        t = result["totals"][side]
        lines.append(f"total {name}: {t['runs']} runs, {t['turns']} turns, {t['tool_calls']} "
                     f"tool calls, {t['tokens']} tokens, cost {t['cost']:g}, "
                     f"wall {t['wall_time']:g}s")
    lines.append("identical (but ids and timing)" if result["identical"] else "different")
    return "\n".join(lines)


__all__ = [
    "Divergence",
    "Paired",
    "Fork",
    "ForkError",
    "ForkPlan",
    "RecordedRun",
    "abort_reason",
    "book",
    "canonical_events",
    "compare",
    "diff",
    "diff_text",
    "in_call_order",
    "load_experiment",
    "parse_setting",
    "plan_fork",
    "prepare",
    "replay_experiment",
    "tool_book",
    "usage_notes",
]
