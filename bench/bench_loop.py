"""The agent loop through the whole process topology vs the pure loop in one process.

    python bench/bench_loop.py [--quick] [--turns 50] [--calls 4] [--repeat 20]
                              [--transports tcp,ipc] [--count-sends DIR] [--parts]

`--quick`: 30 turns, 15 alternated runs (each an option's default; a flag given wins):
issue 51's headline C / W in about a minute. The headline lines come last, after
`== headline ==` (bench/headline.py).

A run of TURNS model turns, each asking for CALLS parallel `echo` tool calls, then one final
answer turn, against a zero-latency scripted model. Three ways:

  A  pure loop, one process: in-memory scripted LlmClient, tools run in-process (`run_tool`)
  B  pure loop, one process, model over HTTP: LlmEngine -> FakeLLMServer (isolates HTTP/SSE)
  C  full topology: hub, gateway -> FakeLLMServer, 4 tool workers, coordinator (with its SQLite
     conversation store), driven by a `prompt` request to `agent.bench`
  D  the pure loop in this process, but model and tools over the same bus (BusLlmClient,
     AgentTools over BusToolExecutor): C - D is what the coordinator process itself adds
     (event publishing, persistence, the command path); D also times each model call and each
     tool batch, which splits the bus overhead between the `llm` path and the tool path.
  F  the floor: the same turns' hops through raw pyzmq (bench/baseline.py `RawTurns`: a
     blocking raw broker and CALLS + 1 raw echo processes, one model round trip then CALLS tool
     round trips at once per turn, nothing done at either end), on each transport. B + F is the
     least any topology of separate processes talking through a Python broker can take, so
     (B + F) / B is the floor of C/B on this machine in this run, and C - B - F is what the
     bus's own code adds on top of its hops.
  Fa the asyncio floor: the same hops with asyncio programs at the requester and the echo
     processes (`RawTurns(ends="asyncio")`: they wait through `zmq.asyncio`, then take every
     message already there and send without a future; the broker stays blocking, as the hub
     is): what any topology whose processes are asyncio programs (the design card's anyio)
     pays for its hops; (B + Fa) / B.
  W the split-work floor (bench/split.py `SplitTurns`): B's own work split over the topology's
     processes, B's loop here, its `LlmEngine` in a model process against the same scripted
     model, `run_tool` in WORKERS tool processes, one msgspec message a request or reply
     through a raw broker between asyncio ends, nothing else (no hub, events, store): W / B is
     what splitting the work as the design card does costs on this machine before any bus
     code runs, C / W what the bus adds to it.
  --parts: C again on the first transport, alternated with the rest, with the bus's features
     switched off by a few lines run in the coordinator and gateway before `cli.py` (a
     measuring instrument, not a setting of the product): no event published (so none logged),
     no coordinator store (no run journal, no history), neither; and the disk's share of those
     (the hub patched too): the hub's log in memory, the coordinator's store never
     checkpointed. What each costs a turn.

Bus overhead per turn = (C - A) / turns (the target is < 2 ms); (C - B) / turns is the part
that is neither the model's HTTP stream nor the loop itself. Per tool call divides the same
difference by the number of tool calls. A, B and C (on each transport) alternate run after run;
each figure is the median of REPEAT runs after a warm-up, each ratio the median of the runs'
ratios (issue 32: C/B <= 2x). Not run by pytest; every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.agents import commands as cmd  # noqa: E402
from agent_bus.agents.loop.run import LoopConfig, run_loop  # noqa: E402
from agent_bus.bus.client import connect  # noqa: E402
from agent_bus.bus.messages import (  # noqa: E402
    AssistantMessage,
    LlmRequest,
    TextPart,
    ToolCall,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    Usage,
)
from bench import common  # noqa: E402
from bench.baseline import RawTurns, free_port, tree_cpu_s  # noqa: E402
from bench.common import EngineLlm, LocalTools, Proc, busctl, count_sends, fake_argv, report_sends  # noqa: E402
from bench.headline import Headlines  # noqa: E402
from bench.split import SplitTurns  # noqa: E402

TOOLS_PY = '''
from agent_bus.tools import tool

@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text
'''

WORKERS = 4
CHUNK = int(os.environ.get("BENCH_CHUNK", "4"))


def script_steps(turns: int, calls: int) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    for t in range(turns):
        steps.append({"reply": {"tool_calls": [
            {"name": "echo", "arguments": {"text": f"turn {t} call {k}"}, "id": f"c{t}_{k}"}
            for k in range(calls)], "usage": {"input": 10, "output": 5}, "chunk_size": CHUNK}})
    steps.append({"reply": {"text": "All done.", "usage": {"input": 10, "output": 2}}})
    return steps


# --- A: pure loop, in-memory model, in-process tools ------------------------------------------


class ScriptedLlm:
    """Replies from the same script as the fake server, with no I/O at all."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.steps = steps
        self.i = 0

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Any = None) -> AssistantMessage:
        reply = self.steps[self.i]["reply"]
        self.i += 1
        content: list[Any] = []
        if reply.get("text"):
            content.append(TextPart(reply["text"]))
        for c in reply.get("tool_calls", []):
            content.append(ToolCall(id=c["id"], name=c["name"], arguments=json.dumps(c["arguments"])))
        usage = Usage(input=10, output=5, total=15)
        return AssistantMessage(content=content, stop_reason="tool_use" if reply.get("tool_calls")
                                else "stop", usage=usage, model="m")


async def pure_loop(llm: Any, tools: LocalTools) -> tuple[float, str]:
    messages: list[Any] = []
    config = LoopConfig(model="x", agent="bench")

    async def emit(event: Any) -> None:
        return None

    started = time.perf_counter()
    result = await run_loop([_user("go")], messages, config, llm, tools, emit)
    return time.perf_counter() - started, result.final_text


def _user(text: str) -> Any:
    from agent_bus.bus.messages import user_text

    return user_text(text)


# --- B: pure loop, model over HTTP (LlmEngine -> FakeLLMServer) ------------------------------


# --- D: the pure loop here, model and tools over the bus -------------------------------------


class Timed:
    """Wraps an LlmClient or ToolExecutor and sums the wall time of its calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.llm = 0.0
        self.batches: dict[str, float] = {}  # first-call start per batch -> wall time of the batch
        self._open: dict[int, list[float]] = {}

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Any = None) -> AssistantMessage:
        started = time.perf_counter()
        try:
            return await self.inner.complete(request, on_delta, abort=abort)
        finally:
            self.llm += time.perf_counter() - started

    async def catalog(self) -> list[ToolInfo]:
        return await self.inner.catalog()

    async def execute(self, request: ToolCallRequest, on_update: Any = None) -> ToolResult:
        batch = request.call_id.split("_")[0]  # ids are c<turn>_<k>
        started = time.perf_counter()
        try:
            return await self.inner.execute(request, on_update)
        finally:
            ended = time.perf_counter()
            first, last = self._open.setdefault(hash(batch), [started, ended])
            self._open[hash(batch)] = [min(first, started), max(last, ended)]

    @property
    def tools(self) -> float:
        return sum(last - first for first, last in self._open.values())


async def bus_loop(endpoint: str, runs: int) -> list[tuple[float, float, float]]:
    from agent_bus.agents.coordinator.bus_adapters import AgentTools, BusLlmClient
    from agent_bus.agents.loop.context import ToolOutputStore
    from agent_bus.tools.executor import BusToolExecutor

    out = []
    async with connect(endpoint, name="bench-loop") as peer:
        for _ in range(runs):
            llm = Timed(BusLlmClient(peer, agent="bench-d"))
            tools = Timed(AgentTools(BusToolExecutor(peer), ["echo"], ToolOutputStore()))
            elapsed, final = await pure_loop(llm, tools)  # type: ignore[arg-type]
            assert final == "All done.", final
            out.append((elapsed, llm.llm, tools.tools))
    return out


# --- C: the full topology -------------------------------------------------------------------


#: `--parts`: topologies with one of the bus's features switched off, to measure what each
#: costs a turn. Each is a few lines run in the process before `cli.py` (role -> code): a
#: measuring instrument only, no setting of the product (which always publishes its events
#: and journals its runs).
_NO_COORDINATOR_EVENTS = ("from agent_bus.agents.coordinator import process as P\n"
                          "async def _none(self, event): pass\n"
                          "P.Session._publish = _none\n")
_NO_GATEWAY_EVENTS = ("from agent_bus.bus import peer as PP\n"
                      "async def _none(self, event, **kw): pass\n"
                      "PP.Peer.publish = _none\n")
_NO_STORE = ("from agent_bus.agents.coordinator import process as P\n"
             "P.Session._journal = lambda self, event: None\n"
             "P.Session.sync = lambda self: None\n")
# The disk's share of those two: every event still logged and every write still made, but the
# hub's log in SQLite's memory (no file, no WAL), and the coordinator's store never copying its
# WAL back into the database (its `Checkpointer` thread never asked).
_LOG_IN_MEMORY = ("from agent_bus.bus.store import sqlite as S\n"
                  "_open = S.SqliteStore.__init__\n"
                  "def _in_memory(self, path, name='events'): _open(self, None, name)\n"
                  "S.SqliteStore.__init__ = _in_memory\n")
_NO_CHECKPOINTS = ("from agent_bus.agents.coordinator import persistence as S\n"
                   "S.CHECKPOINT_COMMITS = 1 << 62\n")  # its checkpoint thread never asked
PART_TEXT = {
    "no-events": "no event published by the coordinator or the gateway, none logged",
    "no-store": "the coordinator's store writes nothing: no run journal, no history",
    "neither": "no event and no store",
    "log-in-memory": "every event logged, but the hub's log in memory: no file, no WAL",
    "no-checkpoints": "every store write made, but the coordinator's WAL never checkpointed",
}
PARTS: dict[str, dict[str, str]] = {
    "no-events": {"coordinator": _NO_COORDINATOR_EVENTS, "gateway": _NO_GATEWAY_EVENTS},
    "no-store": {"coordinator": _NO_STORE},
    "neither": {"coordinator": _NO_COORDINATOR_EVENTS + _NO_STORE, "gateway": _NO_GATEWAY_EVENTS},
    "log-in-memory": {"hub": _LOG_IN_MEMORY},
    "no-checkpoints": {"coordinator": _NO_CHECKPOINTS},
}


async def topology_run(endpoint: str, agent: str) -> tuple[float, cmd.RunResult]:
    async with connect(endpoint, name="bench-client") as peer:
        body = cmd.encode(cmd.Prompt(text="go", new_session=True))
        started = time.perf_counter()
        async with peer.stream(cmd.agent_service(agent), body, timeout=600) as replies:
            last = b""
            async for last in replies:  # noqa: B007 - the final reply is the last one
                pass
        elapsed = time.perf_counter() - started
    return elapsed, msgspec.msgpack.decode(last, type=cmd.RunResult)


def start_fake(steps: list[dict[str, Any]], tmp: Path, name: str) -> tuple[Proc, str]:
    script = tmp / f"{name}.json"
    script.write_text(json.dumps({"steps": steps, "echo": True}))
    port = free_port()
    proc = Proc([*fake_argv(), "--script", str(script), "--port", str(port)])
    assert proc.popen.stdout is not None
    proc.popen.stdout.readline()  # "fake-llm listening on ..."
    return proc, f"http://127.0.0.1:{port}/v1"


def start_topology(tmp: Path, transport: str, base_url: str, tools_py: Path,
                   procs: list[Proc], part: str = "") -> tuple[str, dict[str, int]]:
    """hub (on `transport`), gateway, workers and coordinator: (the hub's endpoint, pids);
    `part`: one of PARTS, those processes patched."""
    patches = PARTS[part] if part else {}
    folder = tmp / (f"{transport}-{part}" if part else transport)
    folder.mkdir(mode=0o700)  # an ipc socket's directory: the hub warns if others can enter
    topo = folder / "topology.toml"
    topo.write_text(f"""
[models.x]
provider = "openai"
base_url = "{base_url}"
model = "m"

[[agents]]
name = "bench"
model = "x"
tools = ["echo"]
""")
    # ipc: as a local topology (`busctl up`) listens; tcp: as a multi-host one does
    address = f"ipc://{folder}/hub.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
    hub = Proc(busctl("hub", "--hub", address, "--state-dir", str(folder / "hub"),
                      patch=patches.get("hub", "")))
    procs.append(hub)
    endpoint = hub.ready()["endpoint"]
    starting = [Proc(busctl("gateway", "--hub", endpoint, "--topology", str(topo),
                            patch=patches.get("gateway", "")))]
    starting += [Proc(busctl("worker", "--hub", endpoint, "--tools", str(tools_py),
                             "--name", f"worker-{i}")) for i in range(WORKERS)]
    starting.append(Proc(busctl("coordinator", "--hub", endpoint, "--topology", str(topo),
                                "--state-dir", str(folder / "agents"),
                                patch=patches.get("coordinator", ""))))
    procs += starting
    for proc in starting:
        proc.ready()
    names = ["hub", "gateway", *(f"worker-{i}" for i in range(WORKERS)), "coordinator"]
    return endpoint, dict(zip(names, (proc.popen.pid for proc in [hub, *starting]), strict=True))


def median(values: list[float]) -> float:
    # the middle value, or the mean of the middle two (as the headlines, bench/headline.py)
    return statistics.median(values)


def floor_of(b: list[float], c: list[float], f: list[float],
             model_turns: int) -> tuple[list[float], list[float]]:
    """Per run after the warm-up: (B + F) / B, the floor of C/B, and (C - B - F) per turn."""
    runs = list(zip(b[1:], c[1:], f[1:], strict=True))
    return ([(bt + ft) / bt for bt, _, ft in runs],
            [(ct - bt - ft) / model_turns for bt, ct, ft in runs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="issue 51's headline in about a minute: --turns 30 --repeat 15 unless "
                         "given")
    ap.add_argument("--turns", type=int, default=None, help="default 50 (30 with --quick)")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=None,
                    help="alternated runs after a warm-up: default 20 (15 with --quick; issue 51 "
                         "asks 10 or more)")
    ap.add_argument("--transports", default="tcp,ipc",
                    help="the hub's transports: a topology on each, C run on each in turn")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="run the coordinator, gateway and hub under cProfile, dumping into DIR")
    ap.add_argument("--count-sends", default="", metavar="DIR",
                    help="count the messages each process sends, by kind (files in DIR)")
    ap.add_argument("--parts", action="store_true",
                    help="also run C (on the first transport) with the bus's event stream, its "
                         "coordinator store, and both switched off, and with the hub's log in "
                         "memory or the coordinator's store never checkpointed (bench-only "
                         "patches): what each costs a turn")
    ap.add_argument("--fakellm", default="", metavar="FILE",
                    help="serve the scripted model from this fakellm.py instead of the tree's "
                         "(an A/B of the fake)")
    args = ap.parse_args()
    quick = args.quick
    args.turns = args.turns if args.turns is not None else 30 if quick else 50
    args.repeat = args.repeat if args.repeat is not None else 15 if quick else 20
    if args.fakellm and not os.path.isfile(args.fakellm):
        ap.error(f"--fakellm: no such file {args.fakellm!r}; give a fakellm.py to serve")
    common.FAKELLM = args.fakellm
    turns, calls, repeat = args.turns, args.calls, args.repeat
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or any(t not in ("tcp", "ipc") for t in transports):
        ap.error(f"--transports: expected tcp, ipc or tcp,ipc, got {args.transports!r}")
    if args.count_sends:
        count_sends(args.count_sends)
    common.PROFILE_DIR = args.profile
    steps = script_steps(turns, calls)
    model_turns, tool_calls = turns + 1, turns * calls
    runs = repeat + 1  # one warm-up
    parts = list(PARTS) if args.parts else []
    from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig

    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmpdir:
        tmp = Path(tmpdir)
        tools_py = tmp / "bench_tools.py"
        tools_py.write_text(TOOLS_PY)
        procs: list[Proc] = []
        raws: dict[str, RawTurns] = {}
        raws_async: dict[str, RawTurns] = {}
        split: SplitTurns | None = None
        try:
            local = LocalTools(str(tools_py))
            fake, base_url = start_fake(steps * runs, tmp, "fake-b")
            procs.append(fake)
            # C on each transport, then D
            fake_c, base_url_c = start_fake(
                steps * runs * (len(transports) + len(parts) + 1), tmp, "fake-c")
            procs.append(fake_c)
            fake_w, base_url_w = start_fake(steps * runs, tmp, "fake-w")
            procs.append(fake_w)
            split = SplitTurns(base_url_w, str(tools_py), WORKERS, transports[0])
            tops = {t: start_topology(tmp, t, base_url_c, tools_py, procs) for t in transports}
            # each part on the first transport, under its own name in `times` and `cpu`
            tops.update((part, start_topology(tmp, transports[0], base_url_c, tools_py, procs,
                                              part)) for part in parts)
            raws.update((t, RawTurns(calls + 1, t)) for t in transports)
            raws_async.update((t, RawTurns(calls + 1, t, ends="asyncio")) for t in transports)
            systems = [*transports, *parts]
            times: dict[str, list[float]] = {k: [] for k in ["A", "B", "W", *systems]}
            split_cpu: list[float] = []
            floor: dict[str, list[float]] = {t: [] for t in transports}
            floor_cpu: dict[str, list[float]] = {t: [] for t in transports}
            floor_async: dict[str, list[float]] = {t: [] for t in transports}
            floor_async_cpu: dict[str, list[float]] = {t: [] for t in transports}
            cpu: dict[str, dict[str, float]] = {t: {} for t in systems}

            async def alternated() -> None:
                """A, B, then C on each transport, run after run: a pair's ratio is measured
                within a second or so, whatever the shared machine does between runs."""
                model = ModelConfig(alias="x", provider="openai", model="m", base_url=base_url)
                catalog = await local.catalog()
                async with LlmEngine([model]) as engine:
                    for i in range(runs):
                        elapsed, final = await pure_loop(ScriptedLlm(steps), local)
                        assert final == "All done.", final
                        times["A"].append(elapsed)
                        elapsed, final = await pure_loop(EngineLlm(engine), local)
                        assert final == "All done.", final
                        times["B"].append(elapsed)
                        cpu_w, (elapsed, final) = await split.run(pure_loop, catalog)
                        assert final == "All done.", final
                        times["W"].append(elapsed)
                        split_cpu.append(cpu_w / model_turns)
                        for t in systems if i % 2 == 0 else systems[::-1]:
                            endpoint, pids = tops[t]
                            before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
                            elapsed, result = await topology_run(endpoint, "bench")
                            assert result.final_text == "All done.", result
                            times[t].append(elapsed)
                            if i > 0:  # after the warm-up run
                                for name, pid in pids.items():
                                    cpu[t][name] = (cpu[t].get(name, 0.0) + tree_cpu_s(pid)
                                                    - before[name])
                            if t not in raws:  # a part: no floor of its own
                                continue
                            wall, cpu_turn = raws[t].run(1, turns, calls)
                            floor[t].append(wall * model_turns)
                            floor_cpu[t].append(cpu_turn)
                            wall, cpu_turn = raws_async[t].run(1, turns, calls)
                            floor_async[t].append(wall * model_turns)
                            floor_async_cpu[t].append(cpu_turn)

            anyio.run(alternated)
            d_runs = anyio.run(bus_loop, tops[transports[0]][0], runs)
        finally:
            if split is not None:
                split.close()
            for raw in [*raws.values(), *raws_async.values()]:
                raw.close()
            for proc in reversed(procs):
                proc.stop()

    med = {k: median(v[1:]) for k, v in times.items()}
    a, b, c = med["A"], med["B"], med[transports[0]]
    d, d_llm, d_tools = min(d_runs[1:])
    ms = 1000.0
    print(f"agent loop: {turns} turns x {calls} parallel echo calls + 1 final turn "
          f"({model_turns} model calls, {tool_calls} tool calls); A, B, C alternated, median of "
          f"{repeat} after a warm-up")
    print(f"  A pure loop, in-memory model, in-process tools : {a * ms:8.1f} ms  "
          f"({a / model_turns * ms:.3f} ms/turn)")
    print(f"  B pure loop, model over HTTP (FakeLLMServer)   : {b * ms:8.1f} ms  "
          f"({b / model_turns * ms:.3f} ms/turn)")
    for t in transports:
        ct = med[t]
        print(f"  C full topology, hub on {t} (hub, gateway, {WORKERS} workers, coord) : "
              f"{ct * ms:8.1f} ms  ({ct / model_turns * ms:.3f} ms/turn)")
    target = 2.0
    for t in transports:
        per = [ct / bt for ct, bt in zip(times[t][1:], times["B"][1:], strict=True)]
        m = median(per)
        print(f"  C/B ({t}), one agent turn through the topology / the same loop and HTTP model "
              f"in one process: {m:.2f}x [{', '.join(f'{x:.2f}' for x in per)}] (target <= "
              f"{target:g}x: {'met' if m <= target else 'NOT met'}); C/A "
              f"{median([ct / at for ct, at in zip(times[t][1:], times['A'][1:], strict=True)]):.2f}x")
    for t in transports:
        f = median(floor[t][1:])
        print(f"  F the same turns' hops through raw pyzmq on {t} (a raw broker, {calls + 1} raw "
              f"echo processes, nothing done at either end): {f / model_turns * ms:.3f} ms/turn, "
              f"CPU {median(floor_cpu[t][1:]) * ms:.3f} ms/turn (all its processes)")
        per, over = floor_of(times["B"], times[t], floor[t], model_turns)
        print(f"    the floor of C/B on {t}, (B + F) / B: {median(per):.2f}x "
              f"[{', '.join(f'{x:.2f}' for x in per)}]; C above that floor, (C - B - F): "
              f"{median(over) * ms:.3f} ms/turn, what the bus's own code adds to its hops")
        fa = median(floor_async[t][1:])
        print(f"  Fa the same hops with asyncio ends on {t} (requester and echo processes that "
              f"are asyncio programs doing the least pyzmq allows, the same raw broker): "
              f"{fa / model_turns * ms:.3f} ms/turn, "
              f"CPU {median(floor_async_cpu[t][1:]) * ms:.3f} ms/turn")
        per, over = floor_of(times["B"], times[t], floor_async[t], model_turns)
        print(f"    the asyncio floor of C/B on {t}, (B + Fa) / B: {median(per):.2f}x "
              f"[{', '.join(f'{x:.2f}' for x in per)}]; C - B - Fa: {median(over) * ms:.3f} "
              f"ms/turn")
    w = med["W"]
    per = [wt / bt for wt, bt in zip(times["W"][1:], times["B"][1:], strict=True)]
    print(f"  W B's work split over the topology's processes on {transports[0]} (its model client "
          f"in one, its tools in {WORKERS}, the loop here; one request or reply a message through "
          f"a raw broker, asyncio ends; no hub, events, store): {w / model_turns * ms:.3f} "
          f"ms/turn, CPU {median(split_cpu[1:]) * ms:.3f} ms/turn (all its processes)")
    full = [ct / wt for ct, wt in zip(times[transports[0]][1:], times["W"][1:], strict=True)]
    print(f"    the split-work floor of C/B, W / B: {median(per):.2f}x "
          f"[{', '.join(f'{x:.2f}' for x in per)}]; C / W {median(full):.2f}x "
          f"[{', '.join(f'{x:.2f}' for x in full)}]")
    hl = Headlines()
    for t in transports:  # W runs on the first transport; each C over the same run's W
        hl.add(f"c_over_w_{t}", [ct / wt for ct, wt in zip(times[t][1:], times["W"][1:],
                                                             strict=True)], "<=", 1.15, "runs")
    for part in parts:
        per = [ct / bt for ct, bt in zip(times[part][1:], times["B"][1:], strict=True)]
        full = [ct / pt for ct, pt in zip(times[transports[0]][1:], times[part][1:], strict=True)]
        over = [pt / wt for pt, wt in zip(times[part][1:], times["W"][1:], strict=True)]
        print(f"  C {part} on {transports[0]} ({PART_TEXT[part]}): "
              f"{med[part] / model_turns * ms:.3f} ms/turn; C/B {median(per):.2f}x "
              f"[{', '.join(f'{x:.2f}' for x in per)}]; C / C {part} {median(full):.2f}x; "
              f"C {part} / W {median(over):.2f}x")
    if len(transports) == 2:
        x, y = transports
        per = [cy / cx for cx, cy in zip(times[x][1:], times[y][1:], strict=True)]
        print(f"  C {y} / C {x}: {median(per):.2f}x [{', '.join(f'{v:.2f}' for v in per)}]")
    print(f"  bus overhead C-A: {(c - a) / model_turns * ms:.3f} ms per turn, "
          f"{(c - a) / tool_calls * ms:.3f} ms per tool call (same total, divided)")
    print(f"  bus overhead C-B (HTTP model call excluded): {(c - b) / model_turns * ms:.3f} ms per "
          f"turn, {(c - b) / tool_calls * ms:.3f} ms per tool call")
    print(f"  D pure loop here, model + tools over the bus ({transports[0]}): {d * ms:8.1f} ms  "
          f"({d / model_turns * ms:.3f} ms/turn)")
    print(f"    of which model calls {d_llm / model_turns * ms:.3f} ms/turn (B's HTTP path: "
          f"{(b - a) / model_turns * ms:.3f}), tool batches {d_tools / turns * ms:.3f} ms/batch "
          f"(in-process: ~{a / model_turns * ms:.3f} ms/turn for everything)")
    print(f"  coordinator process itself C-D: {(c - d) / model_turns * ms:.3f} ms per turn")
    for t in systems:
        per_turn = {k: v / (repeat * model_turns) * ms for k, v in cpu[t].items()}
        workers = sum(v for k, v in per_turn.items() if k.startswith("worker"))
        where = t if t in transports else f"{transports[0]}, {t}"
        print(f"  CPU per turn in C on {where} (load-proof; the processes' own user+system time): "
              + "  ".join(f"{k} {v:.3f} ms" for k, v in per_turn.items()
                          if not k.startswith("worker"))
              + f"  workers {workers:.3f} ms  (total {sum(per_turn.values()):.3f} ms)")
    print("  all runs (ms): " + " | ".join(
        f"{'C ' + k if k in systems else k} " + " ".join(f"{x * ms:.0f}" for x in v)
        for k, v in times.items()) + " | D " + " ".join(f"{x[0] * ms:.0f}" for x in d_runs))
    if args.count_sends:  # C and D both go through a gateway: model turns per run each
        print(f"  ({(len(systems) + 1) * runs * model_turns} model calls through the "
              f"gateways, {runs * model_turns} of them in D from this process)")
        report_sends(args.count_sends)
    hl.print()


if __name__ == "__main__":
    main()
