"""`provider = "llamacpp"` / `busctl up --model-file`: the checks need no model and no llama.cpp.

Running a real model is in test_local_model_real.py (only with AGENT_BUS_GGUF set).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from agent_bus.agents.gateway.engine import ModelConfig
from agent_bus.agents.gateway.providers.llamacpp import LocalModelError, hosted_models, local_model_problems
from agent_bus.agents.launch.topology import Topology, TopologyError, check_topology, parse_topology
from agent_bus.agents.launch.up import LOCAL_MODEL_READY_TIMEOUT, UpOptions, child_specs, resolve
from agent_bus.cli import main
from tests.support import busctl


def _parse(toml: str) -> Topology:
    return parse_topology(toml.encode(), "t.toml", as_json=False)


def test_a_missing_gguf_file_names_the_key_and_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(TopologyError, match=r"t\.toml: models\.mine\.gguf: no such file .*nope\.gguf"):
        _parse(f'[models.mine]\nprovider = "llamacpp"\ngguf = "{missing}"\n')


@pytest.mark.parametrize(("table", "key"), [
    ('provider = "llamacpp"', r"models\.m\.gguf: provider = \"llamacpp\" needs the path"),
    ('provider = "openai"\ngguf = "GGUF"', r"models\.m\.gguf: only a model with provider"),
    ('provider = "llamacpp"\ngguf = "GGUF"\nbase_url = "http://127.0.0.1:8080/v1"',
     r"models\.m\.base_url: a \"llamacpp\" model is served by the gateway itself"),
    ('provider = "llamacpp"\ngguf = "GGUF"\nchat_template_file = "/no/such.jinja"',
     r"models\.m\.chat_template_file: no such file"),
])
def test_local_model_keys_are_checked(tmp_path: Path, table: str, key: str) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # only its existence is checked before the gateway loads it
    topology = msgspec.toml.decode(f"[models.m]\n{table}\n".replace("GGUF", str(gguf)).encode(),
                                   type=Topology)
    problems = check_topology(topology)
    assert problems and re.search(key, problems[0]), problems


def test_without_llama_cpp_installed_the_problem_says_how_to_install(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    code = ("import sys; sys.modules['xllamacpp'] = None\n"  # as if the extra were missing
            "from agent_bus.agents.gateway.engine import ModelConfig\n"
            "from agent_bus.agents.gateway.providers.llamacpp import local_model_problems\n"
            f"print(local_model_problems('m', ModelConfig(provider='llamacpp', gguf={str(gguf)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "models.m.provider" in out and "agent-bus[local]" in out


def test_model_file_builds_a_hosted_default_model(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    topo = resolve(Topology(), UpOptions(model_file=str(gguf)))
    local = topo.models["local"]
    assert (local.provider, local.gguf, local.base_url) == ("llamacpp", str(gguf.resolve()), "")
    assert topo.gateways.default_model == "local"
    assert [p for p in check_topology(topo) if "gguf" in p] == []
    gateway = next(s for s in child_specs(topo, "tcp://127.0.0.1:7400") if s.role == "gateway")
    assert gateway.ready_timeout == LOCAL_MODEL_READY_TIMEOUT  # loading a model takes a while
    sent = msgspec.json.decode(gateway.stdin_data, type=Topology)  # what the gateway is given
    assert sent.models["local"].gguf == str(gguf.resolve())
    plain = next(s for s in child_specs(Topology(), "tcp://127.0.0.1:7400") if s.role == "gateway")
    assert plain.ready_timeout < LOCAL_MODEL_READY_TIMEOUT


def test_up_with_a_missing_model_file_fails_before_starting_anything(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["up", "--hub", "tcp://127.0.0.1:0",
                                       "--model-file", str(tmp_path / "missing.gguf")])
    assert result.exit_code == 2  # a configuration error, as `config check` says it
    assert "models.local.gguf: no such file" in result.output and "missing.gguf" in result.output


def test_up_refuses_demo_and_model_file_together(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["up", "--demo", "--model-file", str(tmp_path / "m.gguf")])
    assert result.exit_code == 2 and "give one" in result.output


def test_a_gateway_given_a_bad_local_model_exits_with_the_key() -> None:
    """`busctl gateway` checks its topology too (it may be started without `busctl up`)."""
    topology = {"models": {"mine": {"provider": "llamacpp", "gguf": "/no/such/model.gguf"}}}
    done = subprocess.run(busctl("gateway", "--hub", "tcp://127.0.0.1:9", "--topology", "-"),
                          input=json.dumps(topology), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "models.mine.gguf: no such file '/no/such/model.gguf'" in done.stderr


@pytest.mark.anyio
async def test_hosting_refuses_a_bad_entry_before_loading_anything() -> None:
    """The Python API (`hosted_models`) refuses what the topology check refuses, by key."""
    bad = ModelConfig(alias="mine", provider="llamacpp", gguf="/no/such/model.gguf")
    with pytest.raises(LocalModelError, match=r"^models\.mine\.gguf: no such file"):
        async with hosted_models([ModelConfig(alias="remote", provider="openai"), bad]):
            pytest.fail("no model may be served when one entry is wrong")


def test_problems_are_empty_for_a_remote_model() -> None:
    assert local_model_problems("m", ModelConfig(provider="openai")) == []
