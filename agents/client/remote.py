"""Drive agents on the bus from a script or the CLI: prompt, follow a run's events, steer, abort.

    async with connect("tcp://127.0.0.1:7400") as bus:
        run = await bus.prompt("assistant", "list the files")
        async for envelope in run.events():
            print(envelope.event)
        result = await run.result()

Events of a run are read from the hub's log and live stream from the moment before the prompt
was sent, so none is missed however fast the agent is.

Sessions: `prompt()` starts a fresh session (conversation) of the agent unless it is given
`session=ID` (continue that one) or `continue_session=True` (the agent's last one); the run's
`session` says which, so it can be continued. A session id names the coordinator holding it,
and the prompt goes to that coordinator's `agent.<name>@<coordinator>` service. `steer`,
`follow_up` and `abort` take `run=` or `session=`; without either they act on the agent's one
live run (found on whichever coordinator holds it) and fail with code `ambiguous`, listing the
live runs, when there are several.

Durable runs: when the coordinator running a run dies, the prompt request fails `PeerLost`, but
the run is journaled and a restarted coordinator of the same name resumes it (`run_resumed`).
A `Run` then keeps following: it waits up to `resume_wait` seconds (`connect(resume_wait=...)`)
for the run's `run_resumed` (or `agent_end`), reads on to `agent_end` and builds the result from
it; with no sign of the run in time (nobody restarted the coordinator) it raises the `PeerLost`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.from_thread
import msgspec

from agent_bus.agents import commands as cmd
from agent_bus.agents import replay
from agent_bus.agents.coordinator.multiagent import publish_topic
from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope, Peer, Subscription
from agent_bus.bus.client import connect as connect_peer
from agent_bus.bus.errors import NoService, NoSuchAgent, PeerLost, RemoteError
from agent_bus.bus.messages import RunWorkspace
from agent_bus.bus.protocol import Status
from agent_bus.bus.security import CurveClient
from agent_bus.tools import Tool, tool
from agent_bus.tools.worker import ToolWorker, WorkerSettings

NO_RUN, AMBIGUOUS = "no_run", "ambiguous"  # the coordinator's error codes (agents.coordinator.process)
PROMPT_TIMEOUT = 24 * 3600.0  # a run may take long; abort is how a caller stops it
#: Seconds a requester waits for a run to resume after its coordinator died (busctl up restarts
#: a crashed process within RESTART_BACKOFF, up to 8 s, and it starts in a second or two).
RESUME_WAIT = 30.0


class Run:
    """One run of one agent: its id, its events, and its result."""

    def __init__(self, bus: AgentBus, agent: str, subscription: Subscription,
                 replies: AsyncIterator[bytes], exit_stack: AsyncExitStack) -> None:
        self.bus = bus
        self.agent = agent
        self.run_id = ""
        self.session = ""
        self._subscription = subscription
        self._replies = replies
        self._stack = exit_stack
        self._result: cmd.RunResult | None = None
        self._final: bytes | None = None
        self._ended = False
        self._end: ev.AgentEnd | None = None  # the run's agent_end, once read
        self._alive = anyio.Event()  # run_resumed or agent_end seen: the run outlived a crash
        self._done = anyio.Event()  # agent_end seen
        self._reading = False  # `events()` is being iterated (the one reader)

    async def _started(self) -> None:
        first = await self._replies.__anext__()
        started = msgspec.msgpack.decode(first, type=cmd.RunStarted)
        self.run_id = started.run_id
        self.session = started.session

    async def events(self) -> AsyncIterator[Envelope]:
        """This run's events, in seq order, ending with its `agent_end`."""
        if self._ended:
            return
        self._reading = True
        try:
            async for envelope in self._subscription:
                if envelope.header.run != self.run_id:
                    continue
                if isinstance(envelope.event, (ev.RunResumed, ev.AgentEnd)):
                    self._alive.set()
                if isinstance(envelope.event, ev.AgentEnd):
                    self._end = envelope.event
                    self._ended = True
                    self._done.set()
                yield envelope
                if self._ended:
                    return
        finally:
            self._reading = False

    async def result(self) -> cmd.RunResult:
        """Wait for the run to end; the final text, stop reason, usage and error."""
        if self._result is None:
            body = await self.final_reply()
            self._result = msgspec.msgpack.decode(body, type=cmd.RunResult)
            await self.close()
        return self._result

    async def final_reply(self) -> bytes:
        """The request's final reply body; raises its error (e.g. PeerLost when the agent's
        coordinator died: then no `agent_end` will ever come)."""
        if self._final is None:
            body = b""
            try:
                async for body in self._replies:  # noqa: B007 - the final reply is the last one
                    pass
            except PeerLost as exc:
                if not self.run_id or self.bus.resume_wait <= 0:
                    raise
                body = await self._resumed_result(exc)
            self._final = body
        return self._final

    async def _resumed_result(self, lost: PeerLost) -> bytes:
        """The coordinator died mid-run: wait for the run to resume (re-raising `lost` when it
        shows no sign within `resume_wait`), then for its agent_end."""
        async with anyio.create_task_group() as tg:
            if not self._reading:  # else the task iterating `events()` sees them for us
                tg.start_soon(self._drain)
            with anyio.move_on_after(self.bus.resume_wait):
                await self._alive.wait()
            if self._alive.is_set():
                await self._done.wait()
            tg.cancel_scope.cancel()
        end = self._end
        if end is None:
            raise lost
        return cmd.encode(cmd.RunResult(run_id=self.run_id, agent=self.agent,
                                        final_text=end.final_text, stop_reason=end.stop_reason,
                                        error=end.error, usage=end.usage, session=self.session))

    async def end_seen(self, timeout: float) -> bool:
        """Whether `events()` has read this run's `agent_end`, waiting up to `timeout` seconds
        for it (another task must be iterating `events()`). After the result arrived the
        `agent_end` normally follows at once; it never comes when the hub's log refused it."""
        with anyio.move_on_after(timeout):
            await self._done.wait()
        return self._done.is_set()

    async def _drain(self) -> None:
        async for _ in self.events():
            pass

    async def abort(self, reason: str = "") -> None:
        await self.bus.abort(self.agent, reason, run=self.run_id, session=self.session)

    async def close(self) -> None:
        await self._stack.aclose()


class AgentBus:
    """A peer with agent verbs. Use `connect()`."""

    def __init__(self, peer: Peer, resume_wait: float = RESUME_WAIT,
                 replay_from: str = "", fork: replay.Fork | None = None) -> None:
        self.peer = peer
        self.resume_wait = resume_wait  # see the module doc (durable runs); 0: fail at once
        self.replay_from = replay_from  # see `connect`
        self.fork = fork
        self._replaying: set[str] = set()  # experiments put in replay of `replay_from`
        self._fork_turns: dict[str, int] = {}  # agent -> the fork's `max_turns` for its runs

    async def _service(self, agent: str, session: str = "") -> str:
        """The service to send a command about `session` (or a new one) to."""
        status = await self.peer.status()
        _require_agent(agent, status)
        coordinator = cmd.session_coordinator(session)
        if not coordinator:
            return cmd.agent_service(agent)
        service = cmd.session_service(agent, coordinator)
        if service not in _affine(agent, status):
            live = sorted(s.rpartition("@")[2] for s in _affine(agent, status))
            raise NoService(f"session `{session}` of agent `{agent}` is held by coordinator "
                            f"`{coordinator}`, which is not live (live coordinators of "
                            f"`{agent}`: {', '.join(live) or 'none'}); restart it to continue "
                            f"the session, or start a fresh one")
        return service

    async def _command(self, agent: str, command: cmd.Command, *, session: str = "",
                       run: str = "", timeout: float = 10.0) -> bytes:
        """Send `command` to the coordinator holding `session`, else the one holding `run`
        (or the agent's one live run, when neither is named)."""
        service = await self._service(agent, session)
        if session:
            return await self.peer.request(service, cmd.encode(command), timeout=timeout)
        affine = sorted(_affine(agent, await self.peer.status()))
        if len(affine) <= 1:
            return await self.peer.request(service, cmd.encode(command), timeout=timeout)
        return await self._command_live(agent, command, affine, run, timeout)

    async def _command_live(self, agent: str, command: cmd.Command, services: list[str],
                            run: str, timeout: float) -> bytes:
        """Several coordinators serve `agent`: send to the one holding the live run."""
        states = [await self._state_of(service) for service in services]
        if run:
            command = _full_run_id(agent, command, run, states)
            error: RemoteError | None = None
            for service in services:  # the coordinator that has the run accepts
                try:
                    return await self.peer.request(service, cmd.encode(command), timeout=timeout)
                except RemoteError as exc:
                    if exc.code != NO_RUN:
                        raise
                    error = exc
            assert error is not None
            raise error
        holding = [(svc, st) for svc, st in zip(services, states, strict=True) if st.live]
        if sum(st.live for _, st in holding) > 1:
            listed = ", ".join(f"run {i.run_id or '(queued)'} (session {i.session})"
                               for _, st in holding for i in st.sessions if i.state != "idle")
            raise RemoteError(f"agent `{agent}` has {sum(st.live for _, st in holding)} runs in "
                              f"progress; name one with --run RUN or --session SESSION: "
                              f"in progress: {listed}", AMBIGUOUS)
        service = holding[0][0] if holding else cmd.agent_service(agent)
        return await self.peer.request(service, cmd.encode(command), timeout=timeout)

    async def _state_of(self, service: str) -> cmd.AgentState:
        body = await self.peer.request(service, cmd.encode(cmd.GetState()), timeout=5)
        return msgspec.msgpack.decode(body, type=cmd.AgentState)

    async def prompt(self, agent: str, text: str = "", *, messages: Sequence[Any] = (),
                     experiment: str = "", session: str = "", continue_session: bool = False,
                     new_session: bool = False, parent_run_id: str = "",
                     max_turns: int = 0, abort_reason: str = "",
                     workspace: RunWorkspace | None = None, key: str = "") -> Run:
        """Start a run; returns once the agent has accepted it (its run id is known).

        A fresh session unless `session` (continue it) or `continue_session` (the agent's last
        session) is given; `run.session` is the id. `new_session` with `session` starts that
        session over. `max_turns` > 0 bounds this run to that many turns (the agent's
        `max_iterations` otherwise); past it the run ends with stop reason `max_iterations`.
        `abort_reason`: a replay's (see `cmd.Prompt.abort_reason`). `workspace`: a folder of the
        run's own on the tool workers, with these files (`RunWorkspace`, docs/protocol.md).
        `key`: the prompt's idempotency key (an experiment cell's): when the hub is lost while
        the run goes on, the prompt is sent again with it on the next hub and the coordinator
        attaches it to the run it already has (one run, one result; docs/protocol.md section 5,
        "Following the hub")."""
        if max_turns < 0:
            raise ValueError(f"max_turns must be 0 (the agent's own bound) or more, not {max_turns}")
        command = cmd.Prompt(text=text, messages=list(messages), experiment=experiment,
                             session=session, continue_session=continue_session,
                             new_session=new_session, parent_run_id=parent_run_id,
                             max_turns=max_turns, abort_reason=abort_reason,
                             workspace=workspace)
        return await self._start(agent, command, session, key)

    async def continue_(self, agent: str, *, experiment: str = "", session: str = "") -> Run:
        """Run `session` (else the agent's last one) again from its history as it is."""
        return await self._start(agent, cmd.Continue(experiment=experiment, session=session),
                                 session)

    async def _replay(self, experiment: str) -> None:
        """With `replay_from`: put `experiment` in replay of it (once)."""
        if not self.replay_from or experiment in self._replaying:
            return
        if not experiment:
            raise ValueError(f"this client replays experiment `{self.replay_from}`: give each "
                             f"prompt an `experiment=` (the new experiment's id)")
        _, plan = await replay.prepare(self.peer, self.replay_from, experiment, fork=self.fork)
        self._fork_turns = plan.max_turns
        self._replaying.add(experiment)

    async def _start(self, agent: str, command: cmd.Command, session: str = "",
                     key: str = "") -> Run:
        if isinstance(command, (cmd.Prompt, cmd.Continue)):
            await self._replay(command.experiment)
        if isinstance(command, cmd.Prompt) and not command.max_turns and self.replay_from:
            command = msgspec.structs.replace(command,
                                              max_turns=self._fork_turns.get(agent, 0))
        stack = AsyncExitStack()
        try:
            # fails at once for an agent nobody serves: else the prompt would wait
            # PROMPT_TIMEOUT for nobody
            service = await self._service(agent, session)
            seq = (await self.peer.status()).seq
            subscription = await stack.enter_async_context(
                self.peer.subscribe([f"agent/{agent}/"], since=seq))
            stream = await stack.enter_async_context(
                self.peer.stream(service, cmd.encode(command), timeout=PROMPT_TIMEOUT,
                                 key=key))
            run = Run(self, agent, subscription, stream, stack)
            await run._started()
        except BaseException:
            await stack.aclose()
            raise
        return run

    async def run(self, agent: str, text: str, **kwargs: Any) -> cmd.RunResult:
        """Prompt and wait for the result."""
        run = await self.prompt(agent, text, **kwargs)
        return await run.result()

    async def run_many(self, prompts: Sequence[tuple[str, str] | tuple[str, str, str]], *,
                       concurrency: int = 4, experiment: str = "") -> list[cmd.RunResult]:
        """Run (agent, text) or (agent, text, session) prompts with at most `concurrency` at
        once; results in input order (`result.session` says which session each ran in).

        Each prompt without a session runs in a fresh session of its agent, so prompts to one
        agent run concurrently and independently (up to the agent's `max_concurrent_runs`).
        Two prompts naming the same session run one after the other.
        """
        limiter = anyio.CapacityLimiter(max(1, concurrency))
        locks: dict[str, anyio.Lock] = {}
        results: list[cmd.RunResult | None] = [None] * len(prompts)

        async def one(index: int, agent: str, text: str, session: str) -> None:
            lock = locks.setdefault(f"{agent}/{session}", anyio.Lock()) if session else None
            async with limiter:
                if lock is None:
                    results[index] = await self.run(agent, text, experiment=experiment)
                    return
                async with lock:
                    results[index] = await self.run(agent, text, experiment=experiment,
                                                    session=session)

        async with anyio.create_task_group() as tg:
            for index, item in enumerate(prompts):
                agent, text, session = (*item, "")[:3]
                tg.start_soon(one, index, agent, text, session)
        return [r for r in results if r is not None]

    async def publish(self, topic: str, text: str, *, sender: str = "script",
                      experiment: str = "") -> None:
        """Send `text` to every agent subscribed to `topic` (and to the event stream)."""
        await publish_topic(self.peer, topic, text, sender, experiment=experiment)

    @asynccontextmanager
    async def serve_tools(self, *functions: Any, concurrency: int = 8, workspace: str = ".",
                          allow_shell: bool = False) -> AsyncIterator[list[str]]:
        """Serve these functions (plain, async or `@tool`) as tools on the hub from this script,
        for as long as the block runs; yields the tool names.

            async with bus.serve_tools(word_count, fetch_prices):
                await bus.run("analyst", "...")
        """
        tools = [f if isinstance(f, Tool) else tool(f) for f in functions]
        settings = WorkerSettings(hub=self.peer.hub, tool_modules=[], concurrency=concurrency,
                                  workspace=workspace, allow_shell=allow_shell,
                                  name=self.peer.name)
        worker = ToolWorker(settings, tools)
        await worker.attach(self.peer)
        try:
            yield [t.name for t in tools]
        finally:
            with anyio.CancelScope(shield=True):
                await worker.leave()

    async def steer(self, agent: str, text: str, *, run: str = "", session: str = "") -> str:
        """Queue `text` for the next turn of a live run (the agent's one live run, unless `run`
        or `session` names it); refused when it is idle. Returns the coordinator's detail."""
        return await self._ok(agent, cmd.Steer(text=text, run=run, session=session), session,
                              run)

    async def follow_up(self, agent: str, text: str, *, run: str = "",
                        session: str = "") -> str:
        return await self._ok(agent, cmd.FollowUp(text=text, run=run, session=session),
                              session, run)

    async def abort(self, agent: str, reason: str = "", *, run: str = "",
                    session: str = "") -> str:
        """Abort a live run; `reason` ends up in its `agent_end` error."""
        return await self._ok(agent, cmd.Abort(reason=reason, run=run, session=session),
                              session, run)

    async def reset(self, agent: str, *, session: str = "") -> str:
        return await self._ok(agent, cmd.Reset(session=session), session, "")

    async def _ok(self, agent: str, command: cmd.Command, session: str, run: str) -> str:
        body = await self._command(agent, command, session=session, run=run)
        return msgspec.msgpack.decode(body, type=cmd.CommandOk).detail

    async def state(self, agent: str, *, session: str = "") -> cmd.AgentState:
        """The agent's state on one coordinator (the one holding `session`, if given)."""
        return await self._state_of(await self._service(agent, session))

    async def agents(self) -> list[str]:
        status = await self.peer.status()
        return sorted(a for a in map(cmd.agent_of_service, (s.name for s in status.services))
                      if a)


def _full_run_id(agent: str, command: cmd.Command, run: str,
                 states: list[cmd.AgentState]) -> cmd.Command:
    """`command` with its run id prefix (the 8 characters `watch` prints) made whole, when
    one live run of `agent` starts with it; several: refused, listing them (each coordinator
    sees only its own runs, so a prefix is resolved here, across them)."""
    matches = sorted({i.run_id for st in states for i in st.sessions
                      if i.state != "idle" and i.run_id and i.run_id.startswith(run)})
    if len(matches) > 1:
        raise RemoteError(f"--run {run} matches {len(matches)} runs of agent `{agent}` in "
                          f"progress: {', '.join(matches)}; give more of the id", AMBIGUOUS)
    if len(matches) == 1 and isinstance(command, (cmd.Steer, cmd.FollowUp, cmd.Abort)):
        return msgspec.structs.replace(command, run=matches[0])
    return command


def _require_agent(agent: str, status: Status) -> None:
    """Fail at once, naming the agents that exist, when no live coordinator serves `agent`."""
    services = {s.name for s in status.services}
    if cmd.agent_service(agent) in services:
        return
    live = sorted(a for a in map(cmd.agent_of_service, services) if a)
    raise NoSuchAgent(f"no live coordinator serves agent `{agent}` (service "
                    f"`{cmd.agent_service(agent)}`); live agents: {', '.join(live) or 'none'}. "
                    f"Host it with an [[agents]] entry in the topology of `busctl up`, or "
                    f"`busctl coordinator --topology FILE --agent {agent}`")


def _affine(agent: str, status: Status) -> set[str]:
    """The live `agent.<agent>@<coordinator>` services: one per coordinator serving it."""
    prefix = f"agent.{agent}@"
    return {s.name for s in status.services if s.name.startswith(prefix) and s.peers > 0}


@asynccontextmanager
async def connect(hub: str | None = None, *, name: str = "agents-client",
                  curve: CurveClient | None = None, resume_wait: float = RESUME_WAIT,
                  replay_from: str = "", fork: replay.Fork | None = None
                  ) -> AsyncIterator[AgentBus]:
    """`resume_wait`: seconds a run's follower waits for the run to resume after its
    coordinator died (0: fail with PeerLost at once). `replay_from="E"`: every prompt's
    experiment (required) is answered from E's log, model replies and tool results
    (`agents.replay`): run a script against a recorded experiment without calling a model.
    With `fork` (`agents.replay.Fork`, as `busctl replay`'s options) part of each run is
    replayed and the rest calls the live model, changed as the fork says; a fork that cannot
    apply raises `ForkError` at the first prompt, before anything runs."""
    if fork is not None and not replay_from:
        raise replay.ForkError("fork= forks a recorded experiment: give replay_from= too")
    async with connect_peer(hub, name=name, role="client", curve=curve) as peer:
        yield AgentBus(peer, resume_wait, replay_from, fork)


class BlockingBus:
    """`AgentBus` for notebooks and plain scripts: the same verbs, called without `await`.

        with connect_blocking() as bus:
            print(bus.run("assistant", "hello").final_text)
    """

    def __init__(self, portal: anyio.from_thread.BlockingPortal, bus: AgentBus) -> None:
        self._portal = portal
        self._bus = bus

    def run(self, agent: str, text: str, **kwargs: Any) -> cmd.RunResult:
        return self._portal.call(lambda: self._bus.run(agent, text, **kwargs))

    def run_many(self, prompts: Sequence[tuple[str, str]], **kwargs: Any) -> list[cmd.RunResult]:
        return self._portal.call(lambda: self._bus.run_many(prompts, **kwargs))

    def steer(self, agent: str, text: str, **ids: str) -> str:
        return self._portal.call(lambda: self._bus.steer(agent, text, **ids))

    def follow_up(self, agent: str, text: str, **ids: str) -> str:
        return self._portal.call(lambda: self._bus.follow_up(agent, text, **ids))

    def abort(self, agent: str, reason: str = "", **ids: str) -> str:
        return self._portal.call(lambda: self._bus.abort(agent, reason, **ids))

    def publish(self, topic: str, text: str, **kwargs: Any) -> None:
        self._portal.call(lambda: self._bus.publish(topic, text, **kwargs))

    def state(self, agent: str, **ids: str) -> cmd.AgentState:
        return self._portal.call(lambda: self._bus.state(agent, **ids))

    def agents(self) -> list[str]:
        return self._portal.call(self._bus.agents)


@contextmanager
def connect_blocking(hub: str | None = None, *, name: str = "agents-client",
                     curve: CurveClient | None = None) -> Iterator[BlockingBus]:
    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            portal.wrap_async_context_manager(connect(hub, name=name, curve=curve)) as bus:
        yield BlockingBus(portal, bus)


__all__ = ["AgentBus", "BlockingBus", "Run", "connect", "connect_blocking"]
