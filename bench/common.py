"""What the benches share: their processes, the scripted model, topologies and tools.

No bench imports another bench; what two of them use lives here (issue 46). The raw pyzmq
baselines and floors are in `bench/baseline.py`, the split-work floor in `bench/split.py`.
Settings a bench's options change for every process it starts (`FAKELLM`, `PROFILE_DIR`,
`GATEWAY_POOL`) are module globals here: a bench sets them as `common.FAKELLM = ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.bus.messages import (  # noqa: E402
    AssistantMessage,
    LlmRequest,
    ToolCallRequest,
    ToolInfo,
    ToolResult,
    error_result,
)
from bench.baseline import free_port, pct, tree_cpu_s  # noqa: E402

# --- processes: one started process, `busctl`'s command line, the scripted model's -----------


class Proc:
    """A started process, its output read for the `{"ready": ...}` line; stopped with its group."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, cwd=ROOT,
                                      start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def ready(self, timeout: float = 20.0) -> dict[str, Any]:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = self.popen.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith('{"ready"'):
                return json.loads(line)
        raise RuntimeError(f"{self.popen.args!r} did not get ready:\n{''.join(seen[-30:])}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, 15)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait(5)


PROFILE_DIR = ""
#: The gateway's httpx pool for a measurement (`--gateway-clients`): (most clients, streams per
#: client before another is added); None = the engine's own defaults.
GATEWAY_POOL: tuple[int, int] | None = None


def count_sends(folder: str) -> None:
    """Make every process started from here on count the messages it sends (bench/sendcount)."""
    os.makedirs(folder, exist_ok=True)
    here = str(ROOT / "bench" / "sendcount")
    path = os.environ.get("PYTHONPATH", "")
    if here not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, path]))
    os.environ["BENCH_SENDCOUNT_DIR"] = folder


def report_sends(folder: str) -> None:
    """Print what each counted process sent, by message kind (after the processes exited)."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        argv = data["argv"]
        role = argv[1] if len(argv) > 1 and argv[0].endswith("cli.py") else Path(argv[0]).name
        sent = {k: v for k, v in data["sent"].items() if k not in ("hello", "bye", "heartbeat",
                                                                    "register", "unregister")}
        rows.append(f"    {role}: " + "  ".join(f"{k} {v}" for k, v in sorted(sent.items())))
    print("  messages sent per process (partial_bodies: the partial replies they carried):")
    print("\n".join(rows) if rows else "    (none counted: the processes did not exit normally)")


def busctl(*args: str, patch: str = "") -> list[str]:
    cli = [str(ROOT / "cli.py")]
    run_cli = "import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    if GATEWAY_POOL is not None and args[0] == "gateway":
        # The pool's size is a class attribute, not a setting: set it in a wrapper for the bench.
        size, per = GATEWAY_POOL
        patch += ("from agent_bus.agents.gateway.engine import _ClientPool\n"
                  f"_ClientPool.SIZE, _ClientPool.PER_CLIENT = {size}, {per}\n")
    if patch:
        cli = ["-c", patch + run_cli, *cli]
    if PROFILE_DIR and args[0] in ("coordinator", "gateway", "hub"):
        out = str(Path(PROFILE_DIR) / f"{args[0]}.prof")
        if cli[0] == "-c":  # cProfile runs a file: write the wrapper into one
            wrapper = Path(PROFILE_DIR) / f"{args[0]}_wrapper.py"
            wrapper.write_text(cli[1])
            cli = [str(wrapper), *cli[2:]]
        return [sys.executable, "-m", "cProfile", "-o", out, *cli, *args]
    return [sys.executable, *cli, *args]



FAKELLM = ""  # a fakellm.py file to serve instead of this tree's (--fakellm)


def fake_argv() -> list[str]:
    """The scripted model's command: this tree's `busctl fake-llm` (asyncio; TCP_NODELAY, which
    asyncio sets, so that Nagle + delayed ACK do not stall each SSE stream ~40 ms), or FAKELLM's
    file, e.g. an older commit's, with the threaded server's listen backlog raised as before."""
    if not FAKELLM:
        return [sys.executable, "-m", "agent_bus.cli", "fake-llm"]
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('fakellm_ab', sys.argv[1]); "
            "m = u.module_from_spec(s); sys.modules['fakellm_ab'] = m; s.loader.exec_module(m); "
            "h = getattr(m, '_Handler', None); h and setattr(h, 'disable_nagle_algorithm', True); "
            "v = getattr(m, '_Server', None); v and setattr(v, 'request_queue_size', 4096); "
            "sys.exit(m.main(sys.argv[2:]))")
    return [sys.executable, "-c", code, FAKELLM]


# --- the pure loop's model and tools in this process (bench_loop, bench_scale) ---------------


class LocalTools:
    """The loop's ToolExecutor running the tools in this process (`run_tool`)."""

    def __init__(self, module: str) -> None:
        from agent_bus.tools import load_tools

        self.tools = {t.name: t for t in load_tools(module)}

    async def catalog(self) -> list[ToolInfo]:
        return [t.info for t in self.tools.values()]

    async def execute(self, request: ToolCallRequest, on_update: Any = None) -> ToolResult:
        from agent_bus.tools import run_tool

        t = self.tools.get(request.name)
        if t is None:
            return error_result(f"Error: Unknown tool '{request.name}'")
        return await run_tool(t, request)


class EngineLlm:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Any = None) -> AssistantMessage:
        return await self.engine.complete(request, on_delta, abort=abort)


# --- bench_scale's topology: N sessions of 3 turns of 20 ms tools (bench_experiment too) -----


SCALE_WORKERS = 4

SCALE_TOOLS_PY = '''
import anyio
from agent_bus.tools import tool

@tool
async def work(text: str) -> str:
    """Sleep TOOL_MS, then return the text."""
    await anyio.sleep({tool_s})
    return text
'''


def scale_script(turns: int, calls: int, model_s: float) -> dict[str, Any]:
    """Rules, not steps: concurrent sessions reach the model in any order, so each reply is
    chosen by what the session's trailing tool results say (turn k's calls return `stepk`)."""

    def calls_for(k: int) -> dict[str, Any]:
        return {"tool_calls": [{"name": "work", "arguments": {"text": f"step{k}"}}
                               for _ in range(calls)], "usage": {"input": 10, "output": 5}}

    rules: list[dict[str, Any]] = [{"tool_result": False, "delay": model_s, "reply": calls_for(1)}]
    for k in range(1, turns):
        rules.append({"tool_result": True, "results_contain": [f"step{k}"], "delay": model_s,
                      "reply": calls_for(k + 1)})
    rules.append({"tool_result": True, "results_contain": [f"step{turns}"], "delay": model_s,
                  "reply": {"text": "All done.", "usage": {"input": 10, "output": 2}}})
    return {"rules": rules}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def topology_toml(base_url: str, n: int) -> str:
    return f"""
[models.x]
provider = "openai"
base_url = "{base_url}"
model = "m"
max_concurrency = {max(8, n)}
timeout = 600

[[agents]]
name = "bench"
model = "x"
tools = ["work"]
max_concurrent_runs = {max(1, n)}
max_queued_runs = {max(1, n)}
"""


class ScaleTopology:
    """hub + fake model + gateway + workers + coordinator, in processes, for one N."""

    def __init__(self, tmp: Path, n: int, args: argparse.Namespace) -> None:
        self.tmp, self.n, self.args = tmp, n, args
        self.procs: dict[str, Proc] = {}
        self.base_url = ""  # the scripted model's, once started

    def start(self) -> str:
        tmp, args = self.tmp, self.args
        tools_py = tmp / "scale_tools.py"
        tools_py.write_text(SCALE_TOOLS_PY.format(tool_s=args.tool_ms / 1000))
        script_file = tmp / "script.json"
        script_file.write_text(json.dumps(scale_script(args.turns, args.calls, args.model_ms / 1000)))
        port = free_port()
        fake = self.procs["fake-llm"] = Proc([*fake_argv(), "--script",
                                              str(script_file), "--port", str(port)])
        fake.ready()
        topo = tmp / "topology.toml"
        self.base_url = f"http://127.0.0.1:{port}/v1"
        topo.write_text(topology_toml(self.base_url, self.n))
        hub = self.procs["hub"] = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0",
                                              "--state-dir", str(tmp / "hub")))
        endpoint = str(hub.ready()["endpoint"])
        self.procs["gateway"] = Proc(busctl("gateway", "--hub", endpoint, "--topology", str(topo)))
        for i in range(SCALE_WORKERS):
            self.procs[f"worker-{i}"] = Proc(busctl(
                "worker", "--hub", endpoint, "--tools", str(tools_py), "--name", f"worker-{i}",
                "--concurrency", str(max(8, self.n * args.calls))))
        self.procs["coordinator"] = Proc(busctl("coordinator", "--hub", endpoint, "--topology",
                                                str(topo), "--state-dir", str(tmp / "agents")))
        for name, proc in self.procs.items():
            if name not in ("fake-llm", "hub"):
                proc.ready()
        return endpoint

    def rss(self) -> dict[str, int]:
        return {name: rss_kb(proc.popen.pid) for name, proc in self.procs.items()}

    def cpu(self) -> dict[str, float]:
        return {name: tree_cpu_s(proc.popen.pid) for name, proc in self.procs.items()}

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()


# --- bench_tools' topology: a hub and workers serving bench_tools.py (bench_fences too) ------


class ToolTopology:
    """A hub and any number of `busctl worker` processes serving bench_tools.py's tools."""

    def __init__(self, state: str) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        hub = self._spawn([sys.executable, "-m", "agent_bus.cli", "hub", "--hub", "tcp://127.0.0.1:0",
                           "--state-dir", state])
        self.endpoint = json.loads(self._ready(hub))["endpoint"]

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=ROOT, start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith('{"ready"'):
            raise RuntimeError(f"{proc.args!r} did not start: {line!r}")
        return line

    def workers(self, n: int, concurrency: int, sandbox: str = "auto") -> list[subprocess.Popen[str]]:
        started = [self._spawn([sys.executable, "-m", "agent_bus.cli", "worker", "--hub",
                                self.endpoint, "--tools", str(ROOT / "bench" / "bench_tools.py"),
                                "--concurrency", str(concurrency), "--sandbox", sandbox])
                   for _ in range(n)]
        for proc in started:
            self._ready(proc)
        return started

    def stop(self, procs: list[subprocess.Popen[str]] | None = None) -> None:
        for proc in reversed(procs if procs is not None else self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(procs if procs is not None else self.procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def calls_per_second(call: Callable[[], Awaitable[object]], in_flight: int,
                           seconds: float) -> float:
    """`call` kept `in_flight` times in flight for `seconds`: completed calls per second."""
    import anyio

    done = 0
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await call()
            done += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(in_flight):
            tg.start_soon(caller)
    return done / (time.perf_counter() - started)


async def tool_round_trip(endpoint: str, n: int, name: str) -> dict[str, float]:
    from agent_bus.bus import protocol as p
    from agent_bus.bus.client import connect
    from agent_bus.bus.messages import ToolCallRequest
    from agent_bus.tools.executor import BusToolExecutor

    request = ToolCallRequest(call_id="c", name=name, arguments=json.dumps({"text": "x" * 40}))
    async with connect(endpoint, name="bench-client") as peer:
        tools = BusToolExecutor(peer)
        for _ in range(200):
            assert not (await tools.execute(request)).is_error
        via_executor, via_request = [], []
        body = p.encode(request)
        for _ in range(n):
            t0 = time.perf_counter()
            await tools.execute(request)
            via_executor.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await peer.request(f"tool.{name}", body)
            via_request.append(time.perf_counter() - t0)
    return {"exec_p50": pct(via_executor, 0.5), "exec_p99": pct(via_executor, 0.99),
            "req_p50": pct(via_request, 0.5), "req_p99": pct(via_request, 0.99),
            "body_bytes": len(body)}


# --- bench_gateway's model reply of 4 streamed tool calls (ab_gateway too) -------------------


# bench_loop.py's model turn: 4 tool calls, their arguments streamed 4 characters at a time
GATEWAY_TOOLS_REPLY = {"tool_calls": [{"name": "echo", "arguments": {"text": f"turn 7 call {k}"},
                                       "id": f"c7_{k}"} for k in range(4)],
                       "usage": {"input": 10, "output": 5}, "chunk_size": 4}
