"""The tool API: schemas, argument validation, result mapping, the runner and the loader."""

import contextvars
import enum
import json
import textwrap
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import msgspec
import pytest
from sniffio import current_async_library_cvar

from agent_bus import tools
from agent_bus.bus.messages import ImagePart, TextPart, ToolCallRequest, ToolInfo, ToolResult, ToolTrace
from agent_bus.bus.tracecontext import span_id, trace_id
from agent_bus.tools import (
    Done,
    Image,
    TaskComplete,
    Tool,
    ToolContext,
    ToolDefinitionError,
    ToolLoadError,
    check_provider_schema,
    load_tools,
    run_tool,
    tool,
)

pytestmark = pytest.mark.anyio

_tag: contextvars.ContextVar[str] = contextvars.ContextVar("_tag", default="")


def sniffio_library() -> str | None:
    """What sniffio's context variable says in the current context."""
    return current_async_library_cvar.get()


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(msgspec.Struct):
    """A point on the plane."""

    x: int
    y: int = 0


class Shape(msgspec.Struct):
    name: str
    corners: list[Point]
    center: Point | None = None


@tool
def draw(
    shape: Shape,
    color: Color,
    mode: Literal["fill", "stroke"] = "fill",
    width: Annotated[float, msgspec.Meta(gt=0, le=10)] = 1.0,
    label: str | None = None,
    tags: list[str] = [],
) -> str:
    """Draw a shape on the canvas.

    Longer explanation that is not part of the description.

    Args:
        shape: The shape to draw.
        color: Fill or stroke colour.
        mode: Whether to fill the shape
            or only stroke its outline.
        width (float): Line width; the Annotated Meta adds
            only bounds, so this description is used.
    """
    return f"{shape.name} {color.value} {mode} {width} {label} {tags}"


@tool(name="counter", idempotent=True, timeout=5, sequential=True)
async def count(
    n: Annotated[int, msgspec.Meta(ge=0, description="How many.")],
    ctx: ToolContext,
    step: int = 1,
) -> list[int]:
    """Count up to n.

    Args:
        n: Overridden by the Annotated description.
    """
    return list(range(0, n, step))


def request(name: str, arguments: Any = "{}", **kw: str) -> ToolCallRequest:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolCallRequest(call_id="c1", name=name, arguments=arguments, **kw)


async def call(t: Tool, arguments: Any = "{}", **kw: Any) -> ToolResult:
    return await run_tool(t, request(t.name, arguments), **kw)


def has_key(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(has_key(v, key) for v in node.values())
    if isinstance(node, list):
        return any(has_key(v, key) for v in node)
    return False


# --- schema ------------------------------------------------------------------------------


def test_sync_tool_schema_inlines_structs_enums_literals_and_optionals() -> None:
    schema = draw.parameters
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["shape", "color"]
    assert not has_key(schema, "$ref") and not has_key(schema, "$defs") and not has_key(schema, "title")
    props = schema["properties"]
    assert props["color"] == {"description": "Fill or stroke colour.", "enum": ["blue", "red"], "type": "string"}
    assert props["mode"] == {
        "description": "Whether to fill the shape or only stroke its outline.",
        "enum": ["fill", "stroke"],
        "type": "string",
        "default": "fill",
    }
    assert props["width"] == {
        "description": "Line width; the Annotated Meta adds only bounds, so this description is used.",
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 10,
        "default": 1.0,
    }
    assert props["label"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    shape = props["shape"]
    assert shape["type"] == "object" and shape["additionalProperties"] is False
    assert shape["required"] == ["name", "corners"]
    point = shape["properties"]["corners"]["items"]
    assert point == {
        "description": "A point on the plane.",
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
        "required": ["x"],
        "additionalProperties": False,
    }
    assert shape["properties"]["center"]["anyOf"][0] == point
    assert check_provider_schema(schema) == []


def test_async_tool_schema_skips_context_and_keeps_annotated_description() -> None:
    assert count.is_async and count.context_param == "ctx"
    assert count.parameters == {
        "type": "object",
        "properties": {
            "n": {"description": "How many.", "type": "integer", "minimum": 0},
            "step": {"type": "integer", "default": 1},
        },
        "required": ["n"],
        "additionalProperties": False,
    }
    assert count.info == ToolInfo(
        name="counter",
        description="Count up to n.",
        parameters=count.parameters,
        sequential=True,
        idempotent=True,
        timeout=5,
    )
    assert draw.info.description == "Draw a shape on the canvas."


def test_tool_without_params_and_docstring() -> None:
    @tool
    def ping() -> str:
        return "pong"

    assert ping.description == ""
    assert ping.parameters == {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    assert check_provider_schema(ping.parameters) == []
    assert ping() == "pong"  # the Tool still calls like the function


def test_check_provider_schema_reports_problems() -> None:
    bad = {
        "$ref": "#/$defs/X",
        "$defs": {"X": {"type": "object"}},
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["c"]}},
    }
    problems = check_provider_schema(bad)
    assert "root `type` must be \"object\", got None - at `$`" in problems
    assert "`$ref` is not allowed - at `$`" in problems
    assert "`$defs` is not allowed - at `$`" in problems
    assert "`additionalProperties` must be false - at `$.properties.a`" in problems
    assert "`required` names `c`, which is not a property - at `$.properties.a`" in problems
    assert check_provider_schema(msgspec.json.schema(Point)) != []  # raw msgspec output fails


def test_recursive_struct_is_refused_at_definition() -> None:
    with pytest.raises(ToolDefinitionError, match="recursive argument type `Tree`"):

        @tool
        def grow(tree: Tree) -> None: ...


class Tree(msgspec.Struct):
    children: list["Tree"] = []


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(x): ...", "parameter `x` of tool `f` needs a type annotation"),
        ("def f(*args: int): ...", "\\*args/\\*\\*kwargs"),
        ("def f(x: int, /): ...", "positional-only"),
    ],
)
def test_bad_signatures_are_refused(source: str, message: str) -> None:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    with pytest.raises(ToolDefinitionError, match=message):
        tool(namespace["f"])


def test_bad_name_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="Tool name `a.b` is invalid"):
        tool(name="a.b")(lambda: None)


# --- argument validation -----------------------------------------------------------------


async def test_valid_arguments_reach_the_function() -> None:
    args = {"shape": {"name": "tri", "corners": [{"x": 1}]}, "color": "red", "width": 2}
    result = await call(draw, args)
    assert result == ToolResult(content=[TextPart("tri red fill 2.0 None []")])


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ('{"n": "3"}', "Error: Invalid arguments for counter: Expected `int`, got `str` - at `$.n`"),
        ('{"n": -1}', "Error: Invalid arguments for counter: Expected `int` >= 0 - at `$.n`"),
        ("{}", "Error: Invalid arguments for counter: Object missing required field `n`"),
        ('{"n": 1, "m": 2}', "Error: Invalid arguments for counter: Object contains unknown field `m`"),
        ('{"n": 1', "Error: Invalid tool arguments JSON for counter: Input data was truncated"),
        ("not json", "Error: Invalid tool arguments JSON for counter: JSON is malformed: invalid character"),
    ],
)
async def test_invalid_arguments_become_error_results(arguments: str, text: str) -> None:
    result = await call(count, arguments)
    assert result.is_error
    assert result.text.startswith(text)


async def test_nested_validation_error_keeps_the_path() -> None:
    args = {"shape": {"name": "t", "corners": [{"x": 1}, {"x": "2"}]}, "color": "red"}
    result = await call(draw, args)
    assert result.is_error
    assert result.text == (
        "Error: Invalid arguments for draw: Expected `int`, got `str` - at `$.shape.corners[1].x`"
    )


async def test_blank_arguments_mean_empty_object() -> None:
    @tool
    def noop() -> None:
        return None

    assert await call(noop, "") == ToolResult(content=[TextPart("")])


# --- results -------------------------------------------------------------------------------


PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 8


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hi", ToolResult(content=[TextPart("hi")])),
        (None, ToolResult(content=[TextPart("")])),
        ({"a": [1, 2]}, ToolResult(content=[TextPart('{"a":[1,2]}')])),
        (Point(1, 2), ToolResult(content=[TextPart('{"x":1,"y":2}')])),
        (PNG, ToolResult(content=[ImagePart(PNG, "image/png")])),
        (Image(b"\xff\xd8\xff..", "image/jpeg"), ToolResult(content=[ImagePart(b"\xff\xd8\xff..", "image/jpeg")])),
        ([TextPart("a"), Image(PNG)], ToolResult(content=[TextPart("a"), ImagePart(PNG)])),
        (["a", "b"], ToolResult(content=[TextPart('["a","b"]')])),
        (ToolResult(content=[TextPart("x")], details={"k": 1}), ToolResult(content=[TextPart("x")], details={"k": 1})),
        (Done("all good"), ToolResult(content=[TextPart("Task complete")], done=True, done_message="all good")),
        (object, ToolResult(content=[TextPart("<class 'object'>")])),
    ],
)
async def test_return_values_map_to_results(value: Any, expected: ToolResult) -> None:
    @tool
    def give() -> Any:
        return value

    @tool
    async def give_async() -> Any:
        return value

    assert await call(give) == expected
    assert await call(give_async) == expected


async def test_task_complete_and_exceptions() -> None:
    @tool
    def finish(message: str | None = None) -> None:
        raise TaskComplete(message)

    @tool
    async def boom() -> None:
        raise ValueError("bad things")

    @tool
    def silent() -> None:
        raise KeyError

    assert await call(finish, {"message": "the answer"}) == ToolResult(
        content=[TextPart("Task complete")], done=True, done_message="the answer"
    )
    assert (await call(finish)).done_message is None
    assert await call(boom) == ToolResult(content=[TextPart("Error: bad things")], is_error=True)
    assert (await call(silent)).text == "Error: KeyError"


# --- context, timeout, progress, cancellation ----------------------------------------------


async def test_context_carries_request_and_settings(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    @tool
    def inspect_ctx(ctx: ToolContext) -> str:
        seen.update({name: getattr(ctx, name) for name in (
            "call_id", "agent", "run_id", "experiment", "tool_name", "workspace", "allow_shell")})
        return "ok"

    req = ToolCallRequest(call_id="c9", name="inspect_ctx", agent="ann", run_id="r1", experiment="e")
    result = await run_tool(inspect_ctx, req, workspace=tmp_path, allow_shell=True)
    assert result.text == "ok"
    assert (seen["call_id"], seen["agent"], seen["run_id"], seen["experiment"]) == ("c9", "ann", "r1", "e")
    assert (seen["tool_name"], seen["workspace"], seen["allow_shell"]) == ("inspect_ctx", tmp_path.resolve(), True)


async def test_context_carries_the_calls_trace_context() -> None:
    """`ctx.traceparent` names the call's `execute_tool` span as `busctl otel` derives it, in the
    trace of the request's root run; an older requester (no `trace`) gets the run's own trace;
    a call outside any run gets none (no span is exported for it)."""
    seen: list[tuple[str, dict[str, str]]] = []

    @tool
    def traced(ctx: ToolContext) -> str:
        seen.append((ctx.traceparent, ctx.trace_carrier))
        return "ok"

    for request in (ToolCallRequest(call_id="c1", name="traced", run_id="sub",
                                    trace=ToolTrace(root_run_id="top")),
                    ToolCallRequest(call_id="c1", name="traced", run_id="sub"),
                    ToolCallRequest(call_id="c1", name="traced")):
        # the body an older worker or requester sends or reads: the field is optional
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=ToolCallRequest)
        assert (await run_tool(traced, decoded)).text == "ok"
    span = f"{span_id('sub', 'tool', 'c1'):016x}"
    assert seen[0] == (f"00-{trace_id('top'):032x}-{span}-01",
                       {"traceparent": f"00-{trace_id('top'):032x}-{span}-01"})
    assert seen[1][0] == f"00-{trace_id('sub'):032x}-{span}-01"
    assert seen[2] == ("", {})


async def test_timeout_message_is_exact() -> None:
    @tool(timeout=0.2)
    async def slow_async() -> str:
        await anyio.sleep_forever()
        return "never"

    @tool(timeout=0.2)
    def slow_sync(ctx: ToolContext) -> str:
        ctx.wait_cancelled_blocking(30)
        return "stopped"

    assert await call(slow_async) == ToolResult(
        content=[TextPart("Tool 'slow_async' timed out after 0.2s")], is_error=True
    )
    with anyio.fail_after(5):
        result = await call(slow_sync)
    assert result.text == "Tool 'slow_sync' timed out after 0.2s" and result.is_error


async def test_progress_from_async_and_sync_tools() -> None:
    updates: list[ToolResult] = []

    async def on_progress(partial: ToolResult) -> None:
        updates.append(partial)

    @tool
    async def steps_async(ctx: ToolContext) -> str:
        await ctx.progress("one")
        await ctx.progress({"pct": 50})
        return "done"

    @tool
    def steps_sync(ctx: ToolContext) -> str:
        ctx.progress("two")
        assert threading.current_thread() is not threading.main_thread()
        return "done"

    assert (await call(steps_async, on_progress=on_progress)).text == "done"
    assert (await call(steps_sync, on_progress=updates.append)).text == "done"
    assert [u.text for u in updates] == ["one", '{"pct":50}', "two"]


async def test_progress_without_listener_is_a_noop() -> None:
    @tool
    async def chatty(ctx: ToolContext) -> str:
        await ctx.progress("ignored")
        return "ok"

    assert (await call(chatty)).text == "ok"


async def test_cancelling_the_caller_sets_ctx_cancelled_and_reraises() -> None:
    started = threading.Event()
    stopped = threading.Event()

    @tool
    def patient(ctx: ToolContext) -> str:
        started.set()
        ctx.wait_cancelled_blocking(30)
        if ctx.cancelled:
            stopped.set()
        return "late"

    outcome: list[Any] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def runner() -> None:
                outcome.append(await call(patient))  # must not complete

            tg.start_soon(runner)
            await anyio.to_thread.run_sync(started.wait)
            tg.cancel_scope.cancel()
    assert outcome == []
    assert stopped.is_set()


async def test_sync_tool_runs_in_a_thread_with_the_callers_context_variables() -> None:
    seen: list[Any] = []

    @tool
    def where() -> str:
        seen.extend([threading.get_ident(), _tag.get(), sniffio_library()])
        return "ok"

    _tag.set("from the caller")
    assert (await call(where)).text == "ok"
    assert seen[0] != threading.get_ident()
    assert seen[1:] == ["from the caller", None]  # and sniffio names no async library there


async def test_sync_tool_cancelled_before_it_starts_never_runs() -> None:
    ran = threading.Event()

    @tool
    def never() -> str:
        ran.set()
        return "ran"

    with anyio.CancelScope() as scope:
        scope.cancel()
        await call(never)
    assert scope.cancelled_caught and not ran.is_set()


async def test_calls_after_an_abandoned_sync_tool_get_other_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tools._runner.CANCEL_GRACE", 0.05)
    release = threading.Event()
    threads: list[int] = []

    @tool(timeout=0.1)
    def stuck() -> str:
        threads.append(threading.get_ident())
        release.wait(10)
        return "late"

    @tool
    def quick() -> str:
        threads.append(threading.get_ident())
        return "ok"

    try:
        with anyio.fail_after(5):
            assert (await call(stuck)).is_error
            assert [(await call(quick)).text for _ in range(3)] == ["ok"] * 3
    finally:
        release.set()
    assert threads[0] not in threads[1:]


async def test_async_tool_sees_cancellation_while_blocked_on_its_own_thread() -> None:
    started = threading.Event()
    seen: list[bool] = []

    def blocking(ctx: ToolContext) -> None:
        started.set()
        seen.append(ctx.wait_cancelled_blocking(30))

    @tool
    async def delegating(ctx: ToolContext) -> str:
        await anyio.to_thread.run_sync(blocking, ctx)  # not abandoned on cancel: waits for it
        return "late"

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, delegating)
            await anyio.to_thread.run_sync(started.wait)
            tg.cancel_scope.cancel()
    assert seen == [True]


async def test_async_tool_can_await_cancellation_and_finishes_normally_unflagged() -> None:
    flags: list[bool] = []

    @tool
    async def quick(ctx: ToolContext) -> str:
        with anyio.move_on_after(0.01):
            await ctx.wait_cancelled()  # not cancelled: the local deadline ends the wait
        flags.append(ctx.cancelled)
        return "ok"

    assert (await call(quick)).text == "ok"
    assert flags == [False]


# --- loading -------------------------------------------------------------------------------


def test_load_tools_from_file_and_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = textwrap.dedent(
        '''
        from agent_bus.tools import tool

        @tool
        def alpha(x: int) -> int:
            """Alpha."""
            return x

        @tool(name="beta")
        async def b(y: str = "") -> str:
            return y

        helper = 3
        '''
    )
    (tmp_path / "mytools_abc.py").write_text(source)
    by_path = load_tools(str(tmp_path / "mytools_abc.py"))
    assert [t.name for t in by_path] == ["alpha", "beta"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    by_name = load_tools("mytools_abc")
    assert [t.name for t in by_name] == ["alpha", "beta"]


def test_load_tools_errors(tmp_path: Path) -> None:
    with pytest.raises(ToolLoadError, match="Cannot import tool module `no_such_mod_xyz`: ModuleNotFoundError"):
        load_tools("no_such_mod_xyz")
    broken = tmp_path / "broken.py"
    broken.write_text("import definitely_missing_dep\n")
    with pytest.raises(ToolLoadError, match="`.*broken.py`: ModuleNotFoundError: No module named 'definitely_missing_dep'"):
        load_tools(str(broken))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ToolLoadError, match="defines no @tool functions"):
        load_tools(str(empty))
    bad_tool = tmp_path / "bad_tool.py"
    bad_tool.write_text("from agent_bus.tools import tool\n@tool\ndef f(x): pass\n")
    with pytest.raises(ToolLoadError, match="ToolDefinitionError: parameter `x`"):
        load_tools(str(bad_tool))


def test_load_builtin_tools() -> None:
    from agent_bus.tools.builtin import BUILTIN_TOOLS

    loaded = load_tools("agent_bus.tools.builtin")
    assert {t.name for t in loaded} == {t.name for t in BUILTIN_TOOLS} == {
        "read_file", "write_file", "list_dir", "search_files", "fetch_url", "run_shell"
    }


def test_public_api_is_sorted_and_importable() -> None:
    assert tools.__all__ == sorted(tools.__all__)
    for name in tools.__all__:
        assert hasattr(tools, name), name


async def test_sync_tool_ignoring_cancellation_is_abandoned_after_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tools._runner.CANCEL_GRACE", 0.05)
    release, finished = threading.Event(), threading.Event()
    late_progress: list[ToolResult] = []

    @tool(timeout=0.1)
    def stubborn(ctx: ToolContext) -> str:
        release.wait(10)
        ctx.progress("after the call ended")  # dropped: the call is over
        finished.set()
        return "ignored"

    with anyio.fail_after(5):
        result = await call(stubborn, on_progress=late_progress.append)
    assert result.text == "Tool 'stubborn' timed out after 0.1s"
    release.set()
    with anyio.fail_after(5):
        await anyio.to_thread.run_sync(finished.wait)
    assert late_progress == []


async def test_failing_progress_callback_does_not_fail_the_tool(caplog: pytest.LogCaptureFixture) -> None:
    def on_progress(partial: ToolResult) -> None:
        raise RuntimeError("publisher down")

    @tool
    async def reporter(ctx: ToolContext) -> str:
        await ctx.progress("x")
        return "fine"

    assert (await call(reporter, on_progress=on_progress)).text == "fine"
    assert "progress callback failed for tool call c1" in caplog.text


def test_load_tools_refuses_duplicate_names(tmp_path: Path) -> None:
    dup = tmp_path / "dup.py"
    dup.write_text(
        "from agent_bus.tools import tool\n"
        "@tool(name='same')\ndef a() -> None: ...\n"
        "@tool(name='same')\ndef b() -> None: ...\n"
    )
    with pytest.raises(ToolLoadError, match="defines two tools named `same`"):
        load_tools(str(dup))


async def test_mutable_defaults_are_copied_per_call_and_dict_values_inlined() -> None:
    @tool
    def collect(
        origin: Point = Point(0, 0), seen: list[int] = [1], by_name: dict[str, Point] = {}
    ) -> dict[str, Any]:
        seen.append(2)
        return {"origin": origin, "seen": seen, "n": len(by_name)}

    assert collect.parameters["properties"]["by_name"]["additionalProperties"]["additionalProperties"] is False
    assert check_provider_schema(collect.parameters) == []
    first = await call(collect)
    second = await call(collect, {"by_name": {"a": {"x": 1}}})
    assert first.text == '{"origin":{"x":0,"y":0},"seen":[1,2],"n":0}'
    assert second.text == '{"origin":{"x":0,"y":0},"seen":[1,2],"n":1}'
