"""The agent loop, pure: the turn engine (`run`), its hooks, context management and the `Agent` actor.

Nothing here imports a transport: the model, the tools and the event sink are injected, so the loop runs
in-process, in tests, or inside the coordinator unchanged (`tests/agents/test_loop_is_pure.py`).
The loop's public names are listed once, in `__all__` below (run.py keeps no copy of the list).
"""

from __future__ import annotations

from agent_bus.agents.loop.abort import Abort, AbortSignal
from agent_bus.agents.loop.run import (
    ABORTED_TEXT,
    BLOCKED_TEXT,
    DENIED_TEXT,
    MAX_ITERATIONS_FALLBACK,
    MAX_ITERATIONS_PREFIX,
    MAX_ITERATIONS_SUMMARY_PROMPT,
    REPEAT_NOTE,
    REPEAT_STOP_TEXT,
    TASK_COMPLETE_TEXT,
    TRUNCATED_CALL_TEXT,
    DeltaSink,
    Emit,
    LlmClient,
    LoopConfig,
    LoopResult,
    QueueMode,
    ToolExecutionMode,
    ToolExecutor,
    UpdateSink,
    run_loop,
)

__all__ = [
    "ABORTED_TEXT",
    "BLOCKED_TEXT",
    "DENIED_TEXT",
    "MAX_ITERATIONS_FALLBACK",
    "MAX_ITERATIONS_PREFIX",
    "MAX_ITERATIONS_SUMMARY_PROMPT",
    "REPEAT_NOTE",
    "REPEAT_STOP_TEXT",
    "TASK_COMPLETE_TEXT",
    "TRUNCATED_CALL_TEXT",
    "Abort",
    "AbortSignal",
    "DeltaSink",
    "Emit",
    "LlmClient",
    "LoopConfig",
    "LoopResult",
    "QueueMode",
    "ToolExecutionMode",
    "ToolExecutor",
    "UpdateSink",
    "run_loop",
]
