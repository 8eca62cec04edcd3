"""Publish synthetic agent runs at RATE events/s for SECONDS (the page's soak load).

    python tests/ui/soak_publisher.py ENDPOINT RATE SECONDS

Each run is 12 events: agent_start, the user's message, an assistant message streamed in five
deltas, a tool call and its result, agent_end; five runs are open at any time (as five agents
at work would be). Prints `{"ready": "soak"}` once connected and `{"done": N}` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus import events as ev  # noqa: E402
from agent_bus.bus.client import connect  # noqa: E402
from agent_bus.bus.messages import (  # noqa: E402
    AssistantDelta,
    AssistantMessage,
    TextPart,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
)


def run_events(n: int) -> list[ev.Event]:
    call = ToolCall(id=f"c{n}", name="echo", arguments=json.dumps({"text": str(n)}))
    reply = AssistantMessage(content=[TextPart(text="working on it"), call], stop_reason="tool_use",
                             usage=Usage(input=100, output=20), model="m")
    result = ToolResultMessage(tool_call_id=call.id, tool_name="echo",
                               content=[TextPart(text=str(n))])
    return [ev.AgentStart(session=f"s{n}"),
            ev.MessageStart(message=UserMessage(content=[TextPart(text=f"task {n}")])),
            ev.MessageStart(message=AssistantMessage(model="m")),
            *[ev.MessageUpdate(delta=AssistantDelta(kind="text", delta=w))
              for w in ("work", "ing ", "on ", "it", ".")],
            ev.MessageEnd(message=reply),
            ev.ToolExecutionStart(tool_call_id=call.id, tool_name="echo", args={"text": str(n)}),
            ev.ToolExecutionEnd(tool_call_id=call.id, tool_name="echo", result=result),
            ev.AgentEnd(final_text="done", stop_reason="stop")]


async def main() -> None:
    endpoint, rate, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    sent = 0
    async with connect(endpoint, name="soak") as peer:
        print(json.dumps({"ready": "soak"}), flush=True)
        lanes: list[tuple[str, str, list[ev.Event]]] = []
        n = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            due = int((time.monotonic() - t0) * rate)
            while sent < due:
                while len(lanes) < 5:
                    n += 1
                    lanes.append((f"agent{n % 5}", uuid.uuid4().hex, run_events(n)))
                agent, run, todo = lanes[sent % len(lanes)]
                await peer.publish(todo.pop(0), agent=agent, run=run, experiment="soak")
                sent += 1
                if not todo:
                    lanes.remove((agent, run, todo))
            await anyio.sleep(0.005)  # paces the publishing rate, not a wait
        await peer.confirm()
    print(json.dumps({"done": sent}), flush=True)


if __name__ == "__main__":
    anyio.run(main)
