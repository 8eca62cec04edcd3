"""Same-run A/B of two source trees' gateway CPU per `llm` call: each tree's hub + gateway run
side by side against one scripted model; batches of calls alternate between them (the order
reversed every round), and each batch's CPU is read from /proc/PID/task/*/schedstat (ns, every
thread, libzmq's too). The requester streams like the coordinator (it reads every partial).

    python bench/ab_gateway.py OLD_TREE NEW_TREE [--rounds 12] [--batch 50] [--kind tools]

`--kind`: `hi` (a one-chunk reply), `tools` (4 streamed tool calls, ~36 SSE events, as in
bench_loop.py) or `history` (the same after a history of 25 such turns). Prints each tree's
median CPU per call (gateway, hub) and the median of the rounds' NEW/OLD ratios. Not run by
pytest; every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.bus.client import connect  # noqa: E402
from agent_bus.bus.messages import (  # noqa: E402
    AssistantMessage,
    LlmMessage,
    LlmRequest,
    TextPart,
    ToolCall,
    ToolResultMessage,
    ToolSpec,
    user_text,
)
from bench.baseline import free_port  # noqa: E402
from bench.common import GATEWAY_TOOLS_REPLY  # noqa: E402

RULES = {"rules": [{"contains": ["tools"], "reply": GATEWAY_TOOLS_REPLY},
                   {"contains": [], "reply": {"text": "ok", "chunk_size": 2}}]}


def cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def start(tree: str, args: list[str], procs: list[subprocess.Popen[str]],
          env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-m", "agent_bus.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tree,
                            env={**os.environ, **(env or {})})
    procs.append(proc)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith('{"ready"'):
            return {**json.loads(line), "pid": proc.pid}
    raise RuntimeError(f"{args[0]} of {tree} did not start")


def history(turns: int) -> list[LlmMessage]:
    messages: list[LlmMessage] = [user_text("go")]
    for t in range(turns):
        calls = [ToolCall(id=f"c{t}_{k}", name="echo", arguments=json.dumps({"text": f"turn {t} {k}"}))
                 for k in range(4)]
        messages.append(AssistantMessage(content=list(calls), stop_reason="tool_use"))
        messages += [ToolResultMessage(tool_call_id=c.id, tool_name="echo",
                                       content=[TextPart(f"turn {t} {c.id}")]) for c in calls]
    return [*messages, user_text("tools")]


async def batch(endpoint: str, body: bytes, n: int) -> None:
    async with connect(endpoint, name="ab-gateway") as peer:
        for _ in range(n):
            async with peer.stream("llm", body, timeout=30) as replies:
                async for _item in replies:
                    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--kind", choices=["hi", "tools", "history"], default="tools")
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in (args.old, args.new)]
    for tree in trees:
        if not (Path(tree) / "agent_bus" / "cli.py").exists():
            ap.error(f"{tree}: not an agent-bus source tree (no agent_bus/cli.py)")
    messages = history(25) if args.kind == "history" else [user_text(args.kind)]
    tools = [] if args.kind == "hi" else [ToolSpec(name="echo")]
    body = msgspec.msgpack.encode(LlmRequest(messages=messages, tools=tools, agent="ab", run_id="r"))
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="ab-gateway-") as tmp:
        try:
            script = Path(tmp) / "script.json"
            script.write_text(json.dumps(RULES))
            port = free_port()
            fake = subprocess.Popen([sys.executable, "-m", "agent_bus.cli", "fake-llm", "--script",
                                     str(script), "--port", str(port)], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, cwd=trees[1])
            procs.append(fake)
            assert fake.stdout is not None
            fake.stdout.readline()  # listening
            tops = []
            for i, tree in enumerate(trees):
                state = Path(tmp) / f"hub{i}"
                hub = start(tree, ["hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(state)],
                            procs)
                gateway = start(tree, ["gateway", "--hub", hub["endpoint"]], procs,
                                {"OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": ""})
                tops.append((hub["endpoint"], gateway["pid"], hub["pid"]))
                anyio.run(batch, hub["endpoint"], body, 20)  # warm-up
            gw: list[list[float]] = [[], []]
            hb: list[list[float]] = [[], []]
            for r in range(args.rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    endpoint, gpid, hpid = tops[i]
                    g0, h0 = cpu_ns(gpid), cpu_ns(hpid)
                    anyio.run(batch, endpoint, body, args.batch)
                    gw[i].append((cpu_ns(gpid) - g0) / args.batch / 1e6)
                    hb[i].append((cpu_ns(hpid) - h0) / args.batch / 1e6)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
    for i, tree in enumerate(trees):
        print(f"{tree}: gateway {statistics.median(gw[i]):.3f} ms/call, "
              f"hub {statistics.median(hb[i]):.3f} ms/call (median of {args.rounds} batches)")
    ratios = sorted(n / o for o, n in zip(gw[0], gw[1], strict=True))
    hub_ratio = statistics.median(n / o for o, n in zip(hb[0], hb[1], strict=True))
    print(f"new/old ({args.kind}): gateway {statistics.median(ratios):.2f}x "
          f"[{', '.join(f'{x:.2f}' for x in ratios)}], hub {hub_ratio:.2f}x")


if __name__ == "__main__":
    main()
