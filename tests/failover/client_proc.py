"""A client of a list of hubs in its own process, for the failover tests (tests/failover).

    python tests/failover/client_proc.py serve HUBS
    python tests/failover/client_proc.py request HUBS [--slow SECONDS]
    python tests/failover/client_proc.py subscribe HUBS

HUBS is one string with commas (what `busctl up` hands its processes). Each prints JSON lines:

- `serve`: serves `work` (not idempotent; prints `{"ran": KEY}` each time its handler runs,
  answers the key back after 20 ms), `slow` (prints `{"started": KEY}`, sleeps the body's
  seconds, prints `{"finished": KEY}`, answers the key) and `stream` (N partials `p0`..,
  one every 0.5 s, then `done`).
- `request`: keyed requests to `work` one after the other (key `k<N>`), each answered printed
  `{"answer": KEY}`, and an event published for each (`{"published": N}`), until stdin closes;
  with `--slow S`, one keyed `slow` request of S seconds instead (`{"answer": ...}` once);
  with `--stream N`, one keyed `stream` request, each body printed `{"body": ...}`.
- `subscribe`: every event's seq as `{"seq": N}`.

Every role prints `{"ready": true, "hub": ENDPOINT}` once connected, `{"moved": ENDPOINT}`
when its peer is welcomed by another hub, and `{"counters": {...}}` when its peer's change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

import anyio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus import events as ev  # noqa: E402
from agent_bus.bus.client import IncomingRequest, Peer, connect  # noqa: E402


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def watch_moves(peer: Peer) -> None:
    """Print each move, and the peer's counters whenever they change."""
    hub, counters = peer.hub, dict(peer.counters)
    while True:
        await anyio.sleep(0.05)  # a helper's poll, not a test's wait
        if peer.connected and peer.hub != hub:
            hub = peer.hub
            say(moved=hub, epoch=peer.epoch)
        if peer.counters != counters:
            counters = dict(peer.counters)
            say(counters=counters)


async def serve(peer: Peer) -> None:
    async def work(req: IncomingRequest) -> bytes:
        say(ran=req.header.key)
        await anyio.sleep(0.02)
        return req.header.key.encode()

    async def slow(req: IncomingRequest) -> bytes:
        say(started=req.header.key)
        await anyio.sleep(float(req.body))
        say(finished=req.header.key)
        return req.header.key.encode()

    async def stream(req: IncomingRequest) -> bytes:
        say(started=req.header.key)
        for i in range(int(req.body)):
            await req.partial(f"p{i}".encode())
            await anyio.sleep(0.5)
        return b"done"

    await peer.serve("work", work, capacity=4)
    await peer.serve("stream", stream, capacity=4)
    await peer.serve("slow", slow, capacity=4)
    say(ready=True, hub=peer.hub)
    await anyio.sleep_forever()


async def request(peer: Peer, slow: float, stream: int) -> None:
    say(ready=True, hub=peer.hub)
    if stream:
        async with peer.stream("stream", str(stream).encode(), key="stream-1",
                               timeout=60) as replies:
            async for body in replies:
                say(body=body.decode())
        say(streamed=True, counters=peer.counters)
        return
    if slow:
        answer = await peer.request("slow", str(slow).encode(), key="slow-1", timeout=60)
        say(answer=answer.decode(), counters=peer.counters)
        return
    stop = anyio.Event()
    loop_token = anyio.lowlevel.current_token()

    def read_stdin() -> None:  # stdin closed: stop
        sys.stdin.read()
        anyio.from_thread.run_sync(stop.set, token=loop_token)

    threading.Thread(target=read_stdin, daemon=True).start()
    n = 0
    while not stop.is_set():
        key = f"k{n}"
        answer = await peer.request("work", b"", key=key, timeout=60)
        say(answer=answer.decode())
        await peer.publish(ev.TopicMessage(topic="tick", text=str(n)))
        n += 1
    say(done=n, counters=peer.counters)


async def subscribe(peer: Peer) -> None:
    async with peer.subscribe() as events:
        say(ready=True, hub=peer.hub)
        async for envelope in events:
            if envelope.header.type == "gap":
                say(gap=str(envelope.event))
            else:
                say(seq=envelope.header.seq)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "request", "subscribe"])
    parser.add_argument("hubs")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--stream", type=int, default=0)
    args = parser.parse_args()
    async with connect(args.hubs, name=f"{args.role}-{os.getpid()}") as peer, \
            anyio.create_task_group() as tg:
        tg.start_soon(watch_moves, peer)
        if args.role == "serve":
            await serve(peer)
        elif args.role == "request":
            await request(peer, args.slow, args.stream)
        else:
            await subscribe(peer)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
