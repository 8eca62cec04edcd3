"""The scripted model's own CPU per streamed call (`busctl fake-llm`), A/B in one run.

    python bench/bench_fakellm.py [--against OLD_FAKELLM.py] [--calls 2000] [--concurrency 200]
                                  [--rounds 3]

At 1,000 sessions the scripted model takes 16-20% of all CPU of `bench_scale.py` (issue 32): what
it spends is CPU the bus does not get. This drives it as the scale bench's gateway does (many
keep-alive connections, streamed OpenAI replies chosen by rules on the trailing tool results, a
conversation at its third turn) and reads the fake process's own user + system CPU from /proc:
load-proof. With `--against FILE` (e.g. `git show OLD:agents/gateway/fakellm.py > old.py`) that
file is served too, alternated round by round, and the ratio of the medians is printed.
Not run by pytest; every process is stopped at the end, even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.baseline import cpu_s  # noqa: E402
from bench.common import scale_script  # noqa: E402


def conversation(turn: int, calls: int) -> list[dict[str, Any]]:
    """What a session sends at its `turn`th model call: the prompt, then per turn an assistant
    message with `calls` tool calls and their results (`stepK`, as bench_scale's tool returns)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for k in range(1, turn):
        ids = [f"call_{k}_{i}" for i in range(calls)]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": "work", "arguments": json.dumps({"text": f"step{k}"})}}
            for cid in ids]})
        messages += [{"role": "tool", "tool_call_id": cid, "content": f"step{k}"} for cid in ids]
    return messages


def serve(source: str | None, script_file: Path) -> tuple[subprocess.Popen[str], str]:
    """This tree's fake (`cli.py fake-llm`), or the fake in file `source` run as a script."""
    argv = ["-m", "agent_bus.cli", "fake-llm"] if source is None else [source]
    proc = subprocess.Popen([sys.executable, *argv, "--script", str(script_file)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["base_url"]


async def drive(base_url: str, pid: int, calls: int, concurrency: int, turns: int) -> float:
    """CPU seconds of the fake per call, over `calls` streamed calls `concurrency` at a time."""
    body = {"model": "m", "stream": True,
            "tools": [{"type": "function", "function": {"name": "work", "parameters": {}}}]}
    bodies = [json.dumps({**body, "messages": conversation(t, 4)}) for t in range(1, turns + 2)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        limit = anyio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with limit, client.stream(
                    "POST", "/chat/completions", content=bodies[i % len(bodies)],
                    headers={"content-type": "application/json"}) as response:
                assert response.status_code == 200, response.status_code
                async for _ in response.aiter_bytes():
                    pass

        async with anyio.create_task_group() as tg:  # warm-up: open the connections
            for i in range(concurrency):
                tg.start_soon(one, i)
        before = cpu_s(pid)
        async with anyio.create_task_group() as tg:
            for i in range(calls):
                tg.start_soon(one, i)
        return (cpu_s(pid) - before) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--against", default="", metavar="FILE",
                    help="another fakellm.py to serve alternately (e.g. the previous commit's)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-ms", type=float, default=100.0)
    args = ap.parse_args()
    if args.against and not os.path.isfile(args.against):
        ap.error(f"--against: no such file {args.against!r}; give a fakellm.py to compare with")
    sources: dict[str, str | None] = {"this tree": None}
    if args.against:
        sources[args.against] = args.against
    results: dict[str, list[float]] = {name: [] for name in sources}
    with tempfile.TemporaryDirectory(prefix="bench-fakellm-") as tmp:
        script_file = Path(tmp) / "script.json"
        script_file.write_text(json.dumps(scale_script(3, 4, args.model_ms / 1000)))
        for i in range(args.rounds):
            for name in (list(sources) if i % 2 == 0 else list(sources)[::-1]):
                proc, base_url = serve(sources[name], script_file)
                try:
                    results[name].append(anyio.run(drive, base_url, proc.pid, args.calls,
                                                   args.concurrency, 3))
                finally:
                    proc.terminate()
                    proc.wait(10)
    us = 1e6
    medians = {name: sorted(v)[len(v) // 2] for name, v in results.items()}
    for name, values in results.items():
        print(f"{name}: {medians[name] * us:.0f} us CPU per streamed call (rounds: "
              f"{', '.join(f'{v * us:.0f}' for v in values)}; {args.calls} calls, "
              f"{args.concurrency} at a time, model {args.model_ms:g} ms)")
    if args.against:
        print(f"this tree / {args.against}: {medians['this tree'] / medians[args.against]:.2f}x")
    print(f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)")


if __name__ == "__main__":
    main()
