"""`busctl ui`: a live web view of the bus, served on a loopback port with the standard library.

One process: the bus subscription (replay from seq 0, then live — the same no-hole stream as
`busctl watch`) runs on the anyio loop and appends each event, as its `--json` line, to a bounded
`EventStore`; an `http.server` thread serves the page (plain JavaScript from `static/`, no CDN,
no build step) and streams the store to each open page as Server-Sent Events. The SSE `id` is the
event's seq, so a page that reconnects (`Last-Event-ID`) continues where it stopped, with no
duplicate. The standard library, not an ASGI server: a page per person needs a thread each, and
no optional extra is needed to see a run.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

import anyio
import msgspec

from bus.client import Peer, connect
from bus.errors import AgentBusError
from bus.render import json_line
from bus.security import CurveClient

log = logging.getLogger("busctl.ui")

MAX_EVENTS = 100_000   # kept for pages that open later; older ones are only in the hub's log
HEARTBEAT = 10.0       # an SSE comment this often: a closed tab is noticed, proxies keep it open
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8")}


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


def _handler(store: EventStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/events":
                self._events()
            elif path in STATIC:
                self._static(*STATIC[path])
            else:
                self._send(404, b"not found: the page is at /", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _static(self, name: str, ctype: str) -> None:
            body = resources.files("bus.ui").joinpath("static", name).read_bytes()
            self._send(200, body, ctype)

        def _since(self) -> int:
            last = self.headers.get("Last-Event-ID", "")
            query = self.path.partition("?")[2]
            for item in query.split("&"):
                key, _, value = item.partition("=")
                if key == "since" and not last:
                    last = value
            try:
                return int(last) if last else -1
            except ValueError:  # a hand-written URL: everything, rather than an error page
                log.info("ui: ignoring a bad since/Last-Event-ID %r", last)
                return -1

        def _events(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            seq = self._since()
            version = -1
            try:
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

    return Handler


async def _poll_status(peer: Peer, store: EventStore, interval: float = 1.0) -> None:
    """Load and queues are not events: the hub's status, polled, goes to the pages as a snapshot."""
    while True:
        try:
            status = await peer.status()
            store.set_status(msgspec.json.encode({"peers": status.peers,
                                                  "services": status.services}).decode())
        except AgentBusError as exc:  # a hub restarting: the next poll will do
            log.info("ui: hub status unavailable: %s", exc)
        await anyio.sleep(interval)


async def serve_ui(hub: str, curve: CurveClient | None, port: int, since: int = 0) -> None:
    store = EventStore()
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(store))
    server.daemon_threads = True  # an open page must not keep the process alive
    thread = threading.Thread(target=server.serve_forever, name="ui-http", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        async with connect(hub, name="busctl-ui", role="watcher", curve=curve) as peer, \
                anyio.create_task_group() as tg:
            tg.start_soon(_poll_status, peer, store)
            async with peer.subscribe([], since=since, fill_gaps=True) as sub:
                print(json.dumps({"ready": "ui", "url": url}), flush=True)
                last = since
                async for envelope in sub:
                    # A `Gap` (a range retention pruned) has no seq of its own: not an SSE id.
                    if envelope.header.seq <= last:
                        continue
                    last = envelope.header.seq
                    store.add(last, json_line(envelope.header, envelope.event))
            tg.cancel_scope.cancel()
    finally:
        store.close()
        await anyio.to_thread.run_sync(server.shutdown)
        server.server_close()
