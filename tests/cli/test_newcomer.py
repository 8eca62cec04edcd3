"""A new user's trips (issue 31), each through the real CLI in a subprocess: a topology file that
`config check` passes but `up` cannot run, a busy events port, keys made twice, a run id as `watch`
prints it, an address typed the short way in Python, `ps` under BUSCTL_HUB."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import Topology, json_lines, pid_alive, start_up
from tests.support import ROOT, busctl, py


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    """A free port whose next one is free too (a hub binds its events on port + 1)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 65535:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port


BAD_HUBS = [
    ('endpoint = "tcp://127.0.0.1:99999"', "hub.endpoint", "65535"),
    ('endpoint = "htp://127.0.0.1:7400"', "hub.endpoint", "tcp://HOST:PORT or ipc://PATH"),
    ("heartbeat_interval = -1", "hub.heartbeat_interval", "out of range"),
]


def test_config_check_and_up_refuse_the_same_values_naming_the_key(tmp_path: Path) -> None:
    """One validation for both (defect 5): ranges and schemes, exit 2, one line naming the key;
    `up` starts nothing (no OverflowError, no hub restart loop)."""
    for body, key, hint in BAD_HUBS:
        config = tmp_path / "bad.toml"
        config.write_text(f"[hub]\n{body}\n")
        for args in (("config", "check", str(config)), ("up", "-c", str(config))):
            result = cli(*args, cwd=tmp_path)
            assert result.returncode == 2, (args, body, result.stdout, result.stderr)
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and key in lines[0] and hint in lines[0], (args, result.stderr)
            assert "a bug" not in result.stderr
    # The flag is checked as well as the file: `--hub` with a port past 65535 is named.
    result = cli("up", "--hub", "tcp://127.0.0.1:99999", cwd=tmp_path)
    assert result.returncode == 2 and "--hub" in result.stderr and "65535" in result.stderr, \
        result.stderr


def test_up_refuses_a_busy_events_port_and_keys_are_not_overwritten(tmp_path: Path) -> None:
    """Defect 6: a hub bound on tcp (`insecure`, so no ipc alias) whose events port (port + 1)
    is taken is refused at once, naming that port. Defect 7: `keys generate` twice refuses
    without --force and keeps the first keys."""
    port = free_port()
    config = tmp_path / "tcp.toml"
    config.write_text(f'[hub]\nendpoint = "tcp://127.0.0.1:{port}"\ninsecure = true\n')
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        result = cli("up", "-c", str(config), cwd=tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"tcp://127.0.0.1:{port + 1} (the hub's events port) is already in use" in result.stderr, \
        result.stderr
    assert "a bug" not in result.stderr

    keys = tmp_path / "keys"
    first = cli("keys", "generate", str(keys), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    hub_secret = (keys / "hub.key_secret").read_bytes()
    again = cli("keys", "generate", str(keys), cwd=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr and "hub.key" in again.stderr, \
        again.stderr
    assert (keys / "hub.key_secret").read_bytes() == hub_secret
    forced = cli("keys", "generate", str(keys), "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (keys / "hub.key_secret").read_bytes() != hub_secret


CLIENT = """
import asyncio, sys
from agent_bus import connect

async def main(hub):
    async with connect(hub or None) as bus:
        print(sorted(await bus.agents()))

asyncio.run(main(sys.argv[1]))
"""


def test_short_addresses_run_prefixes_and_ps(tmp_path: Path, fake_llm: FakeLLMServer) -> None:
    """On one topology listening at `tcp://127.0.0.1:PORT` (this user's ipc alias): Python's
    `connect("127.0.0.1:PORT")` and `BUSCTL_HUB=PORT` work as in the CLI (defect 4); `watch --run`
    takes the 8 characters watch prints and says when a filter matched nothing (defect 8);
    `ps` shows this directory's processes whatever BUSCTL_HUB says (defect 9)."""
    port = free_port()
    env = {"OPENAI_BASE_URL": fake_llm.base_url, "OPENAI_API_KEY": ""}
    proc, _ = start_up(tmp_path, "--hub", f"tcp://127.0.0.1:{port}", env=env)
    topo = Topology(proc, tmp_path, {"endpoint": "", "events": ""})
    pids = topo.child_pids()
    try:
        clean = {k: v for k, v in os.environ.items() if k != "BUSCTL_HUB"}
        for hub, extra in ((f"127.0.0.1:{port}", {}), ("", {"BUSCTL_HUB": str(port)})):
            out = subprocess.run(py("-c", CLIENT, hub), capture_output=True, text=True, timeout=30,
                                 cwd=ROOT, env={**clean, **extra})
            assert out.returncode == 0 and "assistant" in out.stdout, (hub, extra, out.stderr)

        short = {"BUSCTL_HUB": str(port)}
        run = cli("run", "hello there", cwd=tmp_path, env=short)
        assert run.returncode == 0, run.stdout + run.stderr
        full = cli("watch", "--json", "--no-follow", "--since", "0", cwd=tmp_path, env=short)
        run_id = next(e["run_id"] for e in json_lines(full.stdout) if e.get("run_id"))
        by_prefix = cli("watch", "--json", "--no-follow", "--since", "0", "--run", run_id[:8],
                        cwd=tmp_path, env=short)
        events = json_lines(by_prefix.stdout)
        assert events and {e["run_id"] for e in events} == {run_id}, by_prefix.stderr
        assert "agent_end" in {e["type"] for e in events}
        assert by_prefix.stderr == ""
        nothing = cli("watch", "--no-follow", "--since", "0", "--run", "zzzz", cwd=tmp_path,
                      env=short)
        assert nothing.returncode == 0 and nothing.stdout == ""
        assert "no event matched --run zzzz" in nothing.stderr, nothing.stderr
        # issue 49, item 4: the hint is about the filter given (the live agents for --agent)
        nobody = cli("watch", "--no-follow", "--agent", "nobody", cwd=tmp_path, env=short)
        assert nobody.returncode == 0 and nobody.stdout == ""
        assert "no event matched --agent nobody (live agents: assistant;" in nobody.stderr, \
            nobody.stderr
        assert "prefix" not in nobody.stderr

        # BUSCTL_HUB names a hub for commands that talk to one; `ps` keeps listing this
        # directory's processes (only `--hub` on the command line switches it to a hub's peers).
        ps = cli("ps", "--json", cwd=tmp_path, env={"BUSCTL_HUB": "tcp://127.0.0.1:1"})
        assert ps.returncode == 0, ps.stderr
        assert {"hub", "gateway-1", "coordinator-1"} <= {r["name"] for r in json_lines(ps.stdout)}
    finally:
        proc.stop(timeout=8)
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, 9)


def _run_on_a_terminal(args: list[str], timeout: float = 30) -> tuple[int, str, str]:
    """`args` with stdout on a pseudo-terminal (stderr a pipe): exit code, stdout, stderr."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        _, err = proc.communicate(timeout=timeout)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, b"".join(chunks).decode(), err


def test_run_on_a_terminal_max_turns_and_a_quiet_shutdown(up_default: Topology) -> None:
    """Defect 9: on a terminal the answer is printed once; a run stopped by --max-turns exits 3
    with a line on stderr; `busctl down` leaves no ERROR in the hub's log (its replay reader is
    no longer killed by the signal meant for the hub)."""
    topo = up_default
    code, out, err = _run_on_a_terminal(busctl("run", "--hub", topo.endpoint, "say tangerine"))
    assert code == 0, out + err
    assert out.count("say tangerine") == 1, (out, err)

    bounded = cli("run", "--hub", topo.endpoint, "--max-turns", "1", "explore here", cwd=topo.cwd)
    assert bounded.returncode == 3, bounded.stdout + bounded.stderr
    assert "stopped at its turn limit" in bounded.stderr and "exit 3" in bounded.stderr

    replayed = cli("watch", "--hub", topo.endpoint, "--no-follow", "--since", "0", cwd=topo.cwd)
    assert replayed.returncode == 0, replayed.stderr  # the hub's replay reader has work
    down = cli("down", cwd=topo.cwd)
    assert down.returncode == 0, down.stderr
    topo.proc.popen.wait(15)
    logs = cli("logs", "hub", cwd=topo.cwd)
    assert logs.returncode == 0 and "hub" in logs.stdout, logs
    assert " ERROR " not in logs.stdout, logs.stdout


def test_chat_answers_help_and_says_once_that_the_hub_went_and_came_back(tmp_path: Path) -> None:
    """Defect 9: `/help` lists chat's commands (no prompt is sent: no agent exists here); the hub
    going away is one WARNING however long it stays away (retries are DEBUG), and its return
    one more line."""
    from tests.bus.helpers import kill_hub, start_hub
    from tests.support import Proc

    port = free_port()
    hub = start_hub(port, port + 1, tmp_path / "hub")
    chat = Proc(busctl("-v", "chat", "--hub", f"tcp://127.0.0.1:{port}"), stdin=subprocess.PIPE)
    try:
        chat.wait_line(lambda s: s.startswith("chatting with"), 20)
        assert chat.popen.stdin is not None
        chat.popen.stdin.write("/help\n")
        chat.popen.stdin.flush()
        chat.wait_line(lambda s: "/follow TEXT" in s and "follow-up" in s, 10)
        kill_hub(hub, port, port + 1)
        hub.stop()  # (its pipe closed)
        # Two tries without an answer: the second is logged at DEBUG, not WARNING.
        retries = 0

        def second_try(line: str) -> bool:
            nonlocal retries
            retries += "no word from the hub" in line
            return retries == 2

        chat.wait_line(second_try, 30)
        hub = start_hub(port, port + 1, tmp_path / "hub")
        chat.wait_line(lambda s: "is back; reconnected" in s, 20)
        chat.popen.stdin.close()
        assert chat.popen.wait(15) == 0, chat.output()
        lines = chat.output().splitlines()
        warned = [line for line in lines if " WARNING " in line and "no word from the hub" in line]
        back = [line for line in lines if " WARNING " in line and "is back" in line]
        assert len(warned) == 1 and len(back) == 1, chat.output()
        assert "NoAgent" not in chat.output() and "no agent" not in chat.output().lower()
    finally:
        chat.stop()
        hub.stop()
