"""Agents talking to agents: other agents offered as tools, and topics.

**Agent as a tool.** An agent whose spec lists `agents = ["researcher", ...]` is offered one tool
per listed agent, named `ask_<agent>` (characters other than letters, digits, `_` and `-` become
`_`, so `ask_web_search` for an agent `web.search`), with the arguments

    {"prompt": "..."}      # plus "new_session": false|true with `ask_sessions = "caller"`

and a description made of the callee's first system-prompt line (from its service metadata on
the hub) when it is live. A call sends a `Prompt` to `agent.<name>` through the hub (even when the
callee lives in the same coordinator) with `parent_run_id` = the caller's run id, the caller's
experiment, and `call_chain` = the agents already waiting plus the caller. The callee's events
are published under its own run id, its `agent_start` and every header carrying the caller's
run as `parent`. The tool result is the callee's final text; it is an error result when the
callee's run ended with stop reason `error` or `aborted` (the text says which and why), or when
the call could not be made. `details` holds `{"agent", "run_id", "stop_reason"}`.

  - Abort: aborting the caller cancels the tool call, which cancels the prompt request at the
    hub; the callee's coordinator then aborts the callee's run (it ends with `aborted`).
  - Cycles: a call whose callee is already in the chain (A asks B asks A) is refused at once,
    before anything is sent, with an error result naming the chain; the callee's coordinator
    checks the same again (code `call_cycle`). The chain is longer than `MAX_CALL_DEPTH` (4)
    agents -> refused with a text naming the limit (code `call_depth`).
  - Sessions: each call opens a fresh session of the callee (its runs proceed concurrently
    with other callers'), unless the caller's spec says `ask_sessions = "caller"`: then each
    calling session keeps one callee session (its id from the first call's result), continued
    by its later calls (`new_session: true` starts another); it is held in memory with the
    calling session. A callee at capacity (`max_concurrent_runs` and `max_queued_runs` full)
    is retried for up to `BUSY_WAIT` seconds, then the call fails with the callee's busy
    message. A callee no coordinator serves is waited for `SERVICE_WAIT` s (it may be starting).

**Topics.** `publish(topic, text)` is a built-in tool offered to every agent that subscribes to
a topic or lists `agents`, and to any agent naming `publish` in its `tools`; `publish_topic()` is
the same from Python. A topic message is a `TopicMessage` event (type `topic_message`, family
`ext`, topic frame `ext/<sender>/<run>/topic_message`) published with the sender as the agent
and the publishing run (if any) and experiment in the header, so it is in the log and on the
stream (`busctl watch --type topic_message`).

Every coordinator hosting a subscribed agent runs a `TopicRouter`: it subscribes to `ext/` from
the hub's seq at its start (so nothing published after it started is missed), keeps only
`topic_message` events, dedupes by seq, and hands each message to each of its agents subscribed
to that topic, except the sender. The agent receives the text `"[<topic>] <sender>: <text>"`:
when idle, as the prompt of a new run (experiment: the message's, else the agent's own); when
running, queued as a follow-up (mode `follow_up`, the default) or a steering message (mode
`steer`); a message queued too late for the running run to take is run right after it ends
(a `continue`). Each subscribed agent gets each message exactly once per coordinator lifetime;
messages published while no coordinator hosting the agent is up are not delivered.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import msgspec

from agent_bus.agents import commands as cmd
from agent_bus.bus import events as ev
from agent_bus.bus.backoff import Backoff
from agent_bus.bus.client import Envelope, Peer
from agent_bus.bus.errors import NoService, RemoteError, RequestError
from agent_bus.bus.messages import TextPart, ToolCallRequest, ToolInfo, ToolResult, error_result

if TYPE_CHECKING:
    from agent_bus.agents.launch.topology import TopicSubscription

log = logging.getLogger("agents.coordinator.multiagent")

AGENT_TOOL_PREFIX = "ask_"
PUBLISH_TOOL = "publish"
#: Most agents a call chain may hold (A asks B asks C asks D asks E: E's prompt has 4).
MAX_CALL_DEPTH = 4
#: How long a call to a busy callee (not in the chain) keeps retrying before it fails.
BUSY_WAIT = 30.0
#: How long a call waits for a coordinator to serve the callee.
SERVICE_WAIT = 3.0
#: Waits between tries of a busy or not yet served callee: 0.02 s doubling to 0.5 s.
CALL_RETRY = Backoff(first=0.02, factor=2.0, cap=0.5, jitter=0.0)
#: Wait before following the topic stream again after it broke (the hub went away, say).
RESUBSCRIBE = Backoff(first=0.5, factor=1.0, cap=0.5, jitter=0.0)
#: Error codes of refused prompts (the coordinator's replies).
CALL_CYCLE = "call_cycle"
CALL_DEPTH = "call_depth"
AGENT_BUSY = "agent_busy"
#: Topic prefix every TopicMessage is published under (family `ext`).
TOPIC_PREFIX = "ext/"
CATALOG_TTL = 1.0

_result_decoder = msgspec.msgpack.Decoder(cmd.RunResult)
_started_decoder = msgspec.msgpack.Decoder(cmd.RunStarted)


# --- names and checks ------------------------------------------------------------------------


def agent_tool_name(agent: str) -> str:
    """The tool an agent is offered as: `ask_<agent>` with provider-safe characters."""
    return AGENT_TOOL_PREFIX + re.sub(r"[^A-Za-z0-9_-]", "_", agent)


def call_problem(chain: Sequence[str], callee: str,
                 max_depth: int = MAX_CALL_DEPTH) -> tuple[str, str] | None:
    """(code, text) when a prompt to `callee` with `chain` (the agents waiting on it, caller
    last) must be refused, else None."""
    if callee in chain:
        path = " -> ".join([*chain, callee])
        return CALL_CYCLE, (
            f"Call cycle: {path}. Agent {callee!r} is already waiting on this call chain, so "
            f"asking it would deadlock; answer without asking {callee!r}.")
    if len(chain) > max_depth:
        path = " -> ".join([*chain, callee])
        return CALL_DEPTH, (
            f"Agent call depth limit ({max_depth}) reached: {path}. Answer without asking "
            f"another agent.")
    return None


def first_line(text: str, limit: int = 200) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


def topic_text(message: ev.TopicMessage) -> str:
    """What a subscribed agent receives for a topic message."""
    sender = f" {message.sender}:" if message.sender else ""
    return f"[{message.topic}]{sender} {message.text}"


def _text_result(text: str, details: Any = None, *, is_error: bool = False) -> ToolResult:
    return ToolResult(content=[TextPart(text)], is_error=is_error, details=details)


def _arguments(request: ToolCallRequest) -> dict[str, Any] | ToolResult:
    try:
        args = msgspec.json.decode(request.arguments.strip() or "{}")
    except msgspec.DecodeError as exc:
        return error_result(f"Error: Invalid tool arguments JSON for {request.name}: {exc}")
    if not isinstance(args, dict):
        return error_result(f"Error: the arguments of {request.name} must be a JSON object")
    return args


# --- the caller's side of agent-as-tool ------------------------------------------------------


@dataclass
class CallContext:
    """What the calling agent's current run contributes to a call: set per run."""

    chain: list[str] = field(default_factory=list)
    experiment: str = ""
    root: str = ""  # the top-level run of the calling run's tree ("": the calling run is)
    #: callee -> its session this calling session talks to (`ask_sessions = "caller"`); kept
    #: across the calling session's runs.
    callee_sessions: dict[str, str] = field(default_factory=dict)


class AgentCalls:
    """The `ask_<agent>` tools of one calling agent (a local tool provider for `AgentTools`)."""

    def __init__(self, peer: Peer, owner: str, agents: Sequence[str],
                 context: Callable[[], CallContext], *, max_depth: int = MAX_CALL_DEPTH,
                 busy_wait: float = BUSY_WAIT, service_wait: float = SERVICE_WAIT,
                 per_caller_session: bool = False) -> None:
        self.peer = peer
        self.per_caller_session = per_caller_session
        self.owner = owner
        self.context = context
        self.max_depth = max_depth
        self.busy_wait = busy_wait
        self.service_wait = service_wait
        self.tools = {agent_tool_name(a): a for a in agents}
        self._descriptions: dict[str, str] = {}
        self._fetched = -float("inf")

    def handles(self, name: str) -> bool:
        return name in self.tools

    async def catalog(self) -> list[ToolInfo]:
        if not self.tools:
            return []
        await self._refresh()
        return [self._info(tool, agent) for tool, agent in self.tools.items()]

    async def _refresh(self) -> None:
        now = anyio.current_time()
        if now - self._fetched < CATALOG_TTL:
            return
        try:
            status = await self.peer.status()
        except RequestError:
            return  # descriptions are a nicety; offer the tools anyway
        self._fetched = now
        for service in status.services:
            agent = cmd.agent_of_service(service.name)
            if agent and service.peers > 0:
                desc = service.meta.get("description") if isinstance(service.meta, dict) else None
                if isinstance(desc, str):
                    self._descriptions[agent] = desc

    def _info(self, tool: str, agent: str) -> ToolInfo:
        role = self._descriptions.get(agent, "")
        memory = ("and remembers your earlier asks" if self.per_caller_session
                  else "and starts afresh each time: give it everything it needs")
        description = (f"Ask the agent '{agent}' to do something and wait for its final answer "
                       f"(it works with its own tools {memory}).")
        if role:
            description += f" Its role: {role}"
        return ToolInfo(name=tool, description=description, parameters={
            "type": "object",
            "properties": {
                "prompt": {"type": "string",
                           "description": f"The complete request for '{agent}'."},
                **({"new_session": {"type": "boolean",
                                    "description": "Start it on a fresh conversation first."}}
                   if self.per_caller_session else {}),
            },
            "required": ["prompt"],
        })

    async def execute(self, request: ToolCallRequest) -> ToolResult:
        callee = self.tools.get(request.name)
        if callee is None:
            return error_result(f"Error: Unknown tool '{request.name}'")
        args = _arguments(request)
        if isinstance(args, ToolResult):
            return args
        prompt = args.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return error_result(f"Error: {request.name} needs a non-empty string `prompt`")
        new_session = args.get("new_session", False)
        if not isinstance(new_session, bool):
            return error_result(f"Error: `new_session` of {request.name} must be true or false")
        context = self.context()
        chain = [*context.chain, self.owner]
        problem = call_problem(chain, callee, self.max_depth)
        if problem is not None:
            return error_result(f"Error: {problem[1]}")
        session = ""
        if self.per_caller_session and not new_session:
            session = context.callee_sessions.get(callee, "")
        command = cmd.Prompt(text=prompt, experiment=context.experiment,
                             parent_run_id=request.run_id, session=session, call_chain=chain,
                             root_run_id=context.root or request.run_id,
                             workspace=request.workspace)  # the team shares the run's folder
        result = await self._call(callee, cmd.encode(command), request.run_id, session)
        if self.per_caller_session and isinstance(result.details, dict) and \
                result.details.get("session"):
            context.callee_sessions[callee] = result.details["session"]
        return result

    async def _call(self, callee: str, body: bytes, parent: str, session: str = "") -> ToolResult:
        coordinator = cmd.session_coordinator(session)
        service = (cmd.session_service(callee, coordinator) if coordinator
                   else cmd.agent_service(callee))
        busy_until = anyio.current_time() + self.busy_wait
        service_until = anyio.current_time() + self.service_wait
        delays = CALL_RETRY.delays()  # endless: the two deadlines above end the tries
        while True:
            try:
                return await self._call_once(callee, service, body, parent)
            except NoService as exc:
                if anyio.current_time() >= service_until:
                    return error_result(f"Error: no coordinator serves agent '{callee}' "
                                        f"(`{service}`): {exc}")
            except RemoteError as exc:
                if exc.code != AGENT_BUSY:
                    return error_result(f"Error: agent '{callee}' refused the request: {exc}")
                if anyio.current_time() >= busy_until:
                    return error_result(f"Error: agent '{callee}' stayed busy for "
                                        f"{self.busy_wait:g}s: {exc}")
            except RequestError as exc:
                return error_result(f"Error: asking agent '{callee}' failed "
                                    f"({exc.code or 'error'}): {exc}")
            await anyio.sleep(next(delays))  # the callee is busy or starting

    async def _call_once(self, callee: str, service: str, body: bytes, parent: str) -> ToolResult:
        run_id = ""
        last = b""
        # No deadline: a run may take long; the caller's abort cancels the request instead.
        async with self.peer.stream(service, body, timeout=None, parent=parent) as replies:
            async for last in replies:
                if not run_id:
                    try:
                        run_id = _started_decoder.decode(last).run_id
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        pass
        try:
            result = _result_decoder.decode(last)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return error_result(f"Error: agent '{callee}' sent an unreadable result: {exc}")
        details = {"agent": callee, "run_id": result.run_id or run_id,
                   "stop_reason": result.stop_reason, "session": result.session}
        if result.stop_reason in ("error", "aborted"):
            why = result.error or result.final_text or result.stop_reason
            text = f"Error: agent '{callee}' run {result.run_id} ended {result.stop_reason}: {why}"
            return _text_result(text, details, is_error=True)
        return _text_result(result.final_text, details)


# --- topics ----------------------------------------------------------------------------------


async def publish_topic(peer: Peer, topic: str, text: str, sender: str = "", *,
                        experiment: str = "", run: str = "") -> None:
    """Publish `text` to `topic` as a `TopicMessage` event from `sender` (an agent name, or any
    label for a script); every agent subscribed to the topic except the sender receives it."""
    if not topic:
        raise ValueError("a topic name is required")
    await peer.publish(ev.TopicMessage(topic=topic, text=text, sender=sender), agent=sender,
                       run=run, experiment=experiment)


class TopicPublisher:
    """The built-in `publish` tool of one agent (a local tool provider for `AgentTools`)."""

    def __init__(self, peer: Peer, owner: str, context: Callable[[], CallContext]) -> None:
        self.peer = peer
        self.owner = owner
        self.context = context

    def handles(self, name: str) -> bool:
        return name == PUBLISH_TOOL

    async def catalog(self) -> list[ToolInfo]:
        return [ToolInfo(name=PUBLISH_TOOL, description=(
            "Publish a message to a named topic: every agent subscribed to that topic receives "
            "it (you do not receive your own messages). Returns at once; replies, if any, "
            "arrive later as messages from the topic."), parameters={
            "type": "object",
            "properties": {"topic": {"type": "string", "description": "The topic's name."},
                           "text": {"type": "string", "description": "The message."}},
            "required": ["topic", "text"],
        })]

    async def execute(self, request: ToolCallRequest) -> ToolResult:
        args = _arguments(request)
        if isinstance(args, ToolResult):
            return args
        topic, text = args.get("topic"), args.get("text")
        if not isinstance(topic, str) or not topic.strip() or not isinstance(text, str):
            return error_result("Error: publish needs a non-empty string `topic` and a "
                                "string `text`")
        try:
            await publish_topic(self.peer, topic.strip(), text, self.owner,
                                experiment=self.context().experiment, run=request.run_id)
        except RequestError as exc:
            return error_result(f"Error: could not publish to topic '{topic}': {exc}")
        return _text_result(f"Published to topic '{topic.strip()}'.", {"topic": topic.strip()})


class TopicSubscriber(Protocol):
    """What a `TopicRouter` delivers to: one hosted agent."""

    @property
    def name(self) -> str: ...

    def deliver_topic(self, message: ev.TopicMessage, mode: str, experiment: str) -> None: ...


class TopicRouter:
    """Delivers topic messages from the bus to this coordinator's subscribed agents."""

    def __init__(self, peer: Peer,
                 subscribers: Sequence[tuple[TopicSubscriber, Sequence[TopicSubscription]]]) -> None:
        self.peer = peer
        self.routes: dict[str, list[tuple[TopicSubscriber, str]]] = {}
        for agent, subscriptions in subscribers:
            for sub in subscriptions:
                self.routes.setdefault(sub.topic, []).append((agent, sub.mode))
        self.last_seq = 0
        self.delivered = 0

    @property
    def active(self) -> bool:
        return bool(self.routes)

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Follow the stream from the hub's seq now; `task_status.started(seq)` once in place."""
        seq = (await self.peer.status()).seq
        self.last_seq = seq
        delays = RESUBSCRIBE.delays()
        while True:
            try:
                async with self.peer.subscribe([TOPIC_PREFIX], since=self.last_seq) as sub:
                    task_status.started(seq)
                    task_status = anyio.TASK_STATUS_IGNORED
                    async for envelope in sub:
                        self.handle(envelope)
                return
            except RequestError as exc:  # e.g. the hub went away during a replay: resume
                log.warning("topic subscription broke (%s); resuming from seq %d", exc,
                            self.last_seq)
                await anyio.sleep(next(delays))

    def handle(self, envelope: Envelope) -> None:
        event, header = envelope.event, envelope.header
        if not isinstance(event, ev.TopicMessage):
            return
        if header.seq and header.seq <= self.last_seq:
            return  # seen already (replay and live overlap): exactly once
        self.last_seq = max(self.last_seq, header.seq)
        sender = event.sender or header.agent
        for agent, mode in self.routes.get(event.topic, ()):
            if agent.name == sender:
                continue
            try:
                agent.deliver_topic(event, mode, header.experiment)
                self.delivered += 1
            except Exception:
                log.exception("%s: could not deliver a message of topic %r", agent.name,
                              event.topic)


__all__ = [
    "AGENT_TOOL_PREFIX",
    "BUSY_WAIT",
    "CALL_CYCLE",
    "CALL_DEPTH",
    "MAX_CALL_DEPTH",
    "PUBLISH_TOOL",
    "AgentCalls",
    "CallContext",
    "TopicPublisher",
    "TopicRouter",
    "TopicSubscriber",
    "agent_tool_name",
    "call_problem",
    "first_line",
    "publish_topic",
    "topic_text",
]
