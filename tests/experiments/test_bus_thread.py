"""The Inspect bridge's loop in a thread of its own (agents/experiment/bus_thread.py): results,
errors and cancellation cross between the caller's loop and it; it ends when closed. (Its point,
a session surviving a blocked host loop, is tests/experiments/test_inspect_plugin.py's.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest

from agent_bus.agents.experiment.bus_thread import BusThread


@pytest.fixture
def loop() -> Iterator[BusThread]:
    thread = BusThread("test-bus-thread")
    try:
        yield thread
    finally:
        thread.close()
    assert thread.name not in {t.name for t in threading.enumerate()}


async def where(value: int) -> tuple[str, int]:
    await anyio.sleep(0)
    return threading.current_thread().name, value


async def fails() -> None:
    raise LookupError("from the bus thread")


@pytest.mark.anyio
async def test_a_call_runs_on_the_thread_and_its_result_or_error_is_the_callers(
        loop: BusThread) -> None:
    assert not loop.running  # started by the first call, not before
    assert await loop.call(where, 7) == ("test-bus-thread", 7)
    assert loop.running
    with pytest.raises(LookupError, match="from the bus thread"):
        await loop.call(fails)


@pytest.mark.anyio
async def test_cancelling_the_caller_cancels_the_call_on_the_thread(loop: BusThread) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.call, forever)
        await anyio.to_thread.run_sync(started.wait, 10)
        tg.cancel_scope.cancel()
    assert await anyio.to_thread.run_sync(cancelled.wait, 10)


@pytest.mark.anyio
async def test_close_cancels_what_runs_and_a_later_call_starts_the_thread_again(
        loop: BusThread) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    future = loop._started().start_task_soon(forever)  # as a call left running at exit
    await anyio.to_thread.run_sync(started.wait, 10)
    loop.close()
    assert cancelled.is_set() and future.cancelled() and not loop.running
    loop.close()  # idempotent
    assert await loop.call(where, 1) == ("test-bus-thread", 1)
