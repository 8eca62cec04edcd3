"""Issue 27: a model's writes can never reach the code that runs the bus.

The layout is the README's quick start: a project folder with `.venv` inside, the project
installed into it (here: a `.pth` naming this checkout's environment, and the project's own
`src/` on the path as an editable install puts it), `git init`, the default topology (workspace
= the project). Attack 1 of the issue: `write_file` of a `.pth` into the venv (it would run in the
next gateway, holding the key), of an installed module, of a git hook and of the topology file in
use. Each must be refused with a clear tool error.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from tests.support import ROOT, Proc, busctl
from tests.tools.fixtures.procs import call, executor, until, workers

pytestmark = pytest.mark.anyio


def readme_project(tmp_path: Path) -> tuple[Path, Path]:
    """(project folder, its venv's site-packages), laid out as the README's quick start."""
    project = tmp_path / "proj"
    (project / "src" / "myproj").mkdir(parents=True)
    (project / "src" / "myproj" / "__init__.py").write_text("VERSION = 1\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(project / ".venv")],
                   check=True, timeout=60)
    venv_site = next((project / ".venv" / "lib").glob("python3*/site-packages"))
    # "installed": this checkout's packages (site.addsitedir also runs their editable finder)
    # and the project's own sources, as `pip install -e .` would add them
    (venv_site / "agent_bus_test.pth").write_text(
        f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n"
        f"{ROOT}\n{project / 'src'}\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True, timeout=30)
    (project / "busctl.toml").write_text('[[workers]]\nname = "tools"\n')
    return project, venv_site


def project_worker(endpoint: str, project: Path, *extra: str,
                   env: dict[str, str] | None = None) -> Proc:
    python = project / ".venv" / "bin" / "python"
    return Proc([str(python), "-m", "agent_bus.cli", "worker", "--hub", endpoint, "--workspace", ".",
                 "--read-only", str(project / "busctl.toml"), *extra], cwd=project, env=env)


#: A PATH without bubblewrap: the fallback, as on a machine without it.
NO_BWRAP = {"PATH": "/nonexistent"}


ATTACKS = {
    "pth": "{site}/zz.pth",
    "installed module": "src/myproj/__init__.py",
    "git hook": ".git/hooks/pre-commit",
    "topology file": "busctl.toml",
}
PAYLOAD = "import os; open('/tmp/x','a').write(os.environ.get('OPENAI_API_KEY',''))\n"


async def attack_writes(endpoint: str, project: Path, venv_site: Path) -> dict[str, Any]:
    """Every attack's result, plus a legitimate write's, through a real worker."""
    site_rel = venv_site.relative_to(project)
    async with executor(endpoint) as tools:
        results = {name: await tools.execute(call("write_file", path=path.format(site=site_rel),
                                                  content=PAYLOAD))
                   for name, path in ATTACKS.items()}
        results["ok"] = await tools.execute(call("write_file", path="notes/ok.txt", content="x"))
    return results


def assert_refused(results: dict[str, Any], project: Path, venv_site: Path) -> None:
    for name in ATTACKS:
        result = results[name]
        assert result.is_error, f"{name}: {result.text}"
        assert "read-only for tools" in result.text or "`.git` directory" in result.text, \
            f"{name}: {result.text}"
    assert not (venv_site / "zz.pth").exists()
    assert (project / "src" / "myproj" / "__init__.py").read_text() == "VERSION = 1\n"
    assert not (project / ".git" / "hooks" / "pre-commit").exists()
    assert "os.environ" not in (project / "busctl.toml").read_text()
    assert not results["ok"].is_error, results["ok"].text
    assert (project / "notes" / "ok.txt").read_text() == "x"


HAVE_BWRAP = shutil.which("bwrap") is not None
SHELL_ATTACK = ("for p in {site}/zz.pth src/myproj/x.py .git/hooks/pre-commit busctl.toml; do "
                "echo 'import os' >> $p 2>/dev/null && echo WROTE $p; done; "
                "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c . ; "
                "ls /proc | grep -c '^[0-9]'")


@pytest.mark.parametrize("mode", [
    pytest.param("auto", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap")),
    "no-bwrap",  # the fallback: no sandbox, the path filter alone still refuses attack 1
])
async def test_file_tools_refuse_the_code_that_runs_the_bus(hub: dict, tmp_path: Path,
                                                            mode: str) -> None:
    project, venv_site = readme_project(tmp_path)
    proc = project_worker(hub["endpoint"], project, "--sandbox", "auto", "--shell",
                          env=NO_BWRAP if mode == "no-bwrap" else None)
    try:
        ready = proc.wait_ready(20)
        results = await attack_writes(hub["endpoint"], project, venv_site)
        if mode == "auto":
            async with executor(hub["endpoint"]) as tools:
                command = SHELL_ATTACK.format(site=venv_site.relative_to(project))
                shell = await tools.execute(call("run_shell", command=command))
    finally:
        proc.stop()
    assert_refused(results, project, venv_site)
    assert ready["sandbox"]["kind"] == ("bwrap" if mode == "auto" else "none"), ready
    if mode == "no-bwrap":
        assert "not installed" in ready["sandbox"]["reason"], ready
    if mode == "auto":  # the same attacks from a shell meet a read-only file system
        assert "WROTE" not in shell.text, shell.text
        assert not (venv_site / "zz.pth").exists() and not (project / "src/myproj/x.py").exists()
        # the shell sees its own PID namespace only: a few processes, no bus process's environ
        assert int(shell.text.split()[-4]) < 10, shell.text


def _left(marker: str) -> list[int]:
    """The test's own `sleep MARKER` processes (not the shells and bwraps that name them)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == \
                    b"sleep\0" + marker.encode() + b"\0":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (.ci/run installs it)")
async def test_nothing_a_shell_call_starts_outlives_it(hub: dict, tmp_path: Path) -> None:
    """Attack 2: `setsid nohup … &` and a double fork; and the shell has no network."""
    ws = tmp_path / "ws"
    ws.mkdir()
    marker = "31.41592"
    escape = (f"setsid nohup sleep {marker} >/dev/null 2>&1 & "
              f"(sh -c 'sleep {marker} & echo forked' &); sleep 0.3; echo started")
    dial = (f"{sys.executable} -c \"import socket; "
            f"socket.create_connection(('127.0.0.1', {hub['endpoint'].rpartition(':')[2]}))\"")
    async with workers(hub["endpoint"], 1, "--shell", "--workspace", str(ws), "--sandbox",
                       "auto", tools="agent_bus.tools.builtin") as [w], executor(hub["endpoint"]) as tools:
        assert w.ready["sandbox"]["shell"] == "bwrap", w.ready  # type: ignore[attr-defined]
        result = await tools.execute(call("run_shell", command=escape))
        assert "started" in result.text, result.text
        await until(lambda: not _left(marker), timeout=1.0,
                    what="the call's background processes to be gone")
        offline = await tools.execute(call("run_shell", command=dial))
        assert offline.is_error and "Connection refused" in offline.text, offline.text


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
async def test_status_shows_each_workers_own_sandbox(hub: dict, tmp_path: Path) -> None:
    """Two workers serving the same tools, one sandboxed and one not: `busctl status` says which
    is which (from each one's own registration, not the service's latest)."""
    async with workers(hub["endpoint"], 1, "--sandbox", "auto") as [jailed], \
            workers(hub["endpoint"], 1) as [free]:
        done = await anyio.to_thread.run_sync(functools.partial(
            subprocess.run, busctl("status", "--hub", hub["endpoint"]), capture_output=True,
            text=True, timeout=30, cwd=tmp_path))
        assert done.returncode == 0, done.stderr
        lines = {line.split()[0]: line for line in done.stdout.splitlines()
                 if " sandbox " in line}
        names = [w.ready["name"] for w in (jailed, free)]  # type: ignore[attr-defined]
        assert "sandbox bwrap" in lines[names[0]] and "sandbox none" in lines[names[1]], lines


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
async def test_an_mcp_server_the_worker_launches_is_sandboxed_too(hub: dict,
                                                                  tmp_path: Path) -> None:
    """Attack 4: a filesystem MCP server on the workspace cannot write into `.venv`."""
    pytest.importorskip("mcp", reason="needs the `mcp` extra")
    project, venv_site = readme_project(tmp_path)
    server = f"{sys.executable} {ROOT / 'tests' / 'mcp' / 'fixtures' / 'fs_server.py'}"
    proc = project_worker(hub["endpoint"], project, "--mcp", server, "--mcp-prefix", "fs_")
    try:
        ready = proc.wait_ready(40)
        async with executor(hub["endpoint"]) as tools:
            pth = await tools.execute(call("fs_write_text", path=str(venv_site / "zz.pth"),
                                           content=PAYLOAD))
            ok = await tools.execute(call("fs_write_text", path="notes/mcp.txt", content="x"))
    finally:
        proc.stop()
    assert ready["sandbox"]["kind"] == "bwrap", ready
    assert pth.is_error, pth.text  # the SDK says only "Error executing tool" (EROFS inside)
    assert not (venv_site / "zz.pth").exists()
    assert not ok.is_error and (project / "notes" / "mcp.txt").read_text() == "x", ok.text


def test_required_sandbox_refuses_to_start_without_one(tmp_path: Path) -> None:
    """`sandbox = "required"`: a worker fails naming the flag, `busctl up` before it starts
    anything, naming the key."""
    from tests.support import busctl

    worker = subprocess.run(busctl("worker", "--hub", "tcp://127.0.0.1:9", "--sandbox",
                                   "required"), capture_output=True, text=True, timeout=60,
                            env={**os.environ, **NO_BWRAP}, cwd=tmp_path)
    assert worker.returncode != 0 and "--sandbox" in worker.stderr, worker.stderr
    assert "not installed" in worker.stderr, worker.stderr
    (tmp_path / "t.toml").write_text('[[workers]]\nsandbox = "required"\n')
    up = subprocess.run(busctl("up", "-c", "t.toml", "--hub", "tcp://127.0.0.1:0"),
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, **NO_BWRAP}, cwd=tmp_path)
    assert up.returncode != 0 and "workers[0].sandbox" in up.stderr, up.stderr
    (tmp_path / "t.toml").write_text('[[workers]]\nsandbox = "sometimes"\n')
    bad = subprocess.run(busctl("config", "check", "t.toml"), capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode != 0 and "workers[0].sandbox" in bad.stderr + bad.stdout, bad.stderr


SNOOP_KEY = "sk-snoop-across-restarts-5e4d3c2b1a"


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
@pytest.mark.parametrize("restarts", [2, pytest.param(20, marks=pytest.mark.slow)])
async def test_a_snooping_shell_never_sees_the_key_and_nothing_outlives_down(
        tmp_path: Path, restarts: int) -> None:
    """Attacks 2 and 3 on `busctl up` with shell on: a shell reads every visible process's
    environment in a loop while the gateway restarts; then a call still running at `busctl
    down` (with a `setsid` child) leaves no process behind."""
    from agent_bus.agents.gateway.fakellm import FakeLLMServer
    from tests.cli.conftest import Topology, start_up
    from tests.support import busctl

    project = tmp_path / "proj"
    project.mkdir()
    config = project / "busctl.toml"
    config.write_text("[[workers]]\nname = \"tools\"\nshell = true\n")
    marker = "27.18281"
    snoop = ("n=0; while [ ! -f stop ]; do n=$((n+1)); for f in /proc/[0-9]*/environ; do "
             "tr '\\0' '\\n' < $f | grep -a sk-snoop; done 2>/dev/null; done; echo loops $n")
    with FakeLLMServer({"echo": True}) as llm:
        proc, ready = start_up(project, "-c", str(config),
                               env={"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": SNOOP_KEY})
        topo = Topology(proc, project, ready)
        try:
            async with executor(topo.endpoint) as tools, anyio.create_task_group() as tg:
                found: list[str] = []

                async def snooping() -> None:
                    found.append((await tools.execute(call("run_shell", command=snoop,
                                                           timeout=300))).text)

                tg.start_soon(snooping)
                for _ in range(restarts):
                    done = await anyio.to_thread.run_sync(lambda: subprocess.run(
                        busctl("restart", "-c", str(config), "gateway-1"), cwd=project,
                        capture_output=True, text=True, timeout=60))
                    assert done.returncode == 0, done.stderr
                (project / "stop").write_text("")
                await until(lambda: found, timeout=20, what="the snooping call to end")
                assert SNOOP_KEY not in found[0] and "loops" in found[0], found[0]
                assert int(found[0].split()[-4]) > restarts, found[0]  # it kept looking
                tg.start_soon(tools.execute, call("run_shell", timeout=300, command=(
                    f"setsid nohup sleep {marker} >/dev/null 2>&1 & sleep {marker}")))
                await until(lambda: len(_left(marker)) == 2, timeout=10, what="the sleeps")
                down = await anyio.to_thread.run_sync(lambda: subprocess.run(
                    busctl("down", "-c", str(config)), cwd=project, capture_output=True,
                    text=True, timeout=60))
                assert down.returncode == 0, down.stderr
                await until(lambda: not _left(marker), timeout=1.0,
                            what="the running call's processes to be gone after `busctl down`")
                tg.cancel_scope.cancel()
        finally:
            proc.stop(timeout=8)
    assert not _left(marker)


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
async def test_sigterm_to_the_sandbox_alone_still_stops_the_worker_cleanly(hub: dict) -> None:
    """`kill PID` of the bwrap process (bwrap forwards no signal): the worker inside still
    finishes its short call, cancels the long one and unregisters (its parent-death signal)."""
    async with workers(hub["endpoint"], 1, "--concurrency", "2", "--sandbox", "auto") as [w], \
            executor(hub["endpoint"]) as tools:
        assert w.ready["sandbox"]["kind"] == "bwrap"  # type: ignore[attr-defined]
        results: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            async def run(key: str, seconds: float) -> None:
                results[key] = await tools.execute(call("sleepy", key, seconds=seconds))

            tg.start_soon(run, "short", 1.0)
            tg.start_soon(run, "long", 30.0)
            await until(lambda: _loaded(tools, "tool.sleepy", 2), what="both calls to run")
            w.popen.send_signal(signal.SIGTERM)  # the bwrap process only, not its group
        assert not results["short"].is_error, results["short"].text
        assert "shut down while running `sleepy`" in results["long"].text
        assert "tool.sleepy" not in {s.name for s in (await tools.peer.status()).services}


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
async def test_a_sandboxed_workers_pid_is_the_one_the_host_knows(hub: dict) -> None:
    """Inside its PID namespace the worker is pid 1; its hello (so `busctl ps` and the hub's
    status) carries its sandbox's pid on the host: the process a user can `kill`."""
    async with workers(hub["endpoint"], 1, "--sandbox", "auto") as [w]:
        assert w.ready["sandbox"]["kind"] == "bwrap"  # type: ignore[attr-defined]
        ps = await anyio.to_thread.run_sync(functools.partial(
            subprocess.run, busctl("ps", "--hub", hub["endpoint"], "--json"),
            capture_output=True, text=True, timeout=30))
        assert ps.returncode == 0, ps.stderr
        rows = [json.loads(line) for line in ps.stdout.splitlines()]
        [pid] = [row["pid"] for row in rows if row["name"] == w.ready["name"]]  # type: ignore[attr-defined]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert pid == w.popen.pid != 1, rows  # the busctl worker started here, become bwrap
    assert os.path.basename(cmdline[0]) == b"bwrap" and b"worker" in cmdline, cmdline


async def _loaded(tools: Any, service: str, load: int) -> bool:
    return sum(s.load for s in (await tools.peer.status()).services if s.name == service) == load


def test_an_editable_install_of_the_bus_is_read_only_for_tools() -> None:
    """Developing agent-bus in place (`pip install -e .`, the workspace = the checkout): the
    gateway's sources are refused though a worker never imports them."""
    from agent_bus.tools._context import confine
    from agent_bus.tools._exceptions import WorkspaceError
    from agent_bus.tools.sandbox import _editable_sources

    if ("agent_bus", ROOT / "agent_bus") not in _editable_sources():
        pytest.skip("agent-bus is not installed in editable mode here")
    # the sources themselves, not only the folder of links that makes them `agent_bus`
    for path in ("agents/gateway/process.py", "bus/hub.py", "tools/new.py", "cli.py", "commands/base.py",
                 "agent_bus/__init__.py"):
        with pytest.raises(WorkspaceError, match="read-only for tools"):
            confine(ROOT, path)
    assert confine(ROOT, "agents/gateway/process.py", write=False).is_file()  # reading is fine


def test_shell_network_and_home_start_up_files() -> None:
    """`network = true` keeps the shell's network; a home folder as workspace keeps the user's
    shell start-up files read-only for tools."""
    from agent_bus.tools._context import confine
    from agent_bus.tools._exceptions import WorkspaceError
    from agent_bus.tools.sandbox import SandboxPolicy

    assert "--unshare-net" not in SandboxPolicy(shell_network=True).shell_prefix
    offline = SandboxPolicy().shell_prefix
    assert not offline or "--unshare-net" in offline
    with pytest.raises(WorkspaceError, match="start-up file"):
        confine(Path.home(), ".bashrc")


def test_up_without_a_sandbox_says_so(tmp_path: Path) -> None:
    """No bubblewrap (PATH), `sandbox = "auto"`: `busctl up`'s console, `ps` and `status` say
    that the workers run without a sandbox."""
    from tests.cli.conftest import start_up
    from tests.support import busctl

    proc, ready = start_up(tmp_path, env=NO_BWRAP)
    try:
        line = proc.wait_line(lambda s: s.startswith("sandbox"), 10)
        assert "NO SANDBOX" in line and "not installed" in line and "tools-1" in line, line

        def cli(*args: str) -> str:
            done = subprocess.run(busctl(*args), capture_output=True, text=True, timeout=30,
                                  cwd=tmp_path)
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert any(row.startswith("tools-1") and row.split()[-1] == "none"
                   for row in cli("ps").splitlines())
        assert "sandbox none (bubblewrap (`bwrap`) is not installed)" in cli(
            "status", "--hub", ready["endpoint"])
    finally:
        proc.stop(timeout=8)


@pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")
def test_the_hubs_credentials_stay_out_of_tools_reach(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A local topology's socket folder holds the owner's credential (full rights) and each
    process kind's: inside a worker's sandbox only the worker's own is readable, and a shell
    call does not see the folder at all (a shell is not a peer of the bus)."""
    import socket

    from agent_bus.tools import sandbox

    folder = tmp_path / "rt" / "0123456789ab"
    folder.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "hub"))
    listener.listen()
    (folder / "owner.cred").write_text("OWNER-SECRET")
    (folder / "gateway.cred").write_text("GATEWAY-SECRET")
    (folder / "worker-tools.cred").write_text("WORKER-OWN")
    monkeypatch.setenv("BUSCTL_CREDENTIAL_FILE", str(folder / "worker-tools.cred"))
    hub = f"ipc://{folder / 'hub'}"
    workspace = tmp_path / "ws"
    workspace.mkdir()
    try:
        prefix, _ = sandbox.worker_prefix(workspace, hub, [])
        seen = subprocess.run([*prefix, "sh", "-c", f"cd {folder} && cat *.cred; ls"],
                              capture_output=True, text=True, timeout=30)
        assert "WORKER-OWN" in seen.stdout and "hub" in seen.stdout, seen
        assert "OWNER-SECRET" not in seen.stdout and "GATEWAY-SECRET" not in seen.stdout
        policy = sandbox.SandboxPolicy(shell_hide=sandbox.hub_folders(hub))
        shell = subprocess.run([*policy.shell_prefix, "sh", "-c", f"ls -A {folder}"],
                               capture_output=True, text=True, timeout=30)
        assert shell.returncode == 0 and shell.stdout.strip() == "", shell
    finally:
        listener.close()
