"""agent-bus: an actor-based message bus for LLM agents, installed as one import namespace.

    from agent_bus import connect

    async with connect("tcp://127.0.0.1:7400") as bus:
        result = await bus.run("assistant", "list the files")

The repository keeps its layout (`bus/`, `agents/`, `tools/`, `cli.py` and its `commands/` at the
top); this folder links them in, so the wheel installs one top-level package, `agent_bus`, and
nothing generic (`agents` is also openai-agents' import name). Everything imports as `agent_bus.<folder>...`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_bus.agents.client.remote import AgentBus, BlockingBus, Run, connect, connect_blocking
    from agent_bus.tools import ToolContext, tool

# Imported on first use: `agent_bus.agents.loop` (the pure loop) runs this file first and must not
# pull in pyzmq through the client.
_LAZY = {
    "AgentBus": "agent_bus.agents.client.remote",
    "BlockingBus": "agent_bus.agents.client.remote",
    "Run": "agent_bus.agents.client.remote",
    "connect": "agent_bus.agents.client.remote",
    "connect_blocking": "agent_bus.agents.client.remote",
    "ToolContext": "agent_bus.tools",
    "tool": "agent_bus.tools",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_bus' has no attribute {name!r}")
    return getattr(import_module(module), name)


__all__ = ["AgentBus", "BlockingBus", "Run", "ToolContext", "connect", "connect_blocking", "tool"]
