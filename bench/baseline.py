"""The raw-pyzmq baseline every benchmark compares against, measured in the same run.

A blocking DEALER -> ROUTER broker -> DEALER worker echo, with no framing beyond a kind frame:
the physical limit of one broker hop on this machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import zmq


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_broker(endpoint: str) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    worker: bytes | None = None
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        poller.poll()
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            ident, kind = frames[0], frames[1]
            if kind == b"ready":
                worker = ident
            elif kind == b"req" and worker is not None:  # [client, req, body] -> worker
                router.send_multipart([worker, b"req", ident, *frames[2:]])
            elif kind == b"rep":  # [worker, rep, client, body] -> client
                router.send_multipart([frames[2], b"rep", *frames[3:]])
            elif kind == b"stop":
                return


def _raw_worker(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    sock.send_multipart([b"ready"])
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart([b"rep", *frames[1:]])


def raw_round_trip(n: int, body: bytes = b"x" * 64) -> tuple[float, float]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_raw_broker, args=(endpoint,), daemon=True),
             spawn.Process(target=_raw_worker, args=(endpoint,), daemon=True)]
    for proc in procs:
        proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        while True:  # until the worker has registered
            sock.send_multipart([b"req", body])
            if sock.poll(200):
                sock.recv_multipart()
                break
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.send_multipart([b"req", body])
            sock.recv_multipart()
            times.append(time.perf_counter() - t0)
        return pct(times, 0.5), pct(times, 0.99)
    finally:
        sock.close()
        ctx.term()
        for proc in procs:
            proc.kill()
            proc.join()
