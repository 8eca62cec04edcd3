"""A subscriber to the agent-bus event stream written with raw pyzmq + msgspec only.

It shows what a subscriber in any language has to do (see docs/protocol.md):

1. Find the event endpoint: either pass it (`--events tcp://HOST:PORT`), or connect a DEALER to
   the hub (`--hub tcp://HOST:PORT`) and say hello:
       send  [b"AGB/1", msgpack({"kind": "hello", "id": ID}), msgpack({"name": ..., "session": ...})]
       recv  [b"AGB/1", msgpack({"kind": "welcome", "id": ID}), msgpack({"events": ENDPOINT, ...})]
   then say bye: [b"AGB/1", msgpack({"kind": "bye"})].
2. Connect a SUB socket there and subscribe to topic prefixes (`family/agent/run/type`, e.g.
   `agent/assistant/`; empty = everything). The hub's idle heartbeat has topic `hb`.
3. Each event arrives as [topic, b"AGB/1", header, body]: the header is a MessagePack map with
   `seq` (global, strictly increasing), `ts`, `type`, `agent`, `run`, `peer`...; the body is a
   MessagePack map tagged by `type`, or empty for an event too large for the live stream (a stub:
   the body is in the hub's log, printed here as "omitted": true).

Prints one JSON line per event: {"seq", "ts", "type", "agent", "run", "payload"}. With
`--count N` it exits after N events. After its first message from the hub (the subscription is
then in place) it prints `{"ready": "subscriber", "events": ENDPOINT}` on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Any

import msgspec
import zmq

SIGNATURE = b"AGB/1"
HEARTBEAT_TOPIC = b"hb"


class Header(msgspec.Struct):
    kind: str
    id: str = ""
    seq: int = 0
    ts: float = 0.0
    type: str = ""
    agent: str = ""
    run: str = ""
    peer: str = ""


class Welcome(msgspec.Struct):
    events: str


def events_endpoint_from_hub(ctx: zmq.Context, hub: str, timeout: float) -> str:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 500  # let the bye out
    sock.connect(hub)
    try:
        hello_id = uuid.uuid4().hex
        sock.send_multipart([
            SIGNATURE,
            msgspec.msgpack.encode({"kind": "hello", "id": hello_id}),
            msgspec.msgpack.encode({"name": "raw-subscriber", "session": uuid.uuid4().hex[:12],
                                    "pid": os.getpid(), "role": "subscriber"}),
        ])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise SystemExit(f"no welcome from {hub} within {timeout}s")
            frames = sock.recv_multipart()
            if len(frames) < 3 or frames[0] != SIGNATURE:
                continue
            header = msgspec.msgpack.decode(frames[1], type=Header)
            if header.kind == "welcome":
                welcome = msgspec.msgpack.decode(frames[2], type=Welcome)
                sock.send_multipart([SIGNATURE, msgspec.msgpack.encode({"kind": "bye"})])
                return welcome.events
    finally:
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hub", help="the hub's ROUTER endpoint (learn the events endpoint)")
    where.add_argument("--events", help="the hub's event (PUB) endpoint")
    parser.add_argument("--topic", action="append", default=[], help="topic prefix (repeatable)")
    parser.add_argument("--count", type=int, default=0, help="exit after this many events")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.rcvhwm = 100_000
    try:
        events = args.events or events_endpoint_from_hub(ctx, args.hub, args.timeout)
        for topic in args.topic or [""]:
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.setsockopt(zmq.SUBSCRIBE, HEARTBEAT_TOPIC)
        sub.connect(events)
        header_decoder = msgspec.msgpack.Decoder(Header)
        body_decoder = msgspec.msgpack.Decoder()
        encoder = msgspec.json.Encoder()
        out = sys.stdout.buffer
        ready = False
        seen = 0
        while not args.count or seen < args.count:
            frames = sub.recv_multipart()
            if not ready:
                print(msgspec.json.encode({"ready": "subscriber", "events": events}).decode(),
                      file=sys.stderr, flush=True)
                ready = True
            if len(frames) != 4 or frames[1] != SIGNATURE or frames[0] == HEARTBEAT_TOPIC:
                continue
            try:
                header = header_decoder.decode(frames[2])
                # an empty body is a stub: too large for the live stream, the event is in the
                # hub's log (read it with `hub.replay` since seq - 1; docs/protocol.md, "Stubs")
                payload: Any = body_decoder.decode(frames[3]) if frames[3] else None
            except msgspec.DecodeError:
                continue
            line = {"seq": header.seq, "ts": header.ts, "type": header.type,
                    "agent": header.agent, "run": header.run, "payload": payload}
            if payload is None:
                line["omitted"] = True
            out.write(encoder.encode(line) + b"\n")
            out.flush()
            seen += 1
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        ctx.term()


if __name__ == "__main__":
    main()
