"""Inspect AI's plugin entry point (`[project.entry-points.inspect_ai]` in pyproject.toml):
Inspect imports this module when a name under `agent_bus/` (or the model provider
`agent-bus/...`) is asked for, and importing registers them: the task `agent_bus/bus_task`, the
solver `agent_bus/bus_agent` (agents/experiment/inspect_bridge.py) and the model provider
`agent-bus` (agents/experiment/inspect_model.py). Needs the `inspect` extra."""

from __future__ import annotations

from agent_bus.agents.experiment.inspect_bridge import bus_agent, bus_task
from agent_bus.agents.experiment.inspect_model import agent_bus_model

__all__ = ["agent_bus_model", "bus_agent", "bus_task"]
