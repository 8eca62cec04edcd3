"""The cost of Ray's placement (issue 47, acceptance 5): one topology started by `busctl up`
(locally, CURVE on TCP) and by `busctl up --engine ray` (a real three-node Ray cluster on this
machine: a head with no CPU, two nodes), both up at once, measured in alternated slices.

    python bench/bench_ray.py [--smoke] [--rounds 5]

Figures: the time from `up` to ready (each, once); a tool call's round trip (p50 of N lone
`tool.echo` requests through hub -> worker) and tool calls/s (64 in flight, 2 workers), each
topology in turn within every round; ratios Ray / local as medians over the rounds (budget:
0.9x-1.1x). Ray only places the processes: the messages take the same ZeroMQ + CURVE path, so
the ratios should be 1.0 within noise. Not run by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import calls_per_second, pct  # noqa: E402
from bench.headline import Headlines  # noqa: E402

TOOLS = str(ROOT / "bench" / "bench_tools.py")  # its `echo` tool


def topology(tmp: Path, name: str, curve: Path | None) -> Path:
    keys = ""
    if curve is not None:
        keys = (f'curve_secret = "{curve}/hub.key_secret"\ncurve_authorized = "{curve}/authorized"\n'
                f'curve_server_key = "{curve}/hub.key"\ncurve_client_key = "{curve}/owner.key_secret"\n')
    engine = "" if curve is not None else f'[engine]\nkind = "ray"\nname = "{name}"\n'
    (tmp / name).mkdir()
    path = tmp / f"{name}.toml"
    path.write_text(f"""coordinators = 0
agents = []
{engine}
[hub]
endpoint = "tcp://127.0.0.1:0"
state_dir = "{tmp / (name + '-state')}"
{keys}
[gateways]
count = 0

[[workers]]
name = "bench"
tools = ["{TOOLS}"]
count = 2
concurrency = 64
workspace = "{tmp / name}"
sandbox = "off"

[placement.workers]
strategy = "spread"
""")
    return path


def busctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent_bus.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def up(args: list[str], env: dict[str, str]) -> tuple[str, float]:
    started = time.monotonic()
    out = busctl("up", *args, "--json", env=env)
    took = time.monotonic() - started
    if out.returncode != 0:
        raise SystemExit(f"busctl up {' '.join(args)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])["endpoint"], took


async def round_trip(endpoint: str, curve: object, n: int) -> float:
    from agent_bus.bus import protocol as p
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest

    body = p.encode(ToolCallRequest(call_id="c", name="echo", arguments='{"text": "hello"}'))
    async with connect(endpoint, name="bench-rt", curve=curve) as peer:  # type: ignore[arg-type]
        for _ in range(50):
            await peer.request("tool.echo", body)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await peer.request("tool.echo", body)
            times.append(time.perf_counter() - t0)
    return pct(times, 0.5)


async def throughput(endpoint: str, curve: object, seconds: float, in_flight: int = 64) -> float:
    from agent_bus.bus import protocol as p
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest

    body = p.encode(ToolCallRequest(call_id="c", name="echo", arguments='{"text": "hello"}'))
    async with connect(endpoint, name="bench-rps", curve=curve) as peer:  # type: ignore[arg-type]
        return await calls_per_second(lambda: peer.request("tool.echo", body), in_flight, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the least that prints every line")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds, n, seconds = (1, 100, 0.5) if args.smoke else (args.rounds, 2000, 3.0)

    import ray
    from ray.cluster_utils import Cluster

    from agent_bus.agents.launch import ray_engine
    from agent_bus.bus.security import CurveClient

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        home = tmp / "home"
        home.mkdir()
        env = {"HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}
        os.environ.update(env)  # the cluster's processes: no ~/.ray/auth_token of another session
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        local_file = ray_file = None
        try:
            cluster.add_node(num_cpus=1)
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            busctl("keys", "generate", str(tmp / "keys"), "--client", "owner", env=env)
            local_file = topology(tmp, "local", tmp / "keys")
            ray_file = topology(tmp, "onray", None)
            local_endpoint, local_up = up(["-c", str(local_file), "-d"], env)
            ray_endpoint, ray_up = up(["-c", str(ray_file), "--address", cluster.address], env)
            print(f"up to ready: local {local_up:.1f}s, --engine ray {ray_up:.1f}s "
                  f"({ray_up / local_up:.2f}x)", flush=True)
            local_curve = CurveClient(server_public_key_file=str(tmp / "keys" / "hub.key"),
                                      secret_key_file=str(tmp / "keys" / "owner.key_secret"))
            os.environ["RAY_ADDRESS"] = cluster.address
            _, ray_curve = ray_engine.client("onray", cluster.address)
            ray.shutdown()
            systems = {"local": (local_endpoint, local_curve), "ray": (ray_endpoint, ray_curve)}
            rt: dict[str, list[float]] = {"local": [], "ray": []}
            rps: dict[str, list[float]] = {"local": [], "ray": []}
            for r in range(rounds):
                order = ["local", "ray"] if r % 2 == 0 else ["ray", "local"]
                for name in order:
                    rt[name].append(anyio.run(round_trip, *systems[name], n))
                for name in order:
                    rps[name].append(anyio.run(throughput, *systems[name], seconds))
                print(f"round {r + 1}: round trip local {rt['local'][-1] * 1e6:.0f} us, ray "
                      f"{rt['ray'][-1] * 1e6:.0f} us; calls/s local {rps['local'][-1]:.0f}, ray "
                      f"{rps['ray'][-1]:.0f}", flush=True)
            rt_per = [b / a for a, b in zip(rt["local"], rt["ray"], strict=True)]
            rps_per = [b / a for a, b in zip(rps["local"], rps["ray"], strict=True)]
            print(f"Ray-placed / local, medians of {rounds} rounds: round trip "
                  f"{statistics.median(rt_per):.2f}x, calls/s {statistics.median(rps_per):.2f}x "
                  "(budget 0.9x-1.1x)", flush=True)
            hl = Headlines()  # issue 51 item 5
            hl.add("ray_roundtrip_p50", rt_per, "<=", 1.1, "rounds")
            hl.add("ray_calls_per_s", rps_per, ">=", 0.9, "rounds")
            hl.print()
        finally:
            if local_file is not None:
                busctl("down", "-c", str(local_file), env=env)
            if ray_file is not None:
                busctl("down", "-c", str(ray_file), "--address", cluster.address, env=env)
            cluster.shutdown()


if __name__ == "__main__":
    main()
