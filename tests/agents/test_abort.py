"""Abort as cancellation (`agents.loop.abort`): an `Abort` cancels the scopes entered with it, and
the loop gives a model client that watches its `Abort` the grace to return its partial message,
while one that does not watch it is cancelled at once (tests/agents/test_agent.py)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent_bus.agents.loop import abort as abort_module
from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.agent import Agent
from agent_bus.bus.messages import AssistantDelta, AssistantMessage, LlmRequest, TextPart, ThinkingPart
from tests.agents.conftest import FakeTools

pytestmark = pytest.mark.anyio


async def test_setting_an_abort_cancels_its_scopes_entered_before_and_after() -> None:
    abort = Abort()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            entered = anyio.Event()

            async def waits() -> None:
                with abort.cancels() as scope:
                    entered.set()
                    await anyio.sleep_forever()
                assert scope.cancelled_caught

            tg.start_soon(waits)
            await entered.wait()
            assert not abort.is_set() and abort.watched
            abort.set()
        with abort.cancels() as late:  # already set: cancelled at its first checkpoint
            await anyio.sleep_forever()
    assert late.cancelled_caught and abort.is_set()


class WatchingLlm:
    """Streams one delta, then waits under its `Abort`; aborted, it returns its own partial
    message (thinking and text the deltas never carried), as the coordinator's client does.
    `stubborn`: it goes on waiting outside that scope, so only the loop's grace ends the call."""

    def __init__(self, *, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.entered = anyio.Event()

    async def complete(self, request: LlmRequest, on_delta: Any = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        assert abort is not None, "the loop passes every model call an Abort"
        with abort.cancels():
            await on_delta(AssistantDelta(kind="text", delta="streamed"))
            self.entered.set()
            if not self.stubborn:
                await anyio.sleep_forever()
        if self.stubborn:  # waits on outside its abort's scope
            await anyio.sleep_forever()
        return AssistantMessage(content=[ThinkingPart("hmm"), TextPart("mine")], stop_reason="aborted",
                                error="cut", model="the-model")


async def _abort_mid_call(llm: WatchingLlm) -> tuple[AssistantMessage, float]:
    agent = Agent(llm, FakeTools())
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.prompt, "hi")
            await llm.entered.wait()
            started = anyio.current_time()
            agent.abort()
            await agent.wait_for_idle()
    last = agent.state.messages[-1]
    assert isinstance(last, AssistantMessage)
    return last, anyio.current_time() - started


async def test_a_client_watching_its_abort_returns_its_own_partial_at_once() -> None:
    last, took = await _abort_mid_call(WatchingLlm())
    assert last.content == [ThinkingPart("hmm"), TextPart("mine")] and last.model == "the-model"
    assert last.stop_reason == "aborted" and took < abort_module.ABORT_GRACE


async def test_a_client_that_does_not_stop_is_cancelled_after_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort_module, "ABORT_GRACE", 0.2)
    last, took = await _abort_mid_call(WatchingLlm(stubborn=True))
    # the loop's own partial: what the deltas carried
    assert (last.stop_reason, last.text) == ("aborted", "streamed") and 0.2 <= took < 5
