"""What `busctl experiment run` adds over `run_many` (issue 30, acceptance 2).

    python bench/bench_experiment.py [--sessions 200] [--concurrency 50] [--rounds 2]
                                     [--model-ms 0] [--tool-ms 0] [--named]

One topology (common.ScaleTopology: hub with its log on disk, scripted model, gateway, 4 tool
workers, coordinator), one agent. Each session is three turns: two turns of one `work` tool call,
then the answer. The same SESSIONS sessions at CONCURRENCY at once, in the same run:
- `run_many`: `AgentBus.run_many([("bench", "go")] * SESSIONS, concurrency=CONCURRENCY)`;
- the runner: `agents.experiment.runner.Runner` on a spec of SESSIONS samples × 1 variant ×
  1 repeat, `run.concurrency = CONCURRENCY`, one scorer (what `busctl experiment run` does,
  without the process start and the results file): it also reads each run's events (turns), and
  publishes a confirmed journal event per session.
Rounds alternate ABBA so drift hits both; prints each wall time and the ratio of the medians.
With `--named` the runner starts as `--name E` does: it first reads the whole log for E's
journal (`hub.replay` filters by topic, not by experiment), which grows with the log.
Not run by pytest; every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.agents.client.remote import connect  # noqa: E402
from agent_bus.agents.experiment.runner import Journal, Runner  # noqa: E402
from agent_bus.agents.experiment.spec import load_spec  # noqa: E402
from bench.common import ScaleTopology  # noqa: E402


def write_spec(tmp: Path, sessions: int, concurrency: int) -> Path:
    with (tmp / "samples.jsonl").open("w") as out:
        for i in range(sessions):
            out.write(json.dumps({"id": f"s{i}", "input": "go", "target": "done"}) + "\n")
    spec = tmp / "spec.toml"
    spec.write_text(f'name = "bench"\n[dataset]\npath = "samples.jsonl"\n'
                    f'[[variants]]\nname = "one"\nagent = "bench"\n'
                    f'[run]\nconcurrency = {concurrency}\nretries = 0\n'
                    f'[[scorers]]\nkind = "includes"\n')
    return spec


async def with_run_many(endpoint: str, sessions: int, concurrency: int, tag: str) -> float:
    async with connect(endpoint, name="bench-run-many") as bus:
        started = time.perf_counter()
        results = await bus.run_many([("bench", "go")] * sessions, concurrency=concurrency,
                                     experiment=tag)
        took = time.perf_counter() - started
    assert len(results) == sessions and all(r.stop_reason == "stop" for r in results), results[:3]
    return took


async def with_runner(endpoint: str, spec: Path, tag: str, sessions: int,
                      fresh: bool) -> tuple[float, float]:
    """(wall time, of which the start: reading the journal, publishing the plan)."""
    loaded = load_spec(spec)
    async with connect(endpoint, name="bench-runner") as bus:
        started = time.perf_counter()
        runner = Runner(bus, loaded, tag)
        original = runner.start

        start = 0.0

        async def timed_start(resume: bool, fresh: bool = False) -> Journal:
            nonlocal start
            begun = time.perf_counter()
            journal = await original(resume, fresh)
            start = time.perf_counter() - begun
            return journal

        runner.start = timed_start  # type: ignore[method-assign]
        journal = await runner.run(fresh=fresh)
        took = time.perf_counter() - started
    ok = [r for r in journal.results.values() if r.status == "ok"]
    assert len(ok) == sessions and all(r.turns == 3 for r in ok), list(journal.results.values())[:3]
    return took, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs")
    parser.add_argument("--model-ms", type=float, default=0.0)
    parser.add_argument("--tool-ms", type=float, default=0.0)
    parser.add_argument("--named", action="store_true",
                        help="as `--name E`: the runner first reads the log for E's journal "
                             "(default: a fresh random id, as `busctl experiment run SPEC`)")
    args = parser.parse_args()
    scale = argparse.Namespace(turns=2, calls=1, model_ms=args.model_ms, tool_ms=args.tool_ms)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        spec = write_spec(tmp, args.sessions, args.concurrency)
        topology = ScaleTopology(tmp, args.concurrency, scale)
        try:
            endpoint = topology.start()
            anyio.run(with_run_many, endpoint, 20, 10, "warm-up")
            base: list[float] = []
            runner: list[float] = []
            starts: list[float] = []
            for i in range(args.rounds):
                for kind in ("base", "runner", "runner", "base"):
                    tag = f"{kind}-{i}-{len(base) + len(runner)}"
                    if kind == "base":
                        base.append(anyio.run(with_run_many, endpoint, args.sessions,
                                              args.concurrency, tag))
                    else:
                        took, start = anyio.run(with_runner, endpoint, spec, tag,
                                                args.sessions, not args.named)
                        runner.append(took)
                        starts.append(start)
                    print(f"{kind:>7}: {args.sessions} sessions at {args.concurrency}: "
                          f"{(base if kind == 'base' else runner)[-1]:.2f} s"
                          + (f" (start: {starts[-1]:.2f} s)" if kind == "runner" else ""),
                          flush=True)
        finally:
            topology.stop()
    b, r = statistics.median(base), statistics.median(runner)
    cells = statistics.median(t - s for t, s in zip(runner, starts, strict=True))
    print(f"median run_many {b:.2f} s, runner {r:.2f} s: ratio {r / b:.2f}x (target <= 1.2x); "
          f"the runner's sessions alone (without its start, which reads the journal: a scan "
          f"of the whole log, growing with it) {cells:.2f} s: {cells / b:.2f}x")


if __name__ == "__main__":
    main()
