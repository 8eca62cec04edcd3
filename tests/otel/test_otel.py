"""`busctl otel` against a real OTLP/HTTP receiver (issue 19, acceptance 3 and 4).

Real processes: hub, gateway (against the in-test fake model), a tool worker, one coordinator
hosting `boss` (who fans out two parallel `echo` calls and asks `helper`) and `helper`; `busctl
otel` as a child process exporting to `Receiver`, which decodes with opentelemetry-proto.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_bus.agents.client.remote import connect
from agent_bus.agents.gateway.fakellm import RecordedRequest
from agent_bus.bus.tracecontext import parse_traceparent, trace_id
from tests.coordinator.conftest import Stack, calls, start_stack, text
from tests.otel.receiver import Receiver, Span
from tests.support import Proc, busctl, until

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "boss"
model = "x"
tools = ["echo"]
agents = ["helper"]

[[agents]]
name = "helper"
model = "x"
tools = []

[[agents]]
name = "lead"
model = "x"
tools = ["traced"]
agents = ["aide"]

[[agents]]
name = "aide"
model = "x"
tools = ["traced"]
"""

SCRIPT = [
    calls(("echo", {"text": "a"}), ("echo", {"text": "b"}),
          ("ask_helper", {"prompt": "What colour is a banana?"})),    # boss: three calls at once
    text("Bananas are yellow."),                                      # helper
    text("Done: a, b, yellow."),                                      # boss
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("otel"), coordinator=("boss", "helper", "lead", "aide"),
                    agents=AGENTS)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    try:
        yield r
    finally:
        r.stop()


def start_otel(stack: Stack, receiver: Receiver, state: Path, *extra: str) -> Proc:
    proc = Proc(busctl("otel", "--hub", stack.endpoint, "--endpoint", receiver.url,
                       "--state-file", str(state), "--header", "x-team=bus", *extra))
    stack.procs[f"otel-{len(stack.procs)}"] = proc  # stopped with the stack if a test fails
    proc.wait_ready()
    return proc


async def scripted_run(stack: Stack, experiment: str) -> tuple[str, str, float]:
    stack.script(SCRIPT)
    t0 = time.monotonic()
    async with connect(stack.endpoint, name="test-otel") as bus:
        run = await bus.prompt("boss", "use your tools and ask the helper", experiment=experiment)
        result = await run.result()
    assert result.final_text == "Done: a, b, yellow."
    return run.run_id, run.session, time.monotonic() - t0


def of_run(spans: list[Span], run_id: str) -> list[Span]:
    """The trace whose root is `run_id`'s invoke_agent span."""
    roots = [s for s in spans if s.attrs.get("agent_bus.run.id") == run_id]
    return [s for s in spans if roots and s.trace_id == roots[0].trace_id]


def one(spans: list[Span], name: str, **attrs: object) -> Span:
    found = [s for s in spans if s.name == name
             and all(s.attrs.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s.name, s.attrs) for s in spans])
    return found[0]


async def test_a_run_with_a_sub_agent_is_one_trace(stack: Stack, receiver: Receiver,
                                                   tmp_path: Path) -> None:
    otel = start_otel(stack, receiver, tmp_path / "otel.json")
    run_id, session, _ = await scripted_run(stack, "exp-otel")
    spans = await until(lambda: len(of_run(receiver.snapshot(), run_id)) >= 8, 15, "the trace")
    otel.stop()
    spans = of_run(receiver.snapshot(), run_id)

    assert len({s.trace_id for s in spans}) == 1 and len(spans) == 8, [s.name for s in spans]
    boss = one(spans, "invoke_agent boss")
    assert boss.parent_id == ""  # the root of the trace
    assert boss.attrs["gen_ai.operation.name"] == "invoke_agent"
    assert boss.attrs["gen_ai.agent.name"] == "boss"
    assert boss.attrs["gen_ai.conversation.id"] == session
    assert boss.attrs["agent_bus.stop_reason"] == "stop"
    chats = [s for s in spans if s.name == "chat m" and s.parent_id == boss.span_id]
    assert len(chats) == 2
    for chat in chats:
        assert chat.attrs["gen_ai.operation.name"] == "chat"
        assert chat.attrs["gen_ai.request.model"] == "m"  # the provider's id of model "x"
        assert chat.attrs["agent_bus.model.alias"] == "x"
        assert chat.attrs["gen_ai.response.finish_reasons"] in (["stop"], ["tool_use"])
        assert chat.attrs["gen_ai.usage.input_tokens"] > 0
        assert chat.attrs["gen_ai.usage.output_tokens"] > 0
        assert boss.start <= chat.start <= chat.end <= boss.end
    echoes = [s for s in spans if s.name == "execute_tool echo"]
    assert len(echoes) == 2 and {s.parent_id for s in echoes} == {boss.span_id}
    assert {s.attrs["gen_ai.tool.call.id"] for s in echoes} == {"call_0_echo", "call_1_echo"}
    ask = one(spans, "execute_tool ask_helper", **{"gen_ai.tool.name": "ask_helper"})
    assert ask.parent_id == boss.span_id and ask.attrs["gen_ai.tool.call.id"] == "call_2_ask_helper"
    # the sub-agent's run is a child of the tool call that asked it, inside its time
    helper = one(spans, "invoke_agent helper")
    assert helper.parent_id == ask.span_id
    assert ask.start <= helper.start <= helper.end <= ask.end
    helper_chat = one(spans, "chat m", **{"gen_ai.response.finish_reasons": ["stop"],
                                          "gen_ai.conversation.id": helper.attrs[
                                              "gen_ai.conversation.id"]})
    assert helper_chat.parent_id == helper.span_id
    assert all(s.attrs["agent_bus.experiment.id"] == "exp-otel" for s in spans)
    # no content unless --capture-content; the --header reached the collector
    assert not any(k.startswith(CONTENT) for s in spans for k in s.attrs)
    assert receiver.last_headers.get("x-team") == "bus"


# the attributes that carry what was said: only with --capture-content
CONTENT = ("gen_ai.input", "gen_ai.output", "gen_ai.tool.call.arg", "gen_ai.tool.call.result",
           "input.", "output.")


async def test_capture_content(stack: Stack, receiver: Receiver, tmp_path: Path) -> None:
    otel = start_otel(stack, receiver, tmp_path / "otel.json", "--capture-content")
    run_id, _, _ = await scripted_run(stack, "exp-content")
    await until(lambda: len(of_run(receiver.snapshot(), run_id)) >= 8, 15, "the trace")
    otel.stop()
    spans = of_run(receiver.snapshot(), run_id)
    boss = one(spans, "invoke_agent boss")
    assert json.loads(boss.attrs["gen_ai.input.messages"])[0]["parts"][0]["content"] == \
        "use your tools and ask the helper"
    assert "Done: a, b, yellow." in boss.attrs["gen_ai.output.messages"]
    ask = one(spans, "execute_tool ask_helper")
    assert json.loads(ask.attrs["gen_ai.tool.call.arguments"]) == {
        "prompt": "What colour is a banana?"}
    assert ask.attrs["gen_ai.tool.call.result"] == "Bananas are yellow."
    # OpenInference's plain input/output on the agent span (Phoenix's agent rows)
    assert boss.attrs["input.value"] == "use your tools and ask the helper"
    assert boss.attrs["output.value"] == "Done: a, b, yellow."
    # each model call: what it was sent (GenAI input messages) and what it answered
    first, second = sorted((s for s in spans if s.name == "chat m"
                            and s.parent_id == boss.span_id), key=lambda s: s.start)
    prompt = {"role": "user", "parts": [{"type": "text",
                                         "content": "use your tools and ask the helper"}]}
    assert json.loads(first.attrs["gen_ai.input.messages"]) == [prompt]
    (asked,) = json.loads(first.attrs["gen_ai.output.messages"])
    assert asked["role"] == "assistant" and asked["finish_reason"] == "tool_use"
    assert [(p["type"], p["name"], p["arguments"]) for p in asked["parts"]] == [
        ("tool_call", "echo", {"text": "a"}), ("tool_call", "echo", {"text": "b"}),
        ("tool_call", "ask_helper", {"prompt": "What colour is a banana?"})]
    history = json.loads(second.attrs["gen_ai.input.messages"])
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[:2] == [prompt, asked]
    assert {(p["type"], p["id"], p["response"]) for p in history[2]["parts"]} == {
        ("tool_call_response", "call_0_echo", "a"), ("tool_call_response", "call_1_echo", "b"),
        ("tool_call_response", "call_2_ask_helper", "Bananas are yellow.")}
    assert second.attrs["input.value"] == second.attrs["gen_ai.input.messages"]  # for Phoenix
    assert second.attrs["output.value"] == "Done: a, b, yellow."
    # issue 49 item 14: a reply that only calls tools has those calls as its output (Phoenix
    # showed the span's `{"model": …}` when it had none), and a tool span its input and output
    assert first.attrs["output.mime_type"] == "application/json"
    assert json.loads(first.attrs["output.value"]) == {"tool_calls": [
        {"id": "call_0_echo", "name": "echo", "arguments": {"text": "a"}},
        {"id": "call_1_echo", "name": "echo", "arguments": {"text": "b"}},
        {"id": "call_2_ask_helper", "name": "ask_helper",
         "arguments": {"prompt": "What colour is a banana?"}}]}
    assert json.loads(ask.attrs["input.value"]) == {"prompt": "What colour is a banana?"}
    assert ask.attrs["input.mime_type"] == "application/json"
    assert ask.attrs["output.value"] == "Bananas are yellow."
    assert json.loads(second.attrs["gen_ai.output.messages"]) == [{
        "role": "assistant", "parts": [{"type": "text", "content": "Done: a, b, yellow."}],
        "finish_reason": "stop"}]
    helper = one(spans, "invoke_agent helper")
    (helper_chat,) = [s for s in spans if s.parent_id == helper.span_id]
    assert json.loads(helper_chat.attrs["gen_ai.input.messages"])[0]["parts"][0]["content"] == \
        "What colour is a banana?"


async def test_collector_down_then_back_and_resume_after_restart(
        stack: Stack, receiver: Receiver, tmp_path: Path) -> None:
    state = tmp_path / "otel.json"
    otel = start_otel(stack, receiver, state)
    _, _, baseline = await scripted_run(stack, "exp-down")  # collector up: the baseline
    receiver.stop()
    down_run, _, down_time = await scripted_run(stack, "exp-down")
    # the bus did not wait for the collector (the exporter retries in its own thread)
    assert down_time < baseline * 3 + 1.0, (down_time, baseline)
    assert not of_run(receiver.snapshot(), down_run)
    receiver.start()  # the same port: the collector is back
    await until(lambda: len(of_run(receiver.snapshot(), down_run)) == 8, 20,
                "the buffered trace after the collector came back")

    # a restart resumes after the last exported seq: nothing twice, nothing missed
    otel.stop()
    saved = json.loads(state.read_text())
    assert saved["seq"] > 0 and saved["dropped_spans"] == 0
    missed_run, _, _ = await scripted_run(stack, "exp-down")  # while the exporter is stopped
    before = len(receiver.snapshot())
    start_otel(stack, receiver, state)
    await until(lambda: len(of_run(receiver.snapshot(), missed_run)) == 8, 15,
                "the run that happened while the exporter was stopped")
    new = receiver.snapshot()[before:]
    resent = {s.attrs.get("agent_bus.run.id") for s in new if s.name == "invoke_agent boss"}
    assert resent == {missed_run}


def test_bad_header_is_named(stack: Stack, tmp_path: Path) -> None:
    proc = Proc(busctl("otel", "--hub", stack.endpoint, "--header", "no-equals-sign",
                       "--state-file", str(tmp_path / "s.json")))
    try:
        assert proc.popen.wait(15) == 2
        proc.wait_line(lambda line: "KEY=VALUE" in line)
        assert "--header" in proc.output()
    finally:
        proc.stop()


async def test_past_the_bound_the_oldest_trace_is_dropped_and_counted(
        stack: Stack, receiver: Receiver, tmp_path: Path) -> None:
    state = tmp_path / "otel.json"
    since = json.loads(busctl_status(stack))["seq"]
    otel = start_otel(stack, receiver, state, "--max-spans", "10", "--since", str(since))
    receiver.stop()
    # Room for one 8-span trace. The first may be in flight (the exporter retrying) when the
    # collector returns, so it may arrive; the second waits behind it and is dropped when the
    # third arrives; the third is delivered.
    runs = [(await scripted_run(stack, "exp-bound"))[0] for _ in range(3)]
    receiver.start()
    await until(lambda: len(of_run(receiver.snapshot(), runs[2])) == 8, 20, "the newest trace")
    otel.stop()
    assert not of_run(receiver.snapshot(), runs[1])
    saved = json.loads(state.read_text())
    assert saved["dropped_spans"] in (8, 16) and saved["dropped_spans"] + \
        saved["exported_spans"] == 24  # every span delivered or counted
    assert f"dropped {saved['dropped_spans']}" in otel.output()


def busctl_status(stack: Stack) -> str:
    return subprocess.run(busctl("status", "--hub", stack.endpoint, "--json"), capture_output=True,
                          text=True, timeout=20, check=True).stdout


def _traceparent(request: RecordedRequest) -> str:
    return {k.lower(): v for k, v in request.headers.items()}.get("traceparent", "")


def _asks(request: RecordedRequest, text: str) -> bool:
    return text in json.dumps(request.body)


async def test_model_requests_carry_a_traceparent_naming_their_chat_span(
        stack: Stack, receiver: Receiver, tmp_path: Path) -> None:
    """The gateway's HTTP requests to the model (the fake server, over real HTTP) carry a W3C
    `traceparent` whose parent is exactly the `chat` span `busctl otel` exported for that call,
    in the root run's trace: the helper's calls too (the loop and the coordinator send the trace
    context in `LlmRequest.trace`), so a provider that traces its side joins our trace."""
    otel = start_otel(stack, receiver, tmp_path / "otel.json")
    run_id, _, _ = await scripted_run(stack, "exp-traceparent")
    await until(lambda: len(of_run(receiver.snapshot(), run_id)) >= 8, 15, "the trace")
    otel.stop()
    spans = of_run(receiver.snapshot(), run_id)
    boss, helper = one(spans, "invoke_agent boss"), one(spans, "invoke_agent helper")
    chats = {s.span_id: s for s in spans if s.name.startswith("chat ")}
    assert len(chats) == 3
    requests = list(stack.srv.requests)  # this run's only: `script` cleared the log
    assert len(requests) == 3
    parents = []
    for request in requests:
        header = _traceparent(request)
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", header), header
        trace, parent = parse_traceparent(header) or ("", "")
        assert trace == boss.trace_id == f"{trace_id(run_id):032x}", header  # the root's trace
        assert parent in chats, (header, list(chats))
        parents.append(parent)
    assert len(set(parents)) == 3  # one chat span per call
    boss_calls = [r for r in requests if _asks(r, "use your tools and ask the helper")]
    assert len(boss_calls) == 2
    for request, parent in zip(requests, parents, strict=True):
        owner = boss if request in boss_calls else helper
        assert chats[parent].parent_id == owner.span_id, (chats[parent].name, owner.name)


# A user's tool module instrumented with OpenTelemetry: its own SDK, exporter and span, under the
# context the worker hands it (`ctx.trace_carrier`). The exporter's endpoint comes from the
# worker's environment (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), as a user would configure it.
USER_TOOL = """
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agent_bus.tools import ToolContext, tool

provider = TracerProvider(resource=Resource.create({"service.name": "user-tool"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(timeout=5)))
tracer = provider.get_tracer("user-tool")


@tool
def traced(text: str, ctx: ToolContext) -> str:
    \"\"\"Look something up, traced.\"\"\"
    parent = propagate.extract(ctx.trace_carrier)
    with tracer.start_as_current_span("user lookup", context=parent) as span:
        span.set_attribute("user.text", text)
    return f"looked up {text}"
"""

TRACED_SCRIPT = [
    calls(("traced", {"text": "lead"}), ("ask_aide", {"prompt": "Look it up too."})),  # lead
    calls(("traced", {"text": "aide"})),                                               # aide
    text("Found it."),                                                                 # aide
    text("Both found."),                                                               # lead
]


async def test_a_user_tool_spans_join_the_trace_under_its_execute_tool_span(
        stack: Stack, receiver: Receiver, tmp_path: Path) -> None:
    """Acceptance 3's last clause: a tool that starts its own span under the incoming
    `traceparent` (the worker's `ctx.trace_carrier`) appears in the run's trace, its parent the
    exact `execute_tool` span `busctl otel` exported for the call: the top-level run's call and
    the sub-agent's (whose trace is its tree's top-level run's, passed on in
    `ToolCallRequest.trace`)."""
    module = tmp_path / "user_tools.py"
    module.write_text(USER_TOOL)
    worker = Proc(busctl("worker", "--hub", stack.endpoint, "--tools", str(module), "--name",
                         "traced-worker"), env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url})
    stack.procs["traced-worker"] = worker  # stopped with the stack if this test fails
    worker.wait_ready()
    try:
        otel = start_otel(stack, receiver, tmp_path / "otel.json")
        stack.script(TRACED_SCRIPT)
        async with connect(stack.endpoint, name="test-otel") as bus:
            run = await bus.prompt("lead", "look it up and ask the aide", experiment="exp-user")
            assert (await run.result()).final_text == "Both found."
        # lead + 2 chats + 2 tools, aide + 2 chats + 1 tool, and the tool's own 2 spans
        await until(lambda: len(of_run(receiver.snapshot(), run.run_id)) >= 11, 15, "the trace")
        otel.stop()
    finally:
        stack.stop("traced-worker")
    spans = of_run(receiver.snapshot(), run.run_id)
    assert len(spans) == 11, [s.name for s in spans]
    assert {s.trace_id for s in spans} == {f"{trace_id(run.run_id):032x}"}
    lead, aide = one(spans, "invoke_agent lead"), one(spans, "invoke_agent aide")
    ask = one(spans, "execute_tool ask_aide")
    assert ask.parent_id == lead.span_id and aide.parent_id == ask.span_id
    for owner, label in ((lead, "lead"), (aide, "aide")):
        call = one(spans, "execute_tool traced", **{"gen_ai.conversation.id":
                                                    owner.attrs["gen_ai.conversation.id"]})
        assert call.parent_id == owner.span_id
        mine = one(spans, "user lookup", **{"user.text": label})
        assert mine.parent_id == call.span_id, (label, mine.parent_id, call.span_id)
        assert mine.start <= mine.end <= call.end  # the call ended after the tool's span
