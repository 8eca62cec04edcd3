"""The loop's per-turn view of the history (`LlmView`) and its size (`SizeMemo`) reuse what they
computed for the unchanged front of the history; they must always equal a conversion or a
measurement of the whole history from scratch, however the history changed in between."""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from agent_bus.agents.loop.context import (
    LlmView,
    SizeMemo,
    ToolOutputCache,
    ToolOutputConfig,
    ToolOutputStore,
    common_prefix,
    default_convert_to_llm,
    estimate_tokens,
    history_tokens,
    to_llm_message,
)
from agent_bus.bus.messages import (
    AssistantMessage,
    CompactionSummaryMessage,
    CustomMessage,
    Message,
    TextPart,
    ToolCall,
    ToolResultMessage,
    user_text,
)


def _reference(messages: list[Message]) -> list[object]:
    """`default_convert_to_llm` as it was written before `LlmView`: one pass over everything."""
    out: list[object] = []
    open_calls: list[tuple[str, str]] = []

    def close() -> list[object]:
        return [ToolResultMessage(tool_call_id=i, tool_name=n, content=[TextPart("No result provided")],
                                  is_error=True) for i, n in open_calls]

    for message in messages:
        converted = to_llm_message(message)
        if converted is None:
            continue
        if not isinstance(converted, ToolResultMessage):
            out += close()
            open_calls = []
        if isinstance(converted, AssistantMessage):
            open_calls = [(c.id, c.name) for c in converted.tool_calls]
        elif isinstance(converted, ToolResultMessage):
            open_calls = [c for c in open_calls if c[0] != converted.tool_call_id]
        out.append(converted)
    return out + close()


def _plain(messages: Sequence[object]) -> list[object]:
    """The messages without their timestamps (a converted custom kind or closing result is
    made at conversion, with the time of then)."""
    return [msgspec.structs.replace(m, timestamp=0.0) for m in messages]  # type: ignore[type-var]


def _message(rng: random.Random, n: int) -> Message:
    kind = rng.choice(["user", "reply", "calls", "result", "failed", "custom", "summary"])
    if kind == "user":
        return user_text(f"u{n}")
    if kind == "reply":
        return AssistantMessage(content=[TextPart(f"a{n}")], model="m")
    if kind == "calls":
        calls = [ToolCall(id=f"c{n}_{k}", name="t", arguments="{}") for k in range(rng.randint(1, 3))]
        return AssistantMessage(content=calls, stop_reason="tool_use", model="m")
    if kind == "result":
        call = f"c{rng.randint(max(0, n - 4), n)}_{rng.randint(0, 2)}"
        return ToolResultMessage(tool_call_id=call, tool_name="t", content=[TextPart("r" * n)])
    if kind == "failed":
        return AssistantMessage(content=[TextPart("x")], stop_reason="error", error="e", model="m")
    if kind == "custom":
        return CustomMessage(custom_type="note", content=f"c{n}")
    return CompactionSummaryMessage(summary=f"s{n}", tokens_before=n)


def _change(rng: random.Random, history: list[Message], n: int) -> None:
    """Grow the history most of the time; sometimes replace, drop or cut it as hooks can."""
    what = rng.random()
    if what < 0.6 or not history:
        history.extend(_message(rng, n + k) for k in range(rng.randint(1, 4)))
    elif what < 0.75:
        history[rng.randrange(len(history))] = _message(rng, n)  # e.g. a trimmed tool output
    elif what < 0.85:
        del history[rng.randrange(len(history)):]
    elif what < 0.95:
        history[:] = [_message(rng, n)] + history[len(history) // 2:]  # e.g. compaction
    else:
        history.clear()


def test_view_and_size_equal_a_full_pass_after_any_change() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        history: list[Message] = []
        view, size = LlmView(), SizeMemo(estimate_tokens)
        for n in range(60):
            _change(rng, history, n * 10)
            converted = _plain(view.convert(history))
            assert converted == _plain(_reference(history)), (seed, n)
            assert _plain(default_convert_to_llm(list(history))) == converted

            assert size.total(history) == history_tokens(history), (seed, n)


def test_view_returns_a_new_list_each_time() -> None:
    view = LlmView()
    history: list[Message] = [user_text("q")]
    first = view.convert(history)
    first.append(user_text("changed by the caller"))
    assert view.convert(history) == [history[0]]


def test_common_prefix_counts_identical_items() -> None:
    a, b, c = user_text("a"), user_text("b"), user_text("c")
    assert common_prefix([a, b, c], [a, b]) == 2
    assert common_prefix([a, b], [a, b, c]) == 2
    assert common_prefix([a, c], [a, b]) == 1
    assert common_prefix([user_text("a")], [a]) == 0  # equal but not the same object
    assert common_prefix([], [a]) == 0


def test_an_output_that_fits_is_stored_only_when_trimmed() -> None:
    store = ToolOutputStore()
    cache = ToolOutputCache(store, ToolOutputConfig(budget_tokens=300))
    history: list[Message] = [user_text("go")]
    for i in range(3):
        history.append(cache.process(_tool_message(f"c{i}", f"{i}" * 800)))  # 200 tokens each
    assert len(store) == 0  # nothing shows a ref yet
    assert cache.trim(history) == 2
    refs = [m.text.removeprefix("[tool output trimmed; ref=").rstrip("]")  # type: ignore[union-attr]
            for m in history[1:3]]
    assert [store.get(ref) for ref in refs] == ["0" * 800, "1" * 800] and len(store) == 2


def _tool_message(call_id: str, text: str) -> ToolResultMessage:
    return ToolResultMessage(tool_call_id=call_id, tool_name="t", content=[TextPart(text)])
