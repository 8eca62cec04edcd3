"""At the door (issue #35): the hub validates every event body of a known type against its schema
(bus/events.py, the types the log readers decode with) and refuses an invalid one with `bad_event`
to its sender, counted `bad_events`; nothing of it is logged. The publisher is a raw pyzmq peer
(tests/bus/test_raw_contracts.py); only the malformed bodies are generated from our schemas."""

from __future__ import annotations

import typing
from typing import Any

import msgspec

from agent_bus.bus import events as ev
from tests.bus.test_raw_contracts import raw_peers, replay_all


def _wrong_value(info: msgspec.inspect.Type) -> Any:
    """A value `info` does not accept (a string where it takes none, else an int)."""
    return 12345 if isinstance(info, msgspec.inspect.StrType) else "not-this-type"


def malformed_bodies() -> dict[str, dict[str, Any]]:
    """One body per lifecycle type with its first typed field given a value of the wrong type."""
    out = {}
    for cls in typing.get_args(ev.Event):
        type_ = cls.__struct_config__.tag
        if type_ not in ev.LIFECYCLE_TYPES:
            continue
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        field = next(f for f in info.fields if not isinstance(f.type, msgspec.inspect.AnyType))
        out[type_] = {"type": type_, field.encode_name: _wrong_value(field.type)}
    assert set(out) == ev.LIFECYCLE_TYPES
    return out


def test_malformed_event_bodies_are_refused_at_the_door(hub: dict) -> None:
    bodies = {f"bad-{t}": (t, b) for t, b in malformed_bodies().items()}
    bodies["no-message"] = ("message_end", {"type": "message_end"})  # the case
    with raw_peers(hub["endpoint"], "sloppy") as (peer,):
        for event_id, (type_, body) in bodies.items():
            peer.send({"kind": "event", "id": event_id, "type": type_, "agent": "a", "run": "r"},
                      body)
        # a mixed-type message too: its malformed body is refused, the valid one kept
        good = {"type": "turn_start", "turn": 1}
        peer.send({"kind": "event", "id": "mix", "type": "*", "agent": "a", "run": "r"},
                  {"type": "turn_end", "message": "nope"}, good)
        for event_id, (type_, _) in [*bodies.items(), ("mix.0", ("turn_end", None))]:
            header, _ = peer.expect(lambda h, i=event_id: h["kind"] == "error" and h["id"] == i)
            assert header["code"] == "bad_event", header
            assert f"`{type_}` body does not match its schema" in header["error"], header
        logged = [(h["type"], msgspec.msgpack.decode(b)) for h, b in replay_all(peer)
                  if h.get("peer") == peer.peer_id]
        assert logged == [("turn_start", good)], logged
        assert peer.status()["counters"].get("bad_events") == len(bodies) + 1
