"""Each bench in bench/ runs at its smallest size, so none rots between the runs that measure.

Every bench script is started as the README says (`python bench/NAME.py ...`, from the
repository root), a real subprocess, with the options of the README's "smoke options" column;
the test asserts it exits 0 and prints its ratio lines. Their values are not checked: on a
shared 2-core machine at this size they mean nothing (bench/README.md holds the figures).

The benches of issue 51's table end with headline lines (bench/headline.py): after a line
`== headline ==`, one ratio a line, `NAME: VALUE (target OP GOAL: met|NOT met) [UNIT LOW-HIGH,
n=N]`; the test checks that each named headline is there in that format, with a verdict, and
that nothing else follows the mark.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RATIO = r"\d+\.\d+x"
sys.path.insert(0, str(ROOT))

from bench.headline import HEADLINE_RE, MARK  # noqa: E402

# the headline names each bench prints at the smoke options below (issue 51's table)
HEADLINES: dict[str, list[str]] = {
    "bus": ["requests_per_s_ipc_rounds", "events_per_s_paced_ipc", "events_per_s_unpaced_ipc",
            "requests_per_s_ipc_interleaved", "roundtrip_p50_ipc"],
    "bus-curve": ["requests_per_s_tcp_rounds", "events_per_s_paced_tcp",
                  "events_per_s_unpaced_tcp", "requests_per_s_tcp_interleaved",
                  "curve_requests_per_s", "roundtrip_p50_tcp", "curve_roundtrip_p50"],
    "loop": ["c_over_w_ipc"],
    "scale": ["lost_runs"],
    "pace": ["pace_cells_per_s", "pace_delta_p50"],
    "ray": ["ray_roundtrip_p50", "ray_calls_per_s"],
}


def _bwrap_missing() -> str:
    return "" if shutil.which("bwrap") else "needs bubblewrap for a sandboxed worker (.ci/run installs it)"


def _no_venv() -> str:
    # bench_fences starts each tree's worker with that tree's .venv/bin/python
    return "" if (ROOT / ".venv" / "bin" / "python").exists() else "needs the tree's .venv (bench_fences)"


def _no_ray() -> str:
    import importlib.util

    return "" if importlib.util.find_spec("ray") else "needs Ray (the `ray` extra; the test extra has it)"


# (id, argv after `python`, the lines the bench must print (regexes), why it is skipped or "")
BENCHES: list[tuple[str, list[str], list[str], str]] = [
    ("bus", ["bench/bench_bus.py", "--smoke", "--rounds", "1", "--transports", "ipc", "--no-replay"],
     [rf"requests/s, 4 serving peers / raw broker .*: ipc {RATIO}",
      rf"events/s logged \+ published / raw PUB->SUB .*: ipc {RATIO}",
      rf"4 serving peers / raw broker with 4 raw workers {RATIO}", rf"hub / raw blocking broker {RATIO}"],
     ""),
    ("bus-curve", ["bench/bench_bus.py", "--smoke", "--rounds", "1", "--transports", "tcp", "--no-replay"],
     [rf"CURVE: p50 hub with CURVE on tcp .* / the same hub plain tcp {RATIO}",
      rf"CURVE: hub with CURVE on tcp .* / the same hub plain tcp {RATIO}"], ""),
    ("bus-replay", ["bench/bench_bus.py", "--replay-only", "--smoke"],
     [rf"request p99 beside a full replay .*\({RATIO}; target"], ""),
    ("flood", ["bench/bench_flood.py", "--smoke"],
     [rf"round trip beside the flood / idle p50 .*: p50 {RATIO}, p99 {RATIO}, p99.9 {RATIO}, "
      rf"max {RATIO}", r"event log after the floods: WAL \d+\.\d MiB"], ""),
    ("loop", ["bench/bench_loop.py", "--turns", "2", "--repeat", "1", "--transports", "ipc"],
     [rf"C/B \(ipc\).*: {RATIO}", rf"\(B \+ F\) / B: {RATIO}", rf"W / B: {RATIO}"], ""),
    ("scale", ["bench/bench_scale.py", "--sessions", "1", "--rounds", "1", "--second-wave-max", "0",
               "--turns", "1", "--calls", "1", "--model-ms", "1", "--tool-ms", "1"],
     [rf"topology / pure loop .*: {RATIO}", rf"the floor of that ratio.*: {RATIO}"], ""),
    ("tools", ["bench/bench_tools.py", "--smoke"],
     [rf"sandboxed worker vs not .* = {RATIO}", rf"round trip via BusToolExecutor: .*\({RATIO} raw\)",
      rf"speedup {RATIO}"], ""),
    ("fences", ["bench/bench_fences.py", "--other", ".", "--rounds", "1", "--calls", "20", "--shells", "2"],
     [rf"best of 1 rounds: echo round trip, sandboxed: .* = {RATIO}"], _bwrap_missing() or _no_venv()),
    ("gateway", ["bench/bench_gateway.py", "--quick"],
     [r"gateway CPU per `llm` call: ", r"gateway\+bus overhead p50 -?\d+ us", r"message_update events"], ""),
    ("ab_gateway", ["bench/ab_gateway.py", ".", ".", "--rounds", "1", "--batch", "5"],
     [rf"new/old \(tools\): gateway {RATIO}"], ""),
    ("ab_bus", ["bench/ab_bus.py", ".", ".", "--groups", "1", "--rtt", "10", "--slice", "0.2"],
     [rf"round trip p50: .* new/old per group median {RATIO}", rf"requests/s: .* new/old per group median {RATIO}"],
     ""),
    ("ab_hub", ["bench/ab_hub.py", ".", ".", "--groups", "1", "--events", "200", "--rtt", "10"],
     [rf"events_per_s: .* NEW/OLD median of groups {RATIO}",
      rf"hub_cpu_us_per_event: .* NEW/OLD median of groups {RATIO}",
      rf"lone_p50_ms: .* NEW/OLD median of groups {RATIO}"], ""),
    ("http1", ["bench/bench_http1.py", "--calls", "20", "--rounds", "1"], [rf"httpx/http1 {RATIO}"], ""),
    ("fakellm", ["bench/bench_fakellm.py", "--calls", "50", "--concurrency", "10", "--rounds", "1",
                 "--model-ms", "1", "--against", "agents/gateway/fakellm.py"],
     [rf"this tree / agents/gateway/fakellm.py: {RATIO}"], ""),
    ("replay", ["bench/bench_replay.py", "--rounds", "1", "--events", "10", "--event-kib", "16",
                "--seconds", "0.5"], [rf"replay: ratio median {RATIO}"], ""),
    ("pace", ["bench/bench_pace.py", "--smoke"],
     [rf"cells/s, bus / direct: {RATIO}", r"streamed delta latency from the server's clock, p50"], ""),
    ("experiment", ["bench/bench_experiment.py", "--sessions", "10", "--concurrency", "5", "--rounds", "1"],
     [rf"ratio {RATIO} \(target <= 1.2x\)"], ""),
    ("ray", ["bench/bench_ray.py", "--smoke"],
     [rf"up to ready: local .*--engine ray .*\({RATIO}\)",
      rf"Ray-placed / local, .*: round trip {RATIO}, calls/s {RATIO}"], _no_ray()),
]


@pytest.mark.parametrize(("name", "argv", "expected", "skip"), [pytest.param(*b, id=b[0]) for b in BENCHES])
def test_bench_runs_at_its_smallest_size(name: str, argv: list[str], expected: list[str], skip: str) -> None:
    if skip:
        pytest.skip(skip)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=110)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode} after {took:.1f} s:\n{out[-4000:]}"
    missing = [line for line in expected if not re.search(line, proc.stdout)]
    assert not missing, f"{' '.join(argv)} printed no line matching {missing}:\n{proc.stdout[-4000:]}"
    if name in HEADLINES:
        check_headlines(proc.stdout, HEADLINES[name])


def check_headlines(stdout: str, names: list[str]) -> None:
    """After the mark, only headline lines, in the format a script reads; each of `names`."""
    lines = stdout.splitlines()
    assert MARK in lines, f"no {MARK!r} line:\n{stdout[-4000:]}"
    after = [line for line in lines[lines.index(MARK) + 1:] if line]
    bad = [line for line in after if not HEADLINE_RE.match(line)]
    assert not bad, f"lines after {MARK!r} not in the headline format: {bad}"
    found = {HEADLINE_RE.match(line)["name"] for line in after}  # type: ignore[index]
    assert set(names) <= found, f"missing headlines {sorted(set(names) - found)} in {after}"
    for line in after:
        m = HEADLINE_RE.match(line)
        assert m is not None and m["verdict"] in ("met", "NOT met")
        value, goal = float(m["value"]), float(m["goal"])
        assert (m["verdict"] == "met") == (value <= goal if m["op"] == "<=" else value >= goal), line


def test_headline_format_is_what_a_script_reads() -> None:
    from bench.headline import Headlines

    hl = Headlines()
    hl.add("roundtrip_p50_tcp", [1.07, 1.22, 1.46], "<=", 1.15)
    hl.add("curve_requests_per_s", [0.95, 0.91], ">=", 0.9, "rounds")
    hl.add_count("lost_runs", [0, 0], 0, "sizes")
    assert hl.lines == ["roundtrip_p50_tcp: 1.22x (target <= 1.15x: NOT met) [groups 1.07-1.46, n=3]",
                        "curve_requests_per_s: 0.93x (target >= 0.9x: met) [rounds 0.91-0.95, n=2]",
                        "lost_runs: 0 (target <= 0: met) [sizes 0-0, n=2]"]
    check_headlines("\n".join(["detail", MARK, *hl.lines]), ["roundtrip_p50_tcp", "lost_runs"])


def test_every_bench_has_a_smoke_run() -> None:
    """A new bench script gets a row above (and in bench/README.md's table)."""
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")} - {"__init__.py", "common.py",
                                                                  "baseline.py", "split.py",
                                                                  "headline.py"}
    covered = {argv[0].removeprefix("bench/") for _, argv, _, _ in BENCHES}
    assert scripts == covered
    readme = (ROOT / "bench" / "README.md").read_text()
    assert all(f"`{name} " in readme or f"`{name}`" in readme for name in scripts)
