"""A real OTLP/HTTP trace receiver for tests: an HTTP server on a loopback port that decodes each
`POST /v1/traces` with the protocol's generated classes (opentelemetry-proto), the way a collector
does, and keeps the spans. `stop()` closes the socket (the collector is down: connections are
refused); `start()` again binds the same port."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    kind: int
    status: int
    attrs: dict[str, Any]


class Receiver:
    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or \
                        self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(400)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request, dict(self.headers))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self.lock:
            self.requests += 1
            self.last_headers = headers
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(
                            s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                            s.start_time_unix_nano, s.end_time_unix_nano, s.kind, s.status.code,
                            {a.key: value(a.value) for a in s.attributes}))

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
