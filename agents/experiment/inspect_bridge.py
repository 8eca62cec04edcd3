"""Inspect AI bridge (`pip install 'agent-bus[inspect]'`): run each Inspect sample as one bus
session of a named agent (or a team's prompted agent), so `inspect eval` runs on the bus.

    from agent_bus.agents.experiment.inspect_bridge import bus_agent

    @task
    def arith() -> Task:
        return Task(dataset=..., solver=bus_agent("solver"), scorer=match(numeric=True))

    inspect eval task.py --model mockllm/model -T agent=solver   # the bus answers, not --model

The session's answer becomes the sample's output (and an assistant message), with its usage;
its run id, session, stop reason and workspace are in the sample's metadata (`bus`), and its
events carry experiment `experiment` (default: `inspect-<task>`), so `busctl watch`/`export`/
`replay` see them. The hub: `hub=` or $BUSCTL_HUB (as `busctl`). Inspect's scorers then score
the output.

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

from typing import Any, Literal

from inspect_ai.model import ChatMessageAssistant, ModelOutput, ModelUsage
from inspect_ai.solver import Generate, Solver, TaskState, solver

from agent_bus.agents.client.remote import AgentBus, connect
from agent_bus.agents.experiment.runner import old_tool_workers
from agent_bus.agents.experiment.spec import cell_folder
from agent_bus.bus.errors import ConfigError
from agent_bus.bus.messages import MAX_WORKSPACE_BYTES, RunWorkspace, workspace_problem


@solver
def bus_agent(agent: str = "assistant", hub: str | None = None, experiment: str = "",
              max_turns: int = 0, workspace: Literal["sample", "shared"] = "sample") -> Solver:
    """A solver that prompts `agent` on the bus with the sample's input, in a fresh session
    (and, with `workspace = "sample"`, a fresh folder with the sample's files)."""
    if workspace not in ("sample", "shared"):
        raise ConfigError(f"bus_agent: workspace: {workspace!r} is not \"sample\" (each "
                          f"sample's tools in a folder of its own) or \"shared\"")
    workers_checked = False

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        nonlocal workers_checked
        tag = experiment or f"inspect-{state.model}".replace("/", "-")
        spec = await _workspace(state, tag, agent) if workspace == "sample" else None
        if spec is None and _sources():
            raise ConfigError(f"sample {state.sample_id}: files: bus_agent(workspace=\"shared\") "
                              f"runs every sample in the tool workers' own workspace, where "
                              f"its files cannot go; use workspace=\"sample\" (the default)")
        async with connect(hub, name="inspect-bridge") as bus:
            if spec is not None and not workers_checked:
                await _check_workers(bus)
                workers_checked = True
            result = await bus.run(agent, state.input_text, experiment=tag, max_turns=max_turns,
                                   workspace=spec)
        usage = list(result.usage.values())
        state.output = ModelOutput.from_content(model=f"bus/{agent}", content=result.final_text,
                                                error=result.error or None)
        state.output.usage = ModelUsage(
            input_tokens=sum(u.input for u in usage), output_tokens=sum(u.output for u in usage),
            total_tokens=sum(u.total or u.input + u.output for u in usage),
            total_cost=sum(u.cost for u in usage) or None)
        state.messages.append(ChatMessageAssistant(content=result.final_text))
        bus_info: dict[str, Any] = {"run_id": result.run_id, "session": result.session,
                                    "stop_reason": result.stop_reason, "experiment": tag,
                                    "workspace": spec.id if spec is not None else ""}
        state.metadata["bus"] = bus_info
        return state

    return solve


async def _workspace(state: TaskState, tag: str, agent: str) -> RunWorkspace:
    """The sample's own folder, with its files; ConfigError naming the sample past a limit."""
    folder = f"{cell_folder(tag, agent, state.epoch, str(state.sample_id))}/{state.uuid}"
    spec = RunWorkspace(id=folder, files=await _sample_files(str(state.sample_id)))
    problem = workspace_problem(spec)
    if problem:
        raise ConfigError(f"sample {state.sample_id}: files: {problem}")
    return spec


def _sources() -> dict[str, str]:
    """The running sample's `files` as its dataset gave them (Inspect keeps them out of
    `TaskState`; its running sample has them)."""
    from inspect_ai.log._samples import sample_active

    active = sample_active()
    return dict(active.sample.files or {}) if active is not None else {}


async def _sample_files(sample: str) -> dict[str, bytes]:
    """The running sample's `files`, read as Inspect reads them into a sandbox (a folder's
    files one by one, data: URIs, URLs, paths, else the text itself: the private helpers its
    sandboxes use). Reading stops past the size limit: the rest would be refused anyway."""
    from inspect_ai._eval.task.sandbox import read_sandboxenv_file, resolve_sample_files

    sources = _sources()
    if not sources:
        return {}
    files: dict[str, bytes] = {}
    size = 0
    for name, source in resolve_sample_files(sources).items():
        files[name] = await read_sandboxenv_file(source)
        size += len(name) + len(files[name])
        if size > MAX_WORKSPACE_BYTES:
            raise ConfigError(f"sample {sample}: files: more than {MAX_WORKSPACE_BYTES} bytes "
                              f"in all, names included (they go with every tool call of its "
                              f"session); keep big data in the tool workers' workspace and give "
                              f"the sample its name instead")
    return files


async def _check_workers(bus: AgentBus) -> None:
    """As `busctl experiment run`: no live tool worker would run a sample's call in its own
    workspace (one that predates run workspaces)."""
    old = await old_tool_workers(bus.peer)
    if old:
        raise ConfigError(f"bus_agent: workspace: the tool worker(s) {', '.join(old)} cannot "
                          f"run a sample's tool calls in its own workspace (they predate run "
                          f"workspaces); upgrade them, or give bus_agent(workspace=\"shared\")")


__all__ = ["bus_agent"]
