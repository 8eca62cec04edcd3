"""Issue 44, break 7: a topology whose hub listens on a private `ipc://` socket but publishes its
events on `tcp://` gives every local user the whole stream (prompts, replies, tool output), with no
word from `busctl up` or `busctl config check`. Both now refuse it, naming `hub.events` and the
ways out: an ipc:// events address, CURVE, or `hub.insecure = true`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.multihost.conftest import generate
from tests.support import Proc, busctl, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _topology(tmp_path: Path, hub: str) -> Path:
    config = tmp_path / "topology.toml"
    config.write_text(f"[hub]\nendpoint = \"ipc://{tmp_path}/run/hub\"\n{hub}\n"
                      "[[workers]]\ncount = 0\n")
    return config


def _run(*args: str, cwd: Path) -> tuple[int | None, str]:
    """Exit code and output of `busctl ARGS`; a command still running after the deadline (an
    `up` that started) is stopped with its processes, and its code is None."""
    proc = Proc(busctl(*args), cwd=cwd)
    try:
        wait_for(lambda: proc.popen.poll() is not None, 30, f"busctl {args[0]} to exit")
    except TimeoutError:
        pass
    finally:
        code = proc.popen.poll()
        proc.stop(timeout=10)
    return code, proc.output()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("command", [["config", "check"], ["up"]])
def test_tcp_events_beside_an_ipc_hub_are_refused_naming_the_key(tmp_path: Path,
                                                                  command: list[str]) -> None:
    port = _free_port()
    config = _topology(tmp_path, f'events = "tcp://127.0.0.1:{port}"')
    args = [*command, str(config)] if command[0] == "config" else [*command, "-c", str(config)]
    code, out = _run(*args, cwd=tmp_path)
    assert code not in (None, 0), out
    assert "hub.events" in out and "every local user" in out, out
    for fix in ("ipc://", "curve_secret", "insecure = true"):
        assert fix in out, out
    assert not _listening(port), "the events port was bound anyway"


@pytest.mark.parametrize("hub", [
    'events = "tcp://127.0.0.1:{port}"\ninsecure = true',  # the user's explicit opt-in
    'events = "ipc://{tmp}/run/hub.events"',
    "",  # events beside the socket (ipc)
])
def test_what_keeps_the_events_private_or_says_so_is_accepted(tmp_path: Path, hub: str) -> None:
    config = _topology(tmp_path, hub.format(port=_free_port(), tmp=tmp_path))
    code, out = _run("config", "check", str(config), cwd=tmp_path)
    assert code == 0, out


def test_tcp_events_with_curve_are_accepted(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate(keys, "owner")
    config = _topology(tmp_path, f"""events = "tcp://127.0.0.1:{_free_port()}"
curve_secret = "{keys}/hub.key_secret"
curve_authorized = "{keys}/authorized"
curve_server_key = "{keys}/hub.key"
curve_client_key = "{keys}/owner.key_secret\"""")
    code, out = _run("config", "check", str(config), cwd=tmp_path)
    assert code == 0, out
