"""Tools for the cancel soak (tests/bus/test_cancel_soak.py): each reports that it runs, then
blocks until cancelled, so a cancellation always finds it running."""

from __future__ import annotations

import anyio

from agent_bus.tools import ToolContext, tool

#: A sync tool gives up on its own after this long (a lost cancellation then shows as a result).
SYNC_GIVE_UP = 30.0


@tool
async def block_async(ctx: ToolContext) -> str:
    """Report `running`, then wait on the event loop until cancelled."""
    await ctx.progress("running")
    await anyio.sleep_forever()
    return "not reached"


@tool
def block_sync(ctx: ToolContext) -> str:
    """Report `running` from a worker thread, then wait until the call is cancelled."""
    ctx.progress("running")
    if ctx.wait_cancelled_blocking(SYNC_GIVE_UP):
        return "cancelled"
    return "never cancelled"
