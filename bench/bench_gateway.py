"""Gateway overhead: an `llm` request through the hub and the gateway process, against calling
the same zero-latency scripted server directly with the engine in this process; and the rate at
which a long stream's deltas are published as `message_update` events; and the gateway process's
CPU per `llm` call (its own user+system time from /proc: load-proof, unlike the wall times), for
a one-chunk reply and for a turn of 4 streamed tool calls (~36 SSE events, as in bench_loop.py).

    python bench/bench_gateway.py [--quick] [--cpu-only]
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
import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig  # noqa: E402
from agent_bus.agents.gateway.fakellm import FakeLLMServer  # noqa: E402
from agent_bus.bus import events as ev  # noqa: E402
from agent_bus.bus.client import connect  # noqa: E402
from agent_bus.bus.messages import AssistantMessage, LlmRequest, ToolSpec, user_text  # noqa: E402
from bench.baseline import cpu_s, pct  # noqa: E402
from bench.common import GATEWAY_TOOLS_REPLY  # noqa: E402

SHORT = {"text": "ok", "chunk_size": 2}
LONG_CHUNKS = 2000


def _start(args: list[str],
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-m", "agent_bus.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith('{"ready"'):
            return proc, json.loads(line)
    raise RuntimeError(f"{args[0]} did not start")


async def direct(base_url: str, n: int) -> list[float]:
    config = ModelConfig(alias="m", provider="openai", model="m", base_url=base_url)
    times = []
    async with LlmEngine([config]) as engine:
        for _ in range(n):
            t0 = time.perf_counter()
            await engine.complete(LlmRequest(messages=[user_text("hi")]))
            times.append(time.perf_counter() - t0)
    return times


async def through_bus(endpoint: str, n: int) -> list[float]:
    body = msgspec.msgpack.encode(LlmRequest(messages=[user_text("hi")], agent="bench", run_id="r"))
    times = []
    async with connect(endpoint, name="bench") as peer:
        for _ in range(n):
            t0 = time.perf_counter()
            await peer.request("llm", body, timeout=30)
            times.append(time.perf_counter() - t0)
    return times


async def gateway_cpu(endpoint: str, pid: int, text: str, n: int) -> float:
    """The gateway's CPU seconds per `llm` call over `n` sequential calls (after 20 warm-up ones)."""
    tools = [ToolSpec(name="echo")] if text == "tools" else []  # the fake fits calls to the offer
    body = msgspec.msgpack.encode(LlmRequest(messages=[user_text(text)], tools=tools, agent="bench",
                                             run_id="c"))
    async with connect(endpoint, name="bench-cpu") as peer:
        for i in range(n + 20):
            if i == 20:
                before = cpu_s(pid)
            reply = msgspec.msgpack.decode(await peer.request("llm", body, timeout=30),
                                           type=AssistantMessage)
        spent = cpu_s(pid) - before
    assert len(reply.content) == (4 if tools else 1), reply
    return spent / n


async def delta_rate(endpoint: str) -> tuple[int, int, float]:
    body = msgspec.msgpack.encode(LlmRequest(messages=[user_text("long")], agent="bench",
                                             run_id="long"))
    async with connect(endpoint, name="bench-long") as peer:
        async with peer.subscribe(["agent/bench/long/"]) as sub:
            t0 = time.perf_counter()
            await peer.request("llm", body, timeout=60)
            count = chars = 0  # events, and the characters they carried (a read's joined)
            with anyio.move_on_after(10):
                async for envelope in sub:
                    if isinstance(envelope.event, ev.MessageUpdate):
                        count += 1
                        chars += len(envelope.event.delta.delta)
                        if chars == LONG_CHUNKS:
                            break
            return count, chars, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--cpu-only", action="store_true", help="only the gateway's CPU per call")
    args = ap.parse_args()
    n = 200 if args.quick else 1000
    long_reply = {"text": "x" * LONG_CHUNKS, "chunk_size": 1}
    script = {"steps": [{"reply": long_reply}], "rules": [{"contains": [], "reply": SHORT}]}
    rules = {"rules": [{"contains": ["tools"], "reply": GATEWAY_TOOLS_REPLY},
                       {"contains": [], "reply": SHORT}]}
    with FakeLLMServer(rules) as srv_short, \
            FakeLLMServer(script) as srv_long, tempfile.TemporaryDirectory() as tmp:
        hub, ready = _start(["hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", tmp])
        endpoint = ready["endpoint"]
        gw, _ = _start(["gateway", "--hub", endpoint], {"OPENAI_BASE_URL": srv_short.base_url,
                                                        "OPENAI_API_KEY": ""})
        try:
            cpu = [anyio.run(gateway_cpu, endpoint, gw.pid, text, n // 2) for text in ("hi", "tools")]
            print(f"gateway CPU per `llm` call: {cpu[0] * 1e3:.3f} ms (one-chunk reply), "
                  f"{cpu[1] * 1e3:.3f} ms (4 streamed tool calls, ~36 SSE events)")
            if args.cpu_only:
                return
            d = anyio.run(direct, srv_short.base_url, n)
            b = anyio.run(through_bus, endpoint, n)
            print(f"direct engine call (HTTP, in process): p50 {pct(d, .5) * 1e6:.0f} us, "
                  f"p99 {pct(d, .99) * 1e6:.0f} us")
            print(f"`llm` request via hub + gateway:      p50 {pct(b, .5) * 1e6:.0f} us, "
                  f"p99 {pct(b, .99) * 1e6:.0f} us; gateway+bus overhead p50 "
                  f"{(pct(b, .5) - pct(d, .5)) * 1e6:.0f} us")
        finally:
            gw.terminate()
            gw.wait()
            if args.cpu_only:
                hub.terminate()
                hub.wait()
        gw, _ = _start(["gateway", "--hub", endpoint], {"OPENAI_BASE_URL": srv_long.base_url,
                                                        "OPENAI_API_KEY": ""})
        try:
            count, chars, seconds = anyio.run(delta_rate, endpoint)
            print(f"{LONG_CHUNKS} one-character SSE deltas streamed: {chars} characters in {count} "
                  f"message_update events (a read's deltas joined) in {seconds * 1000:.0f} ms = "
                  f"{chars / seconds:,.0f} deltas/s (request to last event seen)")
        finally:
            for proc in (gw, hub):
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
