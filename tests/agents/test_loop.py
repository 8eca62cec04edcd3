"""run_loop event order and behaviours, driven by in-memory fakes (see conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from agent_bus.agents.loop.hooks import AfterToolResult, Allow, Block, BlockAndStop, NextTurn, ToolCallContext
from agent_bus.agents.loop.run import (
    DENIED_TEXT,
    MAX_ITERATIONS_SUMMARY_PROMPT,
    TRUNCATED_CALL_TEXT,
    LoopConfig,
    LoopResult,
    run_loop,
)
from agent_bus.bus.messages import (
    AssistantMessage,
    BranchSummaryMessage,
    CompactionSummaryMessage,
    CustomMessage,
    Message,
    TextPart,
    ToolResult,
    ToolResultMessage,
    UserMessage,
    user_text,
)
from tests.agents.conftest import FakeTools, Recorder, ScriptedLlm, call, reply

pytestmark = pytest.mark.anyio


async def run(
    llm: ScriptedLlm,
    tools: FakeTools | None = None,
    config: LoopConfig | None = None,
    prompt: str | None = "hi",
    history: list[Message] | None = None,
) -> tuple[LoopResult, Recorder, list[Message]]:
    rec = Recorder()
    messages = history if history is not None else []
    prompts = [user_text(prompt)] if prompt is not None else []
    with anyio.fail_after(5):
        result = await run_loop(prompts, messages, config or LoopConfig(), llm, tools or FakeTools(), rec)
    return result, rec, messages


def echo(args: dict[str, Any], on_update: Any) -> str:
    return f"echo:{args.get('x')}"


# 1 ------------------------------------------------------------------------------------------


async def test_prompt_without_tool_calls_emits_exact_lifecycle() -> None:
    result, rec, messages = await run(ScriptedLlm(reply("hello")))
    assert rec.compact() == [
        "agent_start",
        "turn_start",
        "message_start:user",
        "message_end:user",
        "message_start:assistant",
        "message_update",
        "message_end:assistant",
        "turn_end",
        "agent_end",
    ]
    assert rec.of("message_update")[0].delta.delta == "hello"
    assert rec.of("turn_end")[0].tool_results == []
    end = rec.of("agent_end")[0]
    assert (end.final_text, end.stop_reason, end.error) == ("hello", "stop", None)
    assert result.final_text == "hello"
    assert [type(m).__name__ for m in messages] == ["UserMessage", "AssistantMessage"]


# 2 ------------------------------------------------------------------------------------------


async def test_tool_call_lifecycle_then_next_turn() -> None:
    async def streaming(args: dict[str, Any], on_update: Any) -> str:
        await on_update("half")
        return "done:" + args["x"]

    llm = ScriptedLlm(reply("", call("c1", "work", x="a")), reply("fin"))
    result, rec, messages = await run(llm, FakeTools({"work": streaming}))
    assert rec.compact() == [
        "agent_start",
        "turn_start",
        "message_start:user",
        "message_end:user",
        "message_start:assistant",
        "message_end:assistant",
        "tool_execution_start:c1",
        "tool_execution_update:c1",
        "tool_execution_end:c1",
        "message_start:tool_result",
        "message_end:tool_result",
        "turn_end",
        "turn_start",
        "message_start:assistant",
        "message_update",
        "message_end:assistant",
        "turn_end",
        "agent_end",
    ]
    start = rec.of("tool_execution_start")[0]
    assert (start.tool_name, start.args) == ("work", {"x": "a"})
    assert rec.of("tool_execution_update")[0].partial == "half"
    end = rec.of("tool_execution_end")[0]
    assert (end.tool_name, end.result.text, end.is_error) == ("work", "done:a", False)
    assert end.duration >= 0
    turn_end = rec.of("turn_end")[0]
    assert [r.tool_call_id for r in turn_end.tool_results] == ["c1"]
    assert [e.turn for e in rec.of("turn_start")] == [1, 2]
    assert result.final_text == "fin"
    assert isinstance(llm.requests[1].messages[-1], ToolResultMessage)


# 3 ------------------------------------------------------------------------------------------


async def test_parallel_ends_in_completion_order_results_in_call_order() -> None:
    second_done = anyio.Event()

    async def slow(args: dict[str, Any], on_update: Any) -> str:
        await second_done.wait()
        return "slow"

    async def fast(args: dict[str, Any], on_update: Any) -> str:
        second_done.set()
        return "fast"

    llm = ScriptedLlm(reply("", call("c1", "slow"), call("c2", "fast")), reply("ok"))
    _, rec, messages = await run(llm, FakeTools({"slow": slow, "fast": fast}))
    tools_part = [t for t in rec.compact() if t.startswith(("tool_", "message_start:tool"))]
    assert tools_part == [
        "tool_execution_start:c1",
        "tool_execution_start:c2",
        "tool_execution_end:c2",
        "tool_execution_end:c1",
        "message_start:tool_result",
        "message_start:tool_result",
    ]
    results = [m.tool_call_id for m in messages if isinstance(m, ToolResultMessage)]
    assert results == ["c1", "c2"]


def _sequential_order(rec: Recorder) -> list[str]:
    return [t for t in rec.compact() if t.startswith(("tool_execution", "message_end:tool"))]


SEQUENTIAL = [
    "tool_execution_start:c1",
    "tool_execution_end:c1",
    "message_end:tool_result",
    "tool_execution_start:c2",
    "tool_execution_end:c2",
    "message_end:tool_result",
]


async def test_sequential_mode_finishes_each_call_before_the_next() -> None:
    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "echo")), reply("ok"))
    _, rec, _ = await run(llm, FakeTools({"echo": echo}), LoopConfig(tool_execution="sequential"))
    assert _sequential_order(rec) == SEQUENTIAL


async def test_sequential_tool_makes_whole_batch_sequential() -> None:
    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "lock")), reply("ok"))
    tools = FakeTools({"echo": echo, "lock": echo}, sequential=("lock",))
    _, rec, _ = await run(llm, tools)
    assert _sequential_order(rec) == SEQUENTIAL


# 4 ------------------------------------------------------------------------------------------


class Queue:
    """A steering/follow-up source that counts polls."""

    def __init__(self, *batches: list[Message]) -> None:
        self.batches = list(batches)
        self.polls = 0

    def __call__(self) -> list[Message]:
        self.polls += 1
        return self.batches.pop(0) if self.batches else []


async def test_steering_polled_before_first_turn_and_after_each_turn_without_skipping() -> None:
    steer = Queue([user_text("early")], [user_text("interrupt")])
    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "echo")), reply("done"))
    tools = FakeTools({"echo": echo})
    _, rec, messages = await run(llm, tools, LoopConfig(get_steering_messages=steer))
    assert tools.executed == ["c1", "c2"]  # nothing in the batch was skipped
    assert rec.compact()[:6] == [
        "agent_start", "turn_start", "message_start:user", "message_end:user",
        "message_start:user", "message_end:user",
    ]  # fmt: skip
    i = rec.compact().index("turn_start", 2)
    assert rec.compact()[i : i + 3] == ["turn_start", "message_start:user", "message_end:user"]
    assert rec.events[i + 1].message.content[0].text == "interrupt"
    assert llm.requests[1].messages[-1].content[0].text == "interrupt"
    assert steer.polls == 3  # before turn 1, after turn 1, after turn 2


async def test_steering_after_a_no_tool_turn_starts_another_turn() -> None:
    steer = Queue([], [user_text("more")])
    llm = ScriptedLlm(reply("first"), reply("second"))
    result, rec, _ = await run(llm, config=LoopConfig(get_steering_messages=steer))
    assert rec.types().count("turn_start") == 2
    assert result.final_text == "second"


async def test_follow_up_polled_only_when_agent_would_stop() -> None:
    follow = Queue([user_text("next")])
    llm = ScriptedLlm(reply("", call("c1", "echo")), reply("a"), reply("b"))
    result, rec, _ = await run(llm, FakeTools({"echo": echo}), LoopConfig(get_follow_up_messages=follow))
    assert follow.polls == 2  # after turn 2 (would stop) and after turn 3
    assert rec.types().count("turn_start") == 3
    assert result.final_text == "b"


# 5 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["error", "aborted"])
async def test_error_or_aborted_reply_ends_run_without_hooks_or_polls(stop: str) -> None:
    steer, follow = Queue(), Queue()
    called: list[str] = []
    config = LoopConfig(
        get_steering_messages=steer,
        get_follow_up_messages=follow,
        prepare_next_turn=lambda info: called.append("prepare"),  # type: ignore[func-returns-value]
        should_stop_after_turn=lambda info: bool(called.append("stop")),  # type: ignore[func-returns-value]
    )
    failed = AssistantMessage(content=[call("c1", "echo")], stop_reason=stop, error="bad")  # type: ignore[arg-type]
    tools = FakeTools({"echo": echo})
    result, rec, _ = await run(ScriptedLlm(failed), tools, config)
    assert rec.compact()[-4:] == ["message_start:assistant", "message_end:assistant", "turn_end", "agent_end"]
    assert (result.stop_reason, result.error) == (stop, "bad")
    assert (called, tools.executed, steer.polls, follow.polls) == ([], [], 1, 0)


async def test_length_stop_fails_tool_calls_and_continues() -> None:
    tools = FakeTools({"echo": echo})
    llm = ScriptedLlm(reply("", call("c1", "echo", raw='{"x": "tru'), stop="length"), reply("again"))
    result, rec, _ = await run(llm, tools)
    assert tools.executed == []
    assert _sequential_order(rec) == SEQUENTIAL[:3]
    end = rec.of("tool_execution_end")[0]
    assert end.is_error and end.result.text == TRUNCATED_CALL_TEXT.format(name="echo")
    assert end.result.text.startswith('Tool call "echo" was not executed: the response hit')
    assert result.final_text == "again" and len(llm.requests) == 2


# 6 ------------------------------------------------------------------------------------------


async def test_tool_failures_become_error_results_and_loop_continues() -> None:
    def boom(args: dict[str, Any], on_update: Any) -> str:
        raise ValueError("boom")

    def strict(args: dict[str, Any], on_update: Any) -> ToolResult:
        return ToolResult(content=[TextPart("Error: missing field `path`")], is_error=True)

    calls = [
        call("c1", "nope"),
        call("c2", "echo", raw="{bad"),
        call("c3", "boom"),
        call("c4", "strict"),
    ]
    tools = FakeTools({"echo": echo, "boom": boom, "strict": strict})
    result, rec, _ = await run(ScriptedLlm(reply("", *calls), reply("ok")), tools)
    starts = rec.of("tool_execution_start")
    assert starts[1].args == {"_raw": "{bad"}
    ends = {e.tool_call_id: e for e in rec.of("tool_execution_end")}
    assert all(e.is_error for e in ends.values())
    assert ends["c1"].result.text == "Error: Unknown tool 'nope'"
    assert ends["c2"].result.text == (
        "Error: Invalid tool arguments JSON for echo: "
        + _json_error("{bad")
    )
    assert ends["c3"].result.text == "Error: boom"
    assert "path" in ends["c4"].result.text
    assert result.final_text == "ok"


def _json_error(raw: str) -> str:
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return str(exc)
    raise AssertionError("valid JSON")


# 7 ------------------------------------------------------------------------------------------


async def test_before_tool_call_allow_block_and_failing_hook() -> None:
    def before(ctx: ToolCallContext) -> Any:
        if ctx.call.id == "c5":
            raise RuntimeError("checker down")
        assert ctx.args == {"x": ctx.call.id[1:]}
        return {"c1": Allow(), "c2": Block("no writes"), "c3": Block(), "c4": None}[ctx.call.id]

    calls = [call(f"c{i}", "echo", x=str(i)) for i in range(1, 6)]
    tools = FakeTools({"echo": echo})
    _, rec, _ = await run(ScriptedLlm(reply("", *calls), reply("ok")), tools, LoopConfig(before_tool_call=before))
    assert sorted(tools.executed) == ["c1", "c4"]
    ends = {e.tool_call_id: e.result.text for e in rec.of("tool_execution_end")}
    assert ends == {
        "c1": "echo:1",
        "c2": "no writes",
        "c3": "Tool execution was blocked",
        "c4": "echo:4",
        "c5": "Permission check failed: checker down",
    }


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
async def test_block_and_stop_ends_run_with_denied_text(mode: str) -> None:
    async def before(ctx: ToolCallContext) -> Any:
        return BlockAndStop("user said no") if ctx.call.id == "c1" else Allow()

    tools = FakeTools({"echo": echo})
    config = LoopConfig(before_tool_call=before, tool_execution=mode)  # type: ignore[arg-type]
    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "echo")))
    result, rec, _ = await run(llm, tools, config)
    assert tools.executed == []
    assert [e.tool_call_id for e in rec.of("tool_execution_start")] == ["c1"]  # c2 never started
    assert rec.of("tool_execution_end")[0].result.text == "user said no"
    assert rec.types()[-2:] == ["turn_end", "agent_end"]
    assert (result.final_text, result.stop_reason) == (DENIED_TEXT, "denied")
    assert DENIED_TEXT == "Permission request was denied. Turn stopped. Please send your next input to continue."


async def test_after_tool_call_replaces_content_details_and_error_flag() -> None:
    def after(ctx: Any) -> AfterToolResult:
        return AfterToolResult(content="redacted", details={"n": 1}, is_error=True)

    llm = ScriptedLlm(reply("", call("c1", "echo")), reply("ok"))
    _, rec, _ = await run(llm, FakeTools({"echo": echo}), LoopConfig(after_tool_call=after))
    end = rec.of("tool_execution_end")[0]
    assert (end.result.text, end.result.details, end.is_error) == ("redacted", {"n": 1}, True)


async def test_after_tool_call_none_keeps_and_raising_gives_error() -> None:
    def after(ctx: Any) -> None:
        if ctx.call.id == "c2":
            raise RuntimeError("hook broke")

    llm = ScriptedLlm(reply("", call("c1", "echo", x="1"), call("c2", "echo")), reply("ok"))
    _, rec, _ = await run(llm, FakeTools({"echo": echo}), LoopConfig(after_tool_call=after))
    ends = {e.tool_call_id: (e.result.text, e.is_error) for e in rec.of("tool_execution_end")}
    assert ends == {"c1": ("echo:1", False), "c2": ("Error: hook broke", True)}


async def test_transform_context_then_default_convert_to_llm() -> None:
    history: list[Message] = [
        CompactionSummaryMessage(summary="S1"),
        BranchSummaryMessage(summary="B1"),
        CustomMessage(custom_type="note", content="C1"),
    ]
    seen: list[int] = []

    def transform(messages: list[Message]) -> list[Message]:
        seen.append(len(messages))
        return [*messages, CustomMessage(custom_type="x", content="injected")]

    llm = ScriptedLlm(reply("ok"))
    _, _, messages = await run(llm, config=LoopConfig(transform_context=transform), history=history)
    sent = llm.requests[0].messages
    assert all(isinstance(m, UserMessage) for m in sent)
    texts = [m.content[0].text for m in sent]  # type: ignore[union-attr]
    assert "S1" in texts[0] and "B1" in texts[1] and texts[2] == "C1"
    assert texts[3:] == ["hi", "injected"]
    assert seen == [4] and len(messages) == 5  # history untouched by the transform


async def test_custom_convert_to_llm_is_used() -> None:
    llm = ScriptedLlm(reply("ok"))
    convert = lambda ms: [user_text("only this")]  # noqa: E731
    await run(llm, config=LoopConfig(convert_to_llm=convert))
    assert [m.content[0].text for m in llm.requests[0].messages] == ["only this"]  # type: ignore[union-attr]


async def test_prepare_next_turn_changes_model_reasoning_and_context() -> None:
    def prepare(info: Any) -> NextTurn:
        return NextTurn(messages=[*info.messages, user_text("extra")], model="big", reasoning="high")

    llm = ScriptedLlm(reply("", call("c1", "echo")), reply("ok"))
    _, _, messages = await run(
        llm, FakeTools({"echo": echo}), LoopConfig(model="small", reasoning="low", prepare_next_turn=prepare)
    )
    assert [(r.model, r.reasoning) for r in llm.requests] == [("small", "low"), ("big", "high")]
    assert llm.requests[1].messages[-1].content[0].text == "extra"  # type: ignore[union-attr]
    assert any(isinstance(m, UserMessage) and m.content[0].text == "extra" for m in messages)  # type: ignore[union-attr]


async def test_should_stop_after_turn_ends_without_polls() -> None:
    steer = Queue()
    seen: list[list[str]] = []

    def stop(info: Any) -> bool:
        seen.append([type(m).__name__ for m in info.messages])
        return True

    config = LoopConfig(should_stop_after_turn=stop, get_steering_messages=steer)
    llm = ScriptedLlm(reply("", call("c1", "echo")))
    result, rec, _ = await run(llm, FakeTools({"echo": echo}), config)
    assert steer.polls == 1 and len(llm.requests) == 1
    assert seen == [["UserMessage", "AssistantMessage", "ToolResultMessage"]]
    assert rec.types()[-2:] == ["turn_end", "agent_end"] and result.stop_reason == "stop"


async def test_incomplete_work_prompt_injects_hidden_user_message() -> None:
    prompts = ["You still have open todos."]
    config = LoopConfig(get_incomplete_work_prompt=lambda ms: prompts.pop() if prompts else None)
    llm = ScriptedLlm(reply("partial"), reply("all done"))
    result, rec, messages = await run(llm, config=config)
    hidden = [m for m in messages if isinstance(m, UserMessage) and m.hidden]
    assert [m.content[0].text for m in hidden] == ["You still have open todos."]  # type: ignore[union-attr]
    i = rec.compact().index("turn_start", 2)
    assert rec.compact()[i : i + 3] == ["turn_start", "message_start:user", "message_end:user"]
    assert rec.events[i + 1].message.hidden
    assert result.final_text == "all done"


# 8 ------------------------------------------------------------------------------------------


def done(args: dict[str, Any], on_update: Any) -> ToolResult:
    return ToolResult(content=[TextPart("Task complete")], done=True, done_message=args.get("msg"))


async def test_done_tool_sequential_stops_later_calls() -> None:
    tools = FakeTools({"done": done, "echo": echo})
    llm = ScriptedLlm(reply("wrapping up", call("c1", "done", msg="All set"), call("c2", "echo")))
    result, rec, messages = await run(llm, tools, LoopConfig(tool_execution="sequential"))
    assert tools.executed == ["c1"]
    assert [e.tool_call_id for e in rec.of("tool_execution_start")] == ["c1"]
    assert (result.final_text, result.stop_reason) == ("All set", "done")
    assert isinstance(messages[-1], ToolResultMessage) and messages[-1].text == "Task complete"
    assert rec.types()[-2:] == ["turn_end", "agent_end"]


async def test_done_tool_parallel_finishes_batch_and_uses_assistant_text() -> None:
    tools = FakeTools({"done": done, "echo": echo})
    llm = ScriptedLlm(reply("final words", call("c1", "done"), call("c2", "echo")))
    result, rec, _ = await run(llm, tools)
    assert sorted(tools.executed) == ["c1", "c2"]
    assert [r.tool_call_id for r in rec.of("turn_end")[0].tool_results] == ["c1", "c2"]
    assert (result.final_text, result.stop_reason) == ("final words", "done")


async def test_require_done_tool_keeps_looping_without_tool_calls() -> None:
    tools = FakeTools({"done": done})
    llm = ScriptedLlm(reply("thinking"), reply("", call("c1", "done", msg="fin")))
    result, _, _ = await run(llm, tools, LoopConfig(require_done_tool=True))
    assert len(llm.requests) == 2 and result.final_text == "fin"


# 9 ------------------------------------------------------------------------------------------


async def test_max_iterations_summary_on_history_copy() -> None:
    llm = ScriptedLlm(reply("one"), reply("two"), reply("summary content"))
    config = LoopConfig(max_iterations=2, require_done_tool=True)
    result, rec, messages = await run(llm, FakeTools({"echo": echo}), config)
    assert len(llm.requests) == 3
    summary = llm.requests[2]
    assert (summary.tools, summary.tool_choice) == ([], "none")
    assert summary.messages[-1].content[0].text == MAX_ITERATIONS_SUMMARY_PROMPT  # type: ignore[union-attr]
    assert len(messages) == 3  # user, one, two: the summary prompt never entered history
    assert result.final_text == "[Max Iterations Reached]\n\nsummary content"
    assert result.stop_reason == "max_iterations"
    assert rec.of("agent_end")[0].final_text == result.final_text


@pytest.mark.parametrize("failure", ["error", "raise"])
async def test_max_iterations_summary_failure_fallback(failure: str) -> None:
    bad: Any = RuntimeError("down") if failure == "raise" else reply(stop="error")
    llm = ScriptedLlm(reply("one"), bad)
    result, _, _ = await run(llm, config=LoopConfig(max_iterations=1, require_done_tool=True))
    assert result.final_text == "[Max Iterations Reached]\n\nSummary unavailable due to an internal error."


# 11, 12 -------------------------------------------------------------------------------------


async def test_llm_client_raising_ends_run_with_error_lifecycle() -> None:
    result, rec, messages = await run(ScriptedLlm(RuntimeError("provider exploded")))
    assert rec.compact() == [
        "agent_start", "turn_start", "message_start:user", "message_end:user",
        "message_start:assistant", "message_end:assistant", "turn_end", "agent_end",
    ]  # fmt: skip
    last = messages[-1]
    assert isinstance(last, AssistantMessage)
    assert (last.stop_reason, last.error) == ("error", "provider exploded")
    end = rec.of("agent_end")[0]
    assert (end.stop_reason, end.error) == ("error", "provider exploded")


async def test_hook_raising_outside_tools_ends_run_with_error_lifecycle() -> None:
    def transform(ms: list[Message]) -> list[Message]:
        raise RuntimeError("transform broke")

    result, rec, _ = await run(ScriptedLlm(), config=LoopConfig(transform_context=transform))
    assert rec.compact()[-4:] == ["message_start:assistant", "message_end:assistant", "turn_end", "agent_end"]
    assert (result.stop_reason, result.error) == ("error", "transform broke")


async def test_failure_inside_parallel_batch_ends_run_with_error() -> None:
    rec = Recorder()

    async def emit(event: Any) -> None:
        if type(event).__name__ == "ToolExecutionEnd":
            raise RuntimeError("sink broke")
        await rec(event)

    llm = ScriptedLlm(reply("", call("c1", "echo"), call("c2", "echo")))
    result = await run_loop([user_text("hi")], [], LoopConfig(), llm, FakeTools({"echo": echo}), emit)
    assert (result.stop_reason, result.error) == ("error", "sink broke")
    assert rec.types()[-2:] == ["turn_end", "agent_end"]


async def test_retry_policy_and_request_fields_pass_through() -> None:
    llm = ScriptedLlm(reply("ok"))
    config = LoopConfig(
        model="fast", system_prompt="be brief", llm_max_retries=3, llm_retry_base_delay=0.5,
        llm_retry_max_delay=9.0, llm_retryable_statuses=(429,), tool_choice="required", agent="a1",
    )  # fmt: skip
    rec = Recorder()
    await run_loop([user_text("hi")], [], config, llm, FakeTools({"echo": echo}), rec, run_id="r1")
    req = llm.requests[0]
    assert (req.retry.max_attempts, req.retry.base_delay, req.retry.max_delay) == (3, 0.5, 9.0)
    assert req.retry.retry_statuses == [429]
    assert (req.model, req.system_prompt, req.tool_choice, req.agent, req.run_id) == (
        "fast", "be brief", "required", "a1", "r1",
    )  # fmt: skip
    assert [t.name for t in req.tools] == ["echo"]
    default = LoopConfig().retry_policy()
    assert (default.max_attempts, default.base_delay, default.max_delay) == (5, 1.0, 60.0)
    assert default.retry_statuses == [429, 500, 502, 503, 504]
