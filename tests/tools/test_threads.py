"""Sync tools' threads (tools/_threads.py): the short wait for a quick tool on the loop's thread,
and the hand-back through the loop for a tool that is not quick."""

import threading

import anyio
import pytest

from agent_bus.bus.messages import ToolCallRequest, ToolResult
from agent_bus.tools import Tool, run_tool, tool
from tests.support import until

pytestmark = pytest.mark.anyio


async def call(t: Tool, arguments: str = "{}") -> ToolResult:
    return await run_tool(t, ToolCallRequest(call_id="c1", name=t.name, arguments=arguments))


async def test_quick_calls_share_one_thread_that_is_not_the_loops() -> None:
    threads: list[int] = []

    @tool
    def echo(text: str) -> str:
        threads.append(threading.get_ident())
        return text

    with anyio.fail_after(5):
        assert [(await call(echo, f'{{"text": "{i}"}}')).text for i in range(5)] == [
            "0", "1", "2", "3", "4"]
    assert threading.get_ident() not in threads
    assert len(set(threads[1:])) == 1  # the first call may start the thread
    assert echo.quick_in_thread


async def test_a_tool_that_needs_the_loop_while_it_runs_is_handed_back_through_it() -> None:
    """The loop's wait for a tool is short: a tool that waits for the loop gets it, and its next
    call is not waited for; once it is quick again, it is."""
    started, loop_ran = threading.Event(), threading.Event()
    block = [True]

    @tool
    def needs_the_loop() -> str:
        if block[0]:
            started.set()
            if not loop_ran.wait(5):
                return "the event loop stayed blocked"
        return "ok"

    async def answer() -> None:
        await until(started.is_set, what="the tool started")
        loop_ran.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            assert (await call(needs_the_loop)).text == "ok"
        assert not needs_the_loop.quick_in_thread
        block[0] = False
        assert (await call(needs_the_loop)).text == "ok"
        assert needs_the_loop.quick_in_thread


async def test_a_quick_tools_exception_is_its_error_result() -> None:
    @tool
    def broken() -> str:
        raise ValueError("no luck")

    with anyio.fail_after(5):
        result = await call(broken)
    assert result.is_error and result.text == "Error: no luck"
