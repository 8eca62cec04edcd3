"""Run the word-count map-reduce and show which host mapped which file.

    python examples/mapreduce/run.py [--hub tcp://127.0.0.1:7400]
    python examples/mapreduce/run.py --hub tcp://HOST-A:7400 \
        --curve-server-key keys/hub.key --curve-key keys/local.key_secret   # CURVE on (README)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio

from agent_bus import connect
from agent_bus.bus import events as ev
from agent_bus.bus.security import CurveClient

PROMPT = "Count the words in the corpus."


async def main(hub: str, experiment: str, curve: CurveClient | None) -> int:
    async with connect(hub, curve=curve) as bus:
        run = await bus.prompt("wordcount", PROMPT, experiment=experiment, new_session=True)
        async for envelope in run.events():
            event = envelope.event
            if isinstance(event, ev.ToolExecutionEnd) and not event.is_error:
                text = "".join(getattr(p, "text", "") for p in event.result.content)
                if event.tool_name == "count_words":
                    mapped = json.loads(text)
                    print(f"map    {mapped['file']:<18} on {mapped['host']}: "
                          f"{mapped['words']} words ({event.duration:.2f}s)")
                elif event.tool_name == "reduce_counts":
                    print(f"reduce {text}")
        result = await run.result()
    print()
    print(result.final_text)
    return 0 if result.stop_reason == "stop" else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", default=os.environ.get("BUSCTL_HUB", "tcp://127.0.0.1:7400"))
    parser.add_argument("--experiment", default="mapreduce")
    parser.add_argument("--curve-server-key", default=os.environ.get("BUSCTL_CURVE_SERVER_KEY"))
    parser.add_argument("--curve-key", default=os.environ.get("BUSCTL_CURVE_KEY"))
    args = parser.parse_args()
    curve = (CurveClient(server_public_key_file=args.curve_server_key,
                         secret_key_file=args.curve_key) if args.curve_server_key else None)
    sys.exit(anyio.run(main, args.hub, args.experiment, curve))
