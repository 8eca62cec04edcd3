"""Is `agents/gateway/http1.py` worth having beside httpx? The engine's CPU per streamed model call
over the gateway's lean transport against httpx's own (httpcore + h11), in this one process and one
run, alternated in rounds so both see the same machine (issue 34).

The scripted server runs in its own process (`busctl fake-llm`), keep-alive (chunked) and
close-delimited (`--close-delimited`); its CPU is not counted. Replies: 4 streamed tool calls
(~36 SSE events, bench_loop's model turn) and a long text (400 one-character events). Calls one at
a time and 6 at a time (one client either way: the engine's client pool adds a client per 6
streams, and a client handed in is used alone).

    python bench/bench_http1.py [--calls 300] [--rounds 3]
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
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig  # noqa: E402
from agent_bus.bus.messages import LlmRequest, ToolSpec, user_text  # noqa: E402

TOOLS = {"tool_calls": [{"name": "echo", "arguments": {"text": f"turn 7 call {k}"}, "id": f"c7_{k}"}
                        for k in range(4)], "usage": {"input": 10, "output": 5}, "chunk_size": 4}
LONG = {"text": "x" * 400, "chunk_size": 1, "usage": {"input": 10, "output": 400}}
SCRIPT = {"rules": [{"contains": ["tools"], "reply": TOOLS}, {"contains": [], "reply": LONG}]}


def serve(script: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "agent_bus.cli", "fake-llm", "--script", str(script),
                             *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["base_url"]


async def cpu_per_call(base_url: str, lean: bool, text: str, calls: int, concurrency: int) -> float:
    config = ModelConfig(alias="m", provider="openai", model="m", base_url=base_url,
                         max_concurrency=concurrency)
    client = None if lean else httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
    tools = [ToolSpec(name="echo")] if text == "tools" else []
    request = LlmRequest(messages=[user_text(text)], tools=tools)
    limit = anyio.Semaphore(concurrency)
    async with LlmEngine([config], client=client) as engine:
        async def one() -> None:
            async with limit:
                message = await engine.complete(request)
            assert message.stop_reason in ("stop", "tool_use", "tool_calls"), message

        for _ in range(20):  # warm-up: imports, the first connection
            await one()
        start = time.process_time()
        async with anyio.create_task_group() as tg:
            for _ in range(calls):
                tg.start_soon(one)
        spent = time.process_time() - start
        retries = engine.stats().models["m"].retries
    if client is not None:
        await client.aclose()
    assert retries == 0, f"{retries} retries"
    return spent / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.json"
        script.write_text(json.dumps(SCRIPT))
        servers = [serve(script), serve(script, "--close-delimited")]
        try:
            for (_, url), framing in zip(servers, ("keep-alive", "close-delimited"), strict=True):
                for text in ("tools", "long"):
                    for concurrency in (1, 6):
                        lean, plain = [], []
                        for _ in range(args.rounds):
                            lean.append(anyio.run(cpu_per_call, url, True, text, args.calls, concurrency))
                            plain.append(anyio.run(cpu_per_call, url, False, text, args.calls,
                                                   concurrency))
                        a, b = statistics.median(lean), statistics.median(plain)
                        print(f"{framing:15} {text:5} x{concurrency}: http1.py {a * 1e3:.3f} ms, "
                              f"httpx {b * 1e3:.3f} ms per call: httpx/http1 {b / a:.2f}x", flush=True)
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
