"""Issue 44's cost budget: a sandboxed worker of this tree against one of another tree (main).

    python bench/bench_fences.py --other /work/main [--rounds 3] [--calls 2000] [--shells 100]

One hub (this tree's); in each round, a sandboxed worker (`--sandbox auto --shell`, workspace a
fresh folder under /tmp) started from each tree in turn, with that tree's own Python and its own
`bench/bench_tools.py`; against each: the `echo` tool's round trip through BusToolExecutor (p50
of `--calls`) and a `run_shell` call of `true` (p50 of `--shells`). Trees alternate within each
round (A B, then B A) so that drift hits both; the figures are the best p50 of the rounds, with
the ratio this tree / the other (budget 1.1x), and the median of the rounds' (the machine's
load swings). Not run by pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.baseline import pct  # noqa: E402
from bench.common import ToolTopology, tool_round_trip  # noqa: E402


def start_worker(topo: ToolTopology, tree: Path, workspace: Path) -> subprocess.Popen[str]:
    """A sandboxed worker of `tree` (its venv's Python, its own tool module), ready."""
    python = tree / ".venv" / "bin" / "python"
    proc = topo._spawn([str(python), "-P", "-m", "agent_bus.cli", "worker", "--hub",
                        topo.endpoint, "--tools", str(tree / "bench" / "bench_tools.py"),
                        "--tools", "agent_bus.tools.builtin", "--shell", "--sandbox", "auto",
                        "--workspace", str(workspace), "--concurrency", "8"])
    ready = json.loads(topo._ready(proc))
    if ready["sandbox"]["kind"] != "bwrap" or ready["sandbox"].get("shell") != "bwrap":
        raise RuntimeError(f"{tree}: not sandboxed: {ready['sandbox']}")
    return proc


async def shell_time(endpoint: str, n: int) -> float:
    """p50 of a `run_shell` call of `true` (after 5 unmeasured)."""
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest
    from agent_bus.tools.executor import BusToolExecutor

    request = ToolCallRequest(call_id="s", name="run_shell", arguments='{"command": "true"}')
    async with connect(endpoint, name="bench-shell") as peer:
        tools = BusToolExecutor(peer)
        for _ in range(5):
            assert not (await tools.execute(request)).is_error
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            result = await tools.execute(request)
            times.append(time.perf_counter() - t0)
            assert not result.is_error, result.text
    return pct(times, 0.5)


def measure(topo: ToolTopology, tree: Path, calls: int, shells: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="bench-ws-") as ws:
        proc = start_worker(topo, tree, Path(ws))
        try:
            rt = anyio.run(tool_round_trip, topo.endpoint, calls, "echo")["exec_p50"]
            sh = anyio.run(shell_time, topo.endpoint, shells)
        finally:
            topo.stop([proc])
    return rt, sh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="the tree to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--shells", type=int, default=100)
    args = parser.parse_args()
    trees = {"this": ROOT, "other": args.other.resolve()}
    best: dict[str, list[list[float]]] = {name: [[], []] for name in trees}
    with tempfile.TemporaryDirectory() as state:
        topo = ToolTopology(state)
        try:
            for i in range(args.rounds):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                for name in order:
                    rt, sh = measure(topo, trees[name], args.calls, args.shells)
                    best[name][0].append(rt)
                    best[name][1].append(sh)
                    print(f"round {i + 1} {name:5} ({trees[name]}): echo round trip p50 "
                          f"{rt * 1e6:.0f} us, run_shell `true` p50 {sh * 1e3:.2f} ms", flush=True)
        finally:
            topo.stop()
    for how, pick in (("best", min), ("median", statistics.median)):
        (rt_this, sh_this), (rt_other, sh_other) = ([pick(v) for v in best[n]] for n in trees)
        print(f"{how} of {args.rounds} rounds: echo round trip, sandboxed: {rt_this * 1e6:.0f} us"
              f" vs {rt_other * 1e6:.0f} us = {rt_this / rt_other:.3f}x; run_shell `true`: "
              f"{sh_this * 1e3:.2f} ms vs {sh_other * 1e3:.2f} ms = {sh_this / sh_other:.3f}x "
              f"(budget 1.1x)")


if __name__ == "__main__":
    main()
