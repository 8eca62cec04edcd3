"""A stand-in hub on a real ZeroMQ ROUTER socket, until the real standby lands (issue 52).

    python tests/failover/standin_proc.py PORT not-leader [--leader ENDPOINT]
    python tests/failover/standin_proc.py PORT welcome --epoch N --events ENDPOINT

`not-leader`: answers every hello and request `error` `not_leader` (its text names
`--leader` when given), as a standby or a deposed primary does. `welcome`: welcomes every
hello with `epoch` N and then says nothing (no heartbeats): a leader older than one a client
has seen. Prints `{"ready": ...}`, then `{"hello": N}` for each hello.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent_bus.bus import protocol as p  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("mode", choices=["not-leader", "welcome"])
    parser.add_argument("--leader", default="")
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--events", default="tcp://127.0.0.1:1")
    args = parser.parse_args()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    print(json.dumps({"ready": "standin", "port": args.port}), flush=True)
    hellos = 0
    text = f"not the leader; the leader is {args.leader}" if args.leader else "not the leader"
    while True:
        frames = sock.recv_multipart()
        if len(frames) < 3 or frames[1] != p.SIGNATURE:
            continue
        header = p.decode_header(frames[2])
        if header.kind == p.HELLO:
            hellos += 1
            print(json.dumps({"hello": hellos}), flush=True)
        if header.kind not in (p.HELLO, p.REQUEST):
            continue
        if args.mode == "welcome" and header.kind == p.HELLO:
            welcome = p.Welcome(peer="standin", hub_session="standin", events=args.events,
                                heartbeat_interval=1.0, liveness=3, max_message_bytes=1 << 20,
                                epoch=args.epoch)
            sock.send_multipart([frames[0], p.SIGNATURE,
                                 p.encode(p.Header(kind=p.WELCOME, id=header.id)),
                                 p.encode(welcome)])
            continue
        error = p.Header(kind=p.ERROR, id=header.id, code=p.NOT_LEADER, error=text)
        sock.send_multipart([frames[0], p.SIGNATURE, p.encode(error)])


if __name__ == "__main__":
    main()
