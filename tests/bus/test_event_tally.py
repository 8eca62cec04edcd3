"""`bus.events.EventTally`, the decoder every reader of events uses (issue 35): what it cannot
use is skipped and counted, each undecodable seq named once, nothing raised."""

from __future__ import annotations

import msgspec

from agent_bus.bus import events as ev


def body(obj: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_skips_counts_and_names_each_undecodable_seq_once() -> None:
    lines: list[str] = []
    tally = ev.EventTally("reader", lines.append)
    newer = tally.decode(1, "topic_message", body({"type": "topic_message", "topic": "t",
                                                  "text": "x", "added_later": [1]}))
    assert newer == ev.TopicMessage(topic="t", text="x")  # an unknown field is ignored
    assert tally.decode(2, "future", body({"type": "future", "x": 1})) is None
    assert tally.decode(3, "message_end", body({"type": "message_end"})) is None
    assert tally.decode(3, "message_end", body({"type": "message_end"})) is None  # read again
    assert tally.decode(4, "turn_start", b"\xc1 not msgpack") is None
    assert (tally.unknown, tally.bad, tally.bad_seqs) == (1, 2, [3, 4])
    assert len(lines) == 2 and "seq 3 (message_end)" in lines[0] and "`message`" in lines[0]
    assert tally.summary() == "reader: 2 undecodable event(s) skipped (seq 3, 4)"


def test_past_the_named_limit_they_are_only_counted() -> None:
    lines: list[str] = []
    tally = ev.EventTally("reader", lines.append)
    for seq in range(1, ev.NAMED_BAD_EVENTS + 11):
        tally.decode(seq, "agent_end", body({"type": "agent_end", "final_text": 1}))
    assert tally.bad == ev.NAMED_BAD_EVENTS + 10
    assert len(lines) == ev.NAMED_BAD_EVENTS + 1 and "no longer named" in lines[-1]
    assert tally.summary().endswith(", ...)")
