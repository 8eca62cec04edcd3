"""A serving peer in its own process, for tests that must SIGKILL it.

    python tests/bus/peer_proc.py ENDPOINT [--name N] [--capacity C] [--idempotent]
                                  [--curve-server-key HUB.key --curve-key CLIENT.key_secret]

Serves `echo` (waits `delay` seconds from the JSON body, then replies with this process's pid
and the most requests it ever held at once), `slow` (sleeps the body's seconds; prints
`{"started": ID}` when a call begins), and `stats.<pid>` (the same counters). Prints one JSON
ready line once its services are registered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus.client import IncomingRequest, connect  # noqa: E402
from agent_bus.bus.security import CurveClient  # noqa: E402


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--name", default=f"peer-{os.getpid()}")
    parser.add_argument("--capacity", type=int, default=1)
    parser.add_argument("--idempotent", action="store_true")
    parser.add_argument("--curve-server-key", default="")
    parser.add_argument("--curve-key", default="")
    args = parser.parse_args()
    curve = (CurveClient(server_public_key_file=args.curve_server_key,
                         secret_key_file=args.curve_key) if args.curve_key else None)
    active = 0
    max_active = 0
    served = 0

    def stats() -> bytes:
        return json.dumps({"pid": os.getpid(), "max_active": max_active, "served": served}).encode()

    async def echo(req: IncomingRequest) -> bytes:
        nonlocal active, max_active, served
        active += 1
        max_active = max(max_active, active)
        try:
            await anyio.sleep(float(json.loads(req.body or b"{}").get("delay", 0)))
            served += 1
            return stats()
        finally:
            active -= 1

    async def slow(req: IncomingRequest) -> bytes:
        print(json.dumps({"started": req.id, "pid": os.getpid()}), flush=True)
        await anyio.sleep(float(req.body or b"1"))
        return f"done by {os.getpid()}".encode()

    async def report(req: IncomingRequest) -> bytes:
        return stats()

    async with connect(args.endpoint, name=args.name, curve=curve) as peer:
        await peer.serve("echo", echo, capacity=args.capacity, idempotent=args.idempotent)
        await peer.serve("slow", slow, capacity=args.capacity, idempotent=args.idempotent)
        await peer.serve(f"stats.{os.getpid()}", report)
        await peer.status()  # the hub has handled the registrations before this reply
        print(json.dumps({"ready": "peer", "pid": os.getpid(), "peer": peer.peer_id}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    try:
        anyio.run(main)
    except KeyboardInterrupt:
        pass
