"""A foreign tool service next to our agents (issue 29, items 3 and 4): the peer is written from
docs/protocol.md alone (plain pyzmq DEALER/SUB sockets and msgspec MessagePack, the RawPeer of
tests/bus/test_raw_contracts.py, which imports nothing of ours); the hub, gateway and coordinator
are real processes (the module's `stack`), and the fake model shows the request it received.

- A `register` of a tool whose name or schema no model API takes is refused with an `error`
  naming it (counted `bad_register`); the valid one registered beside them gets no reply at all.
- An agent with `tools = ["*"]` running meanwhile succeeds, offering the valid tool (under the
  service name, whatever `meta.name` says) and never the refused one.
- The foreign tool's progress partials reach the log, and `busctl watch`, as
  `tool_execution_update` events: the coordinator publishes them, the tool does not.
- Topic families: `process_restarted`/`process_gave_up` under `bus/`, `run_resumed` under `agent/`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.bus.toolnames import NAME_RULE
from tests.bus.test_raw_contracts import TIMEOUT, RawPeer, raw_peers, subscriber
from tests.coordinator.conftest import Stack, calls, text
from tests.coordinator.test_e2e import run_prompt

pytestmark = pytest.mark.anyio

PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}


def text_part(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def register_foreign_tools(peer: RawPeer) -> list[dict[str, Any]]:
    """Register two bad tools and a good one in one `register`; return the errors."""
    peer.send({"kind": "register", "id": "reg-1"}, {"services": [
        {"name": "tool.bad name!", "capacity": 1, "meta": {"description": "bad"}},
        {"name": "tool.listy", "capacity": 1, "meta": {"parameters": {"type": "array"}}},
        {"name": "tool.raw_progress", "capacity": 1,
         "meta": {"name": "something_else", "description": "Count to n, reporting progress.",
                  "parameters": PARAMETERS}},
    ]})
    peer.sync()  # handled: whatever the hub answers the register is in the inbox now
    about = [h for h, _ in peer.inbox if h.get("id") == "reg-1"]
    peer.inbox = [m for m in peer.inbox if m[0].get("id") != "reg-1"]
    assert len(about) == 2, about  # one error per bad service; none for the good one
    return about


def serve_one_call(peer: RawPeer, stop: threading.Event) -> dict[str, Any]:
    """Answer one `tool.raw_progress` call: two progress partials, then the result; then keep
    heartbeating (any peer must, while connected) until `stop`."""
    header, body = peer.expect(lambda h: h["kind"] == "request", timeout=30)
    assert header["service"] == "tool.raw_progress", header
    call = msgspec.msgpack.decode(body[0])
    for step in ("1 of 2", "2 of 2"):
        peer.send({"kind": "partial", "id": header["id"]},
                  ["progress", {"content": [text_part(step)]}])
    peer.send({"kind": "reply", "id": header["id"]},
              {"content": [text_part("counted to 2")], "details": {"n": 2}})
    while not stop.is_set():
        if time.monotonic() - peer.last_sent >= 0.1:
            peer.send({"kind": "heartbeat"})
        peer.sock.poll(50)
        while peer.sock.poll(0):
            peer.sock.recv_multipart()
    return dict(call)


async def test_a_bad_tool_name_is_refused_and_a_star_agent_never_offers_it(stack: Stack) -> None:
    stack.script([calls(("raw_progress", {"n": 2})), text("Counted.")])
    with raw_peers(stack.endpoint, "foreign") as (peer,):
        name, schema = register_foreign_tools(peer)
        assert {(h["kind"], h["code"]) for h in (name, schema)} == {("error", "bad_request")}
        assert "'tool.bad name!'" in name["error"], name
        assert NAME_RULE in name["error"], name
        assert "'tool.listy'" in schema["error"] and "`meta.parameters`" in schema["error"]
        status = peer.status()
        assert status["counters"].get("bad_register") == 2, status["counters"]
        services = {s["name"] for s in status["services"]}
        assert "tool.raw_progress" in services
        assert not services & {"tool.bad name!", "tool.listy"}, services

        stop = threading.Event()
        served: dict[str, Any] = {}

        def serve() -> None:
            served.update(serve_one_call(peer, stop))

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            try:
                with anyio.fail_after(30):
                    run_id, result = await run_prompt(stack, "a", "count", new_session=True)
            finally:
                stop.set()
    assert (result.stop_reason, result.final_text) == ("stop", "Counted."), result
    assert (served["name"], served["run_id"], served["agent"]) == ("raw_progress", run_id, "a")
    offered = [t["function"]["name"] for t in stack.srv.requests[0].body["tools"]]
    assert "raw_progress" in offered and "echo" in offered, offered
    assert not [n for n in offered if "bad" in n or "something_else" in n], offered

    events = await stack.watch(run_id)  # `busctl watch --json`, from the log
    updates = [e for e in events if e["type"] == "tool_execution_update"]
    assert [(u["tool_name"], u["partial"]["content"][0]["text"]) for u in updates] == [
        ("raw_progress", "1 of 2"), ("raw_progress", "2 of 2")], updates
    start, end = (next(e for e in events if e["type"] == kind)
                  for kind in ("tool_execution_start", "tool_execution_end"))
    assert start["seq"] < updates[0]["seq"] < updates[1]["seq"] < end["seq"]
    assert end["result"]["content"][0]["text"] == "counted to 2"


def test_topic_families_of_supervisor_and_resume_events(stack: Stack) -> None:
    """docs/protocol.md, section 2: `bus` for the bus events (also the supervisor's), `agent`
    for the lifecycle and `run_resumed`, `ext` for anything else."""
    published = [
        ("process_restarted", "", "", {"type": "process_restarted", "process": "w", "restarts": 1}),
        ("process_gave_up", "", "", {"type": "process_gave_up", "process": "w", "restarts": 5}),
        ("run_resumed", "x", "r1", {"type": "run_resumed", "turn": 2, "model": True}),
        ("tool_skipped", "x", "r1", {"type": "tool_skipped", "tool": "a b", "reason": "name"}),
    ]
    with raw_peers(stack.endpoint, "supervisor-like") as (peer,), subscriber(peer) as sub:
        for i, (type_, agent, run, body) in enumerate(published):
            peer.send({"kind": "event", "id": f"e{i}", "type": type_, "agent": agent,
                       "run": run}, body)
        topics = []
        while len(topics) < len(published):
            assert sub.poll(TIMEOUT * 1000), f"events not published; saw {topics}"
            frames = sub.recv_multipart()
            header = msgspec.msgpack.decode(frames[2]) if frames[0] != b"hb" else {}
            if header.get("peer") == peer.peer_id:
                topics.append(frames[0].decode())
        peer.sync()
        assert not [h for h, _ in peer.inbox if h["kind"] == "error"], peer.inbox
    assert topics == ["bus///process_restarted", "bus///process_gave_up",
                      "agent/x/r1/run_resumed", "ext/x/r1/tool_skipped"]

