"""docs/protocol.md read literally (issue 49 item 13): its answers checked against the code and
against real hubs, where a test can. The peers here are raw (pyzmq and msgspec only, the
RawPeer of test_raw_contracts): they do what the document says, nothing more.

- the tool-name rule: the regex the document states is the hub's and `@tool`'s;
- `title` in a tool's `parameters`: refused by the hub, as the document says;
- absent fields: the listings' `=` defaults are the structs', and what a hub leaves out;
- credential files: their names and their format;
- trace ids: the document's recipe gives the ids the code derives.
(A tool's progress, published by its caller only: tests/security/test_journal_and_progress.py.)
"""

from __future__ import annotations

import hashlib
import re
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from agent_bus.bus import protocol as p
from agent_bus.bus.toolnames import NAME_RULE, tool_name_fault
from agent_bus.bus.tracecontext import chat_span_id, span_id, tool_traceparent, trace_id
from agent_bus.tools import Tool, ToolDefinitionError
from tests.bus.test_raw_contracts import SIG, RawPeer, raw_peers
from tests.cli.conftest import start_up
from tests.support import ROOT

DOC = (ROOT / "docs" / "protocol.md").read_text()


def bullet(title: str) -> str:
    """The text of the bullet that starts `- **<title>**`, up to the next bullet."""
    start = DOC.index(f"- **{title}**")
    end = DOC.find("\n- ", start + 1)
    return DOC[start:end]


# --- the tool-name rule ------------------------------------------------------------------


def test_the_documented_tool_name_rule_is_the_hubs_and_tools() -> None:
    stated = re.search(r"`(\^[^`]+\$)`", bullet("Name."))
    assert stated is not None and stated.group(1) == NAME_RULE, stated
    assert tool_name_fault("_ok-1") == "" and tool_name_fault("a" * 64) == ""
    for bad in ("1st", "-dash", "a" * 65, "has space", ""):
        assert tool_name_fault(bad), bad
        with pytest.raises(ToolDefinitionError, match="the first a letter or `_`"):
            Tool(lambda: None, name=bad)


def register_raw(peer: RawPeer, services: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send one `register`; the `error`s the hub answers it with (none for a service it took)."""
    peer.send({"kind": "register", "id": "reg-1"}, {"services": services})
    peer.sync()
    about = [h for h, _ in peer.inbox if h.get("id") == "reg-1"]
    peer.inbox = [m for m in peer.inbox if m[0].get("id") != "reg-1"]
    return about


def test_the_hub_refuses_a_digit_first_name_and_a_title_as_documented(hub: dict) -> None:
    assert "no `title` keyword" in bullet("`parameters`")
    titled = {"type": "object", "properties": {"city": {"type": "string", "title": "City"}}}
    # a *property* named `title` is no keyword: fine
    fine = {"type": "object", "properties": {"title": {"type": "string"}},
            "required": ["title"], "additionalProperties": False}
    with raw_peers(hub["endpoint"], "foreign") as (peer,):
        errors = register_raw(peer, [
            {"name": "tool.1st", "capacity": 1},
            {"name": "tool.titled", "capacity": 1, "meta": {"parameters": titled}},
            {"name": "tool.book", "capacity": 1, "meta": {"parameters": fine}},
        ])
        assert sorted(e["code"] for e in errors) == ["bad_request"] * 2, errors
        name, title = sorted(errors, key=lambda e: "titled" in e["error"])
        assert "'tool.1st'" in name["error"] and NAME_RULE in name["error"], name
        assert "`title` at `$.properties.city`" in title["error"], title
        served = {s["name"] for s in peer.status()["services"]}
    assert "tool.book" in served and not served & {"tool.1st", "tool.titled"}, served


# --- absent fields -----------------------------------------------------------------------


def listings() -> dict[str, list[tuple[str, str | None]]]:
    """Every `Name {field: type, field: type = default, …}` listing of the document (code
    blocks), as (field, default or None) pairs."""
    out: dict[str, list[tuple[str, str | None]]] = {}
    for block in re.findall(r"```\n(.*?)```", DOC, re.S):
        text = " ".join(line.strip() for line in block.splitlines())
        for match in re.finditer(r"\b([A-Z]\w+)\s+\{", text):
            body = _balanced(text, match.end() - 1)
            if body is not None:
                out.setdefault(match.group(1), [_field(f) for f in _split(body)])
    return out


def _balanced(text: str, start: int) -> str | None:
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def _split(body: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in body:
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [*parts, current.strip()] if current.strip() else parts


def _field(text: str) -> tuple[str, str | None]:
    name = text.split(":")[0].strip()
    default = text.split("=", 1)[1].strip() if "=" in text else None
    return name, default


DEFAULTS = {'""': "", "0": 0, "1": 1, "false": False, "[]": [], "{}": {}}


@pytest.mark.parametrize("struct", [p.Hello, p.Welcome, p.Register, p.ServiceSpec,
                                    p.Unregister, p.Status, p.PeerInfo, p.ServiceLoad,
                                    p.ServiceInfo, p.Budget], ids=lambda s: s.__name__)
def test_each_listing_names_the_structs_fields_and_defaults(struct: type) -> None:
    listed = listings()[struct.__name__]
    fields = msgspec.structs.fields(struct)
    assert [name for name, _ in listed] == [f.encode_name for f in fields], listed
    for (name, default), f in zip(listed, fields, strict=True):
        if f.required:
            assert default is None, f"{struct.__name__}.{name} is always sent: no `=`"
            continue
        actual = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        assert default in DEFAULTS and DEFAULTS[default] == actual, (name, default, actual)


def test_a_hub_leaves_out_exactly_the_fields_holding_their_default(hub: dict) -> None:
    assert "a peer serving\nnothing has no `services` key" in DOC
    listed = listings()
    with raw_peers(hub["endpoint"], "idle") as (peer,):
        status = peer.status()
    mine = next(info for info in status["peers"] if info["peer"] == peer.peer_id)
    for name, fields in (("Status", status), ("PeerInfo", mine)):
        absent = {field for field, _ in listed[name]} - set(fields)
        defaulted = {field for field, default in listed[name] if default is not None}
        assert absent <= defaulted, (name, absent)
    assert "services" not in mine, mine  # the document's own example


# --- credential files --------------------------------------------------------------------


def hello_with(endpoint: str, credential: str, services: list[str]) -> list[str]:
    """A raw peer presenting `credential` in its hello registers `services`: the codes of the
    errors it is answered with, in order ("" for one registered)."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)

        def send(header: dict[str, Any], body: Any) -> None:
            sock.send_multipart([SIG, msgspec.msgpack.encode(header), msgspec.msgpack.encode(body)])

        def until(match: Any) -> list[dict[str, Any]]:
            """Every header up to and with the first `match` accepts (10 s each at most)."""
            seen = []
            while sock.poll(10_000):
                header = msgspec.msgpack.decode(sock.recv_multipart()[1])
                seen.append(header)
                if match(header):
                    return seen
            raise AssertionError(f"no answer; got {seen}")

        send({"kind": "hello", "id": "h"}, {"name": "foreign-tool", "session": uuid.uuid4().hex[:12],
                                           "credential": credential})
        until(lambda header: header["kind"] == "welcome")
        codes = []
        for service in services:
            send({"kind": "register", "id": service}, {"services": [{"name": service}]})
            send({"kind": "request", "id": service, "service": "hub.status"}, b"")
            # the status answer comes after any error about the register (one connection: FIFO)
            answers = until(lambda header, sid=service: header["kind"] == "reply"
                            and header.get("id") == sid)
            codes.append(next((a["code"] for a in answers if a["kind"] == "error"), ""))
        return codes
    finally:
        ctx.destroy(linger=0)


def test_credential_files_have_the_documented_names_and_format(tmp_path: Path) -> None:
    stated = re.search(r"alphabet, `(\^[^`]+\$)`", DOC)
    assert stated is not None, "the credential format"
    fmt = re.compile(stated.group(1))
    proc, ready = start_up(tmp_path)
    try:
        folder = Path(ready["endpoint"][len("ipc://"):]).parent
        files = {f.name for f in folder.glob("*.cred")}
        # each file the document names (as a pattern for the numbered ones) is there, and no other
        named = {"owner.cred": "owner", "worker.cred": "worker", "gateway.cred": "gateway",
                 "worker-<group>.cred": r"worker-\w+", "coordinator-<N>.cred": r"coordinator-\d+"}
        assert all(f"`{name}`" in DOC for name in named), named
        for pattern in named.values():
            assert any(re.fullmatch(rf"{pattern}\.cred", f) for f in files), (pattern, files)
        assert all(any(re.fullmatch(rf"{pattern}\.cred", f) for pattern in named.values())
                   for f in files), files
        for name in files:
            assert fmt.fullmatch((folder / name).read_text()), name  # no newline either
        # the foreign tool takes worker.cred, as the document says: tools yes, `llm` no
        worker = (folder / "worker.cred").read_text()
        assert "**`worker.cred`**" in DOC
        assert hello_with(ready["endpoint"], worker, ["tool.foreign", "llm"]) == ["", "forbidden"]
    finally:
        proc.stop(timeout=8)


# --- trace ids ---------------------------------------------------------------------------


def h(n: int, text: str) -> int:
    """The document's `H(n, s)`."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=n).digest(), "big") or 1


def test_trace_ids_follow_the_documented_recipe() -> None:
    text = bullet("Trace ids")
    for run, root, call_id in (("7e57c0de", "", "c1"), ("r2", "7e57c0de", "call_9")):
        assert trace_id(root or run) == h(16, root or run)
        assert span_id(run) == h(8, run)
        assert chat_span_id(run, 3) == h(8, "\x1f".join((run, "chat", "3")))
        expected = f"00-{h(16, root or run):032x}-{h(8, chr(31).join((run, 'tool', call_id))):016x}-01"
        assert tool_traceparent(run, call_id, root) == expected
    example = re.search(r"it is `(00-[0-9a-f]{32}-[0-9a-f]{16}-01)`", text)
    assert example is not None and example.group(1) == tool_traceparent("7e57c0de", "c1")
