"""CurveZMQ settings: key pairs on disk, the hub's authenticator (ZAP) and client socket options.

Key files use pyzmq's certificate format (`zmq.auth.create_certificates`). A hub with a
`CurveServer` encrypts both of its sockets and admits only clients whose public key file is in
`authorized_dir`; the directory is re-read when it changes (polled) and on `request_reload()`
(the hub calls it on SIGHUP), so adding or removing a key needs no restart. ZAP only runs at the
handshake: when a key is removed, the hub itself drops the live peers that authenticated with it
(it watches `generation`) and refuses whatever else arrives on their connections.

Who a peer is: with CURVE, libzmq attaches the ZAP `User-Id` to every message of an
authenticated connection; ours is the client's public key in Z85 (pyzmq's default
`curve_user_id`). The hub reads it with `peer_user_id(frame)` and derives the peer id from it
(`curve_peer_id`), so the id shown in `status` and stamped on events names the key that was
authenticated, not a name the client chose.

Refused handshakes (a key that is not authorised) are counted here, thread-safely, and the hub
merges `counters()` into its status counters as `auth_refused`.

Binding without CURVE: `check_bind` is the policy (loopback only, unless the user says the network
is trusted); `busctl hub` and `busctl up` ask it, each naming its own flags or topology keys.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import tempfile
import threading
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from agent_bus.bus.errors import ConfigError

log = logging.getLogger("bus.security")

ZAP_DOMAIN = "agent-bus"
RELOAD_POLL = 0.25  # seconds between checks of the authorised-keys directory (a removed key's
# peers are dropped within this + the hub's 0.1 s tick: inside one default heartbeat interval)
KEY_ID_CHARS = 12  # Z85 characters of the client key shown in a peer id


def _load_pair(path: str, what: str) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None
    if not secret:
        raise ValueError(f"{what} {path} holds no secret key: pass the `.key_secret` file "
                         "made by `busctl keys generate`")
    return public, secret


def _load_public(path: str, what: str) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None
    return public


class CurveServer(msgspec.Struct, forbid_unknown_fields=True):
    secret_key_file: str  # the hub's `*.key_secret`
    authorized_dir: str  # a directory of client `*.key` files
    # more such directories, each with its own roles.toml: `busctl up` adds the folder of the
    # keys it makes for its own processes, so it never writes into the user's folder
    also_authorized: list[str] = msgspec.field(default_factory=list)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE server in our ZAP domain (call before bind)."""
        public, secret = _load_pair(self.secret_key_file, "hub secret key file")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True

    def start_authenticator(self, ctx: zmq.Context[Any]) -> KeyDirAuthenticator:
        """Start the ZAP handler for `ctx`; must run before any CURVE socket binds."""
        folders = [Path(d) for d in (self.authorized_dir, *self.also_authorized)]
        for folder in folders:
            if not folder.is_dir():
                raise ValueError(f"authorised keys directory {folder} does not exist "
                                 "(make one with `busctl keys generate DIR`)")
        auth = KeyDirAuthenticator(ctx, folders, RELOAD_POLL)
        auth.start()
        return auth


HELD = "(held in memory)"  # the key file names of a CurveClient made by `CurveClient.held`


class CurveClient(msgspec.Struct, forbid_unknown_fields=True, dict=True):
    server_public_key_file: str  # the hub's `*.key`
    secret_key_file: str  # this client's `*.key_secret`

    def __post_init__(self) -> None:
        # Fail at configuration time with a readable message, not later inside a socket task.
        if self.secret_key_file != HELD:
            _load_pair(self.secret_key_file, "client secret key file")
            _load_public(self.server_public_key_file, "hub public key file")

    @classmethod
    def held(cls, server: bytes, public: bytes, secret: bytes) -> CurveClient:
        """A client whose keys live in this process's memory only (a sandboxed worker's: its
        key files are masked in its sandbox). Not a field: never encoded, never in a repr."""
        client = cls(server_public_key_file=HELD, secret_key_file=HELD)
        client.__dict__["_held"] = (server, public, secret)
        return client

    def keys(self) -> tuple[bytes, bytes, bytes]:
        """(hub public, client public, client secret), read now from the files (or memory)."""
        held: tuple[bytes, bytes, bytes] | None = getattr(self, "_held", None)
        if held is not None:
            return held
        public, secret = _load_pair(self.secret_key_file, "client secret key file")
        return _load_public(self.server_public_key_file, "hub public key file"), public, secret

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.keys()


# A sandboxed worker's keys cross its re-execution under bwrap in memory: read outside, written to
# a pipe whose read end the new process inherits (its number in this variable; the keys are never
# in an environment block), read and closed inside before any tool runs (tools/sandbox.py).
HANDED_KEYS_ENV = "BUSCTL_CURVE_FD"


def hand_over(curve: CurveClient) -> int:
    """Put `curve`'s keys in a pipe the next exec inherits; returns its read end. The caller
    closes it (`take_back`) when no exec came (no sandbox)."""
    read, write = os.pipe()
    with os.fdopen(write, "wb") as out:  # ~130 bytes: far below a pipe's buffer
        out.write(b"\n".join(curve.keys()))
    os.set_inheritable(read, True)
    os.environ[HANDED_KEYS_ENV] = str(read)
    return read


def take_back(fd: int) -> None:
    """Undo `hand_over` in a process that did not re-execute itself."""
    os.environ.pop(HANDED_KEYS_ENV, None)
    with contextlib.suppress(OSError):
        os.close(fd)


def handed_keys() -> CurveClient | None:
    """Inside the sandbox: the keys `hand_over` passed (the pipe is read and closed, the variable
    removed, so no tool or child inherits either), or None when none were handed over."""
    fd = os.environ.pop(HANDED_KEYS_ENV, "")
    if not fd.isdigit():
        return None
    with os.fdopen(int(fd), "rb") as pipe:
        parts = pipe.read().split(b"\n")
    if len(parts) != 3:
        raise ValueError("the CURVE keys handed to this worker are incomplete")
    return CurveClient.held(*parts)


def key_hiding(files: Iterable[str], workspace: Path) -> list[str]:
    """What a sandbox must hide so that none of `files` (key files) nor their neighbours (`busctl
    keys generate` writes every client's secret beside the hub's) can be read nor a key added
    beside them: each file's folder, or, when that folder holds the workspace or is the home
    folder (too much to hide), each secret key file in it and the file itself."""
    ws = workspace.resolve()
    too_wide = {Path.home().resolve(), Path("/")}
    out: dict[str, None] = {}
    for name in files:
        path = Path(name).expanduser().resolve()
        folder = path if path.is_dir() else path.parent
        if not ws.is_relative_to(folder) and folder not in too_wide:
            out[str(folder)] = None
            continue
        for secret in [path, *sorted(folder.glob("*.key_secret"))]:
            if secret.is_file():
                out[str(secret)] = None
    return list(out)


def peer_user_id(frame: zmq.Frame) -> str:
    """The ZAP User-Id of the connection a frame (received with copy=False) came on, or ""."""
    try:
        user_id = frame.get("User-Id")
    except (zmq.ZMQError, KeyError, AttributeError):
        return ""
    # Frame.get answers ints for the integer properties (e.g. "more"); "User-Id" is always text.
    return user_id if isinstance(user_id, str) else ""


def curve_peer_id(user_id: str, routing_id: bytes) -> str:
    """`key:<first 12 Z85 chars of the client key>:<routing id hex>`.

    The key part is what the hub authenticated (grep it in the authorised `.key` files); the
    routing-id part tells apart processes sharing one key. Split with `rpartition(":")`: Z85
    may itself contain ":".
    """
    return f"key:{user_id[:KEY_ID_CHARS]}:{routing_id.hex()}"


ROLES_FILE = "roles.toml"  # beside the authorised keys: what each key may do (docs/protocol.md §8)
FULL_RIGHTS = "*"


def read_roles(path: Path, keys_by_name: Mapping[str, bytes]) -> dict[bytes, tuple[str, ...]] | None:
    """The roles file as {public key: service patterns}, or None when there is none (every key
    keeps full rights). A file that cannot be read gives no key any right (never wider access)."""
    if not path.exists():
        return None
    try:
        table = tomllib.loads(path.read_text()).get("roles", {})
        if not isinstance(table, dict):
            raise ValueError("`roles` must be a table of key name = [service patterns]")
        roles: dict[bytes, tuple[str, ...]] = {}
        for name, patterns in table.items():
            if not (isinstance(patterns, list) and all(isinstance(x, str) for x in patterns)):
                raise ValueError(f"roles.{name} must be a list of service patterns (strings)")
            if name not in keys_by_name:
                log.warning("%s: no authorised key file %s.key for roles.%s", path, name, name)
                continue
            roles[keys_by_name[name]] = tuple(patterns)
        return roles
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        log.error("cannot read %s: %s; no key may serve or speak for an agent until it is fixed",
                  path, exc)
        return {}


class KeyDirAuthenticator:
    """ZAP handler admitting the CURVE keys in one or more directories; reloads them when they
    change. Each directory's `roles.toml` gives the roles of its own keys only (a directory
    without one gives its keys full rights, as a single directory always did).

    The key set is swapped atomically on reload; a missing directory or one bad file never
    widens access (a bad file is skipped with a warning, a missing directory admits no one).
    """

    def __init__(self, ctx: zmq.Context[Any], directory: Path | Sequence[Path],
                 poll_interval: float = RELOAD_POLL) -> None:
        self.directories = [directory] if isinstance(directory, Path) else list(directory)
        self.directory = self.directories[0]  # the user's: named in refusals
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("bus.security.zap"))
        self._keys: frozenset[bytes] = frozenset()
        self._roles: dict[bytes, tuple[str, ...]] = {}  # a key left out has no rights
        self._stamp: object = None
        self._lock = threading.Lock()
        self._refused = 0
        self._accepted = 0
        self._reloads = 0
        self.generation = 0  # bumped whenever the set of keys changes (read by the hub loop)
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by request_reload() and stop()
        self._poll_interval = poll_interval
        self._watcher = threading.Thread(target=self._watch, name="curve-keys", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.reload()
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._auth.stop()
        if self._watcher.is_alive():
            self._watcher.join(2)

    # --- keys --------------------------------------------------------------------------

    def reload(self) -> int:
        """Re-read the directories now (also called on SIGHUP); returns the number of keys."""
        with self._lock:
            stamp = self._dir_stamp()
            keys: set[bytes] = set()
            roles: dict[bytes, tuple[str, ...]] = {}
            for directory in self.directories:
                names = self._read_keys(directory)
                keys.update(names.values())
                found = read_roles(directory / ROLES_FILE, names)
                for public, patterns in (found if found is not None else
                                         {k: (FULL_RIGHTS,) for k in names.values()}).items():
                    roles[public] = (*roles.get(public, ()), *patterns)
            if keys != self._keys or self._stamp is None:
                log.info("authorised CURVE keys: %d (from %s)", len(keys),
                         ", ".join(map(str, self.directories)))
            if keys != self._keys:
                self.generation += 1
            self._keys, self._roles = frozenset(keys), roles
            self._stamp = stamp
            self._reloads += 1
            return len(keys)

    @staticmethod
    def _read_keys(directory: Path) -> dict[str, bytes]:
        """{file name without `.key`: public key} of the key files in `directory`."""
        names: dict[str, bytes] = {}
        try:
            paths = sorted(directory.glob("*.key"))
        except OSError as exc:
            log.error("cannot read authorised keys in %s: %s; admitting none of them",
                      directory, exc)
            return names
        for path in paths:
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                log.warning("skipping authorised key file %s: %s", path, exc)
                continue
            names[path.stem] = public
        return names

    def request_reload(self) -> None:
        """Have the watcher thread reload now. Safe in a signal handler: it takes no lock that
        the interrupted thread may hold (`reload()` itself would deadlock on `_lock` if the
        signal landed inside `counters()`)."""
        self._wake.set()

    def is_authorized(self, user_id: str) -> bool:
        """Whether the key behind a ZAP User-Id (the client key in Z85) is still authorised."""
        return user_id.encode("ascii", "replace") in self._keys

    def roles_for(self, user_id: str) -> tuple[str, ...] | None:
        """The service patterns the key behind a ZAP User-Id may serve; None: full rights (no
        roles file, or `*` among its patterns). A key the roles file leaves out has none."""
        patterns = self._roles.get(user_id.encode("ascii", "replace"), ())
        return None if FULL_RIGHTS in patterns else patterns

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq credentials provider: called in the ZAP thread with the client's Z85 key."""
        allowed = key in self._keys
        with self._lock:
            if allowed:
                self._accepted += 1
                return True
            self._refused += 1
            n = self._refused
        if n <= 10 or n % 1000 == 0:
            log.warning("refused a CURVE handshake from unknown key %s... (#%d); add its .key "
                        "file to %s to authorise it", key[:KEY_ID_CHARS].decode("ascii", "replace"),
                        n, self.directory)
        return False

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"auth_refused": self._refused, "auth_accepted": self._accepted,
                    "auth_reloads": self._reloads}

    @property
    def keys(self) -> frozenset[bytes]:
        return self._keys

    def _dir_stamp(self) -> object:
        """Changes whenever a key file is added, removed, renamed or rewritten."""
        try:
            return tuple(self._one_stamp(d) for d in self.directories)
        except OSError:
            return None

    @staticmethod
    def _one_stamp(directory: Path) -> object:
        st = directory.stat()
        entries = []
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name.endswith(".key") or entry.name == ROLES_FILE:
                    est = entry.stat()
                    entries.append((entry.name, est.st_mtime_ns, est.st_size, est.st_ino))
        return (st.st_mtime_ns, tuple(sorted(entries)))

    def _watch(self) -> None:
        while True:
            asked = self._wake.wait(self._poll_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if asked or self._dir_stamp() != self._stamp:
                    self.reload()
            except Exception:  # the watcher must outlive a bad file or a vanished directory
                log.exception("reloading %s failed", self.directories)


def is_loopback_endpoint(endpoint: str) -> bool:
    """ipc:// and tcp on 127.0.0.0/8, ::1 or `localhost` are local; anything else needs CURVE."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[6:].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InsecureBindError(ConfigError):
    """A hub address other machines could reach, without CURVE and without `insecure`."""


def check_bind(addresses: Mapping[str, str], *, curve: bool, insecure: bool, fix: str) -> str | None:
    """The insecure-bind policy: without CURVE a hub binds loopback addresses only (anyone who
    reaches another address is let in), unless `insecure` says the network is trusted.

    `addresses` maps the name the user gave each address by (a flag, a topology key) to it; ""
    is an address not given. Raises InsecureBindError naming the first exposed one and, after
    "Make keys with `busctl keys generate DIR` and ", `fix` (the caller's own flags or keys).
    Returns that address when `insecure` allows it (for a warning), else None.
    """
    if curve:
        return None
    exposed = [(name, address) for name, address in addresses.items()
               if address and not is_loopback_endpoint(address)]
    if not exposed or insecure:
        return exposed[0][1] if exposed else None
    name, address = exposed[0]
    raise InsecureBindError(f"refusing to bind {name} {address} without CURVE: other machines could "
                            f"connect. Make keys with `busctl keys generate DIR` and {fix}")


@contextlib.contextmanager
def private_ipc(endpoint: str) -> Iterator[None]:
    """Around an ipc bind: a 0700 parent directory (when we create it) and a 0600 socket file.

    An existing parent directory is not changed (it may be /tmp); a warning says when others
    can reach into it. The umask is only narrowed for the bind itself.
    """
    if not endpoint.startswith("ipc://"):
        yield
        return
    parent = Path(endpoint[6:]).parent
    if not parent.exists():
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(parent, 0o700)  # mkdir's mode is subject to the umask; make it exact
    elif parent.stat().st_mode & 0o077:
        log.warning("ipc endpoint directory %s is accessible to other users; prefer a 0700 "
                    "directory", parent)
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def generate_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` and `<name>.key_secret` (both 0600) into `directory` (made 0700).

    The pair is written in a private temporary directory and moved into place, so the secret
    is never readable by others, whatever the umask.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=directory)  # 0700
    try:
        public, secret = zmq.auth.create_certificates(tmp, name)
        out = []
        for path in (public, secret):
            os.chmod(path, 0o600)
            target = directory / Path(path).name
            os.replace(path, target)
            out.append(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out[0], out[1]
