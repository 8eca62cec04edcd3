"""Where a topology keeps its state (event log, conversations, logs), and how tools recognise it.

The state directory holds what the bus trusts: the event log, stored conversations, the running
topology. A model's tools must never reach it, so by default it lives outside the project, under
`$BUSCTL_STATE_HOME` (else `$XDG_STATE_HOME/agent-bus`, else `~/.local/state/agent-bus`), one
folder per project directory. Every state directory carries a marker file; the tools' path
confinement refuses any path inside a folder that has one, whatever the workspace is.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from agent_bus.bus.errors import ConfigError

STATE_HOME_ENV = "BUSCTL_STATE_HOME"
STATE_MARKER = ".agent-bus-state"
_MARKER_TEXT = ("agent-bus state directory: the event log, conversations and logs of a topology.\n"
                "Tools refuse every path inside a folder holding this file.\n")


def state_home() -> Path:
    """The folder that holds the default state directories of every project."""
    explicit = os.environ.get(STATE_HOME_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return (base / "agent-bus").resolve()


def default_state_dir(project: Path | str | None = None) -> Path:
    """The state directory of `project` (default: the current directory), outside the project.

    Named `<folder>-<hash of its absolute path>` so two projects never share one and a person can
    still tell which is which.
    """
    root = Path(project or os.getcwd()).resolve()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", root.name) or "root"
    return state_home() / f"{name}-{digest}"


def ensure_state_dir(path: Path | str) -> Path:
    """Create `path` (and parents) and mark it as a state directory; returns it resolved.

    It holds every prompt and reply: it is made 0700, and a state directory an older version
    left open to others is closed, with everything in it (folders 0700, files 0600)."""
    state = Path(path).resolve()
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    if state.stat().st_mode & 0o077:
        make_private(state)
    marker = state / STATE_MARKER
    if not marker.exists():
        marker.write_text(_MARKER_TEXT)
        os.chmod(marker, 0o600)
    return state


def make_private(folder: Path) -> None:
    """`folder` and everything in it readable by its owner only (links are left alone)."""
    os.chmod(folder, 0o700)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o600)


def inside_state_dir(path: Path) -> Path | None:
    """The state directory that `path` (resolved) lies in, or None.

    Walks up from `path`: a handful of `stat` calls, cheap next to the file operation it guards.
    """
    for folder in (path, *path.parents):
        if (folder / STATE_MARKER).is_file():
            return folder
    return None


def overlaps(a: Path, b: Path) -> bool:
    """True when one of the two resolved folders contains the other (or they are the same)."""
    return a == b or a in b.parents or b in a.parents


# --- the local hub's sockets: a private runtime directory -----------------------------------
#
# A local topology's hub listens on ipc:// sockets in a 0700 directory of its user's, so no other
# local user can reach it (docs/protocol.md section 8, "A local topology"). The directory is
# `$XDG_RUNTIME_DIR/agent-bus/<12 hex of the state directory>/` (else `/tmp/agent-bus-<uid>/...`),
# holding `hub` and `hub.events` (short paths: a socket path has at most 107 bytes). The tcp
# address the topology names (`tcp://127.0.0.1:7400`) stays its owner's way to reach it: an alias
# file `tcp-<port>` in the user's runtime folder gives the ipc address, and `connect()` follows it.
# The alias is also written to a folder chosen from the uid alone (`alias_homes`): an MCP client
# starts `busctl mcp serve` with a minimal environment (no XDG_RUNTIME_DIR, no TMPDIR), and it
# must find the topology its user started from a full login shell.

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _runtime_base() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "agent-bus" if xdg else Path(tempfile.gettempdir()) / f"agent-bus-{os.getuid()}"


def runtime_home() -> Path:
    """The user's private folder for the sockets of local hubs (made 0700, checked ours)."""
    return private_dir(_runtime_base())


def _ours(path: Path, private: bool) -> bool:
    """Whether `path` (not followed if a link) is this user's, and with `private` not open to
    others: a client trusts an alias only there (someone else's file could lead it to their hub)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not (private and st.st_mode & 0o077)


def private_dir(path: Path) -> Path:
    """`path` as a directory of this user's that no one else can enter: made 0700 (parents too,
    when missing), narrowed to 0700 if looser; refused if it is a link or another user's (in a
    shared /tmp, someone else may have made it first)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"{path} is not a directory of this user's (a link, or made by uid "
                          f"{st.st_uid}): remove it, or set XDG_RUNTIME_DIR to a private folder")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def topology_runtime_dir(state: Path) -> Path:
    """The private runtime folder of the topology whose state directory is `state`."""
    digest = hashlib.sha256(str(Path(state).resolve()).encode()).hexdigest()[:12]
    return private_dir(runtime_home() / digest)


def local_hub_endpoint(state: Path) -> str:
    """The ipc:// address of the hub of the topology whose state directory is `state`."""
    return f"ipc://{topology_runtime_dir(state)}/hub"


# The credential a process presents in its hello (roles: agents/launch/credentials.py).
CREDENTIAL_ENV = "BUSCTL_CREDENTIAL_FILE"  # its path, set by `busctl up` for its children
OWNER_CREDENTIAL = "owner.cred"  # beside a local topology's sockets: its owner's full rights
MAX_CREDENTIAL = 256


def credential_for(endpoint: str) -> str:
    """What to present to the hub at `endpoint`, a local topology's ipc:// socket: the file named
    by $BUSCTL_CREDENTIAL_FILE when it lies beside the socket (a credential is never sent to
    another hub), else the owner's credential there, when it is this user's and private; ""
    for any other hub, or when there is none."""
    if not endpoint.startswith("ipc://"):
        return ""
    folder = Path(endpoint[6:]).parent
    named = os.environ.get(CREDENTIAL_ENV, "")
    if named:
        path = Path(named)
        if path.parent != folder:
            return ""
    else:
        path = folder / OWNER_CREDENTIAL
        if not (_ours(path.parent, private=True) and _ours(path, private=True)):
            return ""
    try:
        return path.read_text()[:MAX_CREDENTIAL].strip()
    except (OSError, UnicodeDecodeError):
        return ""


ATTACHED_WORKER_CREDENTIAL = "worker.cred"  # tool.* only: a worker attached by hand


def claim_worker_credential(endpoint: str) -> None:
    """For a tool worker attached by hand to a local topology: name the topology's worker
    credential (serve tools only) as this process's, before its sandbox hides every other one
    (the owner's full rights included). Does nothing when a credential is named already."""
    if not endpoint.startswith("ipc://") or os.environ.get(CREDENTIAL_ENV):
        return
    path = Path(endpoint[6:]).parent / ATTACHED_WORKER_CREDENTIAL
    if _ours(path.parent, private=True) and _ours(path, private=True):
        os.environ[CREDENTIAL_ENV] = str(path)


def loopback_port(endpoint: str) -> int | None:
    """The port of a loopback tcp:// address (None for anything else, and for port 0)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[6:].rpartition(":")
    if host not in LOCAL_HOSTS and not host.startswith("127."):
        return None
    return int(port) if port.isdigit() and int(port) else None


def _fixed_runtime_base() -> Path:
    """The runtime folder as chosen without any environment variable: `/run/user/<uid>` (what
    a login manager names in XDG_RUNTIME_DIR) when it exists and is this user's, else
    `/tmp/agent-bus-<uid>` (the literal /tmp: a minimal environment has no TMPDIR either)."""
    login = Path(f"/run/user/{os.getuid()}")
    if _ours(login, private=True) and login.is_dir():
        return login / "agent-bus"
    return Path("/tmp") / f"agent-bus-{os.getuid()}"


def alias_homes() -> list[Path]:
    """Where tcp aliases are written and looked for: the runtime folder of this environment,
    then the one chosen from the uid alone (the same with and without XDG_RUNTIME_DIR)."""
    homes = [_runtime_base(), _fixed_runtime_base()]
    return homes[:1] if homes[0] == homes[1] else homes


def write_private(path: Path, text: str) -> None:
    """Write `path` whole (a temporary file renamed over it), 0600 from the start, never
    through a link planted in its place: how every secret or per-user file is written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def set_tcp_alias(port: int, endpoint: str) -> None:
    """Make `tcp://127.0.0.1:<port>` lead this user's clients to `endpoint` (0600), in every
    folder of `alias_homes`. The runtime folder must take it; the uid-only copy is a courtesy
    to clients started with a minimal environment, skipped when that folder is not ours."""
    first, *others = alias_homes()
    write_private(private_dir(first) / f"tcp-{port}", endpoint)
    for home in others:
        try:
            write_private(private_dir(home) / f"tcp-{port}", endpoint)
        except (OSError, ConfigError):
            pass  # e.g. another user made /tmp/agent-bus-<uid>: never write into theirs


def remove_tcp_alias(port: int, endpoint: str) -> None:
    """Remove the alias from every folder that holds it, unless it now leads to another hub."""
    for home in alias_homes():
        try:
            if _read_alias(home, port, live=False) == endpoint:
                (home / f"tcp-{port}").unlink(missing_ok=True)
        except (OSError, ConfigError):
            pass


def tcp_alias(port: int, live: bool = True) -> str:
    """The ipc:// address this user's local hub for `port` listens on ("" when none; with
    `live`, also when its socket does not accept a connection: a topology that was killed).
    Looked for in each folder of `alias_homes`, in order."""
    for home in alias_homes():
        endpoint = _read_alias(home, port, live)
        if endpoint:
            return endpoint
    return ""


def _read_alias(base: Path, port: int, live: bool) -> str:
    path = base / f"tcp-{port}"
    if not (_ours(base, private=True) and _ours(path, private=True)):
        return ""
    try:
        endpoint = path.read_text().strip()
    except OSError:
        return ""
    if not endpoint.startswith("ipc://"):
        return ""
    if live and not ipc_listening(endpoint[6:]):
        return ""
    return endpoint


def ipc_listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


HUB_FORMS = "tcp://HOST:PORT, ipc://PATH, HOST:PORT or PORT (on 127.0.0.1)"


def hub_refusal(hub: str) -> str:
    """Fail fast on a malformed address (raises ValueError naming the forms) or a hub that is
    plainly not there (returns why: nothing listens on the TCP port, or no ipc socket file),
    instead of a client retrying for its whole connect timeout. Anything less clear-cut is left
    to the ZeroMQ connection ("")."""
    # (No probe socket on the client's zmq context: creating one there upsets the fd-driven
    # reader of the SUB sockets made later — seen as a subscriber stalling under load.)
    scheme, sep, rest = hub.partition("://")
    ok = sep and rest and scheme in ("tcp", "ipc", "inproc", "ws", "wss", "tipc", "vmci")
    if ok and scheme == "tcp":
        port = rest.rpartition(":")[2]
        ok = ":" in rest and port.isdigit() and 0 < int(port) < 65536
    if not ok:
        raise ValueError(f"bad hub address {hub!r} (use {HUB_FORMS})")
    if hub.startswith("ipc://"):
        path = hub[6:]
        if path and not path.startswith("@") and not os.path.exists(path):
            return f"no socket file at {path}"
        return ""
    if hub.startswith("tcp://"):
        host, _, port = hub[6:].rpartition(":")
        host = host.strip("[]")
        if ";" in host:
            return ""  # a source address: let ZeroMQ handle it
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                pass
        except ConnectionRefusedError:
            return "connection refused"
        except OSError:
            return ""
    return ""


def parse_hub_address(value: str) -> str:
    """`tcp://…` and `ipc://…` as given; `HOST:PORT` and a bare `PORT` (loopback) are shorthands
    for tcp, the way people type an address (`--hub localhost:7400`, `--hub 7400`,
    `connect("7400")`). The one parser of hub addresses: busctl's `--hub`/`BUSCTL_HUB` and
    `connect()` in Python accept the same forms. Raises ValueError naming the forms."""
    if value.startswith("tcp://"):  # the port is checked here too: 99999 overflowed a bind
        port = value.rpartition(":")[2]
        if port.isdigit() and int(port) > 65535:
            raise ValueError(f"{value!r}: the port must be from 0 to 65535")
    if "://" in value:
        return value
    host, _, port = value.rpartition(":")
    if port.isdigit() and int(port) <= 65535 and (host or ":" not in value):
        return f"tcp://{host or '127.0.0.1'}:{port}"
    raise ValueError(f"{value!r} is not an address: give {HUB_FORMS}")


def local_alias(endpoint: str) -> str:
    """`endpoint`, or the ipc:// address it is an alias of (this user's local topology)."""
    port = loopback_port(endpoint)
    if port is None:
        return endpoint
    return tcp_alias(port) or endpoint
