"""Fixtures for CURVE and cross-host tests: key directories made by `busctl keys generate`."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq.auth

from agent_bus.bus.security import CurveClient
from tests.support import busctl


@dataclass
class Keys:
    dir: Path  # hub.key, hub.key_secret, <client>.key(_secret), authorized/
    stranger_dir: Path  # a pair the hub does not know

    @property
    def authorized(self) -> Path:
        return self.dir / "authorized"

    @property
    def hub_secret(self) -> Path:
        return self.dir / "hub.key_secret"

    def client(self, name: str) -> CurveClient:
        base = self.stranger_dir if name == "stranger" else self.dir
        return CurveClient(server_public_key_file=str(self.dir / "hub.key"),
                           secret_key_file=str(base / f"{name}.key_secret"))

    def cli_args(self, name: str) -> list[str]:
        curve = self.client(name)
        return ["--curve-server-key", curve.server_public_key_file,
                "--curve-key", curve.secret_key_file]

    def public_z85(self, name: str) -> str:
        base = self.stranger_dir if name == "stranger" else self.dir
        public, _ = zmq.auth.load_certificate(base / f"{name}.key")
        return public.decode("ascii")

    def hub_args(self) -> list[str]:
        return ["--curve-secret", str(self.hub_secret), "--curve-authorized", str(self.authorized)]


def generate(directory: Path, *clients: str) -> None:
    args = ["keys", "generate", str(directory)]
    for name in clients:
        args += ["--client", name]
    result = subprocess.run(busctl(*args), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    generate(tmp_path / "keys", "driver", "worker")
    generate(tmp_path / "elsewhere", "stranger")
    return Keys(tmp_path / "keys", tmp_path / "elsewhere")
