"""CurveZMQ settings: key pairs on disk, the hub's authenticator (ZAP) and client socket options.

Key files use pyzmq's certificate format (`zmq.auth.create_certificates`). A hub with a
`CurveServer` encrypts both of its sockets and admits only clients whose public key file is in
`authorized_dir`; the directory is re-read when it changes, so adding a key needs no restart.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class CurveServer(msgspec.Struct, forbid_unknown_fields=True):
    secret_key_file: str  # the hub's `*.key_secret`
    authorized_dir: str  # a directory of client `*.key` files

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = zmq.auth.load_certificate(self.secret_key_file)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def start_authenticator(self, ctx: zmq.Context[Any]) -> "KeyDirAuthenticator":
        auth = KeyDirAuthenticator(ctx, Path(self.authorized_dir))
        auth.start()
        return auth


class CurveClient(msgspec.Struct, forbid_unknown_fields=True):
    server_public_key_file: str  # the hub's `*.key`
    secret_key_file: str  # this client's `*.key_secret`

    def apply(self, sock: zmq.Socket[Any]) -> None:
        public, secret = zmq.auth.load_certificate(self.secret_key_file)
        server_public, _ = zmq.auth.load_certificate(self.server_public_key_file)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public


class KeyDirAuthenticator:
    """ZAP authenticator for CURVE that reloads the authorised-keys directory when it changes."""

    def __init__(self, ctx: zmq.Context[Any], directory: Path, poll_interval: float = 0.5) -> None:
        self.directory = directory
        self._auth = ThreadAuthenticator(ctx)
        self._stamp: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._poll_interval = poll_interval
        self._watcher = threading.Thread(target=self._watch, name="curve-keys", daemon=True)

    def start(self) -> None:
        self._auth.start()
        self.reload()
        self._watcher.start()

    def reload(self) -> None:
        stamp = self._dir_stamp()
        self._auth.configure_curve(domain="*", location=str(self.directory))
        self._stamp = stamp

    def stop(self) -> None:
        self._stop.set()
        self._auth.stop()

    def _dir_stamp(self) -> tuple[int, int]:
        try:
            st = self.directory.stat()
            return (st.st_mtime_ns, len(os.listdir(self.directory)))
        except OSError:
            return (0, 0)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_interval):
            if self._dir_stamp() != self._stamp:
                self.reload()


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


def generate_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` and `<name>.key_secret` (0600) into `directory` (0700)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    for path in (public, secret):
        os.chmod(path, 0o600)
    return Path(public), Path(secret)
