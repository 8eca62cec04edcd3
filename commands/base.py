"""What every busctl command shares: the group that turns errors into exits, the hub and
CURVE options, running a coroutine, the topology file option."""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import msgspec

from agent_bus.bus.client import DEFAULT_HUB, HUB_ENV
from agent_bus.bus.endpoints import hub_list, joined
from agent_bus.bus.errors import AgentBusError, HubUnreachable, UnknownName
from agent_bus.bus.paths import HUB_FORMS, parse_hub_address
from agent_bus.bus.security import HANDED_KEYS_ENV, CurveClient
from agent_bus.commands.interrupt import exit_130

T = TypeVar("T")
# A turn count on the command line: the topology file's bound (agents/launch/topology.py,
# TurnBound); a bigger number does not fit the wire (msgpack) and ended in an OverflowError.
COUNT = click.IntRange(min=1, max=2**31 - 1)


# busctl's exit codes, one table for every command (README, "Exit codes"; checked against the
# commands by tests/cli/test_exit_codes.py). 3 (`run` stopped at its turn limit) is run's own.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageExit(click.ClickException):
    """Exit 2: the command line is wrong, as click's own usage errors are — a flag or value, a
    name that names nothing (an agent, process, worker group, log or experiment; the message
    lists those that exist), or a hub address nothing answers at. Running it again as it is
    cannot help; exit 1 (`click.ClickException`) is for a command that was right but failed."""

    exit_code = EXIT_USAGE


class HubUnreachableExit(UsageExit):
    pass


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run a coroutine (errors are mapped to exits by `BusctlGroup`)."""
    return anyio.run(fn, *args)


class BusctlGroup(click.Group):
    """The one place where errors become exits: an `AgentBusError` is one line on stderr (exit 2
    when the hub cannot be reached or a name names nothing, else 1), Ctrl-C exits 130, and
    anything unexpected is one line naming the log that holds its traceback — never a bare
    traceback, never a guess."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Commands whose module is imported only when the command is used (or listed by
        # --help): every process `busctl up` starts runs busctl, so each import here is paid
        # at every start (the fake model server's alone was a quarter of busctl's import time).
        self.lazy_commands: dict[str, Callable[[], click.Command]] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_commands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        load = self.lazy_commands.pop(cmd_name, None)
        if load is not None:
            self.add_command(load(), cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if signal.getsignal(signal.SIGINT) is exit_130:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return super().main(*args, **kwargs)
        finally:
            _flush_or_hush()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                BrokenPipeError):  # a closed pipe: click exits 1 quietly (`busctl watch | head`)
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        except BaseExceptionGroup as group:  # raised inside a task group
            leaf = first_leaf(group)
            if isinstance(leaf, BrokenPipeError):
                raise leaf from None
            raise _exit_for(leaf) from None
        except Exception as exc:
            raise _exit_for(exc) from None


def _flush_or_hush() -> None:
    """Output still buffered when the reader has gone (`busctl status | head`): exit 1 quietly,
    as click does for a closed pipe met earlier, not with Python's message at exit."""
    if sys.stdout is None:  # started with stdout closed
        return
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes once more at exit: let that go to /dev/null
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error a task group is reporting: its first agent-bus error, else its first leaf."""
    match, _ = group.split(AgentBusError)
    leaf: BaseException = match if match is not None else group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _exit_for(exc: BaseException) -> click.exceptions.ClickException | click.exceptions.Exit:
    if isinstance(exc, KeyboardInterrupt):
        return click.exceptions.Exit(130)
    if isinstance(exc, HubUnreachable):
        return HubUnreachableExit(str(exc))
    if isinstance(exc, UnknownName):
        return UsageExit(str(exc))
    if isinstance(exc, AgentBusError):
        return click.ClickException(str(exc))
    return click.ClickException(f"unexpected {type(exc).__name__}: {exc} (a bug in busctl; "
                                f"the traceback is in {_crash_log(exc)})")


CRASH_LOG = "busctl-crash.log"
#: Options whose values are secrets (`K=V` headers, tokens): never written to the crash log.
_SECRET_OPTIONS = ("--header", "--mcp-header", "--token")


def _crash_log(exc: BaseException) -> str:
    """Append the traceback of an unexpected error to the user's own crash log; return its path.

    The log is in the user's state folder (`bus.paths.state_home`, made 0700), not the shared
    temporary folder; created 0600 and opened without following a symlink (a link planted there
    is refused, not written through); secrets from the command line are redacted."""
    import traceback

    from agent_bus.bus.paths import state_home
    from agent_bus.bus.redact import Redactor

    shown, secrets = _redacted_argv(sys.argv[1:])
    redact = Redactor(secrets)
    text = redact(f"--- busctl {shown}\n") + redact("".join(traceback.format_exception(exc)))
    try:
        folder = state_home()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / CRASH_LOG
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "a") as log:
            os.fchmod(fd, 0o600)  # one made by an older busctl was 0644
            log.write(text)
    except OSError:
        return "(no log: could not write one; run with -v)"
    return str(path)


def _redacted_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The command line with the values of `_SECRET_OPTIONS` masked (`K=***` for a header),
    and those values (for redacting them from the traceback too)."""
    from agent_bus.bus.redact import MARK

    shown: list[str] = []
    secrets: list[str] = []
    pending = False
    for arg in argv:
        name, eq, value = arg.partition("=")
        if pending or (eq and name in _SECRET_OPTIONS):
            value = arg if pending else value
            key, sep, secret = value.partition("=")
            secret = secret if sep else value
            secrets.append(secret)
            masked = f"{key}={MARK}" if sep else MARK
            shown.append(masked if pending else f"{name}={masked}")
            pending = False
            continue
        pending = arg in _SECRET_OPTIONS
        shown.append(arg)
    return " ".join(shown), secrets


def use_color(stream: Any = None) -> bool:
    from agent_bus.bus.render import color_wanted

    return color_wanted(stream or sys.stdout)


def curve_client(server_key: str | None, key: str | None) -> CurveClient | None:
    from agent_bus.bus.security import handed_keys

    try:  # a sandboxed worker's keys came in memory: its key files are masked in here
        handed = handed_keys()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if handed is not None:
        return handed
    if not server_key and not key:
        return None
    if not (server_key and key):
        raise click.UsageError("--curve-server-key and --curve-key go together (CURVE needs both)")
    try:
        return CurveClient(server_public_key_file=server_key, secret_key_file=key)
    except ValueError as exc:  # e.g. the public `.key` given where the `.key_secret` belongs
        flag = "--curve-server-key" if "hub public key" in str(exc) else "--curve-key"
        raise click.BadParameter(str(exc), param_hint=flag) from None


def hub_address(value: str | None) -> str | None:
    """`--hub`/`BUSCTL_HUB` read by the one parser `connect()` uses too (bus.paths)."""
    try:
        return parse_hub_address(value) if value else value
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def hub_address_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return hub_address(value)


def hub_list_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A client's `--hub`/`BUSCTL_HUB`: one address or several separated by commas (a primary
    hub and its standby, bus/endpoints.py), each read as `hub_address` reads one; passed on as
    one string with commas, which `connect()` reads the same way. A bad or empty entry is a
    usage error naming the flag and the entry."""
    if not value:
        return value
    try:
        return joined(hub_list(value))
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (read from --hub or {HUB_ENV})") from None


def hub_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--hub` plus the CURVE client keys, passed on as `hub` and `curve`; with `--engine ray`,
    both are found on the cluster (the topology's holder actor: nothing typed, no key copied)."""
    return _hub_options(fn, find_on_ray=True)


def hub_and_engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`hub_options` that passes the engine options on (`engine`, `address`, `topology_name`)
    instead of acting on them: `busctl ps` asks Ray itself."""
    return _hub_options(fn, find_on_ray=False)


def _hub_options(fn: Callable[..., Any], *, find_on_ray: bool) -> Callable[..., Any]:

    @click.option("--hub", "hub", envvar=HUB_ENV, default=DEFAULT_HUB, show_default=True,
                  callback=hub_list_option,
                  help=f"Hub address to connect to: {HUB_FORMS} (env {HUB_ENV}); several "
                       f"separated by commas (a primary and its standby): the client follows "
                       f"the hub along them.")
    # not `exists=True`: in a worker's sandbox the files are hidden (its keys came in memory);
    # elsewhere a missing file is named by `curve_client`
    @click.option("--curve-server-key", envvar="BUSCTL_CURVE_SERVER_KEY", default=None,
                  type=click.Path(dir_okay=False),
                  help="The hub's public key file (`busctl keys generate`), for a CURVE hub.")
    @click.option("--curve-key", envvar="BUSCTL_CURVE_KEY", default=None,
                  type=click.Path(dir_okay=False),
                  help="This client's secret key file, for a CURVE hub.")
    @engine_options
    @functools.wraps(fn)
    def wrapper(*args: Any, curve_server_key: str | None, curve_key: str | None,
                engine: str | None, address: str | None, topology_name: str, **kwargs: Any) -> Any:
        if not find_on_ray:
            kwargs.update(engine=engine, address=address, topology_name=topology_name)
        elif engine == "slurm" and HANDED_KEYS_ENV not in os.environ:
            # the hub and the owner's key, published by the job in the state folder
            kwargs["hub"], curve = on_slurm("client", slurm_state(None))
            return fn(*args, curve=curve, **kwargs)
        elif engine == "ray" and HANDED_KEYS_ENV not in os.environ:
            # the hub and the owner's key, found on the cluster: nothing typed. (A worker that
            # re-ran itself in its sandbox has its keys in a pipe and its hub from outside.)
            command = click.get_current_context().info_name or ""  # `worker`: a worker's key
            kwargs["hub"], curve = on_ray("client", topology_name, address or "auto", command)
            return fn(*args, curve=curve, **kwargs)
        kwargs["hub"] = hub_here(kwargs["hub"])
        return fn(*args, curve=curve_client(curve_server_key, curve_key), **kwargs)

    return wrapper


def hub_here(hub: str) -> str:
    """`hub`; but when it is only the default (no --hub, no BUSCTL_HUB), the hub of the topology
    started from this folder, if one runs here: `busctl up --hub 7700` (or a topology file's
    address) is then found by every command run in its folder, as `busctl down` finds it."""
    from click.core import ParameterSource

    if click.get_current_context().get_parameter_source("hub") is not ParameterSource.DEFAULT:
        return hub
    from agent_bus.agents.launch.supervisor import read_run_file, same_process
    from agent_bus.bus.paths import default_state_dir

    info = read_run_file(default_state_dir() / "up.json")
    if info is None or not info.endpoint:
        return hub
    record = info.children.get("hub")
    return info.endpoint if record is not None and same_process(record) else hub


ENGINE_ENV = "BUSCTL_ENGINE"
RAY_NAME_ENV = "BUSCTL_RAY_TOPOLOGY"


def engine_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--engine`, `--address`, `--topology-name`: which engine runs the topology, and for Ray
    the cluster and the topology's name there; passed on as `engine`, `address`, `topology_name`."""
    fn = click.option("--topology-name", envvar=RAY_NAME_ENV, default="", metavar="NAME",
                      help=f"With --engine ray: the topology's name on the cluster [default: "
                           f"the only one up there] (env {RAY_NAME_ENV}).")(fn)
    fn = click.option("--address", envvar="RAY_ADDRESS", default=None, metavar="ADDR",
                      help="With --engine ray: the Ray cluster (HOST:PORT of its head) "
                           "[default: the topology file's, else `auto`, the cluster this "
                           "machine belongs to] (env RAY_ADDRESS).")(fn)
    return click.option("--engine", envvar=ENGINE_ENV,
                        type=click.Choice(["local", "ray", "slurm"]),
                        default=None, help=f"Where the topology runs: `local` (busctl up's own "
                        f"supervisor), `ray` (a Ray cluster; needs `pip install "
                        f"'agent-bus[ray]'`) or `slurm` (srun steps in a Slurm allocation; "
                        f"other commands find its hub in the state folder) [default: the "
                        f"topology file's [engine] kind] (env {ENGINE_ENV}).")(fn)


class RayTarget(msgspec.Struct, frozen=True):
    name: str  # "": the only topology up on the cluster
    address: str


def ray_target(config_file: str | None, engine: str | None, address: str | None,
               name: str) -> RayTarget | None:
    """The Ray topology a command is about (None: a local one): `--engine ray`, or a topology
    file whose [engine] kind is "ray"; its name and address from the flags, else the file."""
    if engine in ("local", "slurm"):
        return None
    topo = load_topology_or_exit(config_file) if config_file else None
    if engine is None and (topo is None or topo.engine.kind != "ray"):
        return None
    if topo is not None and not name:
        from agent_bus.agents.launch.ray_engine import topology_name

        name = topology_name(topo, config_file)
    return RayTarget(name, address or (topo.engine.address if topo else "auto"))


def on_ray(what: str, *args: Any) -> Any:
    """Call `agent_bus.agents.launch.ray_engine.<what>(*args)`, then leave the cluster. Without
    Ray installed: exit 2 naming the extra. Streams to write to are passed in `args` (stdout is
    redirected meanwhile)."""
    import contextlib

    from agent_bus.agents.launch import ray_engine

    try:
        # Ray's driver prints the cluster's notices (a node lost...) on sys.stdout from a thread
        # of its own: to stderr with them, so that stdout stays the command's (`ps --json`).
        with contextlib.redirect_stdout(sys.stderr):
            return getattr(ray_engine, what)(*args)
    except ray_engine.RayUnavailable as exc:
        raise ConfigExit(str(exc)) from None
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


def slurm_state(config_file: str | None, engine: str | None = "slurm") -> Path | None:
    """The state folder of the Slurm topology a command is about (None: not one): `--engine
    slurm` (the `-c` file's, else $BUSCTL_SLURM_STATE, else this folder's), or a `-c` file
    whose [engine] kind is "slurm"."""
    if engine in ("local", "ray"):
        return None
    from agent_bus.agents.launch.slurm_engine import STATE_ENV

    if engine == "slurm" and config_file is None and os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])  # set in the job `busctl submit` writes
    topo = load_topology_or_exit(config_file)
    if engine is None and topo.engine.kind != "slurm":
        return None
    return Path(topo.state_path())


def on_slurm(what: str, *args: Any) -> Any:
    """Call `agent_bus.agents.launch.slurm_engine.<what>(*args)`; no Slurm tools or no
    allocation: exit 2 saying so."""
    from agent_bus.agents.launch import slurm_engine

    try:
        return getattr(slurm_engine, what)(*args)
    except slurm_engine.SlurmUsage as exc:
        raise ConfigExit(str(exc)) from None


def budget_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One `--NAME` option per hub memory budget (bus.hub.BUDGETS), passed on as `budgets`."""
    from agent_bus.bus.hub import BUDGETS, HubConfig

    defaults = HubConfig()
    names = list(BUDGETS)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budgets = {name: kwargs.pop(name) for name in names}
        return fn(*args, budgets=budgets, **kwargs)

    for name in reversed(names):
        wrapper = click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(0),
                               default=getattr(defaults, name), show_default=True,
                               help="Memory budget (docs/reliability.md, \"Memory budgets\")."
                               )(wrapper)
    return wrapper


def state_dir_for(given: str | None, part: str) -> Path:
    """A process's state folder, marked so that tools refuse it (see bus.paths)."""
    from agent_bus.bus.paths import default_state_dir, ensure_state_dir

    try:
        if given:
            return ensure_state_dir(given)
        return ensure_state_dir(default_state_dir()) / part
    except OSError as exc:
        raise click.BadParameter(f"cannot use {given or default_state_dir()!s} as the state "
                                 f"directory: {exc.strerror or exc}", param_hint="--state-dir") from None

def load_topology_or_exit(path: str | None) -> Any:
    """The topology from `path`, from stdin as JSON (`-`, how `busctl up` hands it to its
    children), or the embedded default."""
    from agent_bus.agents.launch.topology import (
        TopologyError,
        default_topology,
        load_topology,
        parse_topology,
    )

    if path is None:
        return default_topology()
    try:
        if path == "-":
            return parse_topology(sys.stdin.buffer.read(), "<stdin>", as_json=True)
        return load_topology(path)
    except TopologyError as exc:
        raise ConfigExit(str(exc)) from None


class ConfigExit(UsageExit):
    """A topology that cannot run, named by its key: exit 2 (bad use), from `config check` and
    `up` alike (they share `check_topology`)."""


def topology_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`-c FILE`: the topology given to `busctl up`, which names its state directory."""
    return click.option("-c", "--config", "config_file", type=click.Path(dir_okay=False),
                        default=None, help="The topology file given to `busctl up` (for its "
                                           "state directory) [default: the embedded default].")(fn)


def state_of(config_file: str | None) -> Path:
    from agent_bus.agents.launch.up import state_dir

    return state_dir(load_topology_or_exit(config_file))
