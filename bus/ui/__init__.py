"""`busctl ui`: a live web view of the bus, served on a local port with the standard library.

One process: the bus subscription (replay from seq 0, then live — the same no-hole stream as
`busctl watch`) runs on the anyio loop and appends each event, as its `--json` line, to a bounded
`EventStore`; an `http.server` thread serves the page (plain JavaScript from `static/`, no CDN,
no build step) and streams the store to each open page as Server-Sent Events. The SSE `id` is the
event's seq, so a page that reconnects (`Last-Event-ID`) continues where it stopped, with no
duplicate. The standard library, not an ASGI server: a page per person needs a thread each, and
no optional extra is needed to see a run.

Access: the page answers only its user (`access.py`): every route needs the page's token, kept
in a 0600 file of the user's private runtime folder; the printed link is a `file://` launcher
there that hands it to the browser once, for an HttpOnly cookie. On loopback every request must
also name loopback in its Host (and Origin, when sent): `bus.httpguard`, the same check as
`busctl mcp serve --http`, refuses a DNS-rebinding page before the token is looked at.

Experiments: `GET /experiment?name=E` answers the experiment page's data (the report of
`busctl experiment report E --json`, progress, the per-sample rows) from the `ExperimentPages`
it is given (`busctl ui` gives `agents/experiment/pages.py`'s book: the bus knows nothing of
experiments, it shows what it is handed); the
list of experiments, with a version per experiment, rides in the status snapshot, so a page
refetches an open experiment when it changed.

Drops: the subscription's counts (events the live stream lost and the log filled in, gaps the
log no longer had) are served as `subscriber.ui-<pid>`, which `busctl status` reads.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Protocol
from urllib.parse import unquote

import anyio
import msgspec

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import IncomingRequest, Peer, Subscription, connect
from agent_bus.bus.errors import AgentBusError, RegisterRefused
from agent_bus.bus.httpguard import refusal
from agent_bus.bus.render import json_line
from agent_bus.bus.security import CurveClient
from agent_bus.bus.ui.access import (
    REFUSED_TEXT,
    Access,
    Verdict,
    hand_out,
    new_token,
    swap_page,
    withdraw,
)

log = logging.getLogger("busctl.ui")

MAX_EVENTS = 100_000   # kept for pages that open later; older ones are only in the hub's log
HEARTBEAT = 10.0       # an SSE comment this often: a closed tab is noticed, proxies keep it open
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8")}


class ExperimentPages(Protocol):
    """The experiments the view serves pages of, kept from the hub's log and the stream."""

    def note_event(self, header: p.Header, event: ev.Event) -> None:
        """An event of the view's subscription (a cell's run starting or ending)."""

    async def catch_up(self, peer: Peer) -> None:
        """Read what the log holds since the last call."""

    def summary(self) -> list[dict[str, Any]]:
        """The list of experiments, each with a version a page refetches on."""

    def page(self, name: str) -> dict[str, Any] | None:
        """One experiment page's data; None: no such experiment."""


class NoExperiments:
    """Pages for a view given no experiments: none to list, none to show."""

    def note_event(self, header: p.Header, event: ev.Event) -> None:
        return

    async def catch_up(self, peer: Peer) -> None:
        return

    def summary(self) -> list[dict[str, Any]]:
        return []

    def page(self, name: str) -> dict[str, Any] | None:
        return None


class EventStore:
    """The last `limit` events as (seq, JSON text); readers wait for seqs after their own.

    Two parallel lists, trimmed by a quarter when full: a reader finds its place by bisection,
    so a page opening (or reconnecting) costs log(n), not a scan of the whole store."""

    def __init__(self, limit: int = MAX_EVENTS) -> None:
        self.limit = limit
        self.seqs: list[int] = []
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        self.status = ""       # the hub's latest status (load, queues) as JSON
        self.status_version = 0

    def set_status(self, text: str) -> None:
        with self.cond:
            if text != self.status:
                self.status, self.status_version = text, self.status_version + 1
                self.cond.notify_all()

    def add(self, seq: int, line: str) -> None:
        with self.cond:
            self.seqs.append(seq)
            self.lines.append(line)
            if len(self.seqs) > self.limit:
                cut = len(self.seqs) - self.limit * 3 // 4
                del self.seqs[:cut], self.lines[:cut]
            self.cond.notify_all()

    def after(self, seq: int, timeout: float, most: int = 5000,
              status_version: int | None = None) -> list[tuple[int, str]]:
        """Up to `most` events with a seq above `seq`, waiting up to `timeout` for the first (or
        for a status newer than `status_version`)."""
        with self.cond:
            same_status = status_version is None or status_version == self.status_version
            if not self._newer(seq) and not self.closed and same_status:
                self.cond.wait(timeout)
            start = bisect.bisect_right(self.seqs, seq)
            end = min(start + most, len(self.seqs))
            return list(zip(self.seqs[start:end], self.lines[start:end], strict=True))

    def _newer(self, seq: int) -> bool:
        return bool(self.seqs) and self.seqs[-1] > seq

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _query(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in path.partition("?")[2].split("&"):
        key, _, value = item.partition("=")
        out.setdefault(key, value)
    return out


class ViewServer(ThreadingHTTPServer):
    """The view's HTTP server: what its request handlers serve from (`PageHandler`)."""

    daemon_threads = True  # an open page must not keep the process alive

    def __init__(self, address: tuple[str, int], store: EventStore, pages: ExperimentPages,
                 token: str) -> None:
        super().__init__(address, PageHandler)
        self.store, self.pages, self.bind = store, pages, address[0]
        self.access = Access(token, self.server_address[1])


class PageHandler(BaseHTTPRequestHandler):
    """One request to the view: the page, its events as SSE, an experiment's data."""

    protocol_version = "HTTP/1.1"
    server: ViewServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if not self._allowed(path):
            return
        if path == "/events":
            self._events()
        elif path == "/experiment":
            self._experiment()
        elif path in STATIC:
            self._static(*STATIC[path])
        else:
            self._send(404, b"not found: the page is at /", "text/plain")

    def _allowed(self, path: str) -> bool:
        """The Host/Origin check (DNS rebinding), then the token: else answered here."""
        refused = refusal(self.server.bind, self.headers.get("Host"), self.headers.get("Origin"))
        if refused is not None:
            log.info("ui: refused a request for %s: %s", path, refused[1])
            self._send(refused[0], refused[1].encode(), "text/plain")
            return False
        verdict = self.server.access.verdict(_query(self.path), self.headers.get("Cookie", ""),
                                 self.headers.get("Authorization", ""))
        if verdict is Verdict.SWAP:
            self._send(200, swap_page(self.path), "text/html; charset=utf-8",
                       {"Set-Cookie": self.server.access.set_cookie()})
        elif verdict is Verdict.REFUSED:
            log.info("ui: refused a request without the token for %s", path)
            self._send(401, REFUSED_TEXT, "text/plain; charset=utf-8",
                       {"WWW-Authenticate": 'Bearer realm="busctl ui"'})
        return verdict is Verdict.ALLOWED

    def _send(self, code: int, body: bytes, ctype: str,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self._private_headers(extra or {})
        self.end_headers()
        self.wfile.write(body)

    def _private_headers(self, extra: dict[str, str]) -> None:
        # no cache keeps a copy, and no address (a `?token=` one) is sent on as a referrer
        self.send_header("Cache-Control", "no-store")
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in extra.items():
            self.send_header(name, value)

    def _static(self, name: str, ctype: str) -> None:
        body = resources.files("agent_bus.bus.ui").joinpath("static", name).read_bytes()
        self._send(200, body, ctype)

    def _experiment(self) -> None:
        name = unquote(_query(self.path).get("name", ""))
        data = self.server.pages.page(name)
        if data is None:
            self._send(404, f"no experiment {name!r} journaled in the hub's log (`busctl "
                            f"experiment run SPEC --name E` starts one)".encode(),
                       "text/plain; charset=utf-8")
            return
        self._send(200, msgspec.json.encode(data), "application/json")

    def _since(self) -> int:
        last = self.headers.get("Last-Event-ID", "") or _query(self.path).get("since", "")
        try:
            return int(last) if last else -1
        except ValueError:  # a hand-written URL: everything, rather than an error page
            log.info("ui: ignoring a bad since/Last-Event-ID %r", last)
            return -1

    def _events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self._private_headers({})
        self.end_headers()
        seq = self._since()
        version = -1
        try:
            store = self.server.store
            while not store.closed:
                batch = store.after(seq, HEARTBEAT, status_version=version)
                chunk = "".join(f"id: {s}\ndata: {line}\n\n" for s, line in batch)
                if version != store.status_version:
                    # `event: status` has no id: it is a snapshot, not part of the stream
                    version = store.status_version
                    if store.status:
                        chunk += f"event: status\ndata: {store.status}\n\n"
                chunk = chunk or ": hb\n\n"
                self.wfile.write(chunk.encode())
                self.wfile.flush()
                seq = batch[-1][0] if batch else seq
        except (BrokenPipeError, ConnectionResetError):
            return  # the tab closed

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("ui: " + format, *args)


async def _poll_status(peer: Peer, store: EventStore, book: ExperimentPages,
                       interval: float = 0.5) -> None:
    """Load and queues are not events: the hub's status, polled, goes to the pages as a snapshot,
    with whether the hub answers (`hub.ok`) and since when it does not, and the experiments'
    list (`_follow_journal` keeps it). The link's own liveness
    (`peer.connected`: the hub's heartbeats) says "unreachable" without waiting for a request
    to time out; the peers and services sent last stay on the page, greyed."""
    last: dict[str, Any] = {}
    down_since = 0.0
    while True:
        status = None
        if peer.connected:
            try:
                status = await peer.status(timeout=2.0)
            except AgentBusError as exc:  # a hub restarting: the next poll will do
                log.info("ui: hub status unavailable: %s", exc)
        if status is not None:
            down_since = 0.0
            last = {"peers": status.peers, "services": status.services, "hub": {"ok": True}}
        else:
            down_since = down_since or time.time()
            last = {**last, "hub": {"ok": False, "since": down_since}}
        last["experiments"] = book.summary()
        store.set_status(msgspec.json.encode(last).decode())
        await anyio.sleep(interval)


async def _follow_journal(peer: Peer, book: ExperimentPages, interval: float = 0.5) -> None:
    """Read the experiments' journal events on from the log (agents/experiment/pages.py says
    why not from the subscription), on its own so a slow replay never holds up the status."""
    while True:
        if peer.connected:
            try:
                await book.catch_up(peer)
            except AgentBusError as exc:  # a hub restarting: the next poll reads on
                log.info("ui: experiment journal unavailable: %s", exc)
        await anyio.sleep(interval)


class Drops(msgspec.Struct):
    """A subscriber's losses, as `subscriber.<name>` answers them (`busctl status` shows them)."""

    name: str
    kind: str
    seq: int = 0
    refilled: int = 0   # events the live stream dropped (the hub's queue for us was full), read
    # from the log instead: nothing lost, but we fell behind
    gaps: int = 0       # ranges the log no longer held (retention): lost for good
    lost: int = 0       # events in those ranges
    extra: dict[str, int] = msgspec.field(default_factory=dict)


async def serve_drops(peer: Peer, drops: Drops, sub: Subscription,
                      extra: Callable[[], dict[str, int]] | None = None) -> None:
    """Register `subscriber.<name>`, answering with the subscription's current counts."""

    def answer(req: IncomingRequest) -> bytes:  # from memory: no task (bus/serving.py)
        drops.refilled = sub.filled
        if extra is not None:
            drops.extra = extra()
        return msgspec.msgpack.encode(drops)

    try:
        await peer.serve(f"subscriber.{drops.name}", answer, capacity=4)
    except RegisterRefused as exc:  # a key whose roles leave it out: the view works without it
        log.warning("%s; this subscriber's losses are not shown in `busctl status`", exc)


async def serve_ui(hub: str, curve: CurveClient | None, port: int, since: int = 0,
                   host: str = "127.0.0.1", token: str = "", open_browser: bool = False,
                   experiments: ExperimentPages | None = None) -> None:
    """Serve the view on `host:port` with `token` ("": a new one) until cancelled or SIGTERM;
    with `open_browser`, open its link in the user's browser once it is ready; the experiment
    pages from `experiments` (None: none)."""
    store = EventStore()
    book = experiments or NoExperiments()
    server = ViewServer((host, port), store, book, token or new_token())
    access = server.access
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    page = f"http://{shown}:{access.port}/"
    try:
        handout = hand_out(access, page)
    except BaseException:
        server.server_close()
        raise
    threading.Thread(target=server.serve_forever, name="ui-http", daemon=True).start()
    # `url` is the link the owner opens (it holds no secret); `page` the server, for scripts
    ready = {"ready": "ui", "url": handout.link, "page": page, "bind": host,
             "token_file": str(handout.token_file), "token": "given" if token else "generated"}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, tg.cancel_scope)
            await _follow(hub, curve, since, store, book, ready, open_browser)
            tg.cancel_scope.cancel()
    finally:
        withdraw(handout, access)
        store.close()
        await anyio.to_thread.run_sync(server.shutdown)
        server.server_close()


async def _open_link(link: str) -> None:
    """The launcher's `file://` link, not the address with the token: a browser's arguments are
    in `ps` for every local user to read."""
    import webbrowser

    if not await anyio.to_thread.run_sync(webbrowser.open, link):
        log.warning("ui: no browser to open %s (set $BROWSER): open it by hand", link)


async def _stop_on_signal(scope: anyio.CancelScope) -> None:
    """SIGTERM (a supervisor, `busctl down`) ends the view cleanly: its token files go with it."""
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _follow(hub: str, curve: CurveClient | None, since: int, store: EventStore,
                  book: ExperimentPages, ready: dict[str, str], open_browser: bool) -> None:
    """The hub's events into `store` (and the book), the status polled; `ready` printed once
    subscribed."""
    drops = Drops(f"ui-{os.getpid()}", "ui")
    async with connect(hub, name="busctl-ui", role="watcher", curve=curve) as peer, \
            anyio.create_task_group() as tg:
        tg.start_soon(_poll_status, peer, store, book)
        tg.start_soon(_follow_journal, peer, book)
        async with peer.subscribe([], since=since, fill_gaps=True) as sub:
            sub.tally = ev.EventTally("busctl ui", log.warning)  # skipped, counted, named
            await serve_drops(peer, drops, sub, lambda: {"undecodable": sub.tally.bad})
            print(json.dumps(ready), flush=True)
            if open_browser:
                tg.start_soon(_open_link, ready["url"])
            last = since
            async for envelope in sub:
                # A `Gap` (a range retention pruned) has no seq of its own: not an SSE id.
                if envelope.header.seq <= last:
                    count_gap(drops, envelope.event)
                    continue
                last = drops.seq = envelope.header.seq
                store.add(last, json_line(envelope.header, envelope.event))
                book.note_event(envelope.header, envelope.event)
        tg.cancel_scope.cancel()


def count_gap(drops: Drops, event: ev.Event) -> None:
    if isinstance(event, ev.Gap):
        drops.gaps += 1
        drops.lost += event.last - event.first + 1
