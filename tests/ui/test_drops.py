"""`busctl status` shows the events a slow subscriber dropped (issue 19: "drops counted and shown
in `busctl status`"). The drops happen in libzmq's PUB queue for that subscriber, which counts
nothing: the subscriber sees the hole in the seqs and reads it from the log, and reports how many
as `subscriber.<name>`, which `busctl status` adds up. Real processes: a hub on ipc:// (small
kernel buffers) with a 10-message queue per subscriber, `busctl ui` stopped with SIGSTOP while a
publisher sends 20,000 events, then let go."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.support import Proc, busctl, py, wait_for

PUBLISHER = str(Path(__file__).resolve().parents[1] / "fault" / "publisher_proc.py")
EVENTS = 20_000


def status(endpoint: str, *args: str) -> str:
    return subprocess.run(busctl("status", "--hub", endpoint, *args), capture_output=True,
                          text=True, timeout=30, check=True).stdout


def test_a_slow_subscribers_drops_are_counted_in_status(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/hub.sock"
    procs: list[Proc] = []
    try:
        procs.append(hub := Proc(busctl(
            "hub", "--hub", endpoint, "--state-dir", str(tmp_path / "hub"),
            "--subscriber-bytes", str(10 * 8192), "--liveness", "60")))
        hub.wait_ready()
        procs.append(ui := Proc(busctl("ui", "--hub", endpoint, "--port", "0")))
        ui.wait_ready()
        before: dict[str, Any] = json.loads(status(endpoint, "--json"))
        name = f"ui-{ui.pid}"
        assert before["subscribers"][name]["refilled"] == 0 and before["dropped"]["total"] == 0

        ui.signal(signal.SIGSTOP)  # a subscriber that reads nothing for a while
        try:
            procs.append(pub := Proc(py(PUBLISHER, endpoint, str(EVENTS))))
            pub.wait_line(lambda s: s.startswith('{"done"'), 120)
        finally:
            ui.signal(signal.SIGCONT)

        def caught_up() -> dict[str, Any] | None:
            st = json.loads(status(endpoint, "--json"))
            mine = st["subscribers"][name]
            return st if mine["seq"] >= st["seq"] - 5 and mine["refilled"] > 0 else None

        st = wait_for(caught_up, 60, "the stopped subscriber catching up from the log")
        mine = st["subscribers"][name]
        # it fell behind, and the log filled in what its queue dropped: nothing lost
        assert 0 < mine["refilled"] <= EVENTS and mine["lost"] == 0
        assert st["dropped"]["subscribers"] == mine["refilled"]
        assert st["dropped"]["total"] == mine["refilled"] + st["dropped"]["oversize_events"] + \
            st["dropped"]["events_refused"]
        human = status(endpoint)
        assert f"subscriber {name}" in human and "dropped events: " in human
        assert f"refilled from the log {mine['refilled']}" in human
    finally:
        for proc in reversed(procs):
            proc.stop()
