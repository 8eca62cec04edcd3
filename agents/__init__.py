"""Agents on the bus: the loop, the Agent actor, and the client API for scripts.

    from agent_bus import connect

    async with connect("tcp://127.0.0.1:7400") as bus:
        result = await bus.run("assistant", "list the files", experiment="e1")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_bus.agents.loop.agent import Agent, AgentError
from agent_bus.agents.loop.hooks import AfterToolResult, Allow, Block, BlockAndStop, NextTurn
from agent_bus.agents.loop.run import LlmClient, LoopConfig, ToolExecutor, run_loop

if TYPE_CHECKING:
    from agent_bus.agents.client.remote import AgentBus, BlockingBus, Run, connect, connect_blocking

# The client API needs the transport (pyzmq); the loop must not. Importing `agents.loop.run` runs this
# file first, so the client names are imported on first use instead of here.
_CLIENT_NAMES = frozenset({"AgentBus", "BlockingBus", "Run", "connect", "connect_blocking"})


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from agent_bus.agents.client import remote

        return getattr(remote, name)
    raise AttributeError(f"module 'agent_bus.agents' has no attribute {name!r}")


__all__ = [
    "AfterToolResult",
    "Agent",
    "AgentBus",
    "AgentError",
    "Allow",
    "Block",
    "BlockAndStop",
    "BlockingBus",
    "LlmClient",
    "LoopConfig",
    "NextTurn",
    "Run",
    "ToolExecutor",
    "connect",
    "connect_blocking",
    "run_loop",
]
