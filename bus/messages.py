"""Provider-neutral conversation messages: the vocabulary the gateway, the loop and events share.

Every type is a `msgspec.Struct` tagged on `role` (messages) or `type` (content parts), so a
`list[Message]` decodes without guessing. Fields added later must have defaults (see
docs/protocol.md, "Schema evolution").
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal, Union

import msgspec

StopReason = Literal["stop", "tool_use", "length", "error", "aborted"]


def now() -> float:
    return time.time()


# --- content parts -------------------------------------------------------------------------


class TextPart(msgspec.Struct, tag_field="type", tag="text", omit_defaults=True):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image", omit_defaults=True):
    data: bytes
    mime_type: str = "image/png"


class ThinkingPart(msgspec.Struct, tag_field="type", tag="thinking", omit_defaults=True):
    thinking: str
    signature: str = ""


class ToolCall(msgspec.Struct, tag_field="type", tag="tool_call", omit_defaults=True):
    """A call the model asked for. `arguments` is the raw JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str = "{}"


UserContent = Union[TextPart, ImagePart]
AssistantContent = Union[TextPart, ThinkingPart, ToolCall]


class Usage(msgspec.Struct, omit_defaults=True):
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    total: int = 0
    cost: float = 0.0
    #: Some of it is an estimate (4 characters a token of the request and of the streamed
    #: reply): the server sent no usage for a reply it did bill (an aborted or broken stream).
    estimated: bool = False

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input=self.input + other.input,
            output=self.output + other.output,
            cache_read=self.cache_read + other.cache_read,
            cache_write=self.cache_write + other.cache_write,
            total=self.total + other.total,
            cost=self.cost + other.cost,
            estimated=self.estimated or other.estimated,
        )


# --- messages ------------------------------------------------------------------------------


class UserMessage(msgspec.Struct, tag_field="role", tag="user", omit_defaults=True):
    content: list[UserContent]
    timestamp: float = msgspec.field(default_factory=now)
    hidden: bool = False


class AssistantMessage(msgspec.Struct, tag_field="role", tag="assistant", omit_defaults=True):
    content: list[AssistantContent] = msgspec.field(default_factory=list)
    stop_reason: StopReason = "stop"
    usage: Usage = msgspec.field(default_factory=Usage)
    model: str = ""
    provider: str = ""
    error: str | None = None
    timestamp: float = msgspec.field(default_factory=now)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p for p in self.content if isinstance(p, ToolCall)]


class ToolResultMessage(msgspec.Struct, tag_field="role", tag="tool_result", omit_defaults=True):
    tool_call_id: str
    tool_name: str
    content: list[UserContent]
    is_error: bool = False
    details: Any = None
    timestamp: float = msgspec.field(default_factory=now)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class CompactionSummaryMessage(
    msgspec.Struct, tag_field="role", tag="compaction_summary", omit_defaults=True
):
    summary: str
    tokens_before: int = 0
    #: The conversation's first user prompt, verbatim (its head when long): usually the task, and
    #: what a small model's summary drops first (Qwen2.5-0.5B summarised eight notes as
    #: "Summary of conversation:...", the first note's code word gone). Each compaction carries it on.
    first_prompt: str = ""
    timestamp: float = msgspec.field(default_factory=now)


class BranchSummaryMessage(msgspec.Struct, tag_field="role", tag="branch_summary", omit_defaults=True):
    summary: str
    from_id: str = ""
    timestamp: float = msgspec.field(default_factory=now)


class CustomMessage(msgspec.Struct, tag_field="role", tag="custom", omit_defaults=True):
    custom_type: str
    content: str
    display: bool = True
    timestamp: float = msgspec.field(default_factory=now)


LlmMessage = Union[UserMessage, AssistantMessage, ToolResultMessage]
Message = Union[
    UserMessage,
    AssistantMessage,
    ToolResultMessage,
    CompactionSummaryMessage,
    BranchSummaryMessage,
    CustomMessage,
]


def user_text(text: str, *, hidden: bool = False) -> UserMessage:
    return UserMessage(content=[TextPart(text)], hidden=hidden)


def tool_result_text(
    call: ToolCall, text: str, *, is_error: bool = False, details: Any = None
) -> ToolResultMessage:
    return ToolResultMessage(
        tool_call_id=call.id,
        tool_name=call.name,
        content=[TextPart(text)],
        is_error=is_error,
        details=details,
    )


# --- the `llm` service: request and streamed deltas ----------------------------------------


class ToolSpec(msgspec.Struct, omit_defaults=True):
    """A tool as offered to a model: `parameters` is a flattened JSON Schema (root type object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}, "additionalProperties": False}
    )


class RetryPolicy(msgspec.Struct, omit_defaults=True):
    max_attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 60.0
    retry_statuses: list[int] = msgspec.field(default_factory=lambda: [429, 500, 502, 503, 504])


ToolChoice = Union[Literal["auto", "none", "required"], str]


class LlmTrace(msgspec.Struct, omit_defaults=True):
    """Where a model call sits in its run tree's trace (the ids `busctl otel` exports, derived by
    bus/tracecontext.py): the gateway's W3C `traceparent` to the provider names the call's `chat`
    span in the trace of the tree's top-level run."""

    #: The call's index among its run's model calls (assistant `message_start`s), from 0: its
    #: `chat` span. None: a call without one (a compaction or max-turns summary): the run's span.
    call: Annotated[int, msgspec.Meta(ge=0)] | None = None
    root_run_id: str = ""  # the tree's top-level run ("": this request's run is the top)


class LlmRequest(msgspec.Struct, omit_defaults=True):
    """Body of a request to service `llm`. `model` names a configured alias (or "" for the default)."""

    messages: list[LlmMessage]
    model: str = ""
    system_prompt: str = ""
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    reasoning: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    retry: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    agent: str = ""
    run_id: str = ""
    experiment: str = ""
    # More sampling (None/[]: the model's `[models.x]`/environment default, else the server's own).
    top_p: float | None = None
    seed: int | None = None  # sent where the provider takes one (OpenAI-compatible servers)
    stop: list[str] = msgspec.field(default_factory=list)
    #: The trace context (None, as older peers send: the gateway's `traceparent` names the run's
    #: `invoke_agent` span in the run's own trace).
    trace: LlmTrace | None = None
    #: "compaction": a summary call of the loop's compaction, whose deltas the gateway does not
    #: publish as the run's `message_update`s (its usage is in `compaction_complete`).
    purpose: Literal["", "compaction"] = ""


DeltaKind = Literal["text", "thinking", "tool_call"]


class AssistantDelta(msgspec.Struct, omit_defaults=True):
    """One streamed piece of an assistant message (published as `message_update`)."""

    kind: DeltaKind
    delta: str
    index: int = 0
    tool_call_id: str = ""
    tool_name: str = ""


# --- tool services (`tool.<name>`): request, result and catalog entries ---------------------


class ToolInfo(msgspec.Struct, omit_defaults=True):
    """A live tool as the hub's registry knows it (service `tool.<name>` metadata)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    sequential: bool = False
    idempotent: bool = False
    timeout: float | None = None

    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)


class ToolTrace(msgspec.Struct, omit_defaults=True):
    """Where a tool call sits in its run tree's trace: the worker gives the tool a W3C
    `traceparent` naming the call's `execute_tool` span (bus/tracecontext.py, the ids `busctl
    otel` exports), in the trace of the tree's top-level run."""

    root_run_id: str = ""  # the tree's top-level run ("": this request's run is the top)


#: A run workspace's files, names and contents together, at most (they ride on the prompt and
#: on every tool call of the run: keep them small).
MAX_WORKSPACE_BYTES = 1024 * 1024
MAX_WORKSPACE_FILES = 1000
#: One segment of a workspace id or file name: no `.`/`..`, no leading dot, no separator.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+,@-]{0,127}")


class RunWorkspace(msgspec.Struct, omit_defaults=True):
    """A folder of its own for one run and the runs it asks (`busctl experiment`: one sample).

    Sent in the prompt (`agent.<name>` `prompt` command); the coordinator attaches it to every
    tool call of the run and of the runs it prompts through `ask_<agent>`. A worker runs such a
    call in `<its workspace>/.runs/<id>/`, made with `files` written into it the first time any
    call names `id` there (later calls reuse it as it is): `id` is 1 to 4 segments joined by
    `/`, `files` maps relative paths (segments joined by `/`) to their bytes."""

    id: str
    files: dict[str, bytes] = msgspec.field(default_factory=dict)


def workspace_problem(workspace: RunWorkspace) -> str:
    """Why `workspace` is not acceptable ("" when it is): every peer checks (untrusted input)."""
    if not 1 <= len(workspace.id.split("/")) <= 4 or not _segments_ok(workspace.id):
        return (f"workspace id {workspace.id[:200]!r}: 1 to 4 segments joined by `/`, each "
                f"letters, digits and _ . = + , @ - (not starting with a dot), at most 128 "
                f"characters")
    if len(workspace.files) > MAX_WORKSPACE_FILES:
        return f"workspace `{workspace.id}`: {len(workspace.files)} files (at most " \
               f"{MAX_WORKSPACE_FILES})"
    size = sum(len(name) + len(data) for name, data in workspace.files.items())
    if size > MAX_WORKSPACE_BYTES:
        return (f"workspace `{workspace.id}`: its files are {size} bytes (names included; at "
                f"most {MAX_WORKSPACE_BYTES}: they go with every tool call of the run)")
    for name in workspace.files:
        if not _segments_ok(name):
            return (f"workspace `{workspace.id}`: file name {name[:200]!r}: a relative path, "
                    f"segments joined by `/` (letters, digits and _ . = + , @ -, not starting "
                    f"with a dot)")
    return ""


def _segments_ok(path: str) -> bool:
    return all(_SEGMENT.fullmatch(part) for part in path.split("/"))


class ToolCallRequest(msgspec.Struct, omit_defaults=True):
    """Body of a request to service `tool.<name>`; `arguments` is the model's raw JSON text."""

    call_id: str
    name: str
    arguments: str = "{}"
    agent: str = ""
    run_id: str = ""
    experiment: str = ""
    #: The trace context (None, as older peers send: the run is taken as its tree's top, which
    #: is right for every run but a sub-agent's).
    trace: ToolTrace | None = None
    #: The run's own workspace (None: the worker's). A worker that serves tool calls must
    #: honour it (docs/protocol.md); one that predates it ignores it, and says so by the
    #: missing `workspaces` key in its services' registration meta.
    workspace: RunWorkspace | None = None


class ToolResult(msgspec.Struct, omit_defaults=True):
    """Final reply of a tool call. `done` ends the agent's run (TaskComplete / Done)."""

    content: list[UserContent] = msgspec.field(default_factory=list)
    is_error: bool = False
    details: Any = None
    done: bool = False
    done_message: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


def error_result(text: str) -> ToolResult:
    return ToolResult(content=[TextPart(text)], is_error=True)
