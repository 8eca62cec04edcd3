"""What busctl says, driven as a user would (real CLI subprocesses, a real hub): hub address
shorthands, the unreachable-hub message as the README states it, Ctrl-C while connecting, unknown
`--type` and experiment names, `export` from the log on disk, red error lines, an example in
every command's help, shell completion, and `up`'s console without machine lines."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import click
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus.client import CONNECT_TIMEOUT, connect
from agent_bus.bus.paths import default_state_dir
from tests.cli.conftest import pid_alive
from tests.support import ROOT, Proc, busctl, wait_for

NO_MODEL = {"OPENAI_API_KEY": "", "OPENAI_BASE_URL": "", "ANTHROPIC_API_KEY": "",
            "ANTHROPIC_BASE_URL": ""}


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def silent_hub() -> Iterator[socket.socket]:
    """A TCP port that accepts connections and never answers: a hub that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener


def start_hub(state: Path) -> tuple[Proc, str]:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(state)))
    try:
        return proc, proc.wait_ready()["endpoint"]
    except BaseException:
        proc.stop()
        raise


def publish(endpoint: str, events: list[tuple[str, ev.Event]]) -> None:
    """Publish (experiment, event) pairs as agent `assistant`; return once the hub logged them."""

    async def go() -> None:
        async with connect(endpoint, name="test-publisher", role="cli") as peer:
            for experiment, event in events:
                await peer.publish(event, agent="assistant", run="run-1", experiment=experiment)
            await peer.confirm()

    anyio.run(go)


def run_events(text: str) -> list[ev.Event]:
    return [ev.AgentStart(), ev.AgentEnd(final_text=text, message_count=2)]


# --- hub addresses -------------------------------------------------------------------------


def test_hub_shorthands_and_a_bad_address(hub: dict) -> None:
    port = hub["endpoint"].rpartition(":")[2]
    for given in (port, f"localhost:{port}", f"127.0.0.1:{port}", hub["endpoint"]):
        status = cli("status", "--hub", given, "--json")
        assert status.returncode == 0, (given, status.stderr)
        assert json.loads(status.stdout)["endpoint"] == hub["endpoint"]
    env_form = cli("status", "--json", env={"BUSCTL_HUB": port})  # the variable takes them too
    assert env_form.returncode == 0, env_form.stderr
    bad = cli("status", "--hub", "nowhere")
    assert bad.returncode == 2
    assert "'--hub'" in bad.stderr and "HOST:PORT or PORT" in bad.stderr, bad.stderr


def test_unreachable_hub_fails_as_the_readme_says(silent_hub: socket.socket) -> None:
    readme = (ROOT / "README.md").read_text()
    limit = f"{CONNECT_TIMEOUT:g}"
    assert f"after {limit} s without an answer" in readme and f"within {limit}s" in readme
    start = time.monotonic()
    refused = cli("status", "--hub", str(free_port()))  # nothing listens: at once
    baseline = time.monotonic() - start
    assert refused.returncode == 2 and "connection refused" in refused.stderr, refused.stderr
    start = time.monotonic()
    silent = cli("status", "--hub", f"localhost:{silent_hub.getsockname()[1]}")
    took = time.monotonic() - start
    assert silent.returncode == 2, silent.stderr
    assert f"within {limit}s" in silent.stderr and "--hub" in silent.stderr, silent.stderr
    assert CONNECT_TIMEOUT <= took < baseline + CONNECT_TIMEOUT + 1.0, (took, baseline)


def test_ctrl_c_while_connecting_exits_130(silent_hub: socket.socket) -> None:
    """Ctrl-C before the run starts: while busctl connects to a hub that never answers."""
    port = silent_hub.getsockname()[1]
    proc = subprocess.Popen(busctl("run", "--hub", f"tcp://127.0.0.1:{port}", "hello"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        silent_hub.settimeout(30)
        conn, _ = silent_hub.accept()  # busctl is connecting now
        conn.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted!" not in err, err
    assert out == ""


# --- watch and export ----------------------------------------------------------------------


def test_watch_refuses_an_unknown_type_listing_the_known_ones() -> None:
    bad = cli("watch", "--type", "agent_end", "--type", "tool_call_end")
    assert bad.returncode == 2
    assert "no event type tool_call_end" in bad.stderr, bad.stderr
    assert "tool_execution_end" in bad.stderr and "agent_start" in bad.stderr


def test_export_names_a_missing_experiment_and_reads_the_log_without_a_hub(
        tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    state = default_state_dir(project)  # where `busctl up` keeps the hub's log (<state>/hub)
    proc, endpoint = start_hub(state / "hub")
    try:
        publish(endpoint, [("exp-a", e) for e in run_events("a")]
                + [("exp-b", e) for e in run_events("b")])
        missing = cli("export", "--hub", endpoint, "--experiment", "nosuch")
        assert missing.returncode == 2 and missing.stdout == ""
        assert "no experiment `nosuch`" in missing.stderr, missing.stderr
        assert "exp-a, exp-b" in missing.stderr
        live = cli("export", "--hub", endpoint, "--experiment", "exp-a")
        assert live.returncode == 0, live.stderr
    finally:
        proc.stop()
    lines = live.stdout.splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["agent_start", "agent_end"]

    # The hub is gone: the same export from its log on disk, asked for explicitly ...
    on_disk = cli("export", "--state-dir", str(state), "--experiment", "exp-a")
    assert on_disk.returncode == 0, on_disk.stderr
    assert on_disk.stdout == live.stdout
    # ... or found by itself in the project folder, when no hub answers (nothing on that port)
    found = cli("export", "--experiment", "exp-a", "-o", "out.jsonl", cwd=project,
                env={"BUSCTL_HUB": f"127.0.0.1:{free_port()}"})
    assert found.returncode == 0, found.stderr
    assert "reading the event log on disk:" in found.stderr
    assert (project / "out.jsonl").read_text() == live.stdout
    missing = cli("export", "--state-dir", str(state), "--experiment", "nosuch", "-o",
                  str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "exp-a, exp-b" in missing.stderr, missing.stderr
    assert not (tmp_path / "none.jsonl").exists()  # no empty file left behind


def test_an_error_line_is_red_from_end_to_end(hub: dict) -> None:
    publish(hub["endpoint"], [("", ev.AgentEnd(stop_reason="error", error="the model is down"))])
    watch = cli("watch", "--hub", hub["endpoint"], "--no-follow", "--since", "0",
                "--type", "agent_end", env={"FORCE_COLOR": "1", "NO_COLOR": ""})
    assert watch.returncode == 0, watch.stderr
    line = next(s for s in watch.stdout.splitlines() if "the model is down" in s)
    red, reset = click.style("x", fg="red").split("x")
    assert line.startswith(red) and line.endswith(reset), repr(line)
    assert line.count(reset) == 1 and "assistant" in line, repr(line)  # no reset midway
    plain = cli("watch", "--hub", hub["endpoint"], "--no-follow", "--since", "0",
                env={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert "\x1b[" not in plain.stdout


# --- help and completion -------------------------------------------------------------------


# One interpreter shows every command's help (as `busctl CMD --help` would, through click's own
# runner): ~30 busctl starts would take a minute on a busy machine.
HELP_WALK = """
import json, click
from click.testing import CliRunner
from agent_bus.cli import main

def walk(group, path):
    # list_commands/get_command, as click's help does: busctl loads some commands lazily.
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if not command.hidden:
            yield (*path, name)
            if isinstance(command, click.Group):
                yield from walk(command, (*path, name))

runner = CliRunner()
print(json.dumps({" ".join(c): [runner.invoke(main, [*c, "--help"], prog_name="busctl").output]
                  for c in walk(main, ())}))
"""


def test_every_commands_help_has_an_example() -> None:
    """The README promises one; the list of commands comes from busctl itself."""
    walk = subprocess.run([sys.executable, "-c", HELP_WALK], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert walk.returncode == 0, walk.stderr
    helps = {name: output for name, (output,) in json.loads(walk.stdout).items()}
    assert {"up", "run", "watch", "steer", "abort", "chat", "fake-llm", "config check"} <= set(helps)
    missing = []
    for name, text in helps.items():
        assert text.startswith(f"Usage: busctl {name}"), text
        block = re.split(r"^\s*Examples?:$", text, maxsplit=1, flags=re.MULTILINE)
        if len(block) < 2 or f"busctl {name}" not in block[1].split("Options:")[0]:
            missing.append(name)
    assert not missing, f"no example (`Examples:` then `busctl CMD …`) in: {', '.join(missing)}"


def test_shell_completion_script_and_its_answers() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "_BUSCTL_COMPLETE=bash_source busctl" in readme
    script = cli(env={"_BUSCTL_COMPLETE": "bash_source"})
    assert script.returncode == 0, script.stderr
    assert "complete -o nosort -F _busctl_completion busctl" in script.stdout, script.stdout
    # what the script asks busctl when a user presses TAB after `busctl wa`
    answer = cli(env={"_BUSCTL_COMPLETE": "bash_complete", "COMP_WORDS": "busctl wa",
                      "COMP_CWORD": "1"})
    assert "plain,watch" in answer.stdout.splitlines(), answer.stdout


# --- busctl up's console -------------------------------------------------------------------


def test_up_console_is_for_people_and_the_ready_line_for_scripts(tmp_path: Path) -> None:
    proc = Proc(busctl("up", "--hub", "tcp://127.0.0.1:0"), cwd=tmp_path, env=NO_MODEL)
    pids: list[int] = []
    try:
        proc.wait_line(lambda s: s.startswith("try "), 60)
        pids = [int(m) for m in re.findall(r"\[(\d+)\]", proc.wait_line(
            lambda s: s.startswith("processes"), 5))]
        ready_file = default_state_dir(tmp_path) / "up.ready"
        ready = json.loads(wait_for(lambda: ready_file.exists() and ready_file.read_text(), 10,
                                    "up.ready"))
        assert ready["ready"] == "up" and ready["pid"] == proc.pid
        status = cli("status", "--hub", ready["endpoint"], "--json")
        assert status.returncode == 0, status.stderr
        assert not any(line.lstrip().startswith("{") for line in proc.output().splitlines()), \
            proc.output()
    finally:
        proc.stop(timeout=15)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not ready_file.exists()  # a run file: removed on the way out


def test_fake_llm_prints_no_traceback_when_a_client_goes_away() -> None:
    """An aborted run closes its connection mid-request: normal, so no traceback in the console
    of `busctl fake-llm` (or of `busctl up --demo`, which runs it)."""
    import struct
    import urllib.request

    proc = Proc(busctl("fake-llm", "--port", "0"))
    try:
        base = proc.wait_ready()["base_url"]
        host, port = base.split("//")[1].split("/")[0].split(":")
        for _ in range(5):  # requests whose client resets the connection at once
            with socket.create_connection((host, int(port))) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.sendall(b"POST /nowhere HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        with urllib.request.urlopen(f"{base}/models", timeout=10) as answer:  # still serving
            assert answer.status == 200
        proc.stop()  # the console is complete once it exited
        assert "Traceback" not in proc.output() and "Error" not in proc.output(), proc.output()
    finally:
        proc.stop()
