"""Issue 44, breaks 3, 4, 8 and 9: nothing a tool writes runs outside the sandbox.

As the attacker ran them: the model's `run_shell` writes a `.pth` into another project's venv
under the host's `/tmp` and hooks into nested repositories (break 3); with the workspace at the
home folder, it makes the start-up files that do not exist yet (break 4); a link planted in
`<workspace>/.runs/` moves a later run's confinement (break 8); concurrent shells read each
other's command lines, and a shell without a sandbox of its own is shown without network
(break 9). Plus the test that kills the "top-level `.git` only" mutant of `check_writable`, the
file tools' side of the same lists (start-up files, Python environments), what the private /tmp
keeps reachable, and the docs' list checked against the code's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.messages import RunWorkspace, ToolCallRequest
from tests.security.test_sandbox import NO_BWRAP
from tests.support import Proc, busctl
from tests.tools.fixtures.procs import call, executor

pytestmark = pytest.mark.anyio
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="needs bubblewrap (.ci/run installs it)")


# --- helpers ----------------------------------------------------------------------------------


def _script(command: str) -> dict[str, Any]:
    """The scripted model: on "attack", one `run_shell` call; then it reports what it saw."""
    calls = [{"name": "run_shell", "arguments": {"command": command}}]
    return {"rules": [
        {"contains": ["attack"], "tool_result": False, "reply": {"text": "On it.", "tool_calls": calls}},
        {"contains": [], "tool_result": True, "reply": {"text": "SAW {tool_results_full}"}},
    ], "echo": True}


@contextmanager
def topology(project: Path, workspace: Path, command: str,
             env: dict[str, str] | None = None) -> Iterator[tuple[Proc, dict[str, Any]]]:
    """`busctl up` (shell on, workspace `workspace`) with the scripted model; every child
    stopped on the way out, the test failing or not."""
    from tests.cli.conftest import Topology, pid_alive, start_up

    config = project / "busctl.toml"
    config.write_text(f'[[workers]]\nname = "tools"\nshell = true\nworkspace = "{workspace}"\n')
    with FakeLLMServer(_script(command)) as llm:
        proc, ready = start_up(project, "-c", str(config), env={
            "OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": "", **(env or {})})
        pids: dict[str, int] = {}
        try:
            pids = Topology(proc, project, ready).child_pids()
            yield proc, ready
        finally:
            proc.stop(timeout=8)
            for pid in pids.values():
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def model_runs(project: Path, ready: dict[str, Any], env: dict[str, str] | None = None) -> str:
    """`busctl run "attack"`: the model's shell call and what came back."""
    done = subprocess.run(busctl("run", "--hub", ready["endpoint"], "attack"), cwd=project,
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    assert "SAW" in done.stdout, done.stdout
    return done.stdout


def make_venv(where: Path) -> Path:
    """A venv at `where` (no pip: fast); its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=60)
    return next((where / "lib").glob("python3*/site-packages"))


def git_init(where: Path) -> Path:
    """A repository at `where`; its hooks folder."""
    subprocess.run(["git", "init", "-q", str(where)], check=True, timeout=30)
    return where / ".git" / "hooks"


# --- break 3: /tmp and nested repositories ----------------------------------------------------


@needs_bwrap
def test_a_shell_writes_nothing_that_runs_outside_the_sandbox(tmp_path: Path) -> None:
    """Another project under the host's /tmp (its venv, its hooks), a repository nested in the
    workspace and a venv inside it: the model's shell changes none of them; /tmp is its own
    (writable, empty, gone after), and the workspace stays writable."""
    other = tmp_path / "other"
    other_site = make_venv(other / ".venv")
    other_hooks = git_init(other)
    project = tmp_path / "proj"
    project.mkdir()
    nested_hooks = git_init(project / "sub")
    vendored_site = make_venv(project / "vendored" / ".venv")
    marker = f"/tmp/fence-{os.getpid()}-{tmp_path.name}"
    attack = " ; ".join([
        f"echo 'import os' > {other_site}/zz.pth",
        f"echo 'touch /tmp/pwned' > {other_hooks}/pre-commit",
        "echo 'touch /tmp/pwned' > sub/.git/hooks/pre-commit",
        f"echo 'import os' > {vendored_site}/zz.pth",
        f"echo x > {marker} && echo TMP $(cat {marker}) $(ls -A /tmp | wc -l)",
        "echo ok > notes.txt && echo WROTE-NOTES", "true"])
    with topology(project, project, attack) as (_, ready):
        seen = model_runs(project, ready)
    assert "WROTE-NOTES" in seen and (project / "notes.txt").read_text() == "ok\n", seen
    assert "TMP x" in seen, seen  # a private /tmp, writable
    assert not Path(marker).exists(), "the shell wrote into the host's /tmp"
    assert not (other_site / "zz.pth").exists(), "a .pth into another project's venv under /tmp"
    assert not (other_hooks / "pre-commit").exists(), "a hook into another project under /tmp"
    assert not (nested_hooks / "pre-commit").exists(), "a hook into a nested repository"
    assert not (vendored_site / "zz.pth").exists(), "a .pth into a venv in the workspace"


# --- break 4: start-up files that do not exist yet --------------------------------------------

STARTUP = [".bash_profile", ".bash_login", ".profile", ".zshrc", ".gitconfig",
           ".config/git/config", ".ssh/authorized_keys"]


@needs_bwrap
def test_a_shell_in_the_home_folder_cannot_make_start_up_files(tmp_path: Path) -> None:
    """The workspace is the home folder (HOME of the whole topology): the model's shell makes
    none of the start-up files that do not exist yet, leaves no placeholder behind while the
    worker runs, and can still write the files and folders of the home folder."""
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    (home / ".config" / "app").mkdir(parents=True)
    attack = " ; ".join([
        *(f"mkdir -p $(dirname ~/{name}) ; echo 'touch /tmp/pwned' >> ~/{name}" for name in STARTUP),
        "echo ok > ~/proj/notes.txt && echo WROTE-PROJ",
        "echo ok > ~/.config/app/settings && echo WROTE-CONFIG", "true"])
    from agent_bus.bus.paths import STATE_HOME_ENV

    # the state outside the workspace (its default is under HOME: `busctl up` would refuse)
    env = {"HOME": str(home), STATE_HOME_ENV: str(tmp_path / "state")}
    with topology(home, home, attack, env=env) as (_, ready):
        seen = model_runs(home, ready, env=env)
        placeholders = [name for name in STARTUP if os.path.lexists(home / name)]
    assert "WROTE-PROJ" in seen and "WROTE-CONFIG" in seen, seen
    assert not placeholders, f"made in the home folder: {placeholders}\n{seen}"
    assert not (home / ".config" / "git").exists() and not (home / ".ssh").exists(), seen


async def test_file_tools_and_the_sandbox_refuse_the_same_start_up_files(
        hub: dict[str, Any], tmp_path: Path) -> None:
    """`write_file` refuses each start-up file (missing ones included) with the same list."""
    home = tmp_path / "home"
    home.mkdir()
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(home),
                       "--sandbox", "off"), cwd=home, env={"HOME": str(home)})
    try:
        proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools:
            results = {name: await tools.execute(call("write_file", path=name, content="x"))
                       for name in STARTUP}
    finally:
        proc.stop()
    for name, result in results.items():
        assert result.is_error and "start-up file" in result.text, (name, result.text)
        assert not (home / name).exists(), name


# --- break 8: a link planted in .runs/ --------------------------------------------------------


def run_call(run: str, **args: Any) -> ToolCallRequest:
    request = call("write_file", **args)
    request.workspace = RunWorkspace(id=run)
    return request


async def test_a_link_planted_in_runs_does_not_move_a_later_runs_confinement(
        hub: dict[str, Any], tmp_path: Path) -> None:
    """An earlier run's shell left `.runs/cell-2 -> ..` (the workspace root) and
    `.runs/exp -> <another experiment>`: a later cell's writes are refused, naming the link."""
    ws = tmp_path / "ws"
    elsewhere = ws / "experiment-b"
    (ws / ".runs").mkdir(parents=True)
    elsewhere.mkdir()
    (ws / ".runs" / "cell-2").symlink_to("..")
    (ws / ".runs" / "exp").symlink_to(elsewhere)
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws), "--sandbox",
                       "off"), cwd=ws)
    try:
        proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools:
            root = await tools.execute(run_call("cell-2", path="pwned.txt", content="x"))
            other = await tools.execute(run_call("exp/cell-1", path="pwned.txt", content="x"))
            fine = await tools.execute(run_call("cell-3", path="ok.txt", content="x"))
    finally:
        proc.stop()
    assert root.is_error and "is a symbolic link" in root.text, root.text
    assert other.is_error and "is a symbolic link" in other.text, other.text
    assert not (ws / "pwned.txt").exists() and not (elsewhere / "cell-1").exists()
    assert not fine.is_error and (ws / ".runs" / "cell-3" / "ok.txt").read_text() == "x"


# --- break 9 ----------------------------------------------------------------------------------


@needs_bwrap
async def test_concurrent_shell_calls_do_not_see_each_others_command_lines(
        hub: dict[str, Any], tmp_path: Path) -> None:
    """One call sleeps with a secret on its command line; another, at the same time, reads every
    command line its /proc shows. A worker run as root included (the nested sandbox used to keep
    the worker's /proc there)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    secret = f"cell-secret-{os.getpid()}"
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws), "--shell",
                       "--concurrency", "2"), cwd=ws)
    try:
        proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools, anyio.create_task_group() as tg:
            tg.start_soon(tools.execute, call("run_shell", "hold", command=(
                f"S={secret}; touch started; while [ ! -f done ]; do sleep 0.05; done")))
            from tests.support import until

            await until(lambda: (ws / "started").exists(), timeout=10, what="the first call")
            spy = await tools.execute(call("run_shell", "spy", command=(
                "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; echo; touch done")))
    finally:
        (ws / "done").touch()
        proc.stop()
    assert "touch done" in spy.text, spy.text  # it saw its own command line
    assert secret not in spy.text, spy.text


def test_a_shell_without_its_own_sandbox_is_shown_with_the_network(tmp_path: Path) -> None:
    """`sandbox = "auto"` and no bubblewrap: the shell has the worker's network; `busctl ps`
    and the ready line say so (they said `net:off`)."""
    from tests.cli.conftest import start_up

    (tmp_path / "t.toml").write_text('[[workers]]\nname = "tools"\nshell = true\n')
    proc, ready = start_up(tmp_path, "-c", "t.toml", env=NO_BWRAP)
    try:
        ps = subprocess.run(busctl("ps", "-c", "t.toml"), capture_output=True, text=True,
                            timeout=30, cwd=tmp_path)
        console = proc.wait_line(lambda s: s.startswith("sandbox"), 10)
    finally:
        proc.stop(timeout=8)
    assert ps.returncode == 0, ps.stderr
    [row] = [line for line in ps.stdout.splitlines() if line.startswith("tools-1")]
    assert "shell:process-group net:on" in row, ps.stdout
    assert "network on" in console, console


# --- the mutant: confinement refusing only a top-level `.git` ---------------------------------


async def test_write_file_refuses_a_nested_repositorys_hooks(hub: dict[str, Any],
                                                              tmp_path: Path) -> None:
    """`sub/.git/hooks/pre-commit` is refused by the file tools themselves (no sandbox here):
    a check of the first path component alone would let it through."""
    ws = tmp_path / "ws"
    hooks = git_init(ws / "sub")
    git_init(ws)
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws), "--sandbox",
                       "off"), cwd=ws)
    try:
        proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools:
            nested = await tools.execute(call("write_file", path="sub/.git/hooks/pre-commit",
                                              content="#!/bin/sh\ntouch /tmp/pwned\n"))
            top = await tools.execute(call("write_file", path=".git/hooks/pre-commit",
                                           content="#!/bin/sh\n"))
    finally:
        proc.stop()
    assert nested.is_error and "`.git` directory" in nested.text, nested.text
    assert top.is_error and "`.git` directory" in top.text, top.text
    assert not (hooks / "pre-commit").exists()


@needs_bwrap
async def test_what_the_worker_was_given_under_tmp_stays_reachable(hub: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    """The private /tmp keeps what the worker was given there: a `--tools FILE` outside the
    workspace and its current folder (read-only), the workspace (writable)."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "given_tools.py").write_text(
        "from agent_bus.tools import tool\n\n\n@tool\ndef given(text: str) -> str:\n"
        "    \"\"\"Return `text` reversed.\"\"\"\n    return text[::-1]\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws), "--shell",
                       "--tools", str(extra / "given_tools.py"), "--tools",
                       "agent_bus.tools.builtin"), cwd=extra)
    try:
        ready = proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools:
            given = await tools.execute(call("given", text="abc"))
            shell = await tools.execute(call("run_shell", command=(
                f"ls {extra}; echo x > {extra}/new 2>/dev/null || echo READ-ONLY; "
                "echo y > made && echo WROTE")))
    finally:
        proc.stop()
    assert ready["sandbox"]["kind"] == "bwrap", ready
    assert given.text == "cba", given.text
    assert "given_tools.py" in shell.text and "READ-ONLY" in shell.text, shell.text
    assert "WROTE" in shell.text and (ws / "made").read_text() == "y\n", shell.text
    assert not (extra / "new").exists()


@needs_bwrap
def test_a_linked_start_up_file_cannot_be_swapped_or_written_through(tmp_path: Path) -> None:
    """Dotfiles kept elsewhere and linked into the home folder (the workspace): the shell can
    neither replace the link with a file of its own nor write through it, in the workspace or
    out of it; `~/.config` as a plain file cannot be turned into a folder holding git's config."""
    home = tmp_path / "home"
    (home / "dotfiles").mkdir(parents=True)
    (home / "dotfiles" / "bashrc").write_text("# mine\n")
    (home / ".bashrc").symlink_to("dotfiles/bashrc")
    outside = tmp_path / "outside-zshrc"
    outside.write_text("# mine\n")
    (home / ".zshrc").symlink_to(outside)
    (home / ".config").write_text("not a folder\n")
    # the sandbox of a worker started with that HOME (a fresh process: the list is its own)
    code = ("import json, pathlib; from agent_bus.tools import sandbox; print(json.dumps("
            "sandbox.worker_prefix(pathlib.Path('.'), 'tcp://127.0.0.1:9', [])[0]))")
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=home, env={**os.environ, "HOME": str(home)})
    assert made.returncode == 0, made.stderr
    prefix = json.loads(made.stdout)
    attack = ("rm -f ~/.bashrc; echo evil > ~/.bashrc; echo evil >> ~/dotfiles/bashrc; "
              "echo evil >> ~/.zshrc; rm -f ~/.config; mkdir -p ~/.config/git && "
              "echo evil > ~/.config/git/config; echo ok > ~/dotfiles/notes && echo WROTE")
    done = subprocess.run([*prefix, "sh", "-c", attack], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "HOME": str(home)})
    assert "WROTE" in done.stdout, done  # the rest of the home folder stays writable
    assert (home / ".bashrc").is_symlink() and (home / ".zshrc").is_symlink()
    assert (home / "dotfiles" / "bashrc").read_text() == "# mine\n"
    assert outside.read_text() == "# mine\n"
    assert (home / ".config").read_text() == "not a folder\n"


async def test_write_file_refuses_a_python_environment_in_the_workspace(
        hub: dict[str, Any], tmp_path: Path) -> None:
    """Another project's venv inside the workspace (not the bus's own): `write_file` refuses a
    `.pth` in its site-packages and its `bin/activate`, the sandbox aside, and says why."""
    ws = tmp_path / "ws"
    site = make_venv(ws / "vendored" / ".venv")
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws), "--sandbox",
                       "off"), cwd=ws)
    try:
        proc.wait_ready(20)
        async with executor(hub["endpoint"]) as tools:
            pth = await tools.execute(call("write_file", path=str(site / "zz.pth"),
                                           content="import os\n"))
            activate = await tools.execute(call("write_file", path="vendored/.venv/bin/activate",
                                                content="touch /tmp/pwned\n"))
            fine = await tools.execute(call("write_file", path="vendored/notes.txt", content="x"))
    finally:
        proc.stop()
    for result in (pth, activate):
        assert result.is_error and "is a Python environment" in result.text, result.text
    assert not (site / "zz.pth").exists()
    assert not fine.is_error and (ws / "vendored" / "notes.txt").read_text() == "x", fine.text


@needs_bwrap
async def test_an_mcp_server_given_on_stdin_under_tmp_is_reachable(hub: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    """`busctl up` passes a group's MCP servers on stdin: a server whose script lives under the
    host's /tmp, outside the workspace, still starts in the private /tmp (read-only there), and
    what it writes beside its script stays in that private /tmp."""
    pytest.importorskip("mcp", reason="needs the `mcp` extra")
    from tests.support import ROOT

    extra = tmp_path / "servers"
    extra.mkdir()
    shutil.copy(ROOT / "tests" / "mcp" / "fixtures" / "fs_server.py", extra / "fs_server.py")
    ws = tmp_path / "ws"
    ws.mkdir()
    specs = [{"command": sys.executable, "args": [str(extra / "fs_server.py")], "prefix": "fs_"}]
    proc = Proc(busctl("worker", "--hub", hub["endpoint"], "--workspace", str(ws),
                       "--mcp-servers", "-"), cwd=ws, stdin=subprocess.PIPE)
    try:
        assert proc.popen.stdin is not None
        proc.popen.stdin.write(json.dumps(specs))
        proc.popen.stdin.close()
        ready = proc.wait_ready(40)
        async with executor(hub["endpoint"]) as tools:
            ok = await tools.execute(call("fs_write_text", path="notes.txt", content="x"))
            out = await tools.execute(call("fs_write_text", path=str(extra / "x.txt"), content="x"))
    finally:
        proc.stop()
    assert ready["sandbox"]["kind"] == "bwrap" and "fs_write_text" in ready["tools"], ready
    assert not ok.is_error and (ws / "notes.txt").read_text() == "x", ok.text
    # the script alone is bound back in: a write beside it lands in the private /tmp
    assert not (extra / "x.txt").exists(), out.text


def test_the_start_up_file_list_is_the_one_the_docs_give() -> None:
    """docs/security.md names the list the file tools and the sandbox share (issue 44 asks which
    list and why): every entry of `HOME_STARTUP_FILES` is in it, and nothing it names is missing
    from the code."""
    import re

    from agent_bus.tools.sandbox import HOME_STARTUP_FILES
    from tests.support import ROOT

    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("**Start-up files that do not exist yet.**", 1)[1].split("\n\n", 1)[0]
    names = " ".join(section.split()).split("and the user's own", 1)[0]  # the home folder's
    listed = set(re.findall(r"`(\.[a-z_./]+)`", names))
    assert listed == set(HOME_STARTUP_FILES), (listed ^ set(HOME_STARTUP_FILES))
