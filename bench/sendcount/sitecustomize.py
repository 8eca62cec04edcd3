"""Counts the ZeroMQ messages a bench process sends, by kind (`--count-sends` of bench_loop.py and
bench_scale.py put this directory on the children's PYTHONPATH). Measurement only, never imported
by the bus itself.

At exit the process writes `{"argv": [...], "sent": {kind: n, ...}}` to
`$BENCH_SENDCOUNT_DIR/<pid>.json`; a `partial` message also adds its body frames to
`partial_bodies`. The hook wraps `bus.transport.send_frames` (every send of the fast transport)
as soon as `bus.transport` is imported, then removes itself from the import path.
"""

from __future__ import annotations

import atexit
import builtins
import collections
import json
import os
import sys
from typing import Any

_sent: collections.Counter[str] = collections.Counter()
_real_import = builtins.__import__


def _wrap() -> None:
    from agent_bus.bus import protocol as p
    from agent_bus.bus import transport as transport

    send = transport.send_frames

    def counting_send(sock: Any, frames: list[Any]) -> None:
        send(sock, frames)
        try:
            kind = p.decode_header(bytes(frames[1])).kind
        except Exception:  # noqa: BLE001 - a count, never a failure of the send
            kind = "?"
        _sent[kind] += 1
        if kind == p.PARTIAL:
            _sent["partial_bodies"] += len(frames) - 2

    transport.send_frames = counting_send


def _import(name: str, *args: Any, **kwargs: Any) -> Any:
    module = _real_import(name, *args, **kwargs)
    # Both fully imported (in sys.modules already while they run): their last names are there.
    # The outer frames of a nested import come here after the hook is gone: wrap only once.
    if (builtins.__import__ is _import
            and hasattr(sys.modules.get("agent_bus.bus.transport"), "FastTransport")
            and hasattr(sys.modules.get("agent_bus.bus.protocol"), "decode_header")):
        builtins.__import__ = _real_import  # once: imports cost nothing extra from here on
        _wrap()
    return module


def _dump() -> None:
    folder = os.environ.get("BENCH_SENDCOUNT_DIR", "")
    if folder and _sent:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as out:
            json.dump({"argv": sys.argv, "sent": dict(_sent)}, out)


if os.environ.get("BENCH_SENDCOUNT_DIR"):
    builtins.__import__ = _import
    atexit.register(_dump)
