"""Inspect AI model provider `agent-bus` (`pip install 'agent-bus[inspect]'`): `--model
agent-bus/<agent>` makes a bus agent Inspect's model. Each `generate()` is one bus session of
that agent, prompted with the conversation's last user message (the agent has its own system
prompt, tools and model; Inspect's system messages, tools and earlier turns are not sent).

Why a model provider and not only a solver: Inspect counts tokens, costs and token limits, and
shows the eval's model, for what goes through a `Model`'s `generate()` (its `stats.model_usage`
and each sample's `model_usage`); a solver that only sets `output.usage` shows 0 tokens. So the
bus agent is the model Inspect records: the eval's model column says `agent-bus/<agent>` (the
thing answering: an agent, maybe a team on several models), its tokens are the session's and
its helpers' (the runs it asked, `ask_<agent>`: a team's whole tree, as `busctl experiment
report` counts), and the models they called (`fake-one`, `gpt-4o`, ...) are the output's
`model` and, with their own usage, the output's metadata `bus.usage`.

Model args (`-M name=value`, or `get_model(..., name=value)`): `hub` (else $BUSCTL_HUB),
`experiment` (the bus experiment id; default `inspect-<task>-<eval run id>`, one per eval),
`max_turns`, `workspace` (`"sample"`: each sample's tools in a fresh folder of its own with its
`files`; `"shared"`) and `timeout` (seconds a session may take; 0: none). A session that ends
`error` or `aborted`, a timeout and a bus failure raise `BusEvalError` (an `AgentBusError`,
never a bare `TimeoutError`, which Inspect would log only as a warning and score as an empty
answer): Inspect records it as the sample's error.

The sessions run on the bus client's own event loop, in a thread (`BUS_THREAD`, bus_thread.py:
one per process, started by the first `generate()`, stopped at exit), not on Inspect's: Inspect
blocking its loop (writing its log, scoring) past the hub's liveness window would otherwise lose
the hub and fail every session in flight (`HubLost`). Inspect cancelling a sample (its time
limit) cancels its session there, which aborts the run.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import msgspec
from inspect_ai.model import (
    ChatMessage,
    ChatMessageUser,
    GenerateConfig,
    ModelAPI,
    ModelOutput,
    ModelUsage,
    modelapi,
)
from inspect_ai.tool import ToolChoice, ToolInfo

from agent_bus.agents import commands as cmd
from agent_bus.agents.client.remote import AgentBus, connect
from agent_bus.agents.experiment.bus_thread import BusThread
from agent_bus.agents.experiment.runner import END_WAIT, FAILED, old_tool_workers
from agent_bus.agents.experiment.spec import cell_folder
from agent_bus.bus import events as ev
from agent_bus.bus.errors import AgentBusError, ConfigError
from agent_bus.bus.messages import MAX_WORKSPACE_BYTES, RunWorkspace, Usage, workspace_problem

WORKSPACES = ("sample", "shared")
#: Where the sessions run: the bus client on a loop of its own, not Inspect's (bus_thread.py).
BUS_THREAD = BusThread("agent-bus-inspect")


class BusEvalError(AgentBusError):
    """A sample's bus session gave no answer: it ended `error`/`aborted`, timed out, or the
    bus failed. Not a `TimeoutError` on purpose (Inspect would not count it as an error)."""


class BusModel(ModelAPI):
    """`agent-bus/<agent>`: one bus session of `<agent>` per `generate()`."""

    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 config: GenerateConfig = GenerateConfig(), hub: str = "",
                 experiment: str = "", max_turns: int | str = 0,
                 workspace: str = "sample", timeout: float | str = 0,
                 **model_args: Any) -> None:
        super().__init__(model_name, base_url, api_key, [], config)
        if model_args:
            raise ConfigError(f"agent-bus/{model_name}: unknown model arg(s) "
                              f"{', '.join(sorted(model_args))}; known: hub, experiment, "
                              f"max_turns, workspace, timeout")
        if workspace not in WORKSPACES:
            raise ConfigError(f"agent-bus/{model_name}: workspace: {workspace!r} is not "
                              f"\"sample\" (each sample's tools in a folder of its own) or "
                              f"\"shared\"")
        # -M values arrive as strings from the command line
        self.agent, self.hub, self.experiment = model_name, hub or None, experiment
        self.max_turns, self.timeout = int(max_turns), float(timeout)
        self.workspace = workspace
        self._workers_checked = False

    def max_connections(self) -> int:
        # the coordinators queue runs past their own `max_concurrent_runs`: Inspect need not
        # hold samples back for the bus
        return 64

    async def generate(self, input: list[ChatMessage], tools: list[ToolInfo],
                       tool_choice: ToolChoice, config: GenerateConfig) -> ModelOutput:
        tag = self.experiment or default_experiment()
        spec = await self._sample_workspace(tag)
        try:
            result = await BUS_THREAD.call(self._run, _prompt_text(input), tag, spec)
        except AgentBusError as exc:
            raise BusEvalError(f"agent `{self.agent}` (experiment {tag}): "
                               f"{type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:  # a bus wait's, were one to escape: an error Inspect records
            raise BusEvalError(f"agent `{self.agent}` (experiment {tag}): timed out: "
                               f"{exc}") from exc
        if result is None:
            raise BusEvalError(f"agent `{self.agent}`: no answer within {self.timeout:g} s "
                               f"(experiment {tag}); its run was aborted")
        if result.stop_reason in FAILED:
            raise BusEvalError(f"agent `{self.agent}`: run {result.run_id} ended "
                               f"{result.stop_reason}: {result.error or 'no detail'} "
                               f"(experiment {tag})")
        return _output(self.agent, result, tag, spec)

    async def _run(self, text: str, tag: str, spec: RunWorkspace | None
                   ) -> cmd.RunResult | None:
        """One session, its helpers' usage added; None past `timeout` (the prompt is
        cancelled, which aborts the run). On `BUS_THREAD`'s loop: a stall of Inspect's cannot
        starve its peer's heartbeats."""
        async with connect(self.hub, name="inspect-bridge") as bus:
            if spec is not None and not self._workers_checked:
                await _check_workers(bus)
                self._workers_checked = True
            since = (await bus.peer.status()).seq
            result: cmd.RunResult | None = None
            with anyio.move_on_after(self.timeout or None):
                result = await bus.run(self.agent, text, experiment=tag,
                                       max_turns=self.max_turns, workspace=spec)
            if result is None:
                return None
            helpers = await _helpers_usage(bus, result.run_id, since)
        return msgspec.structs.replace(result, usage=_added(result.usage, helpers))

    async def _sample_workspace(self, tag: str) -> RunWorkspace | None:
        """With workspace "sample": the running sample's own folder, with its files."""
        active = _active()
        sources = dict(active.sample.files or {}) if active is not None else {}
        if self.workspace == "shared":
            if sources:
                raise ConfigError(f"sample {active.sample.id}: files: workspace \"shared\" "
                                  f"runs every sample in the tool workers' own workspace, "
                                  f"where its files cannot go; use workspace \"sample\" (the "
                                  f"default)")
            return None
        if active is None:  # generate() outside a sample (a grader's call): no folder
            return None
        sample = str(active.sample.id)
        folder = f"{cell_folder(tag, self.agent, active.epoch, sample)}/{active.sample_uuid}"
        spec = RunWorkspace(id=folder, files=await _sample_files(sample, sources))
        problem = workspace_problem(spec)
        if problem:
            raise ConfigError(f"sample {sample}: files: {problem}")
        return spec


@modelapi(name="agent-bus")
def agent_bus_model() -> type[ModelAPI]:
    """Registered here, not only in the plugin's `_registry`: a task file importing the bridge
    gets the provider its `bus_agent` answers through."""
    return BusModel


def default_experiment() -> str:
    """`inspect-<task>-<run id>`: one bus experiment per eval (the task's registry name's
    `/` and other characters a tag or folder may not hold made `-`)."""
    active = _active()
    if active is None:
        return "inspect"
    task = re.sub(r"[^A-Za-z0-9_-]+", "-", active.task).strip("-")
    return f"inspect-{task}-{active.run_id or active.eval_id}"


def _active() -> Any:
    """The running sample (Inspect's private `ActiveSample`: its task, eval and run ids,
    epoch, uuid and `files`, which `TaskState` does not carry), None outside one."""
    from inspect_ai.log._samples import sample_active

    return sample_active()


def _prompt_text(input: list[ChatMessage]) -> str:
    users = [message for message in input if isinstance(message, ChatMessageUser)]
    if not users:
        raise ConfigError("agent-bus: the conversation has no user message to prompt with")
    return str(users[-1].text)


def _output(agent: str, result: cmd.RunResult, tag: str, spec: RunWorkspace | None
            ) -> ModelOutput:
    """The session's answer, its usage summed over its models, named after those models."""
    models = sorted(result.usage)
    output = ModelOutput.from_content(model=", ".join(models) or f"agent-bus/{agent}",
                                      content=result.final_text,
                                      stop_reason="stop" if result.stop_reason == "stop"
                                      else "unknown")
    output.usage = _usage(list(result.usage.values()))
    output.metadata = {"bus": {
        "run_id": result.run_id, "session": result.session, "stop_reason": result.stop_reason,
        "experiment": tag, "workspace": spec.id if spec is not None else "",
        "usage": {model: {"input": u.input, "output": u.output, "total": _total(u),
                          "cost": u.cost} for model, u in result.usage.items()}}}
    return output


async def _helpers_usage(bus: AgentBus, run: str, since: int) -> dict[str, Usage]:
    """The usage by model of the runs `run` asked for (`ask_<agent>`, and theirs in turn), read
    from the log from `since`: a team's tokens are its whole tree's, as `busctl experiment
    report` counts them. Up to `run`'s agent_end (published just after its result: at most
    END_WAIT seconds), which comes after its helpers'."""
    parents: dict[str, str] = {}
    ended: dict[str, dict[str, Usage]] = {}
    with anyio.move_on_after(END_WAIT):
        async with bus.peer.subscribe(["agent/"], since=since) as events:
            async for envelope in events:
                header, event = envelope.header, envelope.event
                if isinstance(event, ev.AgentStart) and header.parent:
                    parents[header.run] = header.parent
                elif isinstance(event, ev.AgentEnd) and header.run == run:
                    break
                elif isinstance(event, ev.AgentEnd) and header.parent:
                    ended[header.run] = event.usage
    found: dict[str, Usage] = {}
    for helper, usage in ended.items():
        if _descends(helper, run, parents):
            found = _added(found, usage)
    return found


def _descends(child: str, top: str, parents: dict[str, str]) -> bool:
    seen: set[str] = set()
    while child in parents and child not in seen:
        seen.add(child)
        child = parents[child]
        if child == top:
            return True
    return False


def _added(one: dict[str, Usage], other: dict[str, Usage]) -> dict[str, Usage]:
    return {model: one.get(model, Usage()) + other.get(model, Usage())
            for model in one.keys() | other.keys()}


def _total(usage: Usage) -> int:
    return usage.total or usage.input + usage.output


def _usage(usage: list[Usage]) -> ModelUsage:
    return ModelUsage(
        input_tokens=sum(u.input for u in usage), output_tokens=sum(u.output for u in usage),
        total_tokens=sum(_total(u) for u in usage),
        input_tokens_cache_read=sum(u.cache_read for u in usage) or None,
        input_tokens_cache_write=sum(u.cache_write for u in usage) or None,
        total_cost=sum(u.cost for u in usage) or None)


async def _sample_files(sample: str, sources: dict[str, str]) -> dict[str, bytes]:
    """The sample's `files`, read as Inspect reads them into a sandbox (a folder's files one by
    one, data: URIs, URLs, paths, else the text itself: the private helpers its sandboxes
    use). Reading stops past the size limit: the rest would be refused anyway."""
    from inspect_ai._eval.task.sandbox import read_sandboxenv_file, resolve_sample_files

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
        raise ConfigError(f"agent-bus: workspace: the tool worker(s) {', '.join(old)} cannot "
                          f"run a sample's tool calls in its own workspace (they predate run "
                          f"workspaces); upgrade them, or give workspace \"shared\"")


__all__ = ["BusEvalError", "BusModel", "agent_bus_model", "default_experiment"]
