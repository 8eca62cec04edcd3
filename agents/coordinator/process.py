"""The coordinator process: hosts agents as actors and serves each as `agent.<name>` on the hub.

    busctl coordinator --hub tcp://127.0.0.1:7400 --topology team.toml --state-dir .busctl/agents

Each `AgentSpec` is a `HostedAgent` serving any number of sessions (conversations); each
`Session` is its own actor: an `Agent` (transcript, steering and follow-up queues, run state)
wired to the bus — the model through `llm` (`BusLlmClient`), tools through `tool.<name>`
services restricted to the spec's `tools` list, plus the built-in `tool_output` served locally
(`AgentTools`). Runs of different sessions proceed concurrently, at most `max_concurrent_runs`
of them per agent and coordinator; up to `max_queued_runs` more wait for a slot (their
`RunStarted` comes when they start), beyond that a prompt is refused with code `agent_busy`
naming both keys. Sessions persist in `<state_dir>` (see `agents.coordinator.persistence`); an idle one is
dropped from memory once `IDLE_SESSIONS_KEPT` more recent ones are idle, and loaded again from
the store when continued.

Routing: each coordinator serves `agent.<name>` (new sessions: the hub gives each to the least
loaded coordinator) and `agent.<name>@<coordinator>`. A session id is `<coordinator>.<hex>`, so
a client continuing it (`agents.client.remote`) sends to the affine service of the coordinator holding
it. We chose affinity over a shared store: a session's in-memory actor (queues, live run) lives
in one process, and coordinators on several machines need not share a disk. Coordinator names
must be unique among live coordinators (`busctl up` names them `coordinator-N`).

Commands (bodies in `agents.commands`):
    prompt / continue   partial `RunStarted{run_id, agent, session}` as soon as the run
                        exists, final `RunResult` when it ends. `session` names the session
                        (unknown: code `unknown_session`), `continue_session` the last one,
                        neither a fresh one. The run lives in a task group the coordinator
                        owns (not in the request handler), so if the prompt request is cancelled
                        (requester gone, hub cancel), the run is aborted and still ends normally
                        with `agent_end` / aborted. A session with a run in progress refuses
                        another (code `agent_busy`).
    steer / follow_up   `CommandOk`, queued for the addressed run (`run` or `session`, else the
                        agent's one live run). Refused with code `idle` when that session has
                        no run (the text says how to continue the conversation), `ambiguous`
                        when several runs are live and none is named (listing them), `no_run`
                        for a run id that is not in progress here.
    abort               `CommandOk` (detail "aborted run ..." or "idle"); `reason` is appended
                        to the error of the run's `agent_end` and `RunResult`.
    reset               `CommandOk`; clears the named (else last) session, refused while it runs.
    state               `AgentState`: the focus session (the one live run, else the last
                        session) plus every session in memory and the counts live/queued/idle/
                        stored.
Error replies use code `agent_busy`, `bad_request` (undecodable body) or `invalid` (e.g.
continue with nothing to continue from), besides those above.

Every event a session emits is published, in emit order (each publish awaited), with
agent=<name>, run=<run_id>, experiment=<the prompt's experiment, else the spec's>, and
parent=<the prompt's parent_run_id>; `agent_start` carries the session id.
Multi-agent (see `agents.coordinator.multiagent`): an agent listing `agents` is offered `ask_<agent>` tools
that prompt those agents through the hub (a prompt's `call_chain` is checked here too: a cycle
is refused with code `call_cycle`, a chain over the depth limit with `call_depth`); agents with
topic subscriptions get `publish`, and a `TopicRouter` (started before the services register)
delivers `topic_message` events to them: queued (follow-up/steer) on the agent's one live run,
else a new run of its last session.
Each `agent.<name>` registers with meta `description` = its system prompt's first line.

Durable runs: each session journals its run in the store before publishing the matching event
(the run at agent_start, turns, tool calls begun and their results; `Session._journal`); the
store commits once per event-loop iteration for all sessions, and the peer commits the open
group before it sends anything (`Peer.before_send`), so an event never leaves before the writes
made before it (the run does not wait for the commit to go on). A
coordinator starting under a name the journal knows resumes that name's live runs
(`Coordinator.resume_runs`, `agents.coordinator.durable`): `run_resumed` in place of the second agent_start,
completed calls not repeated, the call in flight issued again (a non-idempotent tool that may have
run gets an error result instead), one agent_end. Nobody waits for a resumed run's RunResult: its
requester follows its events (`agents.client.remote`).

On SIGINT/SIGTERM: abort running runs, give them up to `SHUTDOWN_GRACE` s to end, unregister,
close (an aborted run is ended, not resumed).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.abc
import msgspec

from agent_bus.agents import commands as cmd
from agent_bus.agents.coordinator import durable
from agent_bus.agents.coordinator.bus_adapters import AgentTools, BusLlmClient
from agent_bus.agents.coordinator.multiagent import (
    PUBLISH_TOOL,
    AgentCalls,
    CallContext,
    TopicPublisher,
    TopicRouter,
    call_problem,
    first_line,
    topic_text,
)
from agent_bus.agents.coordinator.persistence import ConversationRecorder, ConversationStore, JournaledRun
from agent_bus.agents.coordinator.recorded_tools import LoggedTools, RecordedTools, load_tool_book
from agent_bus.agents.gateway.wire import ModelConfig
from agent_bus.agents.launch.topology import HOOK_NAMES, AgentSpec
from agent_bus.agents.loop.agent import PROMPT_BUSY, RESET_BUSY, Agent, AgentError
from agent_bus.agents.loop.context import DEFAULT_CONTEXT_WINDOW
from agent_bus.agents.loop.run import ABORTED_TEXT, LoopConfig, LoopResult, ToolExecutor
from agent_bus.agents.replay_wire import replay_service
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import IncomingRequest, Peer, connect
from agent_bus.bus.errors import ConfigError, RemoteError
from agent_bus.bus.messages import Message, RunWorkspace, workspace_problem
from agent_bus.bus.paths import default_state_dir, ensure_state_dir
from agent_bus.bus.security import CurveClient
from agent_bus.tools.executor import BusToolExecutor

log = logging.getLogger("agents.coordinator.process")

#: Requests an agent's service takes beyond its runs: steer/abort/state while runs run.
COMMAND_CAPACITY = 64
AGENT_CAPACITY = COMMAND_CAPACITY  # kept for importers; see `HostedAgent.capacity`
SHUTDOWN_GRACE = 2.0
#: Idle sessions kept in memory per agent (most recently used); the rest only in the store.
IDLE_SESSIONS_KEPT = 32
LIVE_LISTED = 10  # live runs named in an `ambiguous` / `no_run` error
BUSY = "agent_busy"
INVALID = "invalid"
UNKNOWN_SESSION = "unknown_session"
NO_RUN = "no_run"
AMBIGUOUS = "ambiguous"
IDLE = "idle"
ABORTED = "aborted"


class CoordinatorError(ConfigError):
    """The coordinator cannot start (e.g. a hook that does not import); the message says why."""


class CoordinatorSettings(msgspec.Struct):
    hub: str
    agents: list[AgentSpec]
    state_dir: str = ""  # "" = <default state dir>/agents, outside the project (bus.paths)
    name: str = "coordinator"
    curve: CurveClient | None = None
    #: The topology's models, for each agent's context window (compaction, context-left %).
    models: list[ModelConfig] = msgspec.field(default_factory=list)


# --- hooks ---------------------------------------------------------------------------------


def resolve_hook(path: str) -> Callable[..., Any]:
    """`pkg.mod:fn` (attribute path after the colon may be dotted) or `pkg.mod.fn`."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError("expected `package.module:function` or `package.module.function`")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is a {type(obj).__name__}, not a callable")
    hook: Callable[..., Any] = obj
    return hook


def resolve_hooks(spec: AgentSpec) -> dict[str, Any]:
    """The hooks `spec` names, imported (keyword arguments of `LoopConfig`, checked by name)."""
    hooks: dict[str, Any] = {}
    for hook, path in spec.hooks.items():
        if hook not in HOOK_NAMES:
            raise CoordinatorError(f"agent {spec.name!r}: unknown hook {hook!r} "
                                   f"(one of {', '.join(sorted(HOOK_NAMES))})")
        try:
            hooks[hook] = resolve_hook(path)
        except Exception as exc:
            raise CoordinatorError(f"agent {spec.name!r}: cannot load hook {hook} = {path!r}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    return hooks


def loop_config(spec: AgentSpec, models: Sequence[ModelConfig] = ()) -> LoopConfig:
    """The LoopConfig an AgentSpec describes (hooks imported from their dotted paths)."""
    window = DEFAULT_CONTEXT_WINDOW
    for model in models:
        if model.alias == spec.model or (not spec.model and model is models[0]):
            window = model.context_window
            break
    return LoopConfig(
        model=spec.model,
        system_prompt=spec.system_prompt,
        agent=spec.name,
        tool_execution=spec.tool_execution,
        max_iterations=spec.max_iterations,
        repeat_limit=spec.repeat_limit,
        temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_tokens,
        seed=spec.seed, stop=tuple(spec.stop),
        require_done_tool=spec.require_done_tool,
        steering_mode=spec.steering_mode,
        follow_up_mode=spec.follow_up_mode,
        context_window=window,
        **resolve_hooks(spec),
    )


# --- one hosted agent ----------------------------------------------------------------------


@dataclass
class _Run:
    run_id: str = ""
    done: anyio.Event = field(default_factory=anyio.Event)
    result: LoopResult | None = None
    queued: bool = True  # not started yet (e.g. waiting for a `max_concurrent_runs` slot)
    wait: anyio.CancelScope = field(default_factory=anyio.CancelScope)  # abort cancels the wait


#: Events a session publishes as they are: not journaled, not replaced (`Session._on_event`).
_PASSED = frozenset({ev.MessageStart, ev.MessageEnd, ev.MessageUpdate, ev.ToolExecutionUpdate,
                     ev.CompactionStart, ev.LlmRetry})


class Session:
    """One conversation of a hosted agent: its own Agent (transcript, steering and follow-up
    queues, run state), recorder and call context. At most one run at a time."""

    def __init__(self, host: HostedAgent, session_id: str, messages: Sequence[Message]) -> None:
        self.host = host
        self.id = session_id
        spec = host.spec
        self.recorder: ConversationRecorder = host.store.recorder(spec.name, session_id, messages)
        self.llm = BusLlmClient(host.peer, agent=spec.name, experiment=spec.experiment)
        self.call_context = CallContext(experiment=spec.experiment)
        local: list[Any] = []
        if spec.agents:
            local.append(AgentCalls(host.peer, spec.name, spec.agents, lambda: self.call_context,
                                    per_caller_session=spec.ask_sessions == "caller"))
        if spec.agents or spec.subscribe or PUBLISH_TOOL in spec.tools:
            local.append(TopicPublisher(host.peer, spec.name, lambda: self.call_context))
        self.tools = AgentTools(host.executor, spec.tools, host.output_store,
                                experiment=spec.experiment, local=local,
                                on_skipped=self._tool_skipped, told=host.tools_told)
        # an experiment in replay (`busctl replay`) gets its tool results from the log
        executor = RecordedTools(self.tools, host.tool_books, spec.name, lambda: self.experiment,
                                 on_abort=self._replay_abort)
        self.agent = Agent(self.llm, executor, host.config, on_message_end=self._on_message_end,
                           messages=messages, output_store=host.output_store)
        self.agent.subscribe(self._on_event)
        self.experiment = spec.experiment
        self.parent = ""
        self.workspace: RunWorkspace | None = None  # the live run's (journaled with it)
        self.current: _Run | None = None
        self._started: anyio.abc.TaskStatus[str] | None = None
        self.abort_reason = ""
        self.abort_after_turn = False  # a replayed abort (`_replay_abort`) is due at turn_end
        self.topic_queued = False  # a topic message was queued while a run was active
        self.max_turns = 0  # the live run's own bound (0: the agent's), journaled
        self.resuming = False  # the next agent_start is a resumed run's: `run_resumed` replaces it
        self.last_used = anyio.current_time()

    @property
    def busy(self) -> bool:
        """A run is in progress or claimed (waiting for a slot)."""
        return self.current is not None or self.agent.is_running

    @property
    def run_id(self) -> str:
        run = self.current
        return run.run_id if run is not None and run.run_id else (
            self.agent.run_id if self.agent.is_running else "")

    def info(self) -> cmd.SessionInfo:
        run = self.current
        state = "idle" if not self.busy else ("queued" if run is not None and run.queued
                                              else "running")
        return cmd.SessionInfo(session=self.id, state=state, run_id=self.run_id,
                               message_count=len(self.agent.state.messages))

    # --- events and persistence ----------------------------------------------------------

    def sync(self) -> None:
        try:
            self.recorder.sync(self.agent.state.messages)
        except Exception:  # a full disk must not kill the run; the next sync retries
            log.exception("%s: could not persist session %s", self.host.name, self.id)

    def sync_soon(self) -> None:
        """`sync` in the store's open group, once however many messages ended in it (the
        group commits before the peer sends the events published meanwhile)."""
        self.host.store.at_commit(self.sync)

    def _on_message_end(self, message: Message) -> None:
        self.sync_soon()

    async def _on_event(self, event: ev.Event) -> None:
        if type(event) in _PASSED:  # most of a turn's events: nothing to journal or change
            await self._publish(event)
            return
        if isinstance(event, (ev.TurnStart, ev.CompactionComplete, ev.AgentEnd)):
            self.sync_soon()  # history may have been replaced (compaction, prepare_next_turn, trim)
        if isinstance(event, ev.AgentStart):
            if self.resuming:  # `run_resumed` was published in its place (resume_run)
                self.resuming = False
                return
            event = ev.AgentStart(parent_run_id=self.parent, session=self.id)
            run = self.current
            if run is not None and not run.run_id and self._started is not None:
                run.run_id = self.agent.run_id
                self._started.started(run.run_id)
                self._started = None
        elif isinstance(event, ev.TurnEnd) and self.abort_after_turn:
            self.abort_after_turn = False
            self.agent.abort()  # the loop sees it before the next turn: the run ends aborted
        elif isinstance(event, ev.AgentEnd) and self.abort_reason and \
                event.stop_reason == "aborted":
            event = msgspec.structs.replace(event, error=self._aborted_text(event.error))
        self._journal(event)  # before publishing: what was published is known to be journaled
        await self._publish(event)
        if isinstance(event, ev.AgentEnd):
            self._journal_write(self.host.store.run_end, self.agent.run_id)
            # Now, not at the end of the iteration: the agent_end just published is still held
            # by the peer until then, and a crash in between must not resume an ended run.
            self._journal_write(self.host.store.commit)

    async def _tool_skipped(self, tool: str, reason: str) -> None:
        """A live tool not offered to the model (`AgentTools`): said once, as an event."""
        await self._publish(ev.ToolSkipped(tool=tool, reason=reason))

    async def _publish(self, event: ev.Event) -> None:
        # Journaled before published: the peer holds the event until the end of the loop
        # iteration and commits the open group (one for every session that wrote in it, see
        # `ConversationStore.defer_commits`) before it sends anything (`serve` sets
        # `Peer.before_send`), so the run goes on at once: the events of one iteration share
        # a commit and a send, and a burst of one type (a turn's tool_execution_starts) one
        # message. A peer without that hook: wait for the commit here.
        if self.host.peer.before_send is None:
            await self.host.store.committed()
        try:
            await self.host.peer.publish(event, agent=self.host.name, run=self.agent.run_id,
                                         experiment=self.experiment, parent=self.parent)
        except Exception as exc:  # never fail a run because an event could not be sent
            self.host.publish_failures += 1
            log.warning("%s: could not publish %s: %s", self.host.name, ev.event_type(event), exc)

    # --- the run journal (durable runs, `agents.coordinator.durable`) --------------------------------

    def _journal(self, event: ev.Event) -> None:
        store, run_id = self.host.store, self.agent.run_id
        match event:
            case ev.AgentStart():
                self._journal_write(store.run_begin, JournaledRun(
                    run_id=run_id, agent=self.host.name, session=self.id,
                    coordinator=self.host.coordinator, experiment=self.experiment,
                    parent=self.parent, max_turns=self.max_turns, workspace=self.workspace))
            case ev.TurnStart():
                self._journal_write(store.run_turn, run_id, event.turn)
            case ev.ToolExecutionStart():
                self._journal_write(store.call_begin, run_id, event.tool_call_id,
                                    event.tool_name)
            case ev.ToolExecutionEnd():
                self._journal_write(store.call_end, run_id, event.tool_call_id,
                                    event.tool_name, event.result)

    def _journal_write(self, write: Callable[..., None], *args: Any) -> None:
        try:
            write(*args)
        except Exception:  # a full disk must not kill the run; it only loses durability
            log.exception("%s: could not journal run %s", self.host.name, self.agent.run_id)

    async def resume_run(self, journaled: JournaledRun) -> LoopResult:
        """Go on with a run the previous coordinator process left live: `run_resumed`, the
        unanswered tool calls recovered (`agents.coordinator.durable`), then the loop from the history."""
        agent = self.agent
        agent.state.run_id = journaled.run_id
        messages = agent.state.messages
        calls = durable.unanswered(messages)
        catalog = await self.tools.catalog() if calls else []
        todo = durable.plan(calls, self.host.store.run_calls(journaled.run_id), catalog)
        end = None if calls else durable.final_end(messages)
        log.info("%s: resuming run %s of session %s at turn %d (%d tool calls recovered)",
                 self.host.name, journaled.run_id, self.id, journaled.turn, len(calls))
        await self._publish(ev.RunResumed(session=self.id, parent_run_id=self.parent,
                                          turn=journaled.turn, reissued=todo.rerun,
                                          failed=todo.failed, model=end is None))
        if end is not None:  # the final reply was stored; only its agent_end was lost
            await self._on_event(end)
            return LoopResult(end.final_text, end.stop_reason, end.error, {}, [])
        results = await durable.recover(calls, todo, self.host.name, journaled.run_id,
                                        self.tools.execute, self._on_event)
        self.resuming = True
        return await agent.resume(journaled.run_id, results, start_turn=journaled.turn,
                                  max_turns=journaled.max_turns or None)

    def _replay_abort(self) -> None:
        """A replayed call got the result an abort gave it (`RecordedTools.on_abort`): the
        logged run was aborted during this tool batch. Aborting now would cut the batch's
        other calls short, which the log may show finished: the abort is given when the turn
        ends, where the loop ends the run aborted as the logged one ended."""
        self.abort_after_turn = True

    def _aborted_text(self, error: str | None) -> str:
        return f"{error or ABORTED_TEXT}: {self.abort_reason}"

    def abort(self, reason: str = "") -> None:
        if reason:
            log.info("%s: aborting run %s of session %s: %s", self.host.name, self.run_id,
                     self.id, reason)
            self.abort_reason = reason
        self.agent.abort()
        run = self.current
        if run is not None and run.queued:
            run.wait.cancel()  # never started: it leaves the queue (see HostedAgent._start_run)

    # --- runs ----------------------------------------------------------------------------

    async def run_body(self, start: Callable[[], Any], run: _Run, background: bool = False,
                       *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED
                       ) -> None:
        """Body of a run task in the coordinator's task group; holds one of the agent's run
        slots (taken by `HostedAgent._admit`) until it ends.

        `task_status.started(run_id)` is called by the agent_start listener; an AgentError
        raised before that (nothing to continue) goes to the caller of `start()` (or is
        logged, for a `background` run nobody waits for).
        """
        self._started = task_status
        held = self._hold_workspace()
        try:
            run.queued = False
            run.result = await start()
            if run.result is not None and self.abort_reason and \
                    run.result.stop_reason == "aborted":
                run.result = replace(run.result, error=self._aborted_text(run.result.error))
        except Exception:
            if not run.run_id and not background:
                raise
            log.exception("%s: run %s broke", self.host.name, run.run_id)  # should not raise
        finally:
            if held is not None:
                held[0].release_workspace(held[1])
            if run.run_id:  # ended (or broke): nothing to resume
                self._journal_write(self.host.store.run_end, run.run_id)
            self.host.release(run)
            if self.current is run:
                self.current = None
            self.abort_reason = ""
            self.abort_after_turn = False
            self.last_used = anyio.current_time()
            run.done.set()
            self.host.after_run(self)

    def _hold_workspace(self) -> tuple[BusToolExecutor, str] | None:
        """The run's workspace keeps its tool worker while the run lives (tools/executor.py),
        forgotten when the last run holding it (a team shares one) ends."""
        executor = self.host.executor
        if self.workspace is None or not isinstance(executor, BusToolExecutor):
            return None
        executor.hold_workspace(self.workspace.id)
        return executor, self.workspace.id

    def begin(self, experiment: str, parent: str, chain: Sequence[str], root: str = "",
              workspace: RunWorkspace | None = None) -> _Run:
        """Claim the session for a new run (synchronously) and set the run's context (`root`:
        the top-level run of the tree an asked run joins, for the trace context; `workspace`:
        the run's own folder on the tool workers, which its tool calls carry)."""
        run = _Run()
        self.current = run
        self.experiment = experiment or self.host.spec.experiment
        self.parent = parent
        self.workspace = self.tools.workspace = workspace
        self.llm.experiment = self.tools.experiment = self.experiment
        self.llm.trace_root = self.tools.trace_root = root
        self.call_context = CallContext(chain=list(chain), experiment=self.experiment,
                                        root=root, callee_sessions=self.call_context.callee_sessions)
        self.last_used = anyio.current_time()
        return run


class HostedAgent:
    """An agent definition plus its bus wiring, persistence, sessions and command handler.

    Sessions are kept in memory while they run and, idle, up to `IDLE_SESSIONS_KEPT` most
    recently used ones; the others live only in the conversation store and are loaded again
    when continued (an idle stored session costs no coordinator memory)."""

    def __init__(self, spec: AgentSpec, config: LoopConfig, peer: Peer, executor: ToolExecutor,
                 store: ConversationStore, runs: anyio.abc.TaskGroup,
                 coordinator: str = "coordinator") -> None:
        self.spec = spec
        self.name = spec.name
        self.config = config
        self.peer = peer
        self.executor = executor
        self.store = store
        self.runs = runs
        self.coordinator = coordinator
        self.output_store = store.output_store(spec.name)
        self.tools_told: set[tuple[str, str]] = set()  # `tool_skipped` said, for all sessions
        self.sessions: dict[str, Session] = {}
        #: The sessions `_evict` looks at: every idle one in memory, and busy ones until it
        #: passes them (a run's end puts its session back), so a run's end costs a scan of
        #: about `IDLE_SESSIONS_KEPT` sessions, not of every session in memory (at 1,000
        #: concurrent runs that was 1,000 per run end).
        self._resting: dict[str, Session] = {}
        self.slots = anyio.Semaphore(spec.max_concurrent_runs)
        self.queued = 0  # runs waiting for a slot
        self.publish_failures = 0
        #: experiment -> logged tool results (`agents.replay`); shared by the coordinator's agents
        self.tool_books: dict[str, LoggedTools] = {}

    @property
    def service(self) -> str:
        return cmd.agent_service(self.name)

    @property
    def affine_service(self) -> str:
        return cmd.session_service(self.name, self.coordinator)

    # --- sessions ------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self.coordinator}.{uuid.uuid4().hex[:16]}"

    def session(self, session_id: str, *, create: bool = False) -> Session | None:
        """The session in memory, else loaded from the store, else (with `create`) new."""
        found = self.sessions.get(session_id)
        if found is not None:
            return found
        if self.store.has_session(self.name, session_id):
            messages = self.store.messages(self.name, session_id)
        elif create:
            self.store.new_session(self.name, session_id)
            messages = []
        else:
            return None
        found = self.sessions[session_id] = self._resting[session_id] = Session(
            self, session_id, messages)
        return found

    def _prompt_session(self, session_id: str, continue_last: bool, create: bool) -> Session:
        if session_id:
            found = self.session(session_id, create=create)
            if found is None:
                raise RemoteError(
                    f"agent `{self.name}` has no session `{session_id}` on coordinator "
                    f"`{self.coordinator}` (stored: {self.store.count_sessions(self.name)}); "
                    f"check the id `busctl run` printed, or omit it for a fresh session",
                    UNKNOWN_SESSION)
            return found
        if continue_last:
            return self._last()
        return self.session(self._new_id(), create=True)  # type: ignore[return-value]

    def live(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.busy]

    def _evict(self) -> None:
        """Forget the least recently used idle sessions beyond `IDLE_SESSIONS_KEPT`."""
        resting = self._resting
        if len(resting) <= IDLE_SESSIONS_KEPT:  # it holds every idle session
            return
        idle: list[Session] = []
        for s in list(resting.values()):
            if s.busy:
                del resting[s.id]  # back when its run ends (`_rest`)
            elif not s.agent.has_queued_messages():
                idle.append(s)
        if len(idle) <= IDLE_SESSIONS_KEPT:
            return
        idle.sort(key=lambda s: s.last_used)
        for old in idle[:len(idle) - IDLE_SESSIONS_KEPT]:
            del self.sessions[old.id], resting[old.id]

    def _rest(self, session: Session) -> None:
        """`session` has no run any more (ended, or never started): an eviction candidate."""
        session.current = None
        self._resting[session.id] = session

    # --- run slots -----------------------------------------------------------------------

    async def _admit(self, session: Session, run: _Run) -> None:
        """Wait for one of the agent's `max_concurrent_runs` slots; refuse when
        `max_queued_runs` prompts wait already (never drop one silently)."""
        try:
            self.slots.acquire_nowait()
            return
        except anyio.WouldBlock:
            pass
        if self.queued >= self.spec.max_queued_runs:
            raise RemoteError(
                f"agent `{self.name}` is at capacity: {self.spec.max_concurrent_runs} runs in "
                f"progress and {self.queued} waiting on coordinator `{self.coordinator}` "
                f"(raise `max_concurrent_runs` / `max_queued_runs` of [[agents]] "
                f"`{self.name}`, or retry later)", BUSY)
        self.queued += 1
        try:
            await self.slots.acquire()
        finally:
            self.queued -= 1

    def release(self, run: _Run) -> None:
        self.slots.release()

    def after_run(self, session: Session) -> None:
        """Topic messages queued too late for the run that just ended: run them now."""
        self._resting[session.id] = session
        self._evict()
        if not session.topic_queued or session.busy:
            return
        session.topic_queued = False
        if not session.agent.has_queued_messages():
            return
        log.info("%s: running topic messages queued after its last run", self.name)
        self._start_background(session, session.agent.continue_, session.experiment)

    def _start_background(self, session: Session, start: Callable[[], Any],
                          experiment: str) -> None:
        """Start a run nobody waits for (a topic message, queued messages left over)."""
        run = session.begin(experiment, "", ())

        async def body() -> None:
            await self.slots.acquire()
            await session.run_body(start, run, True)

        self.runs.start_soon(body)

    def resume(self, journaled: JournaledRun) -> None:
        """Go on with a run this coordinator had live when it stopped (see `agents.coordinator.durable`);
        nobody waits for it here: its requester follows its events."""
        session = self.session(journaled.session)
        if session is None:
            log.warning("%s: run %s cannot resume: session %s is not stored", self.name,
                        journaled.run_id, journaled.session)
            self.store.run_end(journaled.run_id)
            return
        run = session.begin(journaled.experiment, journaled.parent, (),
                            workspace=journaled.workspace)
        run.run_id = journaled.run_id
        session.max_turns = journaled.max_turns

        async def body() -> None:
            await self.slots.acquire()
            await session.run_body(lambda: session.resume_run(journaled), run, True)

        self.runs.start_soon(body)

    def deliver_topic(self, message: ev.TopicMessage, mode: str, experiment: str) -> None:
        """A topic message for this agent: queued per `mode` on its one live run, else a new
        run of its last session (several live runs: the last session's, queued or new)."""
        text = topic_text(message)
        live = self.live()
        session = live[0] if len(live) == 1 else self._last()
        if not session.busy:
            self._start_background(session, lambda: session.agent.prompt(text), experiment)
            return
        if mode == "steer":
            session.agent.steer(text)
        else:
            session.agent.follow_up(text)
        session.topic_queued = True

    async def _start_run(self, req: IncomingRequest, session: Session, start: Callable[[], Any],
                         experiment: str, parent: str, chain: Sequence[str] = (),
                         root: str = "", workspace: RunWorkspace | None = None) -> bytes:
        if session.busy:
            raise RemoteError(f"{PROMPT_BUSY} (session `{session.id}` of agent `{self.name}` "
                              f"has run {session.run_id or '(starting)'} in progress)", BUSY)
        run = session.begin(experiment, parent, chain, root, workspace)
        try:
            with run.wait:
                await self._admit(session, run)
        except BaseException:
            self._rest(session)
            raise
        if run.wait.cancelled_caught:  # aborted while it waited for a slot: it never starts
            self._rest(session)
            reason, session.abort_reason = session.abort_reason, ""
            raise RemoteError(f"the prompt to agent `{self.name}` (session `{session.id}`) was "
                              f"aborted before it started: {reason or 'abort'}", ABORTED)
        run.queued = False
        self.store.touch(self.name, session.id)
        try:
            run_id = await self.runs.start(session.run_body, start, run)
        except AgentError as exc:
            self._rest(session)
            raise RemoteError(str(exc), INVALID) from None
        try:
            await req.partial(cmd.encode(cmd.RunStarted(run_id=run_id, agent=self.name,
                                                        session=session.id)))
            await run.done.wait()
        finally:
            if not run.done.is_set():  # the request was cancelled: abort, let the run end
                log.info("%s: prompt request %s cancelled; aborting run %s", self.name, req.id,
                         run_id)
                session.agent.abort()
        result = run.result
        if result is None:
            raise RemoteError(f"run {run_id} of agent {self.name!r} ended without a result",
                              p.HANDLER_ERROR)
        return cmd.encode(cmd.RunResult(run_id=run_id, agent=self.name,
                                        final_text=result.final_text,
                                        stop_reason=result.stop_reason, error=result.error,
                                        usage=result.usage, session=session.id))

    # --- commands ------------------------------------------------------------------------

    async def handle(self, req: IncomingRequest) -> bytes:
        try:
            command = cmd.decode_command(req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"malformed command for `{self.service}`: {exc}",
                              p.BAD_REQUEST) from None
        match command:
            case cmd.Prompt():
                return await self._prompt(req, command)
            case cmd.Continue():
                session = self._prompt_session(command.session, True, False)
                return await self._start_run(req, session, session.agent.continue_,
                                             command.experiment, "")
            case cmd.Steer() | cmd.FollowUp():
                return self._queue(command)
            case cmd.Abort():
                return self._abort(command)
            case cmd.Reset():
                return self._reset(command)
            case cmd.GetState():
                return cmd.encode(self.state())
        raise RemoteError(f"unknown command {type(command).__name__}", p.BAD_REQUEST)

    async def _prompt(self, req: IncomingRequest, command: cmd.Prompt) -> bytes:
        if command.call_chain:  # asked by another agent (agent as a tool)
            problem = call_problem(command.call_chain, self.name)
            if problem is not None:
                raise RemoteError(problem[1], problem[0])
        if command.workspace is not None and (why := workspace_problem(command.workspace)):
            raise RemoteError(f"prompt to agent `{self.name}`: {why}", INVALID)
        session = self._prompt_session(command.session, command.continue_session,
                                       command.new_session)
        if command.new_session and command.session and not session.busy:
            session.agent.reset()  # an explicit fresh start of a named session
            session.sync()
        value: Any = list(command.messages) if command.messages else command.text
        turns = command.max_turns if command.max_turns > 0 else None  # <= 0: the agent's own bound
        agent = session.agent
        session.max_turns = max(0, command.max_turns)

        def start() -> Any:
            if command.abort_reason:  # a replayed abort (cmd.Prompt): set once the run is ours
                session.abort_reason = command.abort_reason
            return agent.prompt(value, max_turns=turns)

        return await self._start_run(req, session, start, command.experiment,
                                     command.parent_run_id, command.call_chain,
                                     command.root_run_id, command.workspace)

    def _target(self, run_id: str, session_id: str) -> Session | None:
        """The session a steer/follow-up/abort addresses; None: nothing live to act on.
        Several live runs and no id: refused, listing them."""
        if run_id:
            # a whole id, or a prefix of one (the 8 characters `busctl watch` prints)
            matches = [s for s in self.live() if s.run_id.startswith(run_id)]
            exact = [s for s in matches if s.run_id == run_id]
            if len(exact) == 1 or len(matches) == 1:
                return (exact or matches)[0]
            if matches:
                raise RemoteError(f"run id prefix `{run_id}` matches {len(matches)} runs of agent "
                                  f"`{self.name}` in progress: "
                                  f"{', '.join(sorted(s.run_id for s in matches))}; give more "
                                  f"of the id", AMBIGUOUS)
            raise RemoteError(f"agent `{self.name}` has no run `{run_id}` in progress on "
                              f"coordinator `{self.coordinator}`; {self._live_text()}", NO_RUN)
        if session_id:
            return self.session(session_id)
        live = self.live()
        if len(live) > 1:
            raise RemoteError(f"agent `{self.name}` has {len(live)} runs in progress; name one "
                              f"with --run RUN or --session SESSION: {self._live_text()}",
                              AMBIGUOUS)
        return live[0] if live else None

    def _live_text(self) -> str:
        live = self.live()
        if not live:
            return "none is in progress"
        shown = ", ".join(f"run {s.run_id or '(queued)'} (session {s.id})"
                          for s in live[:LIVE_LISTED])
        more = f" and {len(live) - LIVE_LISTED} more" if len(live) > LIVE_LISTED else ""
        return f"in progress: {shown}{more}"

    def _queue(self, command: cmd.Steer | cmd.FollowUp) -> bytes:
        session = self._target(command.run, command.session)
        if session is None or not session.busy:
            # Queued on an idle session it would leak into the next, unrelated run.
            which = f"session `{session.id}`" if session is not None else f"agent `{self.name}`"
            last = session.id if session is not None else (self.store.last_session(self.name)
                                                           or "SESSION")
            raise RemoteError(f"{which} has no run in progress, so there is nothing to "
                              f"{'steer' if isinstance(command, cmd.Steer) else 'follow up'}; "
                              f"to continue the conversation: busctl run --agent {self.name} "
                              f"-c {last} \"TEXT\"", IDLE)
        if isinstance(command, cmd.Steer):
            session.agent.steer(command.text)
            n, kind = len(session.agent.steering), "steering"
        else:
            session.agent.follow_up(command.text)
            n, kind = len(session.agent.follow_ups), "follow-up"
        return cmd.encode(cmd.CommandOk(detail=f"queued ({n} {kind}) for run "
                                               f"{session.run_id or '(queued)'} of session "
                                               f"{session.id}"))

    def _abort(self, command: cmd.Abort) -> bytes:
        session = self._target(command.run, command.session)
        if session is None or not session.busy:
            return cmd.encode(cmd.CommandOk(detail="idle"))
        session.abort(command.reason)
        return cmd.encode(cmd.CommandOk(detail=f"aborted run {session.run_id or '(queued)'} "
                                               f"of session {session.id}"))

    def _reset(self, command: cmd.Reset) -> bytes:
        session_id = command.session or self.store.last_session(self.name)
        session = self.session(session_id) if session_id else None
        if session is None:
            return cmd.encode(cmd.CommandOk(detail="reset (nothing stored)"))
        if session.busy:
            raise RemoteError(f"{RESET_BUSY} (session `{session.id}` has run "
                              f"{session.run_id or '(queued)'} in progress)", BUSY)
        session.agent.reset()
        session.sync()
        return cmd.encode(cmd.CommandOk(detail=f"reset session {session.id}"))

    def _last(self) -> Session:
        """The agent's last session (a fresh one when it has none)."""
        last = self.store.last_session(self.name) or self._new_id()
        return self.session(last, create=True)  # type: ignore[return-value]

    def new_session(self) -> str:
        """Start a fresh conversation and make it the agent's last one."""
        session = self._new_id()
        self.session(session, create=True)
        return session

    def state(self) -> cmd.AgentState:
        live = self.live()
        last = self.store.last_session(self.name)
        focus = live[0] if len(live) == 1 else (self.session(last) if last else None)
        infos = sorted((s.info() for s in self.sessions.values()),
                       key=lambda i: (i.state == "idle", i.session))
        base = cmd.AgentState(name=self.name, model=self.spec.model, is_running=bool(live),
                              coordinator=self.coordinator, sessions=infos[:cmd.SESSIONS_LISTED],
                              live=len(live), queued=self.queued,
                              idle=len(self.sessions) - len(live),
                              stored=self.store.count_sessions(self.name),
                              max_concurrent_runs=self.spec.max_concurrent_runs)
        if focus is None:
            return base
        s = focus.agent.state
        return msgspec.structs.replace(
            base, run_id=focus.run_id, message_count=len(s.messages),
            pending_tool_calls=sorted(s.pending_tool_calls), error=s.error,
            queued_steering=len(focus.agent.steering),
            queued_follow_up=len(focus.agent.follow_ups), usage=dict(s.usage),
            session=focus.id, is_running=bool(live))


# --- the coordinator -----------------------------------------------------------------------


class Coordinator:
    """All hosted agents of one process, on one peer."""

    def __init__(self, settings: CoordinatorSettings, peer: Peer, store: ConversationStore,
                 runs: anyio.abc.TaskGroup, configs: dict[str, LoopConfig],
                 executor: ToolExecutor | None = None) -> None:
        self.settings = settings
        self.peer = peer
        self.executor = executor or BusToolExecutor(peer)
        self.agents = {spec.name: HostedAgent(spec, configs[spec.name], peer, self.executor,
                                              store, runs, settings.name)
                       for spec in settings.agents}
        self.topics = TopicRouter(peer, [(h, h.spec.subscribe) for h in self.agents.values()])
        self.tool_books: dict[str, LoggedTools] = {}
        for hosted in self.agents.values():
            hosted.tool_books = self.tool_books

    async def handle_replay(self, req: IncomingRequest) -> bytes:
        """`replay@<coordinator>`: a `ToolBook` for an experiment about to be replayed."""
        try:
            count = load_tool_book(self.tool_books, req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"malformed `{replay_service(self.settings.name)}` request: "
                              f"{exc}", p.BAD_REQUEST) from None
        return cmd.encode(cmd.CommandOk(detail=f"{count} logged tool results"))

    async def register(self) -> None:
        """Serve `agent.<name>` (new sessions: the hub spreads them over the coordinators by
        load) and `agent.<name>@<coordinator>` (the sessions this one holds)."""
        status = await self.peer.status()
        taken = {s.name for s in status.services if s.peers > 0}
        for hosted in self.agents.values():
            if hosted.affine_service in taken:
                log.warning("%s: another live coordinator is named %r; continuing a session "
                            "may reach the wrong one (give each a distinct --name)",
                            hosted.name, self.settings.name)
            spec = hosted.spec
            capacity = spec.max_concurrent_runs + spec.max_queued_runs + COMMAND_CAPACITY
            # `tools`/`agents`: what its runs may call, for a client that must know (`busctl
            # experiment run` refuses only for tools a variant's agents can reach)
            meta = {"agent": hosted.name, "model": spec.model,
                    "coordinator": self.settings.name,
                    "description": first_line(spec.system_prompt),
                    "tools": list(spec.tools), "agents": list(spec.agents)}
            for service in (hosted.service, hosted.affine_service):
                await self.peer.serve(service, hosted.handle, capacity=capacity, meta=meta,
                                      confirm=False)
        await self.peer.serve(replay_service(self.settings.name), self.handle_replay, capacity=4,
                              confirm=False)
        # one round trip for them all (same connection, in order): in place, or refused
        await self.peer.confirm_registers()

    def resume_runs(self, store: ConversationStore) -> int:
        """Resume every run the journal says this coordinator (by name) left live."""
        resumed = 0
        for journaled in store.live_runs(self.settings.name):
            hosted = self.agents.get(journaled.agent)
            if hosted is None:
                log.warning("%s: run %s of agent %s cannot resume: the agent is not hosted "
                            "here any more", self.settings.name, journaled.run_id,
                            journaled.agent)
                store.run_end(journaled.run_id)
                continue
            hosted.resume(journaled)
            resumed += 1
        return resumed

    async def shutdown(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Abort running runs, give them `grace` s to end, unregister."""
        running = [s for h in self.agents.values() for s in h.live()]
        for session in running:
            session.abort("the coordinator is shutting down")
        with anyio.move_on_after(grace):
            for session in running:
                await session.agent.wait_for_idle()
        if running:
            await anyio.sleep(0.05)  # let the handlers send their RunResult replies
        with anyio.move_on_after(1):
            for hosted in self.agents.values():
                try:
                    await self.peer.unserve(hosted.service)
                    await self.peer.unserve(hosted.affine_service)
                except Exception:
                    break


def build_configs(settings: CoordinatorSettings) -> dict[str, LoopConfig]:
    """Every agent's LoopConfig; raises CoordinatorError naming the agent and hook on failure."""
    names = [s.name for s in settings.agents]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CoordinatorError(f"agent(s) defined twice: {', '.join(dupes)}")
    return {spec.name: loop_config(spec, settings.models) for spec in settings.agents}


async def run_coordinator(
    settings: CoordinatorSettings,
    *,
    stop: anyio.Event | None = None,
    task_status: anyio.abc.TaskStatus[dict[str, Any]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Host the agents until SIGINT/SIGTERM (or `stop`); print one JSON ready line once every
    `agent.<name>` is registered. Raises CoordinatorError before connecting when an agent's
    configuration is unusable (e.g. a hook does not import)."""
    configs = build_configs(settings)
    store = ConversationStore(ensure_state_dir(settings.state_dir) if settings.state_dir
                              else ensure_state_dir(default_state_dir()) / "agents")
    store.defer_commits()  # one commit per loop iteration for all sessions' writes
    try:
        with (anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if stop is None
              else _no_signals()) as signals:
            async with connect(settings.hub, name=settings.name, role="coordinator",
                               curve=settings.curve) as peer:
                peer.before_send = store.commit  # journaled before published (`_publish`)
                async with anyio.create_task_group() as runs:
                    coordinator = Coordinator(settings, peer, store, runs, configs)
                    if coordinator.topics.active:  # in place before anyone can prompt us
                        await runs.start(coordinator.topics.run)
                    await coordinator.register()
                    resumed = coordinator.resume_runs(store)
                    ready = {"ready": "coordinator", "name": settings.name, "resumed": resumed,
                             "agents": list(coordinator.agents), "pid": os.getpid(),
                             "peer": peer.peer_id}
                    print(json.dumps(ready), flush=True)
                    task_status.started(ready)
                    if stop is not None:
                        await stop.wait()
                    else:
                        assert signals is not None  # (no `stop`: the signal receiver is open)
                        async for signum in signals:
                            log.info("%s: got signal %d; leaving", settings.name, signum)
                            break
                    await coordinator.shutdown()
                    runs.cancel_scope.cancel()
    finally:
        store.close()


class _no_signals:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = [
    "AGENT_CAPACITY",
    "IDLE_SESSIONS_KEPT",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorSettings",
    "HostedAgent",
    "Session",
    "build_configs",
    "loop_config",
    "resolve_hook",
    "run_coordinator",
]
