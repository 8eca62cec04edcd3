"""Fan a task out to four specialist agents through the orchestrator and print the merged plan.

    python examples/fanout/run.py [--hub tcp://127.0.0.1:7400] ["the task"]

The orchestrator's four `ask_*` tool calls start together; each specialist's run streams on the
bus under its own run id with `parent_run_id` = the orchestrator's run (`busctl watch` shows them).
"""

from __future__ import annotations

import argparse
import os
import sys

import anyio

from agent_bus import connect
from agent_bus.bus import events as ev

TASK = "Should we launch a paid tier for our note-taking app?"


async def main(hub: str, task: str, experiment: str) -> int:
    async with connect(hub) as bus:
        run = await bus.prompt("orchestrator", task, experiment=experiment, new_session=True)
        print(f"orchestrator run {run.run_id} (experiment {experiment})")
        async for envelope in run.events():
            event = envelope.event
            if isinstance(event, ev.ToolExecutionStart):
                print(f"  -> {event.tool_name}  seq {envelope.header.seq}")
            elif isinstance(event, ev.ToolExecutionEnd):
                print(f"  <- {event.tool_name}  {event.duration:.2f}s  seq {envelope.header.seq}")
        result = await run.result()
    print()
    print(result.final_text)
    print()
    for model, usage in result.usage.items():  # the orchestrator's own calls
        print(f"usage {model}: {usage.input} in / {usage.output} out")
    print(f"all runs and their usage: busctl export --experiment {experiment}")
    return 0 if result.stop_reason == "stop" else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", default=os.environ.get("BUSCTL_HUB", "tcp://127.0.0.1:7400"))
    parser.add_argument("--experiment", default="fanout")
    parser.add_argument("task", nargs="?", default=TASK)
    args = parser.parse_args()
    sys.exit(anyio.run(main, args.hub, args.task, args.experiment))
