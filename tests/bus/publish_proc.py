"""A peer in its own process that publishes a burst of large events and closes cleanly.

    python tests/bus/publish_proc.py ENDPOINT RUN [--count N] [--size BYTES]

Publishes N `topic_message` events (run RUN, topic = the event's index, text of BYTES bytes),
leaves the `connect()` block (a normal close, no explicit confirm), then prints one JSON line
`{"done": RUN, "session": ..., "counters": {...}}` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus import events as ev  # noqa: E402
from agent_bus.bus.client import connect  # noqa: E402


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("run")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64 * 1024)
    args = parser.parse_args()
    text = "x" * args.size
    async with connect(args.endpoint, name=f"publisher-{os.getpid()}") as peer:
        for i in range(args.count):
            await peer.publish(ev.TopicMessage(topic=str(i), text=text), run=args.run)
        session = peer.session
    print(json.dumps({"done": args.run, "session": session, "counters": peer.counters}),
          flush=True)


if __name__ == "__main__":
    anyio.run(main)
