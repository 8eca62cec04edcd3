"""Experiments at the model server's pace (issue 51 item 4): what an experiment user waits for.

    python bench/bench_pace.py [--quick | --smoke] [--parallel 4] [--token-ms 10] [--tokens 32]
                               [--cells 24] [--rounds 3] [--base-url URL --model NAME]

The model server: `busctl fake-llm --parallel N --token-ms X` (N slots, requests beyond N wait
their turn as llama.cpp's `--parallel N`; streamed events X ms apart), answering every request
with a streamed reply of K text tokens and no tool call, each token the server's clock as it
writes it (the script's `stamp`: `{sent_at}`). With `--base-url`, a real server instead (e.g.
llama.cpp started with `--parallel 4`): its replies are whatever it generates, capped at
`max_tokens` K, and carry no clock, so only the cells/s ratio is measured.

Two ways to run CELLS cells (one cell = one model call, its reply streamed, no tools), at
concurrency N, alternated ABBA within each round:

- direct: this process sends the same chat-completions requests (the agent's system prompt and
  the cell's input, streamed, `max_tokens` K) with one `httpx.AsyncClient`, N at once, no bus;
- bus: `busctl experiment run SPEC` (a real subprocess) of a spec of CELLS samples x 1 variant x
  1 repeat, `run.concurrency = N`, against a topology of hub (tcp), gateway and coordinator
  (`busctl` processes started here; the agent has no tools, its model `max_concurrency` N).

cells/s: for the bus, CELLS over the hub-stamped window from the experiment's `experiment_plan`
event to its last `experiment_sample` (the runner's own work; the subprocess's start and its
results file are printed apart); for direct, CELLS over its wall time. A streamed delta's
latency: the time a token reaches the reader minus the clock the server wrote into it, on the
same machine; through the bus the reader is a `busctl watch --json --type message_update`
subprocess (this process reads its stdout as it prints), direct it is the httpx client; each
round's ratio is the bus p50 over the direct p50 of the same round. The floor of that path
(after each direct run, unless `--no-floor`): the same requests read by an httpx relay process
that pushes each stamped line through a raw Python broker to a SUB process printing it, the
three processes a delta crosses through the bus (gateway, hub, watch) with none of its work.

Headlines (bench/headline.py, after `== headline ==`): `pace_cells_per_s` bus / direct (target
>= 0.95x) and `pace_delta_p50` through `busctl watch` / straight from the server (target <= 2x).
Not run by pytest, except `--smoke`; every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import common  # noqa: E402
from bench.baseline import free_port  # noqa: E402
from bench.common import Proc, busctl, fake_argv  # noqa: E402
from bench.headline import Headlines  # noqa: E402

# a real model keeps writing to max_tokens (the scripted one ignores the prompt)
SYSTEM = "You are a counter. Count from one upwards in words until you are stopped."
INPUT = "Count from one to five hundred in words, separated by commas."
STAMP = re.compile(r"(\d{10}\.\d{6}) ")  # a token of the stamped reply, as written


class Size(NamedTuple):
    cells: int  # per run, 0: 6 x parallel
    rounds: int  # ABBA rounds


SIZES = {"full": Size(0, 3), "quick": Size(0, 2), "smoke": Size(4, 1)}


def script(tokens: int) -> dict[str, Any]:
    """Every request: a streamed reply of `tokens` stamped tokens, no tool call."""
    return {"stamp": True, "rules": [{"reply": {"text": "{sent_at} " * tokens, "chunk_size": 10}}]}


def topology_toml(base_url: str, model: str, parallel: int, tokens: int) -> str:
    return f"""
[models.x]
provider = "openai"
base_url = "{base_url}"
model = "{model}"
max_concurrency = {parallel}
max_tokens = {tokens}
temperature = 0.0
seed = 1
timeout = 600

[[agents]]
name = "pace"
model = "x"
tools = []
system_prompt = "{SYSTEM}"
max_concurrent_runs = {max(parallel, 1) * 2}
max_queued_runs = 1000
"""


def write_spec(tmp: Path, cells: int, parallel: int) -> Path:
    with (tmp / "samples.jsonl").open("w") as out:
        for i in range(cells):
            out.write(json.dumps({"id": f"s{i}", "input": INPUT, "target": " "}) + "\n")
    spec = tmp / "spec.toml"
    spec.write_text(f'name = "pace"\n[dataset]\npath = "samples.jsonl"\n'
                    f'[[variants]]\nname = "one"\nagent = "pace"\n'
                    f'[run]\nconcurrency = {parallel}\nretries = 0\n'
                    f'[[scorers]]\nkind = "includes"\n')
    return spec


class Watch:
    """A `busctl watch --json` subprocess (or `proc`, another printer of stamped lines: the
    floor's); a thread reads its lines as they come and keeps each stamped token's latency (the
    time the line was read minus the token's server clock)."""

    def __init__(self, endpoint: str, proc: Proc | None = None) -> None:
        self.proc = proc or Proc(busctl("watch", "--hub", endpoint, "--json", "--type",
                                        "message_update"))
        self.latencies: list[float] = []
        self.to_hub: list[float] = []  # the server's clock -> the hub's stamp (`ts`)
        self.lines = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        stdout = self.proc.popen.stdout
        assert stdout is not None
        for line in stdout:
            now = time.time()
            self.lines += 1
            stamps = [float(s) for s in STAMP.findall(line)]
            if not stamps:
                continue
            self.latencies += [now - s for s in stamps]
            if line.startswith("{"):
                ts = json.loads(line).get("ts", 0.0)
                self.to_hub += [ts - s for s in stamps]

    def take(self) -> list[float]:
        out, self.latencies = self.latencies, []
        return out

    def take_to_hub(self) -> list[float]:
        out, self.to_hub = self.to_hub, []
        return out

    def stop(self) -> None:
        self.proc.stop()


def request_body(model: str, tokens: int) -> dict[str, Any]:
    """What the direct driver (and the floor's relay) sends: greedy and seeded as the topology's
    model (a real model's replies the same length both ways), and asking for the usage chunk as
    the gateway does (`providers/openai.py`): without it the scripted server sent one event
    less, a token interval (10 ms) a cell the gateway was charged for the usage it needs."""
    return {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": tokens, "temperature": 0.0, "seed": 1,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": INPUT}]}


async def direct(base_url: str, model: str, cells: int, parallel: int, tokens: int,
                 each: list[float] | None = None, keep_alive: bool = True) -> tuple[float, list[float]]:
    """`cells` streamed requests, `parallel` at once, straight to the server: (wall s, each
    stamped token's latency from the server's clock to this reader); each request's wall
    appended to `each`. `keep_alive` False: a connection a request (llama.cpp's server closes
    each after its stream, unannounced)."""
    body = request_body(model, tokens)
    latencies: list[float] = []
    left = cells
    limits = httpx.Limits(max_connections=parallel,
                          max_keepalive_connections=parallel if keep_alive else 0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                begun = time.perf_counter()
                async with client.stream("POST", f"{base_url}/chat/completions",
                                         json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        now = time.time()
                        latencies.extend(now - float(s) for s in STAMP.findall(line))
                if each is not None:
                    each.append(time.perf_counter() - begun)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(parallel)))
        return time.perf_counter() - started, latencies


# The floor of a delta's path (`--no-floor` leaves it out): the least glue over the same
# processes as the bus's path. A relay process reads the server's stream with httpx, as the
# direct driver does (the gateway's place), and pushes each stamped line through a raw Python
# broker (blocking pyzmq PULL -> XPUB: the hub's place, with no check, stamp or log) to a SUB
# process that prints it (the watch's place). Through the bus a delta crosses the same three
# processes; what it costs over this floor is the bus's own work on the way.
FLOOR_BROKER = """
import json, sys, zmq
ctx = zmq.Context()
pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.XPUB)
pull_port = pull.bind_to_random_port("tcp://127.0.0.1")
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
print(json.dumps({"ports": [pull_port, pub_port]}), flush=True)
pub.recv()  # the printer's subscription: from now on nothing pushed is lost
print(json.dumps({"ready": "broker"}), flush=True)
while True:
    pub.send(pull.recv())
"""
FLOOR_PRINTER = """
import sys, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
out = sys.stdout
while True:
    out.write(sub.recv().decode() + "\\n")
    out.flush()
"""
FLOOR_RELAY = """
import asyncio, json, sys, httpx, zmq
base_url, model, cells, parallel, tokens, pull = sys.argv[1:7]
cells, parallel, tokens = int(cells), int(parallel), int(tokens)
push = zmq.Context().socket(zmq.PUSH)
push.connect(pull)
body = json.loads(sys.argv[7])
async def main():
    left = cells
    limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                async with client.stream("POST", base_url + "/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            push.send(line.encode())
        await asyncio.gather(*(worker() for _ in range(parallel)))
asyncio.run(main())
"""


def floor_processes() -> tuple[list[Proc], str, Watch]:
    """The floor's broker and printer (its reader thread in a `Watch`): (processes, the
    broker's PULL endpoint, the reader)."""
    broker = Proc([sys.executable, "-c", FLOOR_BROKER])
    assert broker.popen.stdout is not None
    pull_port, pub_port = json.loads(broker.popen.stdout.readline())["ports"]
    printer = Proc([sys.executable, "-c", FLOOR_PRINTER, f"tcp://127.0.0.1:{pub_port}"])
    broker.ready()
    return [broker, printer], f"tcp://127.0.0.1:{pull_port}", Watch("", printer)


def floor_run(base_url: str, model: str, cells: int, parallel: int, tokens: int,
              pull: str) -> None:
    """One relay run of `cells` cells (its lines reach the floor's printer as they stream)."""
    subprocess.run([sys.executable, "-c", FLOOR_RELAY, base_url, model, str(cells), str(parallel),
                    str(tokens), pull, json.dumps(request_body(model, tokens))],
                   check=True, timeout=600)


def journal_window(db: Path, after_seq: int) -> tuple[float, float, int, int]:
    """(plan ts, last sample ts, samples, the log's last seq) of the experiment journaled after
    `after_seq` in the hub's log."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT seq, ts, type FROM events WHERE seq > ? AND type IN "
                           "('experiment_plan', 'experiment_sample') ORDER BY seq",
                           (after_seq,)).fetchall()
        last = con.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
    finally:
        con.close()
    plans = [ts for _, ts, kind in rows if kind == "experiment_plan"]
    samples = [ts for _, ts, kind in rows if kind == "experiment_sample"]
    if not plans or not samples:
        raise RuntimeError(f"no experiment journaled after seq {after_seq} in {db}")
    return plans[0], samples[-1], len(samples), int(last)


def count_type(db: Path, kind: str) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COUNT(*) FROM events WHERE type = ?", (kind,)).fetchone()[0])
    finally:
        con.close()


def last_seq(db: Path) -> int:
    if not db.exists():
        return 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
    finally:
        con.close()


def bus_run(endpoint: str, spec: Path, name: str, tmp: Path, db: Path, cells: int,
            each: list[float] | None = None) -> tuple[float, float]:
    """`busctl experiment run` of `spec`: (cells/s over its journal's window, process wall s);
    each cell's wall (prompt to result, from the results file) appended to `each`."""
    before = last_seq(db)
    started = time.perf_counter()
    done = subprocess.run(busctl("experiment", "run", str(spec), "--hub", endpoint, "--name", name,
                                 "--results", str(tmp / f"{name}.jsonl")),
                          cwd=tmp, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"busctl experiment run exited {done.returncode}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    deadline = time.monotonic() + 10  # the journal is confirmed before the runner goes on
    while True:
        try:
            t0, t1, samples, _ = journal_window(db, before)
            if samples >= cells:
                break
        except RuntimeError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: fewer than {cells} samples journaled")
        time.sleep(0.05)
    if each is not None:
        with (tmp / f"{name}.jsonl").open() as rows:
            each += [json.loads(row)["wall"] for row in rows]
    return samples / (t1 - t0), wall


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the least that prints every line")
    ap.add_argument("--parallel", type=int, default=4, help="the server's slots and the "
                    "experiment's concurrency (default 4)")
    ap.add_argument("--token-ms", type=float, default=10.0,
                    help="ms between the scripted server's streamed tokens (default 10)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a reply (default 32)")
    ap.add_argument("--cells", type=int, default=0, help="cells a run (default 6 x --parallel)")
    ap.add_argument("--rounds", type=int, default=0, help="ABBA rounds (default 3; 2 --quick)")
    ap.add_argument("--base-url", default="",
                    help="a running OpenAI-compatible server (.../v1) instead of the scripted one")
    ap.add_argument("--model", default="m", help="the model name sent to --base-url")
    ap.add_argument("--replay-priority", choices=("idle", "low"), default="",
                    help="the hub's --replay-priority (default: the hub's own, idle): every "
                         "prompt's subscription starts with a replay from the log, served by "
                         "that reader")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="run the hub, gateway and coordinator under cProfile, dumping into DIR")
    ap.add_argument("--event-linger", type=float, default=None, metavar="S",
                    help="a measuring instrument, not a setting: the gateway and coordinator "
                         "hold events and partial replies up to S seconds instead of "
                         "bus/outbox.py's EVENT_LINGER (a line run before cli.py; the gateway "
                         "keeps its own STREAM_LINGER when that is shorter)")
    ap.add_argument("--no-watch", action="store_true",
                    help="no `busctl watch` during the bus runs (cells/s only)")
    ap.add_argument("--no-floor", action="store_true",
                    help="leave out the floor of a delta's path (a relay after each direct run)")
    args = ap.parse_args()
    common.PROFILE_DIR = args.profile  # read by `busctl()`
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    for flag, value in (("--parallel", args.parallel), ("--tokens", args.tokens)):
        if value < 1:
            ap.error(f"{flag}: expected 1 or more, got {value}")
    parallel, tokens = args.parallel, args.tokens
    cells = args.cells or size.cells or 6 * parallel
    rounds = args.rounds or size.rounds
    real = bool(args.base_url)
    hl = Headlines()
    with tempfile.TemporaryDirectory(prefix="bench-pace-") as folder:
        tmp = Path(folder)
        procs: list[Proc] = []
        watch: Watch | None = None
        floor: Watch | None = None
        try:
            if real:
                base_url = args.base_url.rstrip("/")
            else:
                (tmp / "script.json").write_text(json.dumps(script(tokens)))
                port = free_port()
                procs.append(Proc([*fake_argv(), "--script", str(tmp / "script.json"), "--port",
                                   str(port), "--parallel", str(parallel), "--token-ms",
                                   str(args.token_ms)]))
                procs[-1].ready()
                base_url = f"http://127.0.0.1:{port}/v1"
            topo = tmp / "topology.toml"
            topo.write_text(topology_toml(base_url, args.model, parallel, tokens))
            hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                              str(tmp / "hub"), *(["--replay-priority", args.replay_priority]
                                                  if args.replay_priority else [])))
            procs.append(hub)
            endpoint = str(hub.ready()["endpoint"])
            patch = ("" if args.event_linger is None else
                     f"import agent_bus.bus.outbox as o\no.EVENT_LINGER = {args.event_linger!r}\n")
            for argv in (busctl("gateway", "--hub", endpoint, "--topology", str(topo),
                                patch=patch),
                         busctl("coordinator", "--hub", endpoint, "--topology", str(topo),
                                "--state-dir", str(tmp / "agents"), patch=patch)):
                procs.append(Proc(argv))
            for proc in procs[-2:]:
                proc.ready()
            spec = write_spec(tmp, cells, parallel)
            db = tmp / "hub" / "events.db"
            watch = None if args.no_watch else Watch(endpoint)
            pull = ""
            if not (args.no_watch or args.no_floor or real):
                floor_procs, pull, floor = floor_processes()
                procs += floor_procs
            # warm-up: imports, connections, the server's first requests
            bus_run(endpoint, write_spec_small(tmp, parallel), "warm", tmp, db, parallel)
            asyncio.run(direct(base_url, args.model, parallel, parallel, tokens,
                               keep_alive=not real))
            if watch is not None:
                watch.take()
                watch.take_to_hub()
            rates: dict[str, list[float]] = {"bus": [], "direct": []}
            walls: list[float] = []
            cell_walls: dict[str, list[float]] = {"bus": [], "direct": []}
            lat: dict[str, list[float]] = {"bus": [], "direct": [], "floor": []}
            to_hub: list[float] = []
            p50s: dict[str, list[float]] = {"bus": [], "direct": [], "floor": []}
            print(f"{cells} cells a run, {parallel} at once; the model: "
                  + (base_url if real else f"busctl fake-llm --parallel {parallel} --token-ms "
                     f"{args.token_ms:g}, {tokens} tokens a reply"), flush=True)
            for r in range(rounds):
                round_lat: dict[str, list[float]] = {"bus": [], "direct": [], "floor": []}
                for i, kind in enumerate(("direct", "bus", "bus", "direct")):
                    if kind == "direct":
                        wall, got = asyncio.run(direct(base_url, args.model, cells, parallel,
                                                       tokens, cell_walls["direct"], not real))
                        rates["direct"].append(cells / wall)
                    else:
                        rate, wall = bus_run(endpoint, spec, f"pace-{r}-{i}", tmp, db, cells,
                                             cell_walls["bus"])
                        rates["bus"].append(rate)
                        walls.append(cells / wall)
                        got = []
                        if watch is not None:
                            time.sleep(0.2)  # the watch's last lines (printed as they came)
                            got = watch.take()
                            to_hub += watch.take_to_hub()
                    round_lat[kind] += got
                    print(f"round {r + 1} {kind:>6}: {rates[kind][-1]:.2f} cells/s"
                          + (f" (the whole `busctl experiment run` process: {walls[-1]:.2f}/s)"
                             if kind == "bus" else "")
                          + (f"; delta p50 {p50(got) * 1e3:.2f} ms ({len(got)} tokens)"
                             if got else ""), flush=True)
                    if kind == "direct" and floor is not None:
                        floor_run(base_url, args.model, cells, parallel, tokens, pull)
                        time.sleep(0.2)  # the printer's last lines
                        got = floor.take()
                        round_lat["floor"] += got
                        print(f"round {r + 1}  floor: delta p50 {p50(got) * 1e3:.2f} ms "
                              f"({len(got)} tokens)", flush=True)
                for kind in lat:
                    lat[kind] += round_lat[kind]
                    if round_lat[kind]:
                        p50s[kind].append(p50(round_lat[kind]))
            retries = count_type(db, "llm_retry")
            print(f"the gateway's retries of a model call (llm_retry events) in the whole run: "
                  f"{retries}", flush=True)
        finally:
            for reader in (watch, floor):
                if reader is not None:
                    reader.stop()
            for proc in reversed(procs):
                proc.stop()
    cell_ratios = [b / d for b, d in zip(rates["bus"], rates["direct"], strict=True)]
    print(f"cells/s, bus / direct: {statistics.median(cell_ratios):.2f}x (runs "
          f"{min(cell_ratios):.2f}-{max(cell_ratios):.2f}); medians bus "
          f"{statistics.median(rates['bus']):.2f}/s, direct {statistics.median(rates['direct']):.2f}/s"
          f", the whole busctl process {statistics.median(walls):.2f}/s")
    print(f"one cell's wall, p50 (p99): through the bus (prompt to result, the runner's) "
          f"{p50(cell_walls['bus']) * 1e3:.1f} ms ({pct99(cell_walls['bus']) * 1e3:.1f}), direct "
          f"(request to the stream's end) {p50(cell_walls['direct']) * 1e3:.1f} ms "
          f"({pct99(cell_walls['direct']) * 1e3:.1f})")
    hl.add("pace_cells_per_s", cell_ratios, ">=", 0.95, "runs")
    if lat["bus"] and lat["direct"]:
        delta_ratios = [b / d for b, d in zip(p50s["bus"], p50s["direct"], strict=True)]
        print(f"streamed delta latency from the server's clock, p50 (p99): through `busctl watch` "
              f"{p50(lat['bus']) * 1e3:.2f} ms ({pct99(lat['bus']) * 1e3:.2f}), straight to "
              f"httpx {p50(lat['direct']) * 1e3:.2f} ms ({pct99(lat['direct']) * 1e3:.2f}); "
              f"{len(lat['bus'])} and {len(lat['direct'])} tokens; of the bus's, the server's "
              f"clock to the hub's stamp (the gateway reading and publishing it, the hub taking "
              f"it) p50 {p50(to_hub) * 1e3:.2f} ms, the rest (the hub logging and publishing it, "
              f"`busctl watch` printing it) {(p50(lat['bus']) - p50(to_hub)) * 1e3:.2f} ms")
        hl.add("pace_delta_p50", delta_ratios, "<=", 2.0, "rounds")
        if lat["floor"]:
            over = [b / f for b, f in zip(p50s["bus"], p50s["floor"], strict=True)]
            floor_over = [f / d for f, d in zip(p50s["floor"], p50s["direct"], strict=True)]
            print(f"the floor of a delta's path (an httpx relay process -> a raw Python broker -> "
                  f"a SUB process printing it): p50 {p50(lat['floor']) * 1e3:.2f} ms (p99 "
                  f"{pct99(lat['floor']) * 1e3:.2f}); floor / straight to httpx "
                  f"{statistics.median(floor_over):.2f}x (rounds {min(floor_over):.2f}-"
                  f"{max(floor_over):.2f}); through `busctl watch` / the floor "
                  f"{statistics.median(over):.2f}x (rounds {min(over):.2f}-{max(over):.2f})")
    else:
        print("streamed delta latency: not measured (--no-watch, or a real server: its tokens "
              "carry no clock)")
    hl.print()


def pct99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.99))]


def write_spec_small(tmp: Path, parallel: int) -> Path:
    small = tmp / "warm"
    small.mkdir(exist_ok=True)
    return write_spec(small, parallel, parallel)


if __name__ == "__main__":
    main()
