"""`[engine]` and `[placement]` in the topology file, and `--engine ray` where Ray is not
installed (no cluster needed: tests/ray has the real ones)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support import busctl


def _busctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def _without_ray(tmp_path: Path) -> dict[str, str]:
    """An interpreter where `import ray` fails as it does without the extra: a `ray` package
    first on the path that raises ImportError (python -P still reads PYTHONPATH)."""
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError('No module named ray', name='ray')\n")
    return {"PYTHONPATH": str(shadow.parent)}


def test_engine_ray_without_ray_exits_2_naming_the_extra(tmp_path: Path) -> None:
    env = _without_ray(tmp_path)
    for args in (("up", "--engine", "ray"), ("ps", "--engine", "ray"), ("down", "--engine", "ray"),
                 ("status", "--engine", "ray")):
        out = _busctl(*args, env=env)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "pip install 'agent-bus[ray]'" in out.stderr, (args, out.stderr)


def test_a_ray_topology_file_is_checked_naming_the_key(tmp_path: Path) -> None:
    cases = {
        '[engine]\nkind = "rey"\n': "engine.kind",
        '[engine]\nadress = "auto"\n': "engine.adress: unknown key",
        '[placement.tolls]\nstrategy = "spread"\n': "placement.tolls: names no process or group",
        '[placement.workers]\nstrategy = "wide"\n': "strategy",
        '[placement.hub]\nnode = "10.0.0.5"\nstrategy = "spread"\n': "placement.hub: `node` and `strategy`",
        '[placement.gateways]\nresources = { GPU = -1 }\n': "resources",
    }
    for text, expected in cases.items():
        file = tmp_path / "t.toml"
        file.write_text(text)
        out = _busctl("config", "check", str(file))
        assert out.returncode == 2 and expected in out.stderr, (text, out.stderr)
    file.write_text('[engine]\nkind = "ray"\naddress = "10.0.0.5:6379"\n'
                    '[placement.tools]\nresources = { bus_tools = 1 }\nstrategy = "spread"\n'
                    '[placement.hub]\nnode = "zone=a"\n')
    out = _busctl("config", "check", str(file))
    assert out.returncode == 0, out.stderr
