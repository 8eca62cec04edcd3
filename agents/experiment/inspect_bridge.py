"""Inspect AI bridge (`pip install 'agent-bus[inspect]'`): run each Inspect sample as one bus
session of a named agent (or a team's prompted agent), so `inspect eval` runs on the bus.

agent-bus is an Inspect plugin (the `inspect_ai` entry point, `agent_bus._registry`): these
resolve by name, with no task file of one's own:

    inspect eval agent_bus/bus_task -T dataset=samples.jsonl -T agent=solver -T scorer=number
    inspect eval task.py --solver agent_bus/bus_agent -S agent=solver
    inspect eval task.py --model agent-bus/solver          # a task using Inspect's generate()

or in a task file:

    from agent_bus.agents.experiment.inspect_bridge import bus_agent

    @task
    def arith() -> Task:
        return Task(dataset=..., solver=bus_agent("solver"), scorer=match(numeric=True),
                    model="agent-bus/solver")

`bus_agent` answers through the `agent-bus/<agent>` model (agents/experiment/inspect_model.py),
so Inspect records the session's tokens and cost against that model like any model call; give
the task `model="agent-bus/<agent>"` (as `bus_task` does) or `--model agent-bus/<agent>` so the
eval's model says so too. The session's answer becomes the sample's output (and an assistant
message); its run id, session, stop reason, experiment, workspace and usage per model it called
are in the sample's metadata (`bus`). Its events carry experiment `experiment` (default:
`inspect-<task>-<eval run id>`, one per eval), so `busctl watch`/`export`/`replay` see them. The
hub: `hub=` or $BUSCTL_HUB (as `busctl`). A session that fails (ends `error`/`aborted`, passes
`timeout`, or the bus fails) is the sample's error (`BusEvalError`), not an answer.

Each sample's tool calls run in a fresh folder of its own on the tool workers (`workspace =
"sample"`, the default, as `busctl experiment`'s `run.workspace`), with the sample's `files`
(Inspect's `Sample.files`: {name in the folder: a path, a data: URI, a URL or the content},
read as Inspect reads them for a sandbox) written in it; the folder's id is
`<experiment>/<agent>.r<epoch>/<sample>/<the sample's uuid>` (a new one for each eval and retry,
as a sandbox is), so its files are at `<worker workspace>/.runs/<that id>/`. Over the run
workspace's limits (docs/protocol.md, "Run workspaces") the sample fails, naming the limit.
`workspace = "shared"`: the workers' own workspace (a sample with files is refused then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from inspect_ai import Task, task
from inspect_ai.dataset import Dataset, Sample, csv_dataset, json_dataset
from inspect_ai.model import get_model
from inspect_ai.scorer import exact, f1, includes, match
from inspect_ai.solver import Generate, Solver, TaskState, solver

from agent_bus.agents.experiment.inspect_model import WORKSPACES, BusEvalError
from agent_bus.bus.errors import ConfigError

#: `bus_task`'s `scorer=`: Inspect's own scorers, named as `busctl experiment`'s spec names
#: the same checks where it has them (`number`: the answer's last number equals the target).
SCORERS = {"match": match, "number": lambda: match(numeric=True), "includes": includes,
           "exact": exact, "f1": f1}


@solver
def bus_agent(agent: str = "assistant", hub: str | None = None, experiment: str = "",
              max_turns: int = 0, workspace: Literal["sample", "shared"] = "sample",
              timeout: float = 0) -> Solver:
    """A solver that prompts `agent` on the bus with the sample's input, in a fresh session
    (and, with `workspace = "sample"`, a fresh folder with the sample's files); `timeout`:
    seconds the session may take (0: none), past which it is aborted and the sample fails."""
    if workspace not in WORKSPACES:
        raise ConfigError(f"bus_agent: workspace: {workspace!r} is not \"sample\" (each "
                          f"sample's tools in a folder of its own) or \"shared\"")
    # memoized by Inspect per arguments: one model (and one tool-worker check) for the eval
    model = get_model(f"agent-bus/{agent}", hub=hub or "", experiment=experiment,
                      max_turns=max_turns, workspace=workspace, timeout=timeout)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        state.output = await model.generate(state.messages)
        state.messages.append(state.output.message)
        bus: dict[str, Any] = (state.output.metadata or {}).get("bus", {})
        state.metadata["bus"] = bus
        return state

    return solve


@task
def bus_task(dataset: str, agent: str = "assistant", scorer: str = "match", hub: str = "",
             experiment: str = "", max_turns: int = 0,
             workspace: Literal["sample", "shared"] = "sample", timeout: float = 0) -> Task:
    """A dataset file (`.jsonl`, `.json` or `.csv`; fields `input`, `target`, `id`, `files`,
    `metadata`, as `busctl experiment`'s) answered by the bus agent `agent` and scored by one
    of Inspect's scorers (`SCORERS`). The eval's model is `agent-bus/<agent>`."""
    if scorer not in SCORERS:
        raise ConfigError(f"bus_task: scorer: {scorer!r} is not one of "
                          f"{', '.join(sorted(SCORERS))}")
    return Task(dataset=_dataset(dataset), scorer=SCORERS[scorer](),
                solver=bus_agent(agent, hub, experiment, max_turns, workspace, timeout),
                model=f"agent-bus/{agent}")


def _dataset(path: str) -> Dataset:
    """The file's samples; a number target (as in JSON) compared as its text; `files` a list of
    names next to the dataset, as an experiment's may be, or Inspect's {name: source}."""
    def record(row: dict[str, Any]) -> Sample:
        target, files = row.get("target"), row.get("files")
        if isinstance(files, list):
            files = {name: name for name in files}
        return Sample(input=row["input"], target="" if target is None else str(target),
                      id=row.get("id"), files=files, metadata=row.get("metadata"))

    if not Path(path).is_file():
        raise ConfigError(f"bus_task: dataset: no file {path}")
    if path.endswith(".csv"):
        return csv_dataset(path, record)
    return json_dataset(path, record)


__all__ = ["SCORERS", "BusEvalError", "bus_agent", "bus_task"]
