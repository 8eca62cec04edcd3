"""Agents on the bus: the loop, the Agent actor, and the client API for scripts.

    from agents import connect

    async with connect("tcp://127.0.0.1:7400") as bus:
        result = await bus.run("assistant", "list the files", experiment="e1")
"""

from agents.agent import Agent, AgentError
from agents.hooks import AfterToolResult, Allow, Block, BlockAndStop, NextTurn
from agents.loop import LlmClient, LoopConfig, ToolExecutor, run_loop
from agents.remote import AgentBus, BlockingBus, Run, connect, connect_blocking

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
