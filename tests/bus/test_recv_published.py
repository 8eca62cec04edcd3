"""The subscriber's receive (`bus.subscription.recv_published`) on real PUB/SUB sockets: valid
messages come back whole, and a message shorter than the protocol allows costs at most the message
after it; the reads are back on a message boundary right after."""

from __future__ import annotations

import time

import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.subscription import recv_published

EVENT = [b"agent/a/r/turn_start", p.SIGNATURE, b"\x81\xa4kind\xa5event", b"\x81\xa4type\xa1x"]
BEAT = [p.HEARTBEAT_TOPIC, p.SIGNATURE, b"\x81\xa4kind\xa9heartbeat"]


def received(sub: zmq.Socket, count: int) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + 10
    while len(out) < count and time.monotonic() < deadline:
        if sub.poll(100):
            out.append(recv_published(sub))
    return out


def test_valid_and_short_messages() -> None:
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.bind("inproc://recv-published")
        sub.connect("inproc://recv-published")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        deadline = time.monotonic() + 10
        while not sub.poll(10):  # until the subscription is in place
            assert time.monotonic() < deadline
            pub.send_multipart(BEAT)
        while sub.poll(0):
            recv_published(sub)
        for message in (EVENT, BEAT, [b"short"], EVENT, EVENT, BEAT):
            pub.send_multipart(message)
        got = received(sub, 5)
        assert got[:2] == [EVENT, BEAT]
        # the short message and the one after it come as one list, which fails the signature
        # check the subscription makes; then every message is whole again
        assert got[2] == [b"short", *EVENT] and got[2][1] != p.SIGNATURE
        assert got[3:] == [EVENT, BEAT]
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()
