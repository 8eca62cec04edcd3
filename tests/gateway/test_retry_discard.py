"""A stream cut half-way is retried: the `llm_retry` event says its text is discarded, and the
human renderer of `busctl run`/`watch` drops that text instead of printing both attempts."""

from __future__ import annotations

import io
from collections.abc import Iterator

import anyio
import msgspec
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope, connect
from agent_bus.bus.messages import AssistantMessage, LlmRequest, RetryPolicy, user_text
from agent_bus.bus.render import HumanPrinter
from tests.support import Proc, busctl

pytestmark = pytest.mark.anyio

CUT = "FIRST ATTEMPT TEXT"


class Terminal(io.StringIO):
    """What the printer writes, as a terminal would receive it (the printer erases only on one)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def cut_once() -> Iterator[FakeLLMServer]:
    script = {"steps": [{"fail": {"kind": "drop", "after_events": 6, "partial_text": CUT}},
                        {"fail": {"kind": "status", "status": 503}},
                        {"reply": {"text": "the real answer"}}]}
    with FakeLLMServer(script) as srv:
        yield srv


@pytest.fixture
def gateway(hub: dict, cut_once: FakeLLMServer) -> Iterator[Proc]:
    proc = Proc(busctl("gateway", "--hub", hub["endpoint"], "--name", "gw-cut"),
                env={"OPENAI_BASE_URL": cut_once.base_url})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


async def run_events(hub: dict) -> tuple[AssistantMessage, list[Envelope]]:
    async with connect(hub["endpoint"], name="discard-test") as peer:
        seq = (await peer.status()).seq
        request = LlmRequest(messages=[user_text("go")], agent="a", run_id="r1",
                             retry=RetryPolicy(base_delay=0.01, max_delay=0.02))
        body = await peer.request("llm", msgspec.msgpack.encode(request), timeout=20)
        reply = msgspec.msgpack.decode(body, type=AssistantMessage)
        seen: list[Envelope] = []
        async with peer.subscribe(since=seq) as sub:
            with anyio.fail_after(10):
                async for envelope in sub:
                    seen.append(envelope)
                    text = "".join(e.event.delta.delta for e in seen if isinstance(e.event, ev.MessageUpdate))
                    if text.endswith("the real answer"):
                        break
    return reply, seen


async def test_a_cut_stream_is_retried_and_watchers_drop_its_text(hub: dict, gateway: Proc) -> None:
    reply, seen = await run_events(hub)
    assert reply.text == "the real answer"
    retries = [e.event for e in seen if isinstance(e.event, ev.LlmRetry)]
    # the cut attempt streamed text (discarded); the 503 streamed nothing (nothing to discard)
    assert [(r.attempt, r.discarded) for r in retries] == [(1, True), (2, False)]

    screen = Terminal()
    printer = HumanPrinter(screen, color=False)
    for envelope in seen:
        printer.print(envelope.header, envelope.event)
    shown = _render_terminal(screen.getvalue())
    assert CUT[:6] not in shown and "the real answer" in shown
    assert "its streamed text is discarded" in shown

    piped = io.StringIO()  # not a terminal: nothing can be erased, so the retry line says so
    printer = HumanPrinter(piped, color=False)
    for envelope in seen:
        printer.print(envelope.header, envelope.event)
    lines = piped.getvalue().splitlines()
    cut_line = next(i for i, line in enumerate(lines) if CUT[:6] in line)
    assert "its streamed text is discarded" in lines[cut_line + 1]


def _render_terminal(raw: str) -> str:
    """Apply the escapes the printer uses (CR, erase line, cursor up) to a list of screen rows."""
    rows, col = [""], 0
    i = 0
    while i < len(raw):
        if raw.startswith("\033[K", i):
            rows[-1] = rows[-1][:col]
            i += 3
        elif raw.startswith("\033[1A", i):
            rows.pop() if len(rows) > 1 else None
            col = len(rows[-1])
            i += 4
        elif raw[i] == "\r":
            col, i = 0, i + 1
        elif raw[i] == "\n":
            rows.append("")
            col, i = 0, i + 1
        else:
            rows[-1] = rows[-1][:col] + raw[i] + rows[-1][col + 1:]
            col, i = col + 1, i + 1
    return "\n".join(rows)
