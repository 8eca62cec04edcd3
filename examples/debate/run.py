"""Run one debate: the judge's transcript, its verdict, and each debater's answer to the verdict.

    python examples/debate/run.py [--hub tcp://127.0.0.1:7400] ["the motion"]

The judge reaches the debaters through agent-as-tool calls (`ask_pro`, `ask_con`); the verdict
travels on the topic `debate`, which starts a new run of each subscribed debater.
"""

from __future__ import annotations

import argparse
import os
import sys

import anyio

from agent_bus import connect
from agent_bus.bus import events as ev
from agent_bus.bus.messages import AssistantMessage

MOTION = "Remote work is better than office work."


def text_of(message: object) -> str:
    return "".join(getattr(part, "text", "") for part in getattr(message, "content", []))


async def main(hub: str, motion: str, experiment: str) -> int:
    async with connect(hub) as bus:
        # Follow the debaters and the topics from now on, to catch their answers to the verdict.
        seq = (await bus.peer.status()).seq
        async with bus.peer.subscribe(["agent/pro/", "agent/con/", "ext/"], since=seq) as sub:
            run = await bus.prompt("judge", motion, experiment=experiment, new_session=True)
            print(f"motion: {motion}\n")
            async for envelope in run.events():
                event = envelope.event
                if isinstance(event, ev.ToolExecutionEnd) and event.tool_name.startswith("ask_"):
                    print(f"[{event.tool_name[4:]}] {text_of(event.result)}\n")
            result = await run.result()
            print(f"[judge] {result.final_text}\n")
            # The verdict was published on `debate`: each debater answers in a run of its own.
            answers: dict[str, str] = {}
            verdict_seq = None
            with anyio.fail_after(30):
                async for envelope in sub:
                    event, header = envelope.event, envelope.header
                    if isinstance(event, ev.TopicMessage) and header.experiment == experiment:
                        verdict_seq = header.seq
                    elif (verdict_seq is not None and header.seq > verdict_seq
                          and isinstance(event, ev.MessageEnd)
                          and isinstance(event.message, AssistantMessage)):
                        answers[header.agent] = text_of(event.message)
                        print(f"[{header.agent}, on the topic] {answers[header.agent]}")
                    if len(answers) == 2:
                        break
    print(f"\nthe whole debate: busctl export --experiment {experiment}")
    return 0 if result.stop_reason == "stop" else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", default=os.environ.get("BUSCTL_HUB", "tcp://127.0.0.1:7400"))
    parser.add_argument("--experiment", default="debate")
    parser.add_argument("motion", nargs="?", default=MOTION)
    args = parser.parse_args()
    sys.exit(anyio.run(main, args.hub, args.motion, args.experiment))
