"""The script-facing API: attaching tools from a script in one call, topics from a script."""

from __future__ import annotations

import anyio
import pytest

from agent_bus import connect
from agent_bus.bus import events as ev
from agent_bus.bus.client import connect as connect_peer
from agent_bus.bus.messages import ToolCallRequest
from agent_bus.tools.executor import BusToolExecutor
from tests.support import until

pytestmark = pytest.mark.anyio


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


async def test_serve_tools_from_a_script(hub: dict) -> None:
    async with connect(hub["endpoint"], name="script") as bus, \
            connect_peer(hub["endpoint"], name="caller") as caller:
        tools = BusToolExecutor(caller)
        async with bus.serve_tools(shout) as names:
            assert names == ["shout"]
            catalog = {t.name: t for t in await tools.catalog()}
            assert catalog["shout"].description == "Upper-case a text."
            result = await tools.execute(ToolCallRequest(call_id="c1", name="shout",
                                                         arguments='{"text": "hi"}'))
            assert result.text == "HI" and not result.is_error
        async def forgotten() -> bool:
            return "shout" not in {t.name for t in await tools.catalog()}

        await until(forgotten, 5, "the hub to forget the script's tool")


async def test_publish_from_a_script_is_on_the_stream(hub: dict) -> None:
    async with connect(hub["endpoint"], name="script") as bus:
        seq = (await bus.peer.status()).seq
        await bus.publish("news", "hello all", sender="tester", experiment="x1")
        async with bus.peer.subscribe(since=seq) as sub:
            with anyio.fail_after(5):
                async for envelope in sub:
                    if isinstance(envelope.event, ev.TopicMessage):
                        assert envelope.event.topic == "news"
                        assert envelope.event.sender == "tester"
                        assert envelope.header.experiment == "x1"
                        break
