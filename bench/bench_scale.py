"""N concurrent sessions of one agent through the whole process topology.

    python bench/bench_scale.py [--quick] [--sessions 1,10,100,1000] [--rounds 3] [--count-sends DIR]

`--quick`: issue 51's headlines (N = 100 and 1,000, topology / the split-work floor, and nothing
lost) in about a minute: `--sessions 100,1000 --second-wave-max 0 --split-floor-only` (of the
floors, only the split-work floor), unless given; 4 rounds at N = 100, 2 at 1,000 (its rounds'
spread is narrow, each takes ~20 s here) unless `--rounds` is given. The headline lines come
last, after `== headline ==` (bench/headline.py).

Each session is one run of TURNS tool turns (default 3), each turn a model reply asking for CALLS
(default 4) parallel `work` calls that sleep TOOL_MS (default 20 ms), then the final answer.
The scripted model (agents/gateway/fakellm.py, its own process) waits MODEL_MS (default 100 ms) before
every reply. Processes as in bench_loop.py: hub (event log on disk), gateway, 4 tool workers,
coordinator, all started fresh for each N, plus one client here sending N `prompt`s at once,
each to a fresh session.

The issue's ideal is TURNS x (MODEL_MS + TOOL_MS) = 360 ms whatever N is; the loop also needs
the final-answer reply, which costs one more MODEL_MS, so the ideal of this script is 460 ms.
Both ratios are printed.

Per N: wall time (first prompt sent -> last result in), turns/s (model replies), events/s the
hub logged during the window, p50/p99 tool-call latency (hub timestamps of each call's
`tool_execution_start` -> `tool_execution_end` in the event log), RSS of each process after the
runs, coordinator RSS per session (growth over its RSS before the prompts, divided by N: the
sessions are idle and stored by then, only IDLE_SESSIONS_KEPT of them stay in memory), and a
loss check: every prompt got a result and every run has exactly one `agent_end` in the log.

Per N, ROUNDS times (default 5, 3 at N >= 1,000), alternated: the same N runs with
`asyncio.gather` over the pure loop in this process (in-memory model sleeping MODEL_MS,
in-process tool; the no-bus limit), then N through the topology; the ratio printed is the
median of the rounds' ratios (issue 32: <= 1.3x at N = 100, <= 1.5x at 1,000). Every wave is
checked for loss.

Each round also measures the floor of that ratio: the same N sessions' hops through raw pyzmq
(bench/baseline.py `RawTurns`: a raw broker and WORKERS + 1 raw echo processes, nothing done at
either end), whose CPU, with the pure loop's own CPU (the coordinator runs the same loop) and the
scripted model's CPU in the topology's window, no topology of separate processes on this
machine's cores can spend in less wall time than their sum over the cores (nor in less than the
pure loop's wall). The floor / pure is printed beside the ratio.

The topology must also call its model over HTTP, which the pure loop does not: each round also
runs the pure loop with the model over HTTP (the gateway's own `LlmEngine` in this process,
against the topology's scripted model), and its CPU in place of the pure loop's gives the floor
of a topology whose model is an HTTP server; topology / that loop's wall is the ratio at N of
`bench_loop.py`'s C / B. The same hops with asyncio ends (`RawTurns(ends="asyncio")`: a
requester and echo processes that are asyncio programs doing the least pyzmq allows) in place of
the blocking ones give the asyncio floor with an HTTP model: what a topology whose processes are
asyncio programs (the design card's anyio) cannot go under. Last, the split-work floor
(bench/split.py `SplitTurns`, `bench_loop.py`'s W): the same N runs of the pure loop here with
the model's `LlmEngine` in a process of its own and the tools in WORKERS others, one message a
request or reply through a raw broker and nothing else: what splitting the work as the design
card does costs at N before any bus code runs, measured as a wall time (its wall / pure is
printed, and topology / it). Not run by pytest; every process is stopped at the end, even on
error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sqlite3
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
from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig  # noqa: E402
from agent_bus.agents.loop.run import LoopConfig, run_loop  # noqa: E402
from agent_bus.bus.client import connect  # noqa: E402
from agent_bus.bus.errors import AgentBusError  # noqa: E402
from agent_bus.bus.messages import (  # noqa: E402
    AssistantMessage,
    LlmRequest,
    TextPart,
    ToolCall,
    Usage,
    user_text,
)
from bench import common  # noqa: E402
from bench.baseline import RawTurns, cpu_s, pct  # noqa: E402
from bench.common import (  # noqa: E402
    SCALE_TOOLS_PY,
    EngineLlm,
    LocalTools,
    Proc,
    ScaleTopology,
    count_sends,
    fake_argv,
    free_port,
    report_sends,
    scale_script,
)
from bench.headline import Headlines  # noqa: E402
from bench.split import SplitTurns  # noqa: E402

WORKERS = common.SCALE_WORKERS  # the topology's tool workers
#: issue 32: N sessions through the topology / the pure loop at the same N
TARGETS = {100: 1.3, 1000: 1.5}
#: issue 51: N sessions through the topology / the split-work floor at the same N
SPLIT_TARGETS = {100: 1.10, 1000: 1.05}
QUICK_ROUNDS = {100: 4, 1000: 2}  # --quick's rounds at N (3 at any other N; see rounds_at)
CORES = os.cpu_count() or 1

async def prompt_all(endpoint: str, n: int) -> tuple[float, float, list[cmd.RunResult], int]:
    """N prompts at once, each to a fresh session: (wall start, wall end, results, failures)."""
    results: list[cmd.RunResult] = []
    failures = 0
    async with connect(endpoint, name="bench-scale") as peer:

        async def one() -> None:
            nonlocal failures
            body = cmd.encode(cmd.Prompt(text="go", new_session=True))
            last = b""
            try:
                async with peer.stream(cmd.agent_service("bench"), body, timeout=600) as replies:
                    async for last in replies:  # noqa: B007 - the final reply is the last one
                        pass
                results.append(msgspec.msgpack.decode(last, type=cmd.RunResult))
            except (AgentBusError, msgspec.DecodeError) as exc:  # counted: the loss check
                failures += 1
                if failures <= 3:
                    print(f"    prompt failed: {exc}", file=sys.stderr)

        started_ts = time.time()
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
        ended_ts = time.time()
    return started_ts, ended_ts, results, failures


def read_log(db_path: Path, since: float, until: float) -> dict[str, Any]:
    """From the hub's event log: events in the window, tool-call latencies, agent_end per run."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT ts, type, run, body FROM events WHERE ts >= ? AND ts <= ? "
                          "ORDER BY seq", (since, until + 1.0)).fetchall()
    finally:
        db.close()
    in_window = sum(1 for ts, *_ in rows if ts <= until)
    starts: dict[tuple[str, str], float] = {}
    latencies: list[float] = []
    ends: dict[str, int] = {}
    last: dict[str, tuple[str, float]] = {}  # run -> its previous event (type, ts)
    gaps: dict[str, list[float]] = {}  # "a -> b" -> the times from a run's a to its next b
    for ts, kind, run, body in rows:
        if run and kind != "message_update":
            prev = last.get(run)
            if prev is not None:
                gaps.setdefault(f"{prev[0]} -> {kind}", []).append(ts - prev[1])
            last[run] = (kind, ts)
        if kind == "tool_execution_start":
            starts[(run, msgspec.msgpack.decode(body)["tool_call_id"])] = ts
        elif kind == "tool_execution_end":
            began = starts.pop((run, msgspec.msgpack.decode(body)["tool_call_id"]), None)
            if began is not None:
                latencies.append(ts - began)
        elif kind == "agent_end":
            ends[run] = ends.get(run, 0) + 1
    return {"events": in_window, "latencies": latencies, "ends": ends,
            "unmatched_starts": len(starts), "gaps": gaps}


def wait_logged(db_path: Path, runs: set[str], deadline_s: float = 10.0) -> None:
    """The hub commits a batch before publishing it; wait (with a deadline) until every run's
    agent_end is in the log, so a slow commit is not reported as a loss."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            seen = {r for (r,) in db.execute("SELECT run FROM events WHERE type = 'agent_end'")}
        finally:
            db.close()
        if runs <= seen:
            return
        time.sleep(0.05)


def lost_runs(results: list[cmd.RunResult], failures: int, ends: dict[str, int]) -> int:
    """Prompts without a result, runs without exactly one agent_end in the log, wrong answers."""
    return (failures + sum(1 for r in results if ends.get(r.run_id, 0) != 1)
            + sum(1 for r in results if r.final_text != "All done."))


def run_topology(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """N sessions through the topology, alternated with N over the pure loop in this process
    (`asyncio.gather`, no bus) ROUNDS times: each round's ratio shares the machine's speed of
    those seconds. The first topology wave is the one measured in detail."""
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmpdir:
        topo = ScaleTopology(Path(tmpdir), n, args)
        tools_py = Path(tmpdir) / "scale_tools_pure.py"
        tools_py.write_text(SCALE_TOOLS_PY.format(tool_s=args.tool_ms / 1000))
        tools = LocalTools(str(tools_py))
        pure: list[float] = []
        walls: list[float] = []
        floors: list[float] = []
        raw: RawTurns | None = None
        raw_async: RawTurns | None = None
        split: SplitTurns | None = None
        split_walls: list[float] = []  # the same N runs with B's work split over processes

        def pure_round() -> None:
            """The pure loop at N, then the raw hops of the same N sessions, then the pure loop
            with the model over HTTP: the round's floors need the topology's scripted-model CPU
            too (`floor_round`)."""
            cpu0 = cpu_self()
            pure.append(asyncio.run(pure_gather(n, args, tools)))
            pure_cpu.append(cpu_self() - cpu0)
            if args.split_floor_only:
                for values in (raw_cpu, http_walls, http_cpu, raw_async_cpu):
                    values.append(float("nan"))
            else:
                assert raw is not None and raw_async is not None
                raw_cpu.append(raw.run(n, args.turns, args.calls)[1] * n * (args.turns + 1))
                raw_async_cpu.append(raw_async.run(n, args.turns, args.calls)[1] * n
                                     * (args.turns + 1))
                cpu0 = cpu_self()
                http_walls.append(asyncio.run(pure_gather(n, args, tools, topo.base_url)))
                http_cpu.append(cpu_self() - cpu0)
            assert split is not None
            split_walls.append(asyncio.run(split_gather(n, split, tools)))

        def floor_round(model_cpu: float) -> None:
            spent = pure_cpu[-1] + raw_cpu[-1] + model_cpu
            floors.append(max(pure[-1], spent / CORES))
            spent = http_cpu[-1] + raw_cpu[-1] + model_cpu
            http_floors.append(max(pure[-1], spent / CORES))
            spent = http_cpu[-1] + raw_async_cpu[-1] + model_cpu
            async_floors.append(max(pure[-1], spent / CORES))

        pure_cpu: list[float] = []
        raw_cpu: list[float] = []
        http_cpu: list[float] = []  # the pure loop's with the model over HTTP (its engine's)
        http_walls: list[float] = []
        http_floors: list[float] = []
        raw_async_cpu: list[float] = []
        async_floors: list[float] = []  # with the model over HTTP and asyncio ends
        try:
            if not args.split_floor_only:
                raw = RawTurns(WORKERS + 1)
                raw_async = RawTurns(WORKERS + 1, ends="asyncio")
            endpoint = topo.start()
            split = SplitTurns(topo.base_url, str(tools_py), WORKERS, "tcp", max(8, n))
            asyncio.run(split_gather(1, split, tools))  # warm-up: its processes, connections
            anyio.run(prompt_all, endpoint, 1)  # warm-up: imports, connections, the store
            asyncio.run(pure_gather(1, args, tools))
            pure_round()
            before, cpu_before = topo.rss(), topo.cpu()
            since, until, results, failures = anyio.run(prompt_all, endpoint, n)
            walls.append(until - since)
            cpu = {k: v - cpu_before[k] for k, v in topo.cpu().items()}
            floor_round(cpu["fake-llm"])
            db_path = Path(tmpdir) / "hub" / "events.db"
            wait_logged(db_path, {r.run_id for r in results})
            after = topo.rss()
            log = read_log(db_path, since, until)
            lost = lost_runs(results, failures, log["ends"])
            # A second wave of N fresh sessions: the first wave's N are idle and stored now, and
            # the memory its peak freed is reused, so this wave's growth is what N more idle
            # stored sessions cost (the first wave's growth also holds the allocator's peak).
            second = after["coordinator"]
            if n <= args.second_wave_max:
                _, _, more, more_failures = anyio.run(prompt_all, endpoint, n)
                wait_logged(db_path, {r.run_id for r in more})
                second = topo.rss()["coordinator"]
                lost += lost_runs(more, more_failures, read_log(db_path, 0, time.time())["ends"])
            for _ in range(args.rounds - 1):
                pure_round()
                model_cpu = topo.cpu()["fake-llm"]
                t0, t1, more, more_failures = anyio.run(prompt_all, endpoint, n)
                walls.append(t1 - t0)
                floor_round(topo.cpu()["fake-llm"] - model_cpu)
                wait_logged(db_path, {r.run_id for r in more})
                lost += lost_runs(more, more_failures, read_log(db_path, t0, t1)["ends"])
        finally:
            topo.stop()
            for hops in (raw, raw_async, split):
                if hops is not None:
                    hops.close()
    ends = log["ends"]
    return {"n": n, "wall": walls[0], "walls": walls, "pure": pure, "floors": floors,
            "pure_cpu": pure_cpu, "raw_cpu": raw_cpu, "http_cpu": http_cpu,
            "http_floors": http_floors, "http_walls": http_walls, "results": len(results),
            "raw_async_cpu": raw_async_cpu, "async_floors": async_floors,
            "split_walls": split_walls,
            "failures": failures, "lost": lost, "events": log["events"],
            "latencies": log["latencies"], "before": before, "after": after, "gaps": log["gaps"],
            "cpu": cpu, "second_wave_kb": second - after["coordinator"],
            "extra_ends": sum(ends.values()) - len(ends)}


# --- the no-bus limit: asyncio.gather over the pure loop -------------------------------------


class SleepyLlm:
    """The script's replies from memory after MODEL_MS, keyed on the trailing tool results
    (as the fake server's rules are)."""

    def __init__(self, turns: int, calls: int, model_s: float) -> None:
        self.turns, self.calls, self.model_s = turns, calls, model_s
        self.ids = 0

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Any = None) -> AssistantMessage:
        await anyio.sleep(self.model_s)
        done = sum(1 for m in request.messages if isinstance(m, AssistantMessage))
        usage = Usage(input=10, output=5, total=15)
        if done >= self.turns:
            return AssistantMessage(content=[TextPart("All done.")], stop_reason="stop",
                                    usage=usage, model="m")
        content: list[Any] = []
        for _ in range(self.calls):
            self.ids += 1
            content.append(ToolCall(id=f"c{self.ids}", name="work",
                                    arguments=json.dumps({"text": f"step{done + 1}"})))
        return AssistantMessage(content=content, stop_reason="tool_use", usage=usage, model="m")


async def pure_gather(n: int, args: argparse.Namespace, tools: LocalTools,
                      base_url: str = "") -> float:
    """N runs of the pure loop at once: the model from memory, or with `base_url` over HTTP
    through the gateway's own engine (`LlmEngine`, as the topology's gateway holds it)."""
    async with contextlib.AsyncExitStack() as stack:
        llm: Any = SleepyLlm(args.turns, args.calls, args.model_ms / 1000)
        if base_url:
            model = ModelConfig(alias="x", provider="openai", model="m", base_url=base_url,
                                max_concurrency=max(8, n), timeout=600)
            llm = EngineLlm(await stack.enter_async_context(LlmEngine([model])))
        started = time.perf_counter()
        await gather_runs(n, llm, tools)
        return time.perf_counter() - started


async def gather_runs(n: int, llm: Any, tools: Any) -> None:
    """N runs of the pure loop at once with `llm` and `tools`, each checked for its answer."""

    async def emit(event: Any) -> None:
        return None

    async def one() -> None:
        result = await run_loop([user_text("go")], [], LoopConfig(model="x", agent="bench"),
                                llm, tools, emit)
        assert result.final_text == "All done.", result.final_text

    await asyncio.gather(*(one() for _ in range(n)))


async def split_gather(n: int, split: SplitTurns, tools: LocalTools) -> float:
    """N runs of the pure loop at once with B's work split over processes (bench/split.py): the
    model's `LlmEngine` in a process of its own, the tools in WORKERS others; the wall time."""
    catalog = await tools.catalog()
    started = time.perf_counter()
    await split.run(functools.partial(gather_runs, n), catalog)
    return time.perf_counter() - started


# --- the gateway's HTTP client alone -----------------------------------------------------------


def cpu_self() -> float:
    return cpu_s(os.getpid())


async def http_probe(base_url: str, n: int, clients: int, waves: int = 3) -> float:
    """N concurrent streamed completions spread over CLIENTS httpx.AsyncClients (the gateway's
    LlmEngine holds one), the replies' SSE read line by line: CPU ms of this process per call."""
    import httpx

    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}],
            "tools": [{"type": "function", "function": {"name": "work", "parameters": {
                "type": "object", "properties": {"text": {"type": "string"}}}}}]}
    pool = [httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=600)
            for _ in range(clients)]
    sent = 0

    async def one() -> None:
        nonlocal sent
        client, sent = pool[sent % clients], sent + 1
        async with client.stream("POST", f"{base_url}/chat/completions", json=body) as reply:
            async for _ in reply.aiter_lines():
                pass

    try:
        await asyncio.gather(*(one() for _ in range(4 * clients)))  # warm-up: connections
        started = cpu_self()
        for _ in range(waves):
            await asyncio.gather(*(one() for _ in range(n)))
        return (cpu_self() - started) / (waves * n) * 1000
    finally:
        for client in pool:
            await client.aclose()


def run_http_probe(ns: list[int], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-scale-http-") as tmpdir:
        script_file = Path(tmpdir) / "script.json"
        script_file.write_text(json.dumps(scale_script(1, args.calls, args.model_ms / 1000)))
        port = free_port()
        fake = Proc([*fake_argv(), "--script", str(script_file), "--port", str(port)])
        try:
            fake.ready()
            for n in ns:
                per = {k: asyncio.run(http_probe(f"http://127.0.0.1:{port}/v1", n, k))
                       for k in (1, 8)}
                print(f"httpx alone, N={n} concurrent streamed replies: {per[1]:.2f} ms CPU per "
                      f"call with one AsyncClient, {per[8]:.2f} ms spread over 8")
        finally:
            fake.stop()


def median_of(values: list[float]) -> float:
    # the middle value, or the mean of the middle two (as the headlines, bench/headline.py)
    return statistics.median(values)


def listed(values: list[float], spec: str = ".2f", sep: str = ", ") -> str:
    return sep.join(f"{x:{spec}}" for x in values)


def over_pure(r: dict[str, Any], key: str) -> list[float]:
    """Each round's `r[key]` (a wall time) over the same round's pure-loop wall."""
    return [x / p for x, p in zip(r[key], r["pure"], strict=True)]


def topology_over(r: dict[str, Any], key: str) -> list[float]:
    """Each round's topology wall over the same round's `r[key]` (a wall time)."""
    return [w / x for w, x in zip(r["walls"], r[key], strict=True)]


def report_raw_floors(r: dict[str, Any]) -> None:
    """The floors from raw hops (blocking, then asyncio ends) and the pure loop over HTTP."""
    floor = over_pure(r, "floors")
    above = [w / f for w, f in zip(r["walls"], r["floors"], strict=True)]
    print(f"         the floor of that ratio, (pure loop CPU + the same sessions' hops through "
          f"raw pyzmq + the scripted model's CPU) / {CORES} cores, or the pure wall if longer, "
          f"/ pure: {median_of(floor):.2f}x [{', '.join(f'{x:.2f}' for x in floor)}]"
          f"; topology / floor {median_of(above):.2f}x; CPU s per wave: pure loop "
          f"{' '.join(f'{x:.1f}' for x in r['pure_cpu'])}, raw hops "
          f"{' '.join(f'{x:.1f}' for x in r['raw_cpu'])}")
    report_http_floors(r)


def report_http_floors(r: dict[str, Any]) -> None:
    ms = 1000.0
    http_floor = over_pure(r, "http_floors")
    per_http = topology_over(r, "http_walls")
    print(f"         with the model over HTTP (the pure loop's CPU measured with the gateway's "
          f"engine in its process: {listed(r['http_cpu'], '.1f', ' ')} s per wave), the floor / "
          f"pure: {median_of(http_floor):.2f}x [{listed(http_floor)}]; topology / that pure loop "
          f"(walls ms {listed([w * ms for w in r['http_walls']], '.0f', ' ')}): "
          f"{median_of(per_http):.2f}x [{listed(per_http)}]")
    async_floor = over_pure(r, "async_floors")
    print(f"         and with asyncio ends (the same hops between asyncio programs: "
          f"{listed(r['raw_async_cpu'], '.1f', ' ')} CPU s per wave), the asyncio floor / pure: "
          f"{median_of(async_floor):.2f}x [{listed(async_floor)}]")


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    ms = 1000.0
    n, wall = r["n"], r["wall"]
    ideal_issue = args.turns * (args.model_ms + args.tool_ms) / ms
    ideal = ideal_issue + args.model_ms / ms
    turns = n * (args.turns + 1)
    lat = r["latencies"]
    p50 = pct(lat, 0.5) * ms if lat else float("nan")
    p99 = pct(lat, 0.99) * ms if lat else float("nan")
    after, before = r["after"], r["before"]
    coord_growth = after["coordinator"] - before["coordinator"]
    print(f"N={n:5d}  wall {wall * ms:8.0f} ms  ({wall / ideal:.2f}x ideal {ideal * ms:.0f} ms; "
          f"{wall / ideal_issue:.2f}x the issue's {ideal_issue * ms:.0f} ms)")
    print(f"         {turns / wall:8.0f} turns/s  {r['events'] / wall:8.0f} events/s via hub "
          f"({r['events']} events)  tool call p50 {p50:.1f} ms  p99 {p99:.1f} ms "
          f"({len(lat)} calls)")
    print("         RSS MB after: " + "  ".join(
        f"{k} {v / 1024:.0f}" for k, v in after.items() if not k.startswith("worker"))
          + f"  workers {sum(v for k, v in after.items() if k.startswith('worker')) / 1024:.0f}"
          + " (4 together)")
    wave = (f"; second wave of {n} more: {r['second_wave_kb'] / max(1, n):.1f} kB per session"
            if n <= args.second_wave_max else "")
    print(f"         coordinator growth {coord_growth / 1024:.1f} MB = "
          f"{coord_growth / max(1, n):.1f} kB per session incl. the runs' peak{wave}")
    print(f"         CPU s during the window ({wall:.1f} s wall, 2 cores): " + "  ".join(
        f"{k} {v:.1f}" for k, v in r["cpu"].items() if not k.startswith("worker"))
          + f"  workers {sum(v for k, v in r['cpu'].items() if k.startswith('worker')):.1f}")
    print(f"         results {r['results']}/{n}, prompt failures {r['failures']}, "
          f"runs without exactly one agent_end or wrong answer: {r['lost']}, "
          f"duplicate agent_ends {r['extra_ends']}  -> "
          + ("nothing lost" if r["lost"] == 0 and r["results"] == n else "LOST")
          + f" (all {len(r['walls']) + (n <= args.second_wave_max)} waves checked: {r['lost']} lost)")
    per = [w / p for w, p in zip(r["walls"], r["pure"], strict=True)]
    ratio = median_of(per)
    target = TARGETS.get(n)
    verdict = "" if target is None else (
        f"; target <= {target}x: {'met' if ratio <= target else 'NOT met'}")
    print(f"         topology / pure loop (asyncio.gather, same N), median of {len(per)} "
          f"alternated rounds: {ratio:.2f}x [{', '.join(f'{x:.2f}' for x in per)}]{verdict}; "
          f"walls ms: topology {' '.join(f'{w * ms:.0f}' for w in r['walls'])}, pure "
          f"{' '.join(f'{w * ms:.0f}' for w in r['pure'])}")
    if args.split_floor_only:
        print("         (the raw-hop floors, blocking and with asyncio ends, and the pure loop "
              "with the model over HTTP: not measured, --quick or --split-floor-only)")
    else:
        report_raw_floors(r)
    split = over_pure(r, "split_walls")
    per_split = topology_over(r, "split_walls")
    print(f"         the split-work floor (the same N runs here, the model's engine and the tools "
          f"each in processes of their own, joined by raw pyzmq, bench/split.py; walls ms "
          f"{listed([w * ms for w in r['split_walls']], '.0f', ' ')}) / pure: "
          f"{median_of(split):.2f}x [{listed(split)}]; topology / it {median_of(per_split):.2f}x "
          f"[{listed(per_split)}]")
    # Where a run's time goes: the mean hub-stamped time between a run's consecutive events
    # (deltas left out), summed per kind of step; the largest few.
    spent = sorted(((sum(v) / n, k, sum(v) / len(v)) for k, v in r["gaps"].items()), reverse=True)
    print("         per run, largest steps (total ms per run, mean ms per step): " + "; ".join(
        f"{k} {tot * ms:.0f} ({mean * ms:.1f})" for tot, k, mean in spent[:4]))
    sys.stdout.flush()


def rounds_at(n: int, args: argparse.Namespace) -> int:
    if args.rounds is not None:
        return int(args.rounds)
    if args.quick:
        return QUICK_ROUNDS.get(n, 3)
    return 3 if n >= 1000 else 5  # more rounds than --quick's, where a round is short


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="issue 51's headlines in about a minute: --sessions 100,1000 "
                         "--second-wave-max 0 --split-floor-only, 4 rounds at N = 100 and 2 at "
                         "1,000 unless given")
    ap.add_argument("--sessions", default=None,
                    help="comma-separated N values (default: 1,10,100,1000; 100,1000 with --quick)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--model-ms", type=float, default=100.0)
    ap.add_argument("--tool-ms", type=float, default=20.0)
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="run the coordinator, gateway and hub under cProfile, dumping into DIR")
    ap.add_argument("--gateway-clients", default="", metavar="SIZE[:PER]",
                    help="the gateway's httpx pool for this run: at most SIZE AsyncClients, a "
                         "new one once each holds PER streams (default: the engine's 16:6)")
    ap.add_argument("--second-wave-max", type=int, default=None, metavar="N",
                    help="run a second wave (idle stored session memory) for N up to this "
                         "(default 100; 0 with --quick)")
    ap.add_argument("--split-floor-only", action="store_true",
                    help="of the floors, measure only the split-work floor (skip the raw hops, "
                         "blocking and with asyncio ends, and the pure loop with the model over "
                         "HTTP); implied by --quick")
    ap.add_argument("--http-probe", action="store_true",
                    help="also time bare httpx.AsyncClients (the gateway's HTTP client) at each N")
    ap.add_argument("--rounds", type=int, default=None,
                    help="per N, alternated rounds of the pure loop (asyncio.gather) then the "
                         "topology; the ratio is their median (default 5, 3 at N >= 1,000; with "
                         "--quick 4 at N = 100, 2 at 1,000)")
    ap.add_argument("--pure", type=int, default=0, metavar="N",
                    help="also the pure loop alone at N sessions, after the rest (0: skip)")
    ap.add_argument("--count-sends", default="", metavar="DIR",
                    help="count the messages each process sends, by kind (files in DIR/nN)")
    ap.add_argument("--fakellm", default="", metavar="FILE",
                    help="serve the scripted model from this fakellm.py instead of the tree's "
                         "(e.g. `git show OLD:agents/gateway/fakellm.py > old.py`: an A/B of the fake)")
    args = ap.parse_args()
    args.sessions = args.sessions or ("100,1000" if args.quick else "1,10,100,1000")
    args.split_floor_only = args.split_floor_only or args.quick
    if args.second_wave_max is None:
        args.second_wave_max = 0 if args.quick else 100
    if args.fakellm and not os.path.isfile(args.fakellm):
        ap.error(f"--fakellm: no such file {args.fakellm!r}; give a fakellm.py to serve")
    common.FAKELLM = args.fakellm
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds: expected 1 or more, got {args.rounds}")
    common.PROFILE_DIR = args.profile  # read by `busctl()`
    if args.gateway_clients:
        try:
            size, _, per = args.gateway_clients.partition(":")
            common.GATEWAY_POOL = (int(size), int(per or 6))
        except ValueError:
            ap.error(f"--gateway-clients: expected SIZE or SIZE:PER (integers, e.g. 16:6), got "
                     f"{args.gateway_clients!r}")
    try:
        ns = [int(x) for x in args.sessions.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sessions: expected comma-separated integers like 1,10,100, got "
                 f"{args.sessions!r}")
    print(f"{args.turns} tool turns x {args.calls} parallel {args.tool_ms:g} ms calls + final "
          f"answer per session; model {args.model_ms:g} ms per reply; {WORKERS} workers")
    hl = Headlines()
    lost: list[int] = []
    for n in ns:
        if args.count_sends:
            count_sends(os.path.join(args.count_sends, f"n{n}"))
        began = time.monotonic()
        r = run_topology(n, argparse.Namespace(**{**vars(args), "rounds": rounds_at(n, args)}))
        report(r, args)
        print(f"(N={n} took {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        lost.append(r["lost"] + n - r["results"])
        if n in SPLIT_TARGETS:
            hl.add(f"sessions_{n}_over_split", topology_over(r, "split_walls"), "<=",
                   SPLIT_TARGETS[n], "rounds")
        if args.count_sends:  # the warm-up session and the second wave included
            report_sends(os.path.join(args.count_sends, f"n{n}"))
    if args.http_probe:
        run_http_probe(ns, args)
    if args.pure > 0:
        with tempfile.TemporaryDirectory(prefix="bench-scale-pure-") as tmpdir:
            tools_py = Path(tmpdir) / "scale_tools_pure.py"
            tools_py.write_text(SCALE_TOOLS_PY.format(tool_s=args.tool_ms / 1000))
            tools = LocalTools(str(tools_py))
            wall = asyncio.run(pure_gather(args.pure, args, tools))
        ideal = (args.turns * (args.model_ms + args.tool_ms) + args.model_ms) / 1000
        print(f"pure loop, asyncio.gather, N={args.pure}: wall {wall * 1000:.0f} ms "
              f"({wall / ideal:.2f}x ideal), {args.pure * (args.turns + 1) / wall:.0f} turns/s")
    # every wave of every N: runs without exactly one agent_end or a wrong answer, prompts
    # without a result
    hl.add_count("lost_runs", lost, 0, "sizes")
    hl.print()


if __name__ == "__main__":
    main()
