"""Drive agents on the bus from a script or the CLI: prompt, follow a run's events, steer, abort.

    async with connect("tcp://127.0.0.1:7400") as bus:
        run = await bus.prompt("assistant", "list the files")
        async for envelope in run.events():
            print(envelope.event)
        result = await run.result()

Events of a run are read from the hub's log and live stream from the moment before the prompt
was sent, so none is missed however fast the agent is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.from_thread
import msgspec

from agents import commands as cmd
from agents.multiagent import publish_topic
from tools import Tool, tool
from tools.worker import ToolWorker, WorkerSettings
from bus import events as ev
from bus.client import Envelope, Peer, Subscription
from bus.client import connect as connect_peer
from bus.errors import BusError, NoService
from bus.protocol import Status
from bus.security import CurveClient

PROMPT_TIMEOUT = 24 * 3600.0  # a run may take long; abort is how a caller stops it


class Run:
    """One run of one agent: its id, its events, and its result."""

    def __init__(self, bus: AgentBus, agent: str, subscription: Subscription,
                 replies: AsyncIterator[bytes], exit_stack: AsyncExitStack) -> None:
        self.bus = bus
        self.agent = agent
        self.run_id = ""
        self._subscription = subscription
        self._replies = replies
        self._stack = exit_stack
        self._result: cmd.RunResult | None = None
        self._final: bytes | None = None
        self._ended = False

    async def _started(self) -> None:
        first = await self._replies.__anext__()
        started = msgspec.msgpack.decode(first, type=cmd.RunStarted)
        self.run_id = started.run_id

    async def events(self) -> AsyncIterator[Envelope]:
        """This run's events, in seq order, ending with its `agent_end`."""
        if self._ended:
            return
        async for envelope in self._subscription:
            if envelope.header.run != self.run_id:
                continue
            yield envelope
            if isinstance(envelope.event, ev.AgentEnd):
                self._ended = True
                return

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
            async for body in self._replies:
                pass
            self._final = body
        return self._final

    async def abort(self) -> None:
        await self.bus.abort(self.agent)

    async def close(self) -> None:
        await self._stack.aclose()


class AgentBus:
    """A peer with agent verbs. Use `connect()`."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    async def _command(self, agent: str, command: cmd.Command, timeout: float = 10.0) -> bytes:
        _require_agent(agent, await self.peer.status())
        return await self.peer.request(cmd.agent_service(agent), cmd.encode(command),
                                       timeout=timeout)

    async def prompt(self, agent: str, text: str = "", *, messages: Sequence[Any] = (),
                     experiment: str = "", new_session: bool = False,
                     parent_run_id: str = "", max_turns: int = 0) -> Run:
        """Start a run; returns once the agent has accepted it (its run id is known).

        `max_turns` > 0 bounds this run to that many turns (the agent's `max_iterations`
        otherwise); past it the run ends with stop reason `max_iterations`."""
        if max_turns < 0:
            raise ValueError(f"max_turns must be 0 (the agent's own bound) or more, not {max_turns}")
        command = cmd.Prompt(text=text, messages=list(messages), experiment=experiment,
                             new_session=new_session, parent_run_id=parent_run_id,
                             max_turns=max_turns)
        return await self._start(agent, command)

    async def continue_(self, agent: str, *, experiment: str = "") -> Run:
        return await self._start(agent, cmd.Continue(experiment=experiment))

    async def _start(self, agent: str, command: cmd.Command) -> Run:
        stack = AsyncExitStack()
        try:
            status = await self.peer.status()
            _require_agent(agent, status)  # else the prompt would wait PROMPT_TIMEOUT for nobody
            seq = status.seq
            subscription = await stack.enter_async_context(
                self.peer.subscribe([f"agent/{agent}/"], since=seq))
            stream = await stack.enter_async_context(
                self.peer.stream(cmd.agent_service(agent), cmd.encode(command),
                                 timeout=PROMPT_TIMEOUT))
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

    async def run_many(self, prompts: Sequence[tuple[str, str]], *, concurrency: int = 4,
                       experiment: str = "") -> list[cmd.RunResult]:
        """Run (agent, text) prompts with at most `concurrency` at once; results in input order.

        Each agent runs one run at a time, so prompts for the same agent are queued per agent
        (a busy agent refuses a second prompt); the limit applies across agents.
        """
        limiter = anyio.CapacityLimiter(max(1, concurrency))
        locks: dict[str, anyio.Lock] = {agent: anyio.Lock() for agent, _ in prompts}
        results: list[cmd.RunResult | None] = [None] * len(prompts)

        async def one(index: int, agent: str, text: str) -> None:
            async with locks[agent], limiter:
                results[index] = await self.run(agent, text, experiment=experiment)

        async with anyio.create_task_group() as tg:
            for index, (agent, text) in enumerate(prompts):
                tg.start_soon(one, index, agent, text)
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

    async def steer(self, agent: str, text: str) -> None:
        await self._command(agent, cmd.Steer(text=text))

    async def follow_up(self, agent: str, text: str) -> None:
        await self._command(agent, cmd.FollowUp(text=text))

    async def abort(self, agent: str, reason: str = "") -> None:
        """Abort the agent's current run; `reason` is logged by its coordinator."""
        await self._command(agent, cmd.Abort(reason=reason))

    async def reset(self, agent: str) -> None:
        await self._command(agent, cmd.Reset())

    async def state(self, agent: str) -> cmd.AgentState:
        return msgspec.msgpack.decode(await self._command(agent, cmd.GetState()),
                                      type=cmd.AgentState)

    async def agents(self) -> list[str]:
        status = await self.peer.status()
        return sorted(s.name[6:] for s in status.services if s.name.startswith("agent."))


def _require_agent(agent: str, status: Status) -> None:
    """Fail at once, naming the agents that exist, when no live coordinator serves `agent`."""
    services = {s.name for s in status.services}
    if cmd.agent_service(agent) in services:
        return
    live = sorted(name[6:] for name in services if name.startswith("agent."))
    raise NoService(f"no live coordinator serves agent `{agent}` (service "
                    f"`{cmd.agent_service(agent)}`); live agents: {', '.join(live) or 'none'}. "
                    f"Host it with an [[agents]] entry in the topology of `busctl up`, or "
                    f"`busctl coordinator --topology FILE --agent {agent}`")


async def topology_status(peer: Peer) -> dict[str, Any]:
    """The hub's status plus each gateway's queues and usage and each agent's state."""
    status = await peer.status()
    report: dict[str, Any] = msgspec.to_builtins(status)
    report["gateways"] = {}
    report["agents"] = {}
    for service in status.services:
        try:
            if service.name.startswith("gateway."):
                body = await peer.request(service.name, b"", timeout=3)
                report["gateways"][service.name[8:]] = msgspec.msgpack.decode(body)
            elif service.name.startswith("agent."):
                body = await peer.request(service.name, cmd.encode(cmd.GetState()), timeout=3)
                report["agents"][service.name[6:]] = msgspec.msgpack.decode(body)
        except BusError as exc:
            report.setdefault("errors", []).append(f"{service.name}: {exc}")
    return report


@asynccontextmanager
async def connect(hub: str | None = None, *, name: str = "agents-client",
                  curve: CurveClient | None = None) -> AsyncIterator[AgentBus]:
    async with connect_peer(hub, name=name, role="client", curve=curve) as peer:
        yield AgentBus(peer)


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

    def steer(self, agent: str, text: str) -> None:
        self._portal.call(self._bus.steer, agent, text)

    def follow_up(self, agent: str, text: str) -> None:
        self._portal.call(self._bus.follow_up, agent, text)

    def abort(self, agent: str, reason: str = "") -> None:
        self._portal.call(self._bus.abort, agent, reason)

    def publish(self, topic: str, text: str, **kwargs: Any) -> None:
        self._portal.call(lambda: self._bus.publish(topic, text, **kwargs))

    def state(self, agent: str) -> cmd.AgentState:
        return self._portal.call(self._bus.state, agent)

    def agents(self) -> list[str]:
        return self._portal.call(self._bus.agents)


@contextmanager
def connect_blocking(hub: str | None = None, *, name: str = "agents-client",
                     curve: CurveClient | None = None) -> Iterator[BlockingBus]:
    with anyio.from_thread.start_blocking_portal("asyncio") as portal, \
            portal.wrap_async_context_manager(connect(hub, name=name, curve=curve)) as bus:
        yield BlockingBus(portal, bus)


__all__ = ["AgentBus", "BlockingBus", "Run", "connect", "connect_blocking", "topology_status"]
