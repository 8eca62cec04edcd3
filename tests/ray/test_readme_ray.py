"""The README's Ray section, checked statically (no Kubernetes server runs here): its KubeRay
`RayCluster` is one KubeRay accepts in shape, with the Ray version the `ray` extra pins and the
ports the section says must be open; its topology example is a valid topology file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from agent_bus.agents.launch.topology import parse_topology

yaml = pytest.importorskip("yaml")  # PyYAML comes with Ray

ROOT = Path(__file__).resolve().parent.parent.parent
SECTION = ROOT.joinpath("README.md").read_text().split("### Across machines on Ray", 1)[1].split("\n## ", 1)[0]


def _block(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, flags=re.S)


def test_the_kuberay_raycluster_has_the_shape_kuberay_takes() -> None:
    [text] = _block("yaml")
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    extra = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    low = re.search(r">=([\d.]+)", extra[0]).group(1)  # type: ignore[union-attr]
    assert doc["spec"]["rayVersion"].startswith(low + "."), (doc["spec"]["rayVersion"], extra)
    head = doc["spec"]["headGroupSpec"]
    groups = [head, *doc["spec"]["workerGroupSpecs"]]
    for group in groups:  # KubeRay passes rayStartParams to `ray start`: every value a string
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["image"].endswith(doc["spec"]["rayVersion"]) for c in containers)
    for worker in doc["spec"]["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"], worker
        assert worker["groupName"]
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 7400, 7401} <= ports, ports
    for port in ports:
        assert str(port) in SECTION.split("Open between the nodes", 1)[1], port


def test_the_placement_example_is_a_valid_topology() -> None:
    [example, *_] = _block("toml")
    topology = parse_topology(example.encode(), "README", as_json=False)
    assert topology.engine.kind == "ray" and set(topology.placement) == {
        "hub", "gateways", "workers", "coordinators"}


def test_the_shell_recipes_are_valid_shell() -> None:
    """The two-machine commands and the Slurm batch script parse (`bash -n`), and start the same
    Ray version's nodes the way the section says (a head, then nodes joining its GCS port)."""
    import subprocess

    blocks = _block("sh")
    assert len(blocks) == 2, blocks
    for block in blocks:
        script = "\n".join(line.split("$ ", 1)[1] if re.match(r"^[\d.]+\$ ", line) else line
                           for line in block.splitlines())
        check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert check.returncode == 0, (script, check.stderr)
        assert "ray start --head --port=6379" in script and "--address=" in script, script
        assert "busctl up -c team.toml --engine ray" in script and "busctl down --engine ray" in script
    assert "#SBATCH" in blocks[1] and "scontrol show hostnames" in blocks[1]
