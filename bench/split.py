"""The split-work floor of `bench_loop` (W): B's own work in the topology's processes, joined by
the least pyzmq allows.

`RawTurns` (bench/baseline.py) measures the hops of a turn with nothing done at either end. The
topology does more than nothing at its ends: its gateway runs the model client (`LlmEngine`) and
its workers run the tools (`run_tool`), each in a process of its own that wakes once a hop, its
caches emptied by the other processes since. `SplitTurns` measures what that costs without the
bus: B's loop (`run_loop`) here, calling a model process that runs B's `LlmEngine` against the
same scripted model and CALLS tool processes that run `run_tool`. Every message is one
msgspec-encoded request or reply through a blocking raw broker (as the hub is), and every end is
an asyncio program that does the least pyzmq allows (`_End`). No hub, events, store, heartbeats,
deadlines or streamed deltas (the loop here gets none, so it does less than B's, which handles
each delta): B's work split over the design card's processes and nothing else. W / B is then a
floor of C/B for any implementation of that split on this machine, and C / W what the bus adds
to it: its features (the event stream and the store, measured apart by `bench_loop --parts`) and
its own code.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import tempfile
from typing import Any

import msgspec
import zmq

from bench.baseline import cpu_s, free_port, own_cpu_s

MODEL = b"model"
TOOL = b"tool"


def _serve_router(endpoint: str, handle: Any) -> None:
    """A blocking ROUTER bound at `endpoint`, with no HWM, as the raw broker of bench/baseline.py
    is (whose loop stays as it is: it is the baseline every ratio is set against). Each wake-up
    takes every waiting message and calls `handle(router, frames)` for each."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.sndhwm = router.rcvhwm = 0
    router.bind(endpoint)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        poller.poll()
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            handle(router, frames)


def _pool_broker(endpoint: str) -> None:
    """The raw broker with two pools: a request names its pool and goes to that pool's next
    process in turn. Blocking, one pass per wake-up, as the hub."""
    pools: dict[bytes, list[bytes]] = {MODEL: [], TOOL: []}
    turns = dict.fromkeys(pools, 0)
    parked: list[list[bytes]] = []  # requests that came before any process of their pool

    def handle(router: zmq.Socket, frames: list[bytes]) -> None:  # type: ignore[type-arg]
        ident, kind = frames[0], frames[1]
        if kind == b"req":  # [client, req, pool, id, body] -> [worker, req, client, id, body]
            pool = pools[frames[2]]
            if not pool:
                parked.append(frames)
                return
            turns[frames[2]] = turn = (turns[frames[2]] + 1) % len(pool)
            router.send_multipart([pool[turn], b"req", ident, *frames[3:]])
        elif kind == b"rep":  # [worker, rep, client, id, body] -> [client, rep, id, body]
            router.send_multipart([frames[2], b"rep", *frames[3:]])
        elif kind == b"ready":  # [worker, ready, pool]: it takes what waited for its pool
            pools[frames[2]].append(ident)
            for waiting in [f for f in parked if f[2] == frames[2]]:
                parked.remove(waiting)
                router.send_multipart([ident, b"req", waiting[0], *waiting[3:]])

    _serve_router(endpoint, handle)


class _End:
    """A DEALER on the running asyncio loop, doing the least pyzmq allows: its fd watched with
    `add_reader`, every waiting message handed to `on_message` at once, sends without a future.
    (ZeroMQ's fd is edge-triggered and a send may take the edge: after each send the socket is
    asked whether input waits, as the bus's transport does.)"""

    def __init__(self, endpoint: str, on_message: Any) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndhwm = self.sock.rcvhwm = 0
        self.sock.connect(endpoint)
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(frames)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self.sock.close()
        self.ctx.term()


def _serve(endpoint: str, pool: bytes, answer: Any) -> None:
    """An asyncio process of `pool` that answers each request in a task with `answer(body)`."""

    async def main() -> None:
        tasks: set[asyncio.Task[None]] = set()

        async def reply(client: bytes, req_id: bytes, body: bytes) -> None:
            end.send([b"rep", client, req_id, await answer(body)])

        def on_message(frames: list[bytes]) -> None:
            task = asyncio.ensure_future(reply(frames[1], frames[2], frames[3]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        end = _End(endpoint, on_message)
        end.send([b"ready", pool])
        await asyncio.Event().wait()  # until the process is stopped

    asyncio.run(main())


def _model_process(endpoint: str, base_url: str, concurrency: int) -> None:
    """B's model client, `LlmEngine` against the scripted model, as a process of its own
    (`concurrency` calls at once at most, as the engine of the loop it stands for)."""
    from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig
    from agent_bus.bus.messages import LlmRequest

    decode = msgspec.msgpack.Decoder(LlmRequest).decode
    encode = msgspec.msgpack.Encoder().encode
    limits = {"max_concurrency": concurrency, "timeout": 600} if concurrency else {}
    engine = LlmEngine([ModelConfig(alias="x", provider="openai", model="m", base_url=base_url,
                                    **limits)])

    async def answer(body: bytes) -> bytes:
        return encode(await engine.complete(decode(body)))

    _serve(endpoint, MODEL, answer)


def _tool_process(endpoint: str, tools_py: str) -> None:
    """B's tools, `run_tool` on the tools of `tools_py`, as a process of its own."""
    from agent_bus.bus.messages import ToolCallRequest, error_result
    from agent_bus.tools import load_tools, run_tool

    tools = {t.name: t for t in load_tools(tools_py)}
    decode = msgspec.msgpack.Decoder(ToolCallRequest).decode
    encode = msgspec.msgpack.Encoder().encode

    async def answer(body: bytes) -> bytes:
        request = decode(body)
        t = tools.get(request.name)
        result = (await run_tool(t, request) if t is not None
                  else error_result(f"Error: Unknown tool '{request.name}'"))
        return encode(result)

    _serve(endpoint, TOOL, answer)


class SplitClient:
    """The loop's LlmClient and ToolExecutor here: each call one request through the broker."""

    def __init__(self, endpoint: str, catalog: list[Any]) -> None:
        from agent_bus.bus.messages import AssistantMessage, ToolResult

        self._end = _End(endpoint, self._on_reply)
        self._catalog = catalog
        self._ids = itertools.count()
        self._waiting: dict[bytes, asyncio.Future[bytes]] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._reply = msgspec.msgpack.Decoder(AssistantMessage).decode
        self._result = msgspec.msgpack.Decoder(ToolResult).decode

    def _on_reply(self, frames: list[bytes]) -> None:
        self._waiting.pop(frames[1]).set_result(frames[2])

    async def _call(self, pool: bytes, message: Any) -> bytes:
        req_id = str(next(self._ids)).encode()
        future = self._waiting[req_id] = asyncio.get_running_loop().create_future()
        self._end.send([b"req", pool, req_id, self._encode(message)])
        return await future

    async def complete(self, request: Any, on_delta: Any = None, *, abort: Any = None) -> Any:
        return self._reply(await self._call(MODEL, request))

    async def catalog(self) -> list[Any]:
        return self._catalog

    async def execute(self, request: Any, on_update: Any = None) -> Any:
        return self._result(await self._call(TOOL, request))

    def close(self) -> None:
        self._end.close()


class SplitTurns:
    """A pool broker, one model process (against the scripted model at `base_url`, at most
    `concurrency` calls at once, the engine's default when 0) and `tools` tool processes
    (serving `tools_py`), each its own process, on `transport` tcp or ipc; `run(loop)` runs a
    loop here through them; `close()` stops every process."""

    def __init__(self, base_url: str, tools_py: str, tools: int, transport: str = "ipc",
                 concurrency: int = 0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="split-turns-")
        self.endpoint = (f"ipc://{self._tmp.name}/broker.sock" if transport == "ipc"
                         else f"tcp://127.0.0.1:{free_port()}")
        spawn = mp.get_context("spawn")
        self._procs = [spawn.Process(target=_pool_broker, args=(self.endpoint,), daemon=True),
                       spawn.Process(target=_model_process,
                                     args=(self.endpoint, base_url, concurrency), daemon=True)]
        self._procs += [spawn.Process(target=_tool_process, args=(self.endpoint, tools_py),
                                      daemon=True) for _ in range(tools)]
        for proc in self._procs:
            proc.start()

    async def run(self, loop: Any, catalog: list[Any]) -> tuple[float, Any]:
        """`await loop(llm, tools)` with the split processes as its model and its tools (their
        `catalog`): (the CPU seconds of every process, this one included, its result)."""
        client = SplitClient(self.endpoint, catalog)
        try:
            cpu0 = self.cpu_s()
            result = await loop(client, client)
            return self.cpu_s() - cpu0, result
        finally:
            client.close()

    def cpu_s(self) -> float:
        return sum(cpu_s(proc.pid) for proc in self._procs if proc.pid) + own_cpu_s()

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.join()
        self._tmp.cleanup()

