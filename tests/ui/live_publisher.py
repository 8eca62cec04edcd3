"""Publish two live runs and keep a tool call in flight, for the live run page's test
(tests/ui/test_live_page.py), then stay connected.

    python tests/ui/live_publisher.py ENDPOINT

`tools`: one model call (done at once) asking for three parallel `fetch` calls, all left open.
`stream`: a model reply streaming in (a text delta, no message_end). This process serves
`tool.fetch` (capacity 2) as worker `worker-a`, and a second connection keeps one call to it in
flight, so the hub's status shows the worker busy (1/2). Prints
`{"ready": "live", "tools": RUN, "stream": RUN}` once all is published.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus import events as ev  # noqa: E402
from agent_bus.bus.client import IncomingRequest, connect  # noqa: E402
from agent_bus.bus.messages import (  # noqa: E402
    AssistantDelta,
    AssistantMessage,
    TextPart,
    ToolCall,
    UserMessage,
)


def tools_run() -> list[ev.Event]:
    calls = [ToolCall(id=f"f{i}", name="fetch", arguments=json.dumps({"url": f"https://x/{i}"}))
             for i in range(3)]
    reply = AssistantMessage(content=[TextPart(text="three at once"), *calls], model="m",
                             stop_reason="tool_use")
    return [ev.AgentStart(session="s-tools"), ev.TurnStart(turn=1),
            ev.MessageStart(message=UserMessage(content=[TextPart(text="fetch three")])),
            ev.MessageStart(message=AssistantMessage(model="m")), ev.MessageEnd(message=reply),
            *[ev.ToolExecutionStart(tool_call_id=c.id, tool_name=c.name,
                                    args=json.loads(c.arguments)) for c in calls]]


def stream_run() -> list[ev.Event]:
    return [ev.AgentStart(session="s-stream"), ev.TurnStart(turn=1),
            ev.MessageStart(message=UserMessage(content=[TextPart(text="tell me")])),
            ev.MessageStart(message=AssistantMessage(model="m")),
            ev.MessageUpdate(delta=AssistantDelta(kind="text", delta="The answer ")),
            ev.MessageUpdate(delta=AssistantDelta(kind="text", delta="streams in"))]


async def main() -> None:
    endpoint = sys.argv[1]
    async with connect(endpoint, name="worker-a", role="worker") as peer, \
            connect(endpoint, name="caller") as caller, anyio.create_task_group() as tg:

        async def fetch(req: IncomingRequest) -> bytes:
            await anyio.sleep_forever()  # in flight for as long as this runs
            return b""

        await peer.serve("tool.fetch", fetch, capacity=2)
        tg.start_soon(lambda: caller.request("tool.fetch", b"{}", timeout=3600))
        ids = {"tools": uuid.uuid4().hex, "stream": uuid.uuid4().hex}
        for name, events in (("tools", tools_run()), ("stream", stream_run())):
            for event in events:
                await peer.publish(event, agent=f"agent-{name}", run=ids[name])
        await peer.confirm()
        print(json.dumps({"ready": "live", **ids}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
