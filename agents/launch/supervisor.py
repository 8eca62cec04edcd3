"""Child-process supervision for `busctl up`: start, wait for ready, restart with backoff, stop.

Each child runs in its own process group (so a stop takes its grandchildren too), writes its
output to `<log_dir>/<name>.log` and, in the foreground, to the terminal prefixed by its name. A
child announces readiness with one JSON line starting with `{"ready"` on stdout (busctl's own
pieces); a topology's `[[processes]]` entry is ready once started, or as it says (`ready_when`:
that line, or a port accepting a connection). A child that exits
while the topology is up is restarted with exponential backoff; one that crash-loops is given up.

Every child is started through `python -m agent_bus.bus.procsec SUPERVISOR_PID …`, which asks the kernel to
SIGTERM it when the supervisor dies: a SIGKILLed supervisor leaves no orphan. The supervisor keeps
a run file (`up.json`: its pid and each child's pid and start time) so `busctl down` can find and
stop every process even when the supervisor itself is gone.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import anyio
import anyio.abc
import msgspec

from agent_bus.bus.backoff import Backoff
from agent_bus.bus.errors import AgentBusError

# 0.5, 1, 2, 4, 8 s (docs/architecture.md). No jitter: each child restarts on its own schedule,
# and the exact delay is what the user is told ("restarting in 2s").
RESTART_BACKOFF = Backoff(first=0.5, factor=2.0, cap=8.0, jitter=0.0)
CRASH_LOOP_RESTARTS = 5  # restarts within CRASH_LOOP_WINDOW that make us give up
CRASH_LOOP_WINDOW = 60.0
STOP_TIMEOUT = 4.0

Notify = Callable[[str, "Child", int | None], Awaitable[None]]  # (what, child, exit code)
# Where a child runs: its argv and the extra environment names it may see, as this machine
# starts it (another engine wraps it: `srun` on a node of a Slurm allocation, slurm_engine.py).
Launch = Callable[["ChildSpec"], tuple[list[str], list[str]]]


# What every child may see of the supervisor's environment. Anything else — provider keys above
# all — reaches a child only when its spec says so (the gateway inherits everything).
_SAFE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED",
    "NO_COLOR", "FORCE_COLOR", "XDG_STATE_HOME", "BUSCTL_STATE_HOME", "SYSTEMROOT",
})


#: Names that look like secrets (as run_shell's scrub): a child that needs them (the gateway)
#: gets them on stdin, never in its environment (`ChildSpec.secrets_on_stdin`).
SECRET_NAME_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def split_secrets(env: dict[str, str], names: list[str] | tuple[str, ...] = ()
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """(`env` without its secrets, the secrets): names matching SECRET_NAME_RE, plus `names`
    (each model's `api_key_env`, whatever it is called)."""
    secret = {k: v for k, v in env.items() if SECRET_NAME_RE.search(k) or k in names}
    return {k: v for k, v in env.items() if k not in secret}, secret


def scrub_environ_block(names: set[str]) -> int:
    """Blank the values of `names` in this process's original environment block, the memory
    `/proc/self/environ` shows (changing `os.environ` does not touch it). Python's copy in
    `os.environ` stays: the process keeps the keys in memory, made undumpable by its caller.
    Returns how many values were blanked (0 where /proc is missing: other systems)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[-3]), int(fields[-2])  # env_start, env_end (proc(5))
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = mem.read(end - start)
            done = 0
            offset = 0
            for entry in block.split(b"\0"):
                name, eq, value = entry.partition(b"=")
                if eq and value and name.decode(errors="replace") in names:
                    mem.seek(start + offset + len(name) + 1)
                    mem.write(b"\0" * len(value))
                    done += 1
                offset += len(entry) + 1
            return done
    except (OSError, ValueError, IndexError):
        return 0


def minimal_environ(pass_names: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The safe part of this process's environment, plus the variables named in `pass_names`."""
    return {name: value for name, value in os.environ.items()
            if name in _SAFE_ENV_NAMES or name.startswith("LC_") or name in pass_names}


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the base environment
    ready_timeout: float = 20.0
    restart: bool = True
    role: str = ""  # what the child is (hub, gateway, worker…): decides the stop order
    inherit_env: bool = False  # the whole environment (the gateway: it holds the keys)
    # With inherit_env: the secrets of that environment (`split_secrets`, plus these names) go
    # on stdin as one JSON line before `stdin_data`, not into the child's environment block.
    secrets_on_stdin: bool = False
    secret_names: list[str] = field(default_factory=list)
    pass_env: list[str] = field(default_factory=list)  # else: minimal + these names
    # Written to the child's stdin at every (re)start, then closed: configuration handed over
    # from the supervisor's memory, never re-read from a file something else could rewrite.
    stdin_data: bytes = b""
    # When the child counts as ready: "line" (its `{"ready": ...}` stdout line: busctl's own
    # pieces), "started" (once spawned), "port" (once 127.0.0.1:ready_port accepts a connection).
    ready_when: Literal["line", "started", "port"] = "line"
    ready_port: int = 0

    def awaited(self) -> str:
        """What readiness waits for, in the words of the topology file (for an error)."""
        if self.ready_when == "port":
            return f"a connection to 127.0.0.1:{self.ready_port} to be accepted (ready_port)"
        return ('a {"ready": ...} JSON line on its stdout (ready = "line"; without it the '
                'process is ready once started)')


@dataclass
class Child:
    spec: ChildSpec
    process: anyio.abc.Process | None = None
    ready: dict[str, Any] | None = None
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    gave_up: bool = False
    ready_event: anyio.Event = field(default_factory=anyio.Event)
    started_at: float = 0.0  # wall clock of the current process's start
    last_exit: int | None = None  # returncode of the previous process (negative: a signal)
    restart_now: bool = False  # `busctl restart`: no backoff, not counted as a crash
    removed: bool = False  # scaled down: stopped for good
    supervised: bool = True  # False once its supervising task has given up or ended

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None


class ChildFailed(AgentBusError):
    pass


class ChildRecord(msgspec.Struct):
    pid: int
    start_ticks: int  # /proc start time: tells our process from a later one given the same pid


class RunFile(msgspec.Struct):
    """`<state>/up.json`: what `busctl down`, `ps`, `logs` and a second `up` know of a topology."""
    pid: int
    cwd: str
    endpoint: str = ""
    events: str = ""
    control: str = ""  # the supervisor's control socket (restart, scale, ps)
    children: dict[str, ChildRecord] = {}


def start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 when unknown or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 and fields[0] != b"Z" else 0


def same_process(record: ChildRecord) -> bool:
    """True while the recorded process still runs (not a zombie, not a reused pid)."""
    ticks = start_ticks(record.pid)
    return ticks != 0 and (record.start_ticks in (0, ticks))


def read_run_file(path: Path) -> RunFile | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=RunFile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def signal_name(code: int | None) -> str:
    """`exit 1`, `SIGKILL`, or `-` for a process that has not exited."""
    if code is None:
        return "-"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class Supervisor:
    def __init__(self, log_dir: Path, echo: TextIO | None, color: bool = False,
                 launch: Launch | None = None, stop_signal: int = signal.SIGTERM) -> None:
        self.launch = launch
        self.stop_signal = stop_signal  # what asks a child to stop (srun's steps: SIGUSR1)
        self.log_dir = log_dir
        self.echo = echo
        self.color = color
        self.children: dict[str, Child] = {}
        self.stopping = False
        self.notify: Notify | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.run_file: Path | None = None
        self.run_info = RunFile(pid=os.getpid(), cwd=os.getcwd())
        log_dir.mkdir(parents=True, exist_ok=True)

    async def __aenter__(self) -> Supervisor:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop_all()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    async def start(self, spec: ChildSpec) -> Child:
        """Start a child and wait for its ready line; raise ChildFailed with its output if not."""
        child = Child(spec)
        self.children[spec.name] = child
        assert self._tg is not None
        self._tg.start_soon(self._supervise, child)
        with anyio.move_on_after(spec.ready_timeout):
            await child.ready_event.wait()
        if child.ready is None:
            tail = self.tail(spec.name)
            raise ChildFailed(f"`{spec.name}` did not become ready within {spec.ready_timeout:g}s:"
                              f" it waited for {spec.awaited()} (log: "
                              f"{self.log_path(spec.name)}){tail}")
        return child

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return ("\n" + "\n".join(f"  {name} | {line}" for line in text)) if text else ""

    async def _supervise(self, child: Child) -> None:
        try:
            await self._supervise_loop(child)
        finally:
            child.supervised = False

    async def _supervise_loop(self, child: Child) -> None:
        while not self.stopping:
            code = await self._run_once(child)
            child.last_exit = code
            if self.stopping or child.removed:
                return
            if child.restart_now:  # asked for: at once, and not a crash
                child.restart_now = False
                self._again(child, code)
                continue
            if not child.spec.restart:
                return
            now = time.monotonic()
            child.restart_times = [t for t in child.restart_times if now - t < CRASH_LOOP_WINDOW]
            if len(child.restart_times) >= CRASH_LOOP_RESTARTS:
                child.gave_up = True
                self._say(child.spec.name, f"crash-looping (exit {code}, {child.restarts} restarts); "
                          f"giving up — see {self.log_path(child.spec.name)}")
                if self.notify:
                    await self.notify("gave_up", child, code)
                return
            delay = restart_delay(len(child.restart_times))
            self._say(child.spec.name, f"exited with {code}; restarting in {delay:g}s")
            await anyio.sleep(delay)
            if self.stopping or child.removed:
                return
            child.restart_times.append(time.monotonic())
            child.restart_now = False  # a restart asked for during the backoff is this one
            self._again(child, code)

    def _again(self, child: Child, code: int | None) -> None:
        child.restarts += 1
        child.ready_event = anyio.Event()
        child.ready = None
        if self.notify:
            self._tg.start_soon(self._notify_when_ready, child, code)  # type: ignore[union-attr]

    async def _notify_when_ready(self, child: Child, code: int | None) -> None:
        with anyio.move_on_after(child.spec.ready_timeout):
            await child.ready_event.wait()
        if self.notify:
            await self.notify("restarted", child, code)

    async def _run_once(self, child: Child) -> int | None:
        spec = child.spec
        argv, pass_env = self.launch(spec) if self.launch else (spec.argv, spec.pass_env)
        base = dict(os.environ) if spec.inherit_env else minimal_environ(pass_env)
        stdin_data = spec.stdin_data
        if spec.secrets_on_stdin:
            base, secrets = split_secrets(base, spec.secret_names)
            stdin_data = json.dumps(secrets).encode() + b"\n" + stdin_data
        env = {**base, "PYTHONUNBUFFERED": "1", **spec.env}
        log = self.log_path(spec.name).open("a", buffering=1)
        guarded = [sys.executable, "-P", "-m", "agent_bus.bus.procsec", str(os.getpid()), *argv]
        try:
            process = await anyio.open_process(
                guarded, stdin=subprocess.PIPE if stdin_data else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as exc:
            log.write(f"failed to start: {exc}\n")
            log.close()
            return None
        child.process = process
        child.started_at = time.time()
        self.save_run_file()
        try:
            async with process, anyio.create_task_group() as tg:
                if process.stdin is not None:
                    tg.start_soon(_hand_over, process.stdin, stdin_data)
                if spec.ready_when == "started":
                    _set_ready(child, {"ready": "started"})
                elif spec.ready_when == "port":
                    tg.start_soon(_ready_on_connect, child, spec.ready_port)
                assert process.stdout is not None
                await self._pump(child, process.stdout, log)
                tg.cancel_scope.cancel()  # its output ended: it exited; no port to wait for
            return await process.wait()  # already waited for by leaving `process`: the code
        finally:
            log.close()

    async def _pump(self, child: Child, stream: anyio.abc.ByteReceiveStream, log: TextIO) -> None:
        buffer = b""
        async for chunk in stream:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                log.write(line + "\n")
                if (child.ready is None and child.spec.ready_when == "line"
                        and (ready := ready_line(line)) is not None):
                    _set_ready(child, ready)
                    continue
                self._say(child.spec.name, line)

    def _say(self, name: str, line: str) -> None:
        if self.echo is None:
            return
        prefix = f"{name:>12} | "
        if self.color:
            import click

            prefix = click.style(prefix, fg="cyan")
        self.echo.write(prefix + line + "\n")
        self.echo.flush()

    async def stop_all(self, order: list[str] | None = None) -> None:
        """SIGTERM each child (in `order`, else reverse start order); SIGKILL what is left."""
        self.stopping = True
        names = order or list(reversed(self.children))
        deadline = time.monotonic() + STOP_TIMEOUT
        for name in names:
            child = self.children.get(name)
            if child is None or not child.alive:
                continue
            _killpg(child, self.stop_signal)
            with anyio.move_on_after(max(0.1, min(2.0, deadline - time.monotonic()))):
                await child.process.wait()  # type: ignore[union-attr]
        for child in self.children.values():
            if child.process is not None:
                _killpg(child, signal.SIGKILL)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children[name]
        _killpg(child, sig)

    async def restart(self, name: str) -> Child:
        """Stop one child (SIGTERM, then SIGKILL) and start it again at once; wait for ready."""
        child = self.children[name]
        if not child.supervised:  # it had stopped for good (crash loop, or restart = false)
            self.children.pop(name)
            fresh = await self.start(child.spec)
            fresh.restarts, fresh.last_exit = child.restarts + 1, child.last_exit
            if self.notify:
                await self.notify("restarted", fresh, child.last_exit)
            return fresh
        old = child.process
        child.restart_now = True
        await _terminate(child, self.stop_signal)
        with anyio.move_on_after(child.spec.ready_timeout + 1):
            while child.process is old or child.ready is None:
                await anyio.sleep(0.05)  # the supervising task swaps the process in
        if child.ready is None:
            raise ChildFailed(f"`{name}` did not become ready again (log: {self.log_path(name)})")
        return child

    async def remove(self, name: str) -> None:
        """Stop one child for good (scaling down) and forget it."""
        child = self.children[name]
        child.removed = True
        await _terminate(child, self.stop_signal)
        self.children.pop(name, None)
        self.save_run_file()

    def save_run_file(self) -> None:
        """Rewrite `up.json` with every live child (atomically: readers never see half)."""
        if self.run_file is None:
            return
        self.run_info.children = {
            name: ChildRecord(pid=child.pid, start_ticks=start_ticks(child.pid))
            for name, child in self.children.items() if child.pid is not None}
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.run_info))
        tmp.replace(self.run_file)

    def table(self) -> list[dict[str, Any]]:
        """One row per child, in start order: what `busctl ps` prints."""
        now = time.time()
        rows = []
        for name, child in self.children.items():
            state = ("gave up" if child.gave_up else "ready" if child.alive and child.ready
                     else "starting" if child.alive else "exited")
            rows.append({"name": name, "role": child.spec.role, "pid": child.pid or 0,
                         "state": state,
                         "uptime": round(now - child.started_at, 1) if child.alive else 0.0,
                         "restarts": child.restarts, "last_exit": signal_name(child.last_exit),
                         "sandbox": _sandbox_cell(child)})
        return rows


def _sandbox_cell(child: Child) -> str:
    return sandbox_cell(child.ready or {}) if child.spec.role == "worker" else "-"


def sandbox_cell(ready: dict[str, Any]) -> str:
    """A worker's sandbox for `busctl ps`, from its ready line: `bwrap` (+ `shell:bwrap
    net:off`), `none`; `-`."""
    info = ready.get("sandbox")
    if not isinstance(info, dict):
        return "-"
    shell = f" shell:{info['shell']} net:{'on' if info.get('shell_network') else 'off'}" \
        if info.get("shell") else ""
    return f"{info.get('kind', '?')}{shell}"


async def _terminate(child: Child, stop_signal: int = signal.SIGTERM) -> None:
    if not child.alive:
        return
    _killpg(child, stop_signal)
    with anyio.move_on_after(STOP_TIMEOUT):
        await child.process.wait()  # type: ignore[union-attr]
    if child.alive:
        _killpg(child, signal.SIGKILL)
        with anyio.move_on_after(2):
            await child.process.wait()  # type: ignore[union-attr]


async def _hand_over(stdin: anyio.abc.ByteSendStream, data: bytes) -> None:
    """Write a child's configuration to its stdin; a child that died first just does not get it."""
    try:
        await stdin.send(data)
        await stdin.aclose()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


def restart_delay(recent_restarts: int) -> float:
    """The wait before a restart: RESTART_BACKOFF's delay after `recent_restarts` earlier ones
    (those inside CRASH_LOOP_WINDOW), so a child that stayed up a while starts over at 0.5 s."""
    return next(itertools.islice(RESTART_BACKOFF.delays(), recent_restarts, None))


def _killpg(child: Child, sig: int) -> None:
    if child.process is None:
        return
    try:
        os.killpg(child.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LogTail:
    """`busctl logs`: the children's log files, each line prefixed with the child's name; in
    follow mode, new lines (and new logs, after a scale up) as they are written."""

    POLL = 0.2  # seconds between looks at the files while following

    def __init__(self, folder: Path, names: set[str], color: bool,
                 out: TextIO | None = None) -> None:
        self.folder = folder
        self.names = names  # empty: every log
        self.color = color
        self.out = out or sys.stdout
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}

    def _paths(self) -> list[Path]:
        return sorted(p for p in self.folder.glob("*.log") if not self.names or p.stem in self.names)

    def print_existing(self, tail: int | None) -> None:
        for path in self._paths():
            lines = self._read_new(path)
            for line in lines[max(0, len(lines) - tail):] if tail is not None else lines:
                self._say(path.stem, line)
        self.out.flush()

    def follow_once(self) -> None:
        """Print what was appended since the last look, then wait a moment."""
        for path in self._paths():
            for line in self._read_new(path):
                self._say(path.stem, line)
        self.out.flush()
        time.sleep(self.POLL)

    def _read_new(self, path: Path) -> list[str]:
        offset = self.offsets.get(path, 0)
        try:
            with path.open("rb") as f:
                if f.seek(0, os.SEEK_END) < offset:  # truncated: start over
                    offset = 0
                f.seek(offset)
                data = f.read()
        except OSError:
            return []
        self.offsets[path] = offset + len(data)
        *lines, rest = (self.partial.pop(path, b"") + data).split(b"\n")
        if rest:
            self.partial[path] = rest  # a line still being written
        return [line.decode(errors="replace") for line in lines]

    def _say(self, name: str, line: str) -> None:
        prefix = f"{name:>12} | "
        if self.color:
            import click

            prefix = click.style(prefix, fg="cyan")
        self.out.write(prefix + line + "\n")


def _set_ready(child: Child, ready: dict[str, Any]) -> None:
    child.ready = ready
    child.ready_event.set()


#: Between two tries to connect to a `ready_port` (the wait is bounded by `ready_timeout`).
PORT_POLL = 0.1


async def _ready_on_connect(child: Child, port: int) -> None:
    """Ready once 127.0.0.1:`port` accepts a connection (cancelled when the child exits)."""
    while True:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            await anyio.sleep(PORT_POLL)  # a poll interval; start() holds the deadline
            continue
        await stream.aclose()
        _set_ready(child, {"ready": "port", "port": port})
        return


def ready_line(line: str) -> dict[str, Any] | None:
    """A child's JSON ready line (`{"ready": ...}`, printed once it is registered), or None."""
    if not line.startswith('{"ready"'):
        return None
    try:
        ready = json.loads(line)
    except ValueError:
        return None
    return ready if isinstance(ready, dict) else None


def python_argv(*args: str) -> list[str]:
    """Run `busctl` children with this interpreter, whether or not the script is on PATH.

    `-P`: the current directory (often the workspace, which tools write) is not put on the
    children's sys.path, so a file a tool wrote there cannot shadow a module the bus imports."""
    return [sys.executable, "-P", "-m", "agent_bus.cli", *args]
