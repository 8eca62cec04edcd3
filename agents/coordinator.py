"""The coordinator process: hosts agents as actors and serves each as `agent.<name>` on the hub.

    busctl coordinator --hub tcp://127.0.0.1:7400 --topology team.toml --state-dir .busctl/agents

One `Agent` per `AgentSpec`, each wired to the bus: the model through `llm` (`BusLlmClient`),
tools through `tool.<name>` services restricted to the spec's `tools` list, plus the built-in
`tool_output` served locally (`AgentTools`). Conversations persist in `<state_dir>` (see
`agents.persistence`); on start each agent loads its current session.

Commands (bodies in `agents.commands`):
    prompt / continue   partial `RunStarted{run_id, agent}` as soon as the run exists, final
                        `RunResult` when it ends. The run lives in a task group the coordinator
                        owns (not in the request handler), so if the prompt request is cancelled
                        (requester gone, hub cancel), the run is aborted and still ends normally
                        with `agent_end` / aborted. While a run is active: error reply with the
                        Agent's own message (`Agent is already processing a prompt. ...`).
    steer / follow_up   `CommandOk`, queued for the current or next run.
    abort               `CommandOk` (detail "aborted" or "idle").
    reset               `CommandOk`; refused while running with the Agent's message.
    state               `AgentState`.
Error replies use code `agent_busy` (a run is active), `bad_request` (undecodable body) or
`invalid` (e.g. continue with nothing to continue from).

Every event an agent emits is published, in emit order (each publish awaited), with
agent=<name>, run=<run_id>, experiment=<the prompt's experiment, else the spec's>, and
parent=<the prompt's parent_run_id>. Many agents run concurrently; each runs one run at a time.
Multi-agent (see `agents.multiagent`): an agent listing `agents` is offered `ask_<agent>` tools
that prompt those agents through the hub (a prompt's `call_chain` is checked here too: a cycle
is refused with code `call_cycle`, a chain over the depth limit with `call_depth`); agents with
topic subscriptions get `publish`, and a `TopicRouter` (started before the services register)
delivers `topic_message` events to them: a new run when idle, else a queued follow-up/steer.
Each `agent.<name>` registers with meta `description` = its system prompt's first line.

On SIGINT/SIGTERM: abort running runs, give them up to `SHUTDOWN_GRACE` s to end, unregister,
close.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from agents import commands as cmd
from agents.agent import CONTINUE_BUSY, PROMPT_BUSY, Agent, AgentError
from agents.bus_adapters import AgentTools, BusLlmClient
from agents.context import DEFAULT_CONTEXT_WINDOW
from agents.llm import ModelConfig
from agents.loop import LoopConfig, LoopResult, ToolExecutor
from agents.multiagent import (
    PUBLISH_TOOL,
    AgentCalls,
    CallContext,
    TopicPublisher,
    TopicRouter,
    call_problem,
    first_line,
    topic_text,
)
from agents.persistence import ConversationRecorder, ConversationStore
from agents.topology import HOOK_NAMES, AgentSpec
from bus import events as ev
from bus import protocol as p
from bus.client import IncomingRequest, Peer, connect
from bus.errors import ConfigError, RemoteError
from bus.messages import Message
from bus.paths import default_state_dir, ensure_state_dir
from bus.security import CurveClient
from tools.executor import BusToolExecutor

log = logging.getLogger("agents.coordinator")

AGENT_CAPACITY = 64  # concurrent commands per agent: steer/abort/state are served while a run runs
SHUTDOWN_GRACE = 2.0
BUSY = "agent_busy"
INVALID = "invalid"


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
    return obj


def resolve_hooks(spec: AgentSpec) -> dict[str, Callable[..., Any]]:
    hooks: dict[str, Callable[..., Any]] = {}
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


class HostedAgent:
    """An Agent plus its bus wiring, persistence and command handler."""

    def __init__(self, spec: AgentSpec, config: LoopConfig, peer: Peer, executor: ToolExecutor,
                 store: ConversationStore, runs: anyio.abc.TaskGroup) -> None:
        self.spec = spec
        self.name = spec.name
        self.peer = peer
        self.store = store
        self.runs = runs
        session, messages = store.load(spec.name)
        self.recorder: ConversationRecorder = store.recorder(spec.name, session, messages)
        self.output_store = store.output_store(spec.name)
        self.llm = BusLlmClient(peer, agent=spec.name, experiment=spec.experiment)
        self.call_context = CallContext(experiment=spec.experiment)
        local: list[Any] = []
        if spec.agents:
            local.append(AgentCalls(peer, spec.name, spec.agents, lambda: self.call_context))
        if spec.agents or spec.subscribe or PUBLISH_TOOL in spec.tools:
            local.append(TopicPublisher(peer, spec.name, lambda: self.call_context))
        self.tools = AgentTools(executor, spec.tools, self.output_store,
                                experiment=spec.experiment, local=local)
        self.agent = Agent(self.llm, self.tools, config, on_message_end=self._on_message_end,
                           messages=messages, output_store=self.output_store)
        self.agent.subscribe(self._on_event)
        self.experiment = spec.experiment
        self.parent = ""
        self.current: _Run | None = None
        self._started: anyio.abc.TaskStatus[str] | None = None
        self.publish_failures = 0
        self._topic_queued = False  # a topic message was queued while a run was active

    @property
    def service(self) -> str:
        return cmd.agent_service(self.name)

    # --- events and persistence ----------------------------------------------------------

    def _sync(self) -> None:
        try:
            self.recorder.sync(self.agent.state.messages)
        except Exception:  # a full disk must not kill the run; the next sync retries
            log.exception("%s: could not persist the conversation", self.name)

    def _on_message_end(self, message: Message) -> None:
        self._sync()

    async def _on_event(self, event: ev.Event) -> None:
        if isinstance(event, (ev.TurnStart, ev.CompactionComplete, ev.AgentEnd)):
            self._sync()  # history may have been replaced (compaction, prepare_next_turn, trim)
        if isinstance(event, ev.AgentStart):
            if self.parent:
                event = ev.AgentStart(parent_run_id=self.parent)
            run = self.current
            if run is not None and not run.run_id and self._started is not None:
                run.run_id = self.agent.run_id
                self._started.started(run.run_id)
                self._started = None
        try:
            await self.peer.publish(event, agent=self.name, run=self.agent.run_id,
                                    experiment=self.experiment, parent=self.parent)
        except Exception as exc:  # never fail a run because an event could not be sent
            self.publish_failures += 1
            log.warning("%s: could not publish %s: %s", self.name, ev.event_type(event), exc)

    # --- runs ----------------------------------------------------------------------------

    async def _run(self, start: Callable[[], Any], run: _Run, background: bool = False,
                   *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Body of a run task in the coordinator's task group.

        `task_status.started(run_id)` is called by the agent_start listener; an AgentError
        raised before that (busy, nothing to continue) goes to the caller of `start()` (or is
        logged, for a `background` run nobody waits for).
        """
        self._started = task_status
        try:
            run.result = await start()
        except Exception:
            if not run.run_id and not background:
                raise
            log.exception("%s: run %s broke", self.name, run.run_id)  # the loop should not raise
        finally:
            if self.current is run:
                self.current = None
            run.done.set()
            self._after_run()

    def _begin(self, experiment: str, parent: str, chain: Sequence[str]) -> _Run:
        """Claim the agent for a new run (synchronously) and set the run's context."""
        run = _Run()
        self.current = run
        self.experiment = experiment or self.spec.experiment
        self.parent = parent
        self.llm.experiment = self.tools.experiment = self.experiment
        self.call_context = CallContext(chain=list(chain), experiment=self.experiment)
        return run

    def _start_background(self, start: Callable[[], Any], experiment: str) -> None:
        """Start a run nobody waits for (a topic message, queued messages left over)."""
        run = self._begin(experiment, "", ())
        self.runs.start_soon(self._run, start, run, True)

    def _after_run(self) -> None:
        """Topic messages queued too late for the run that just ended: run them now."""
        if not self._topic_queued or self.current is not None or self.agent.is_running:
            return
        if not self.agent.has_queued_messages():
            self._topic_queued = False
            return
        log.info("%s: running topic messages queued after its last run", self.name)
        self._start_background(self.agent.continue_, self.experiment)

    def deliver_topic(self, message: ev.TopicMessage, mode: str, experiment: str) -> None:
        """A topic message for this agent: a new run when idle, else queued per `mode`."""
        text = topic_text(message)
        if self.current is None and not self.agent.is_running:
            self._start_background(lambda: self.agent.prompt(text), experiment)
            return
        if mode == "steer":
            self.agent.steer(text)
        else:
            self.agent.follow_up(text)
        self._topic_queued = True

    async def _start_run(self, req: IncomingRequest, start: Callable[[], Any], experiment: str,
                         parent: str, busy_text: str, chain: Sequence[str] = ()) -> bytes:
        if self.agent.is_running or self.current is not None:
            raise RemoteError(busy_text, BUSY)
        run = self._begin(experiment, parent, chain)
        try:
            run_id = await self.runs.start(self._run, start, run)
        except AgentError as exc:
            self.current = None
            raise RemoteError(str(exc), BUSY if self.agent.is_running else INVALID) from None
        try:
            await req.partial(cmd.encode(cmd.RunStarted(run_id=run_id, agent=self.name)))
            await run.done.wait()
        finally:
            if not run.done.is_set():  # the request was cancelled: abort, let the run end
                log.info("%s: prompt request %s cancelled; aborting run %s", self.name, req.id,
                         run_id)
                self.agent.abort()
        result = run.result
        if result is None:
            raise RemoteError(f"run {run_id} of agent {self.name!r} ended without a result",
                              p.HANDLER_ERROR)
        return cmd.encode(cmd.RunResult(run_id=run_id, agent=self.name,
                                        final_text=result.final_text,
                                        stop_reason=result.stop_reason, error=result.error,
                                        usage=result.usage))

    # --- commands ------------------------------------------------------------------------

    async def handle(self, req: IncomingRequest) -> bytes:
        try:
            command = cmd.decode_command(req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"malformed command for `{self.service}`: {exc}",
                              p.BAD_REQUEST) from None
        agent = self.agent
        match command:
            case cmd.Prompt():
                return await self._prompt(req, command)
            case cmd.Continue():
                return await self._start_run(req, agent.continue_, command.experiment, "",
                                             CONTINUE_BUSY)
            case cmd.Steer(text=text):
                agent.steer(text)
                return cmd.encode(cmd.CommandOk(detail=f"queued ({len(agent.steering)} steering)"))
            case cmd.FollowUp(text=text):
                agent.follow_up(text)
                return cmd.encode(cmd.CommandOk(detail=f"queued ({len(agent.follow_ups)} follow-up)"))
            case cmd.Abort():
                running = agent.is_running
                agent.abort()
                return cmd.encode(cmd.CommandOk(detail="aborted" if running else "idle"))
            case cmd.Reset():
                try:
                    agent.reset()
                except AgentError as exc:
                    raise RemoteError(str(exc), BUSY) from None
                self._sync()
                return cmd.encode(cmd.CommandOk(detail="reset"))
            case cmd.GetState():
                return cmd.encode(self.state())
        raise RemoteError(f"unknown command {type(command).__name__}", p.BAD_REQUEST)

    async def _prompt(self, req: IncomingRequest, command: cmd.Prompt) -> bytes:
        agent = self.agent
        if command.call_chain:  # asked by another agent (agent as a tool)
            problem = call_problem(command.call_chain, self.name)
            if problem is not None:
                raise RemoteError(problem[1], problem[0])
        if agent.is_running or self.current is not None:
            raise RemoteError(PROMPT_BUSY, BUSY)
        if command.new_session:
            self.new_session()
        value: Any = list(command.messages) if command.messages else command.text
        turns = command.max_turns if command.max_turns > 0 else None  # <= 0: the agent's own bound
        return await self._start_run(req, lambda: agent.prompt(value, max_turns=turns),
                                     command.experiment,
                                     command.parent_run_id, PROMPT_BUSY, command.call_chain)

    def new_session(self) -> str:
        """Start a fresh conversation (refused while running)."""
        self.agent.reset()
        session = self.store.new_session(self.name)
        self.recorder.switch(session)
        return session

    def state(self) -> cmd.AgentState:
        s = self.agent.state
        return cmd.AgentState(
            name=self.name, model=s.model, is_running=s.is_running, run_id=s.run_id,
            message_count=len(s.messages), pending_tool_calls=sorted(s.pending_tool_calls),
            error=s.error, queued_steering=len(self.agent.steering),
            queued_follow_up=len(self.agent.follow_ups), usage=dict(s.usage),
            session=self.recorder.session,
        )


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
                                              store, runs)
                       for spec in settings.agents}
        self.topics = TopicRouter(peer, [(h, h.spec.subscribe) for h in self.agents.values()])

    async def register(self) -> None:
        for hosted in self.agents.values():
            await self.peer.serve(hosted.service, hosted.handle, capacity=AGENT_CAPACITY,
                                  meta={"agent": hosted.name, "model": hosted.spec.model,
                                        "coordinator": self.settings.name,
                                        "description": first_line(hosted.spec.system_prompt)})
        await self.peer.status()  # same connection, in order: the registrations are in place

    async def shutdown(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Abort running runs, give them `grace` s to end, unregister."""
        running = [h for h in self.agents.values() if h.agent.is_running]
        for hosted in running:
            hosted.agent.abort()
        with anyio.move_on_after(grace):
            for hosted in running:
                await hosted.agent.wait_for_idle()
        if running:
            await anyio.sleep(0.05)  # let the handlers send their RunResult replies
        with anyio.move_on_after(1):
            for hosted in self.agents.values():
                try:
                    await self.peer.unserve(hosted.service)
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
    try:
        with (anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if stop is None
              else _no_signals()) as signals:
            async with connect(settings.hub, name=settings.name, role="coordinator",
                               curve=settings.curve) as peer:
                async with anyio.create_task_group() as runs:
                    coordinator = Coordinator(settings, peer, store, runs, configs)
                    if coordinator.topics.active:  # in place before anyone can prompt us
                        await runs.start(coordinator.topics.run)
                    await coordinator.register()
                    ready = {"ready": "coordinator", "name": settings.name,
                             "agents": list(coordinator.agents), "pid": os.getpid(),
                             "peer": peer.peer_id}
                    print(json.dumps(ready), flush=True)
                    task_status.started(ready)
                    if stop is not None:
                        await stop.wait()
                    else:
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
    "Coordinator",
    "CoordinatorError",
    "CoordinatorSettings",
    "HostedAgent",
    "build_configs",
    "loop_config",
    "resolve_hook",
    "run_coordinator",
]
