"""Issue 12 §9: a full disk under the event log is an operating condition, not a crash.

The hub runs in a private mount namespace with its state dir on a small tmpfs (root only; the
test is skipped elsewhere). The test fills that tmpfs through `/proc/<hub pid>/root`, so the
hub's own view of the disk is what fills up, and frees it again.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope, IncomingRequest, Peer, Subscription, connect
from tests.support import Proc, busctl, until

pytestmark = pytest.mark.anyio

TOPIC = "disk"  # the TopicMessage topic of this test's events


def tmpfs_namespaces_work(where: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {where}"],
                           capture_output=True, timeout=10)
    return probe.returncode == 0


def hub_on_tmpfs(state: Path, size: str) -> Proc:
    """`busctl hub` with `state` a tmpfs of `size` that only the hub's mount namespace sees."""
    hub = (f"exec {sys.executable} -m agent_bus.cli hub --hub tcp://127.0.0.1:0 "
           f"--state-dir {state} --heartbeat-interval 0.2")
    return Proc(["unshare", "-m", "sh", "-c",
                 f"mount -t tmpfs -o size={size} tmpfs {state} && {hub}"])


def fill(directory: Path) -> Path:
    """Write a file in `directory` until the file system is full."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    small = b"\0" * 512
    with open(filler, "ab", buffering=0) as out:  # the last partial block too
        try:
            while True:
                out.write(small)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


async def logged_texts(peer: Peer) -> list[tuple[int, str]]:
    """(seq, text) of this test's events in the hub's log, replayed from the start; and it
    checks that the whole log (the hub's own events included) is numbered 1, 2, 3, ..."""
    head = (await peer.status()).seq
    seqs: list[int] = []
    texts: list[tuple[int, str]] = []
    async with peer.subscribe(since=0) as sub:
        async for env in sub:
            seqs.append(env.header.seq)
            if isinstance(env.event, ev.TopicMessage) and env.event.topic == TOPIC:
                texts.append((env.header.seq, env.event.text))
            if env.header.seq >= head:
                break
    assert seqs == list(range(1, head + 1)), "the log has a gap or a duplicate"
    return texts


async def test_disk_full_refuses_events_keeps_routing_and_recovers(tmp_path: Path) -> None:
    state = tmp_path / "hub"
    state.mkdir()
    if not tmpfs_namespaces_work(state):
        pytest.skip("needs root and `unshare -m` to mount a private tmpfs")
    proc = hub_on_tmpfs(state, "2m")
    try:
        ready = proc.wait_ready()
        ep = ready["endpoint"]
        seen_by_hub = Path(f"/proc/{ready['pid']}/root") / str(state).lstrip("/")
        assert (seen_by_hub / "events.db").exists()
        assert not (state / "events.db").exists(), "the tmpfs is not private to the hub"
        published: list[str] = []

        async def echo(req: IncomingRequest) -> bytes:
            return b"echo:" + req.body

        async with connect(ep, name="server") as server, \
                connect(ep, name="publisher") as pub, connect(ep, name="driver") as driver:
            await server.serve("echo", echo)
            await server.status()

            async def publish(text: str) -> None:
                await pub.publish(ev.TopicMessage(topic=TOPIC, text=text))
                published.append(text)

            for i in range(20):
                await publish(f"before-{i}")
            await pub.status()  # in order on one connection: all 20 handled...
            assert len(await logged_texts(driver)) == 20  # ...and logged (replay flushes first)

            # The disk fills up: the next batch fails, is refused, and the hub says why.
            filler = fill(seen_by_hub)
            i = 0

            async def refusing() -> bool:
                nonlocal i
                await publish(f"full-{i}")
                i += 1
                return bool((await pub.status()).log_error)

            await until(refusing, 10, "the hub to report the full disk")
            st = await driver.status()
            assert "full" in st.log_error, st.log_error
            assert st.counters["log_write_errors"] >= 1
            # issue 35 item 4: `busctl status`'s text says so too, not only its --json
            shown = await anyio.run_process(busctl("status", "--hub", ep), check=False)
            assert f"EVENTS REFUSED: {st.log_error}" in shown.stdout.decode(), shown.stdout
            head_while_full = st.seq
            for k in range(30):  # refused at the door now: no seq is used
                await publish(f"full-door-{k}")
            st = await pub.status()
            assert st.seq == head_while_full
            assert st.counters["events_refused"] >= 30
            # ...while requests are routed as usual.
            assert await driver.request("echo", b"x", timeout=5) == b"echo:x"
            assert [t for _, t in await logged_texts(driver)] == [f"before-{k}" for k in range(20)]
            await until(lambda: pub.counters.get("events_refused", 0) >= 30, 10,
                        "the publisher to be told its events were refused")
            assert pub.counters.get("stale_replies", 0) == 0

            # Space comes back: logging resumes by itself, seq continues after the last logged.
            filler.unlink()
            t_freed = anyio.current_time()
            j = 0

            async def logging_again() -> bool:
                nonlocal j
                await publish(f"after-{j}")
                j += 1
                return not (await pub.status()).log_error

            await until(logging_again, 10, "the hub to log events again")
            recovered_in = anyio.current_time() - t_freed
            async with driver.subscribe() as sub:
                for k in range(20):
                    await publish(f"live-{k}")
                with anyio.fail_after(10):
                    live = [env async for env in _take(sub, "live-19")]
            assert [e.event.text for e in live][-20:] == [f"live-{k}" for k in range(20)]

            # Every event is either logged exactly once or was refused to its publisher.
            texts = await logged_texts(driver)
            logged = [text for _, text in texts]
            assert len(logged) == len(set(logged)), "an event was logged twice"
            await until(lambda: len(logged) + pub.counters.get("events_refused", 0)
                        == len(published), 10, "every event to be logged or refused")
            assert set(logged) <= set(published)
            assert [t for t in logged if t.startswith("before-")] == \
                [f"before-{k}" for k in range(20)]
            assert not [t for t in logged if t.startswith("full-door-")]
            assert logged[-20:] == [f"live-{k}" for k in range(20)]
            assert texts[0][0] < texts[-1][0]
        output = proc.output()
        assert proc.popen.poll() is None, "the hub exited:\n" + output
        assert output.count("cannot be written") == 1, output  # said once, on stderr
        assert "writable again" in output
        assert "cannot rollback" not in output
        assert recovered_in < 5, f"logging resumed {recovered_in:.1f} s after space was freed"
    finally:
        proc.stop()


async def _take(sub: Subscription, last_text: str) -> AsyncIterator[Envelope]:
    """This test's events from a live subscription, up to the one with `last_text`."""
    async for env in sub:
        if isinstance(env.event, ev.TopicMessage) and env.event.topic == TOPIC:
            yield env
            if env.event.text == last_text:
                return
