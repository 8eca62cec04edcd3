"""Inspect AI bridge (`pip install 'agent-bus[inspect]'`): run each Inspect sample as one bus
session of a named agent (or a team's prompted agent), so `inspect eval` runs on the bus.

    from agent_bus.agents.experiment.inspect_bridge import bus_agent

    @task
    def arith() -> Task:
        return Task(dataset=..., solver=bus_agent("solver"), scorer=match(numeric=True))

    inspect eval task.py --model mockllm/model -T agent=solver   # the bus answers, not --model

The session's answer becomes the sample's output (and an assistant message), with its usage;
its run id, session and stop reason are in the sample's metadata (`bus`), and its events carry
experiment `experiment` (default: `inspect-<task>`), so `busctl watch`/`export`/`replay` see
them. The hub: `hub=` or $BUSCTL_HUB (as `busctl`). Inspect's scorers then score the output.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.model import ChatMessageAssistant, ModelOutput, ModelUsage
from inspect_ai.solver import Generate, Solver, TaskState, solver

from agent_bus.agents.client.remote import connect


@solver
def bus_agent(agent: str = "assistant", hub: str | None = None, experiment: str = "",
              max_turns: int = 0) -> Solver:
    """A solver that prompts `agent` on the bus with the sample's input, in a fresh session."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        tag = experiment or f"inspect-{state.model}".replace("/", "-")
        async with connect(hub, name="inspect-bridge") as bus:
            result = await bus.run(agent, state.input_text, experiment=tag, max_turns=max_turns)
        usage = list(result.usage.values())
        state.output = ModelOutput.from_content(model=f"bus/{agent}", content=result.final_text,
                                                error=result.error or None)
        state.output.usage = ModelUsage(
            input_tokens=sum(u.input for u in usage), output_tokens=sum(u.output for u in usage),
            total_tokens=sum(u.total or u.input + u.output for u in usage),
            total_cost=sum(u.cost for u in usage) or None)
        state.messages.append(ChatMessageAssistant(content=result.final_text))
        bus_info: dict[str, Any] = {"run_id": result.run_id, "session": result.session,
                                    "stop_reason": result.stop_reason, "experiment": tag}
        state.metadata["bus"] = bus_info
        return state

    return solve


__all__ = ["bus_agent"]
