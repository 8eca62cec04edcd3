"""`busctl otel` and `busctl ui` used wrongly: one clear line naming the flag, a non-zero exit,
within seconds (no traceback, no hang)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import busctl


@pytest.fixture
def dead_hub() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=15)


def test_otel_dead_hub(dead_hub: str, tmp_path: Path) -> None:
    r = run("otel", "--hub", dead_hub, "--state-file", str(tmp_path / "s.json"))
    assert r.returncode == 2 and "cannot reach the hub" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "s.json").exists()


def test_otel_state_file_in_a_missing_folder(dead_hub: str, tmp_path: Path) -> None:
    r = run("otel", "--hub", dead_hub, "--state-file", str(tmp_path / "no" / "s.json"))
    assert r.returncode == 2 and "--state-file" in r.stderr and "folder does not exist" in r.stderr


def test_ui_port_in_use(dead_hub: str, busy_port: int) -> None:
    r = run("ui", "--hub", dead_hub, "--port", str(busy_port))
    assert r.returncode == 2 and "--port" in r.stderr and "already in use" in r.stderr


def test_ui_dead_hub(dead_hub: str) -> None:
    r = run("ui", "--hub", dead_hub, "--port", "0")
    assert r.returncode == 2 and "cannot reach the hub" in r.stderr
