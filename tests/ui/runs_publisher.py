"""Publish FINISHED short runs, then LIVE runs left open, and stay connected (the "what runs now"
page's load; tests/ui/test_now.py).

    python tests/ui/runs_publisher.py ENDPOINT FINISHED LIVE

A finished run: the user's message, one model call asking for two tools, both tool calls (a
millisecond each: their bars are the ones that need the minimum width), the answer. A live run
waits on an open `fetch` call (this process serves `tool.fetch`, as a worker would, so the page
can name the worker), except the newest, whose model call is streaming. Prints
`{"ready": "runs", "live": [run ids, oldest first]}` once all are published.
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
    ToolResultMessage,
    Usage,
    UserMessage,
)


def start(n: int, tools: list[str]) -> tuple[list[ev.Event], list[ToolCall]]:
    calls = [ToolCall(id=f"c{n}_{i}", name=t, arguments=json.dumps({"url": f"https://x/{n}/{i}"}))
             for i, t in enumerate(tools)]
    reply = AssistantMessage(content=[TextPart(text="let me look"), *calls], stop_reason="tool_use",
                             usage=Usage(input=100, output=20), model="m")
    return [ev.AgentStart(session=f"s{n}"), ev.TurnStart(turn=1),
            ev.MessageStart(message=UserMessage(content=[TextPart(text=f"task {n}")])),
            ev.MessageStart(message=AssistantMessage(model="m")), ev.MessageEnd(message=reply),
            ev.TurnStart(turn=2),
            *[ev.ToolExecutionStart(tool_call_id=c.id, tool_name=c.name,
                                    args=json.loads(c.arguments)) for c in calls]], calls


def end(call: ToolCall) -> ev.Event:
    result = ToolResultMessage(tool_call_id=call.id, tool_name=call.name,
                               content=[TextPart(text="ok")])
    return ev.ToolExecutionEnd(tool_call_id=call.id, tool_name=call.name, result=result)


def finished(n: int) -> list[ev.Event]:
    events, calls = start(n, ["grep", "read_file"])
    return [*events, *[end(c) for c in calls],
            ev.MessageStart(message=AssistantMessage(model="m")),
            ev.MessageEnd(message=AssistantMessage(content=[TextPart(text="done")], model="m",
                                                   usage=Usage(input=150, output=5))),
            ev.AgentEnd(final_text="done", stop_reason="stop")]


def live(n: int, streaming: bool) -> list[ev.Event]:
    events, calls = start(n, ["grep", "fetch"])
    events.append(end(calls[0]))  # grep is done; fetch stays open
    if streaming:
        events += [end(calls[1]), ev.MessageStart(message=AssistantMessage(model="m")),
                   ev.MessageUpdate(delta=AssistantDelta(kind="text", delta="The page says"))]
    return events


async def main() -> None:
    endpoint, n_finished, n_live = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    async with connect(endpoint, name="worker-a", role="worker") as peer:

        async def fetch(req: IncomingRequest) -> bytes:
            await anyio.sleep_forever()  # never asked: the events say a call is open
            return b""

        await peer.serve("tool.fetch", fetch, capacity=2, meta={"sandbox": "bwrap"})
        live_ids = []
        for n in range(n_finished):
            run = uuid.uuid4().hex
            for event in finished(n):
                await peer.publish(event, agent=f"agent{n % 4}", run=run, experiment="exp-a")
        for i in range(n_live):
            run = uuid.uuid4().hex
            live_ids.append(run)
            for event in live(n_finished + i, streaming=i == n_live - 1):
                await peer.publish(event, agent=f"researcher{i}", run=run, experiment="exp-b")
        await peer.confirm()
        print(json.dumps({"ready": "runs", "live": live_ids}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main)
