"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head with no
CPU (it hosts the GCS and the hub's custom resource `bus_hub`) and two nodes, `bus_a` (labelled
`bus-zone=a`) and `bus_b`. One cluster per test module (a cluster costs seconds to start on 2
cores). Ray is imported by the fixture and the test modules (`pytest.importorskip`), so that
they are skipped cleanly without the `ray` extra (a skip raised while a conftest loads is an
error)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# A killed node is declared dead after ~1.5 s instead of Ray's default ~30 s, so a test of
# recovery measures the bus coming back, not the detection (the head's health checks).
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
          "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


@dataclass
class RayCluster:
    cluster: Any
    home: Path
    head: Any
    a: Any
    b: Any

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def env(self, **more: str) -> dict[str, str]:
        """What a `busctl` started by a test gets: the cluster's own HOME (so no
        ~/.ray/auth_token of another session is used) and no usage reports."""
        return {"HOME": str(self.home), "RAY_USAGE_STATS_ENABLED": "0", **more}

    def node_names(self) -> dict[str, str]:
        """Ray node id (hex) -> head / a / b."""
        return {self.head.node_id: "head", self.a.node_id: "a", self.b.node_id: "b"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")}
    os.environ.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "resources": {"bus_hub": 1}, "include_dashboard": False,
        "_system_config": HEALTH})
    try:
        a = cluster.add_node(num_cpus=1, resources={"bus_a": 1}, labels={"bus-zone": "a"})
        b = cluster.add_node(num_cpus=1, resources={"bus_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="agent-bus", log_to_driver=False)
        yield RayCluster(cluster, home, cluster.head_node, a, b)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
