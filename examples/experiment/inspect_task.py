"""The example's dataset as an Inspect AI task, answered by the bus (agents/experiment/inspect_bridge.py).

    busctl up -c examples/experiment/topology.toml
    inspect eval examples/experiment/inspect_task.py -T agent=solver

The eval's model is the bus agent, `agent-bus/solver` (the plugin's model provider): Inspect
records each session's tokens against it. `match(numeric=True)` compares the answer's last
number with the target, as the spec's `number` scorer does. The same with no task file:
`inspect eval agent_bus/bus_task -T dataset=examples/experiment/samples.jsonl -T agent=solver
-T scorer=number`.
"""

from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import Sample, json_dataset
from inspect_ai.scorer import match

from agent_bus.agents.experiment.inspect_bridge import bus_agent


def record(row: dict[str, Any]) -> Sample:
    return Sample(id=row["id"], input=row["input"], target=str(row["target"]),
                  metadata=row.get("metadata", {}))


@task
def arith(agent: str = "solo", hub: str = "", experiment: str = "") -> Task:
    dataset = json_dataset(str(Path(__file__).with_name("samples.jsonl")), record)
    return Task(dataset=dataset, solver=bus_agent(agent, hub or None, experiment),
                scorer=match(numeric=True), model=f"agent-bus/{agent}")
