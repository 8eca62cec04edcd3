"""Publish COUNT topic_message events from PEERS concurrent peers, as fast as the bus takes them.

    python tests/fault/publisher_proc.py ENDPOINT COUNT [--peers 4]

Prints `{"ready": "publisher"}` once connected and `{"done": COUNT}` at the end.
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
    parser.add_argument("count", type=int)
    parser.add_argument("--peers", type=int, default=4)
    args = parser.parse_args()
    per_peer = args.count // args.peers

    async def publish(k: int, ready: anyio.Event) -> None:
        async with connect(args.endpoint, name=f"pub{k}") as peer:
            ready.set()
            for i in range(per_peer):
                await peer.publish(ev.TopicMessage(topic="load", text=f"{k}:{i}"), agent=f"p{k}")

    async with anyio.create_task_group() as tg:
        readies = [anyio.Event() for _ in range(args.peers)]
        for k, ready in enumerate(readies):
            tg.start_soon(publish, k, ready)
        for ready in readies:
            await ready.wait()
        print(json.dumps({"ready": "publisher"}), flush=True)
    print(json.dumps({"done": per_peer * args.peers}), flush=True)


if __name__ == "__main__":
    anyio.run(main)
