"""Context management: usage tracking, the tool-output cache and compaction inside the loop."""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest

from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.context import (
    FIRST_PROMPT_CUT,
    CompactionConfig,
    ToolOutputCache,
    ToolOutputConfig,
    ToolOutputStore,
    UsageTracker,
    compacted_history,
    context_exceeded_text,
    default_convert_to_llm,
    history_tokens,
    parse_compaction,
)
from agent_bus.agents.loop.run import LoopConfig, run_loop
from agent_bus.bus.messages import (
    AssistantMessage,
    CompactionSummaryMessage,
    Message,
    TextPart,
    ToolCallRequest,
    ToolResultMessage,
    Usage,
    UserMessage,
    user_text,
)
from tests.agents.conftest import FakeTools, Recorder, ScriptedLlm, call, reply

pytestmark = pytest.mark.anyio


def tool_message(call_id: str, text: str, name: str = "read") -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name=name, content=[TextPart(text)])


# usage ----------------------------------------------------------------------------------------


def test_usage_totals_by_model_and_context_left() -> None:
    tracker = UsageTracker()
    assert tracker.context_left_percent(1000) is None
    tracker.add(AssistantMessage(model="a", usage=Usage(input=10, output=5, total=15)))
    tracker.add(AssistantMessage(model="b", usage=Usage(total=250)))
    tracker.add(AssistantMessage(model="a", usage=Usage(input=1, total=1)))
    assert tracker.by_model["a"] == Usage(input=11, output=5, total=16)
    assert tracker.total.total == 266
    assert tracker.context_left_percent(1000) == 100  # last: total 1 -> round(99.9)
    tracker.add(AssistantMessage(model="b", usage=Usage(total=900)))
    assert tracker.context_left_percent(1000) == 10
    assert tracker.context_left_percent(None) is None


async def test_agent_end_carries_run_usage_by_model() -> None:
    llm = ScriptedLlm(reply("", call("c1", "echo")), reply("ok"))
    big = AssistantMessage(content=[TextPart("ok")], usage=Usage(total=7), model="big")
    llm.script[1] = big
    llm.script[0].usage = Usage(total=3)
    rec = Recorder()
    await run_loop([user_text("hi")], [], LoopConfig(), llm, FakeTools({"echo": lambda a, u: "x"}), rec)
    assert rec.of("agent_end")[0].usage == {"m": Usage(total=3), "big": Usage(total=7)}


# tool output cache -------------------------------------------------------------------------------


def test_large_output_is_cut_with_ref_and_full_text_retrievable() -> None:
    store = ToolOutputStore()
    cache = ToolOutputCache(store, ToolOutputConfig(max_message_bytes=51_200))
    text = "".join(f"line {i:06d} " + "x" * 90 + "\n" for i in range(1000))  # ~102 KB
    out = cache.process(tool_message("c1", text))
    cut = out.text
    ref = re.search(r"ref=([0-9a-f]+)", cut)[1]  # type: ignore[index]
    head, note, tail = re.fullmatch(r"(.*\n)\n\[(tool output truncated; .*?)\]\n(.*)", cut, re.S).groups()  # type: ignore[union-attr]
    assert note.startswith(f"tool output truncated; ref={ref}: ") and "`tool_output`" in note
    assert len((head + tail).encode()) <= 51_200 and text.startswith(head) and text.endswith(tail)
    assert head.endswith("\n") and tail.startswith("line ") and tail.endswith("x\n")  # whole lines
    assert f"{len(text) - len(head) - len(tail)} of its {len(text)} characters" in note
    assert store.get(ref) == text
    small = cache.process(tool_message("c2", "short"))
    assert small.text == "short"


async def test_tool_output_builtin_tool_pages_by_ref() -> None:
    store = ToolOutputStore()
    ref = store.put("abcdefghij")
    info = store.tool_info()
    assert info.name == "tool_output" and "ref" in info.parameters["properties"]
    ok = await store.handle(ToolCallRequest(call_id="1", name="tool_output", arguments=f'{{"ref": "{ref}", "offset": 2, "limit": 3}}'))
    assert (ok.text, ok.is_error) == ("cde", False)
    missing = await store.handle(ToolCallRequest(call_id="2", name="tool_output", arguments='{"ref": "zz"}'))
    assert missing.is_error and "ref=zz" in missing.text
    bad = await store.handle(ToolCallRequest(call_id="3", name="tool_output", arguments="{}"))
    assert bad.is_error


def test_oldest_outputs_trimmed_to_budget() -> None:
    store = ToolOutputStore()
    cache = ToolOutputCache(store, ToolOutputConfig(budget_tokens=300))
    history: list[Message] = [user_text("go")]
    for i in range(3):
        history.append(reply("", call(f"c{i}", "t")))
        history.append(cache.process(tool_message(f"c{i}", "y" * 800)))  # 200 tokens each
    trimmed = cache.trim(history)
    assert trimmed == 2
    texts = [m.text for m in history[2::2]]  # type: ignore[union-attr]
    assert texts[0].startswith("[tool output trimmed; ref=") and texts[1].startswith("[tool output trimmed; ref=")
    assert texts[2] == "y" * 800
    ref = texts[0].removeprefix("[tool output trimmed; ref=").rstrip("]")
    assert store.get(ref) == "y" * 800
    assert cache.trim(history) == 0


def test_budget_defaults_from_context_window() -> None:
    cfg = ToolOutputConfig()
    assert (cfg.budget(128_000), cfg.budget(10_000), cfg.budget(1_000_000), cfg.budget(None)) == (
        32_000, 5_000, 60_000, 60_000,
    )  # fmt: skip
    assert (cfg.budget(40_000), cfg.budget(4096)) == (20_000, 2048)  # never over half the window
    # one result: at most a quarter of the window (4 bytes a token), 51,200 bytes at most
    assert (cfg.message_bytes(4096), cfg.message_bytes(128_000), cfg.message_bytes(None)) == (
        4096, 51_200, 51_200)


def test_the_newest_results_are_cut_to_the_budget_never_trimmed_away() -> None:
    """A small window: the results the model is about to read keep a cut each, with their ref;
    older ones go first."""
    store = ToolOutputStore()
    cache = ToolOutputCache(store, ToolOutputConfig(), context_window=4096)  # budget 2,048 tokens
    history: list[Message] = [user_text("go"), reply("", call("old", "t"))]
    history.append(cache.process(tool_message("old", "o" * 3000)))
    history.append(reply("", call("a", "t"), call("b", "t")))
    history += [cache.process(tool_message(k, f"{k}\n" * 3000)) for k in ("a", "b")]
    assert len(history[-1].text) < 4300  # type: ignore[union-attr]  # cut to a quarter already
    cache.trim(history)
    old, a, b = history[2], history[4], history[5]
    assert old.text.startswith("[tool output trimmed; ref=")  # type: ignore[union-attr]
    for message, key in ((a, "a"), (b, "b")):
        text = message.text  # type: ignore[union-attr]
        assert text.startswith(f"{key}\n{key}\n") and "[tool output truncated; ref=" in text
        ref = re.search(r"ref=([0-9a-f]+)", text)[1]  # type: ignore[index]
        assert store.get(ref) == f"{key}\n" * 3000  # the full text stays retrievable
    assert sum(len(m.text) for m in (a, b)) <= 2048 * 4 + 400  # type: ignore[union-attr]  # + 2 notes


async def test_loop_truncates_tool_results_in_history_and_events() -> None:
    llm = ScriptedLlm(reply("", call("c1", "dump")), reply("ok"))
    tools = FakeTools({"dump": lambda a, u: "z" * 60_000})
    rec, messages = Recorder(), []  # type: ignore[var-annotated]
    await run_loop([user_text("hi")], messages, LoopConfig(), llm, tools, rec)
    end = rec.of("tool_execution_end")[0]
    assert "[tool output truncated; ref=" in end.result.text
    assert messages[2] is end.result


# compaction --------------------------------------------------------------------------------------


def test_parse_compaction_and_compacted_history_keep_last_turn() -> None:
    assert parse_compaction("<retain>ref=1</retain><summary>did X</summary>") == "did X\n\nDetails to keep:\nref=1"
    assert parse_compaction("plain text") == "plain text"
    history: list[Message] = [
        user_text("first"), reply("", call("a", "t")), tool_message("a", "r"), reply("mid"),
        user_text("second"), reply("", call("b", "t")), tool_message("b", "r2"),
    ]  # fmt: skip
    new = compacted_history(history, "S", retain_last_turns=1, tokens_before=9)
    assert isinstance(new[0], CompactionSummaryMessage) and new[0].summary == "S"
    assert new[1:] == history[4:]  # the last turn: its injected user message, reply, tool result


def test_default_convert_closes_unanswered_tool_calls_and_drops_failed_replies() -> None:
    failed = AssistantMessage(content=[TextPart("x")], stop_reason="error", error="e")
    out = default_convert_to_llm([user_text("q"), reply("", call("a", "t"), call("b", "t")), tool_message("a", "r"), failed, user_text("again")])
    roles = [type(m).__name__ for m in out]
    assert roles == ["UserMessage", "AssistantMessage", "ToolResultMessage", "ToolResultMessage", "UserMessage"]
    assert out[3].tool_call_id == "b" and out[3].is_error  # type: ignore[union-attr]


def _compaction_config(**kw: Any) -> LoopConfig:
    return LoopConfig(context_window=1000, compaction=CompactionConfig(threshold=0.8, **kw))


async def test_compaction_replaces_history_when_threshold_reached() -> None:
    llm = ScriptedLlm(
        reply("", call("c0", "echo"), total=300),
        reply("", call("c1", "echo"), total=850),
        reply("<summary>user asked; tool ran</summary>"),
        reply("after", total=100),
    )
    rec, messages = Recorder(), []  # type: ignore[var-annotated]
    with anyio.fail_after(5):
        await run_loop([user_text("hi")], messages, _compaction_config(), llm, FakeTools({"echo": lambda a, u: "r"}), rec)
    types = rec.types()
    third_turn = [i for i, t in enumerate(types) if t == "turn_start"][2]
    assert types[third_turn : third_turn + 4] == [
        "turn_start", "compaction_start", "compaction_complete", "message_start",
    ]  # fmt: skip: compaction comes before the next model call, not after the last one
    assert rec.of("compaction_start")[0].tokens == 850
    assert rec.of("compaction_complete")[0].compacted is True
    summary_request = llm.requests[2]
    assert (summary_request.tools, summary_request.tool_choice) == ([], "none")
    # only the older turn is summarised: the newest one (its results unread) stays verbatim
    assert [type(m).__name__ for m in summary_request.messages] == [
        "UserMessage", "AssistantMessage", "ToolResultMessage", "UserMessage"]
    prompt = summary_request.messages[-1].content[0].text  # type: ignore[union-attr]
    assert prompt.startswith("You are summarizing the conversation for context compaction.")
    assert isinstance(messages[0], CompactionSummaryMessage) and messages[0].summary == "user asked; tool ran"
    # the run's question stays, after the summary, with the newest turn and the answer
    assert [type(m).__name__ for m in messages[1:]] == [
        "UserMessage", "AssistantMessage", "ToolResultMessage", "AssistantMessage",
    ]  # fmt: skip
    assert messages[1].content[0].text == "hi" and messages[2].tool_calls[0].id == "c1"  # type: ignore[union-attr]
    third = llm.requests[3].messages
    assert isinstance(third[0], UserMessage) and "user asked; tool ran" in third[0].content[0].text  # type: ignore[union-attr]


async def test_the_first_prompt_rides_verbatim_beside_a_summary_that_dropped_it() -> None:
    """Issue 45 §2 against a real 0.5B model: its summary of eight notes was "Summary of
    conversation:...", the first note's code word gone. The first prompt (usually the task) is
    kept verbatim beside the summary, carried on by the next compaction, and cut when long."""
    llm = ScriptedLlm(
        reply("noted", total=850), reply("<summary>...</summary>"), reply("noted", total=850),
        reply("<summary>...</summary>"), reply("noted", total=100),
    )
    messages: list[Message] = []
    first = "The secret code word is ZEBRA-42. " + "pad " * 400  # ~1,600 bytes: over an eighth of 1,000
    with anyio.fail_after(5):
        for prompt in (first, "note two", "note three"):
            await run_loop([user_text(prompt)], messages, _compaction_config(retain_last_turns=0),
                           llm, FakeTools(), Recorder())
    summary = messages[0]
    assert isinstance(summary, CompactionSummaryMessage) and summary.summary == "..."
    assert summary.first_prompt.startswith("The secret code word is ZEBRA-42. ")
    assert summary.first_prompt.endswith(FIRST_PROMPT_CUT) and len(summary.first_prompt) < len(first)
    assert sum(isinstance(m, CompactionSummaryMessage) for m in messages) == 1
    seen = llm.requests[-1].messages[0].content[0].text  # type: ignore[union-attr]
    assert "kept verbatim" in seen and "ZEBRA-42" in seen  # what the model reads after two compactions
    assert llm.requests[3].messages[-1].content[0].text.startswith("You are summarizing")  # type: ignore[union-attr]


async def test_nothing_older_than_the_question_and_its_results_means_no_summary_call() -> None:
    """The issue's case: a window filled by the prompt and one tool result. No compaction call
    (it would summarise nothing and invent the rest); the question and result go to the model."""
    llm = ScriptedLlm(reply("", call("c1", "echo"), total=850), reply("after", total=100))
    rec, messages = Recorder(), []  # type: ignore[var-annotated]
    with anyio.fail_after(5):
        await run_loop([user_text("hi")], messages, _compaction_config(), llm, FakeTools({"echo": lambda a, u: "r"}), rec)
    assert "compaction_start" not in rec.types() and len(llm.requests) == 2
    assert [type(m).__name__ for m in llm.requests[1].messages] == [
        "UserMessage", "AssistantMessage", "ToolResultMessage"]


async def test_a_full_history_is_compacted_by_the_next_run_not_after_the_answer() -> None:
    llm = ScriptedLlm(reply("big", total=900), reply(stop="error"), reply("ok", total=10))
    first, second, messages = Recorder(), Recorder(), []  # type: ignore[var-annotated]
    with anyio.fail_after(5):
        await run_loop([user_text("hi")], messages, _compaction_config(), llm, FakeTools(), first)
        assert first.types()[-2:] == ["turn_end", "agent_end"]  # the answer is not held back
        # retain no turn: the first run's one turn is what there is to summarise
        await run_loop([user_text("again")], messages, _compaction_config(retain_last_turns=0), llm,
                       FakeTools(), second)
    assert second.types()[:4] == ["agent_start", "turn_start", "compaction_start", "compaction_complete"]
    assert second.of("compaction_complete")[0].compacted is False  # the summary call failed
    assert [type(m).__name__ for m in messages] == ["UserMessage", "AssistantMessage"] * 2
    assert llm.requests[1].messages[-1].content[0].text.startswith("You are summarizing")  # type: ignore[union-attr]


def test_compacted_history_keeps_fewer_turns_to_fit_half_the_window() -> None:
    big = "x" * 4000  # ~1,000 estimated tokens
    history: list[Message] = [
        user_text("first"), reply("", call("a", "t")), tool_message("a", big), reply("mid"),
        user_text("second"), reply("", call("b", "t")), tool_message("b", big),
    ]  # fmt: skip
    kept = compacted_history(history, "S", retain_last_turns=3, budget=1500)
    assert kept[1:] == history[3:] and history_tokens(kept) < 1500  # two turns fit, three do not
    # over any budget, the newest turn stays while history ends in its unread tool results ...
    assert compacted_history(history, "S", retain_last_turns=3, budget=500)[1:] == history[4:]
    # ... and goes once it was answered: the summary and the short answer
    answered = [*history, reply("done")]
    assert compacted_history(answered, "S", retain_last_turns=3, budget=500)[1:] == [answered[-1]]
    # the current run's prompt (kept by identity) stays, after the summary
    kept = compacted_history(answered, "S", retain_last_turns=0, keep=[history[0]])
    assert kept[1:] == [history[0]]
    assert compacted_history(history, "S", retain_last_turns=3)[1:] == history  # no budget


async def test_no_compaction_below_threshold_or_when_disabled() -> None:
    for config, total in ((_compaction_config(), 799), (LoopConfig(context_window=1000, compaction=None), 999)):
        rec = Recorder()
        await run_loop([user_text("hi")], [], config, ScriptedLlm(reply("ok", total=total)), FakeTools(), rec)
        assert "compaction_start" not in rec.types()


@pytest.mark.parametrize(("total", "compacts"), [(800, True), (799, False)])
async def test_compaction_starts_at_exactly_the_threshold(total: int, compacts: bool) -> None:
    """threshold=0.8 of a 1000-token window: a reply of exactly 800 tokens compacts before the
    next model call, one token fewer does not."""
    llm = ScriptedLlm(reply("", call("c1", "echo"), total=total), reply("<summary>s</summary>"),
                      reply("after", total=10))
    if not compacts:
        llm.script.pop(1)  # no summary call
    rec = Recorder()
    earlier: list[Message] = [user_text("before"), reply("earlier")]  # something to summarise
    with anyio.fail_after(5):
        await run_loop([user_text("hi")], earlier, _compaction_config(), llm, FakeTools({"echo": lambda a, u: "r"}), rec)
    starts = rec.of("compaction_start")
    assert [s.tokens for s in starts] == ([total] if compacts else [])
    assert len(llm.requests) == (3 if compacts else 2) and not llm.script


def _too_long(window: int) -> AssistantMessage:
    return AssistantMessage(stop_reason="error", model="m",
                            error=context_exceeded_text(window, "request (9000 tokens) exceeds n_ctx"))


async def test_a_refused_prompt_adopts_the_reported_window_at_once_then_fails_saying_what_to_change() -> None:
    """The server's window (in its context-exceeded error) sizes the tool outputs and compaction
    of the same call; when the question and the newest results still do not fit, the run ends
    with an error that says why and what to change, never with an answer to something else."""
    llm = ScriptedLlm(reply("", call("c1", "echo")), _too_long(600), _too_long(600))
    rec, messages = Recorder(), []  # type: ignore[var-annotated]
    config = LoopConfig(context_window=128_000)  # what the loop believed before the error
    with anyio.fail_after(5):
        result = await run_loop([user_text("what is in it?")], messages, config, llm,
                                FakeTools({"echo": lambda a, u: "w\n" * 20_000}), rec)
    retry = llm.requests[2].messages
    assert retry[0].content[0].text == "what is in it?"  # type: ignore[union-attr]
    result_text = retry[-1].text  # type: ignore[union-attr]
    # a quarter of 600 tokens, at the rate the refusal showed (9,000 counted for ~10,000 estimated)
    assert "[tool output truncated; ref=" in result_text and len(result_text) < 1200
    assert result.stop_reason == "error" and "compaction_start" not in rec.types()
    error = result.error or ""
    assert "does not fit the model's context window (600 tokens)" in error
    assert "bigger window" in error and "`max_tokens`" in error and "smaller tool result" in error


async def test_an_answer_cut_at_max_tokens_ends_the_run_with_length() -> None:
    llm = ScriptedLlm(reply("a long answer that was cu", stop="length"))
    rec = Recorder()
    result = await run_loop([user_text("hi")], [], LoopConfig(), llm, FakeTools(), rec)
    end = rec.of("agent_end")[0]
    assert (result.stop_reason, end.stop_reason, end.error) == ("length", "length", None)
    assert end.final_text == "a long answer that was cu"


class Summariser:
    """A model that answers a summary request with `<summary>S<n></summary>` (n: its count) and
    anything else with a reply that fills the window (so the next turn compacts)."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.summaries = 0

    async def complete(self, request: Any, on_delta: Any = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        self.requests.append(request)
        last = request.messages[-1].content[0].text
        if last.startswith("You are summarizing"):
            self.summaries += 1
            return reply(f"<summary>S{self.summaries}</summary>", total=100)
        return reply("ok", total=900)

    def summary_requests(self) -> list[str]:
        return [repr(r.messages) for r in self.requests if not r.tools and r.tool_choice == "none"]


def _notes(count: int, size: int) -> list[Message]:
    """A history of `count` notes (each `size` bytes, with its own code word) and their answers;
    the last answer used most of a 1,000-token window."""
    history: list[Message] = []
    for i in range(count):
        history += [user_text(f"note-{i}: " + "n" * size), reply(f"noted {i}", total=850)]
    return history


async def test_older_history_too_big_for_one_summary_call_is_summarised_in_chunks() -> None:
    """Issue 45 §2: every older message reaches a summary call (the oldest were dropped to fit
    one call in half the window); each chunk's call is given the summary so far."""
    llm, rec, messages = Summariser(), Recorder(), _notes(8, 400)
    with anyio.fail_after(5):
        await run_loop([user_text("what was note 0?")], messages, _compaction_config(), llm, FakeTools(), rec)
    done = rec.of("compaction_complete")[0]
    summaries = llm.summary_requests()
    assert done.compacted and done.left_out == 0 and done.summary_calls == len(summaries) > 1
    assert all(any(f"note-{i}:" in s for s in summaries) for i in range(7))  # note 7 is the kept turn
    assert all(f"S{n}" in summaries[n] for n in range(1, len(summaries)))  # the summary so far
    assert done.usage.total == 100 * len(summaries)
    assert isinstance(messages[0], CompactionSummaryMessage) and messages[0].summary == f"S{len(summaries)}"


async def test_a_turn_too_big_for_any_summary_call_is_reported_left_out() -> None:
    llm, rec = Summariser(), Recorder()
    messages = [user_text("huge: " + "h" * 8000), reply("seen", total=100), *_notes(2, 100)]
    with anyio.fail_after(5):
        await run_loop([user_text("and now?")], messages, _compaction_config(), llm, FakeTools(), rec)
    done = rec.of("compaction_complete")[0]
    assert done.compacted and done.left_out == 1
    assert not any("huge:" in s for s in llm.summary_requests())
    assert any("note-0:" in s for s in llm.summary_requests())


def _real(text: str, prompt: int) -> AssistantMessage:
    return AssistantMessage(content=[TextPart(text)], usage=Usage(input=prompt - 10, cache_read=10), model="m")


def test_the_rate_is_read_from_the_last_real_usage_of_the_history() -> None:
    """Issue 45 §3: real tokens per estimated one, from the replies' reported prompts."""
    from agent_bus.agents.loop.context import TokenRate, history_rate

    note = user_text("word " * 400)  # 2,000 bytes: ~515 estimated tokens (4 bytes a token)
    history: list[Message] = [user_text("hi"), _real("a", 100), note, _real("b", 100 + 750)]
    grown = history_tokens(history[:3]) - history_tokens(history[:1])
    assert history_rate(history).scale == pytest.approx(750 / grown)  # the growth, tools unknown
    whole = history_rate(history, fixed=200)
    assert whole.whole and whole.scale == pytest.approx(850 / (history_tokens(history[:3]) + 200))
    assert whole.tokens(1000) > 1000 and whole.budget(whole.tokens(1000)) in (999, 1000)
    # replies older than the last compaction measured another history; estimates measure nothing
    summary = CompactionSummaryMessage(summary="s", timestamp=history[-1].timestamp + 1)  # type: ignore[attr-defined]
    assert history_rate([summary, *history]) == TokenRate()
    estimated = AssistantMessage(usage=Usage(input=500, estimated=True))
    assert history_rate([user_text("x"), estimated], fixed=10) == TokenRate()


def test_the_estimate_counts_a_digit_a_token() -> None:
    """Tokenizers cut numbers into runs of one to three digits (Qwen2.5: one each): number-heavy
    text is not 4 bytes a token."""
    from agent_bus.agents.loop.context import json_tokens

    assert json_tokens(b"word " * 400) == 500
    assert json_tokens(b"1234 " * 400) == 1600 + 100
