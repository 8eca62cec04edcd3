"""`--hub` / `BUSCTL_HUB` take a list of hubs: checked whole up front (a bad or empty entry is a
usage error naming `--hub` and the entry), and a command starts at the first hub that answers."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.failover.conftest import hub_ports
from tests.support import Proc, busctl


def _busctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("value", "named"), [
    ("7400,,7401", "entry 2 of '7400,,7401' is empty"),
    ("7400,nowhere", "entry 2 of '7400,nowhere': 'nowhere' is not an address"),
    ("tcp://127.0.0.1", "bad hub address 'tcp://127.0.0.1'"),
])
def test_a_bad_entry_is_a_usage_error_naming_it(value: str, named: str) -> None:
    for args, env in ((("--hub", value), None), ((), {"BUSCTL_HUB": value})):
        done = _busctl("status", *args, env=env)
        assert done.returncode == 2, done
        assert "'--hub'" in done.stderr and named in done.stderr, done.stderr


def test_a_command_starts_at_the_first_hub_that_answers(
        start_hub: Callable[[int], Proc]) -> None:
    dead, live, other = hub_ports(3)  # nothing is started on `dead` and `other`
    start_hub(live)
    done = _busctl("status", "--json", "--hub", f"127.0.0.1:{dead},127.0.0.1:{live}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["endpoint"] == f"tcp://127.0.0.1:{live}"
    nobody = _busctl("status", "--hub", f"127.0.0.1:{dead},127.0.0.1:{other}")
    assert nobody.returncode == 2
    assert "cannot reach any hub" in nobody.stderr and str(dead) in nobody.stderr


def test_hub_list_reads_the_forms_of_one_address_each() -> None:
    from agent_bus.bus.endpoints import hub_list

    assert hub_list("7400, localhost:7401,tcp://10.0.0.6:7400,7400") == [
        "tcp://127.0.0.1:7400", "tcp://localhost:7401", "tcp://10.0.0.6:7400"]
    assert hub_list(["ipc:///run/a/hub.sock", "7402"]) == [
        "ipc:///run/a/hub.sock", "tcp://127.0.0.1:7402"]
    with pytest.raises(ValueError, match="entry 3 of 'a:1,b:2,' is empty"):
        hub_list("a:1,b:2,")
    with pytest.raises(ValueError, match="no hub address"):
        hub_list([])


def test_a_sandboxed_worker_keeps_each_listed_local_hub(tmp_path: Path) -> None:
    from agent_bus.tools.sandbox import _ipc_paths

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert _ipc_paths(f"ipc://{one}/hub.sock,tcp://127.0.0.1:7400,ipc://{two}/hub.sock") == [
        one.resolve(), two.resolve()]
