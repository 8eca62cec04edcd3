"""The `@tool` decorator and the `Tool` it produces."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, overload

import msgspec

from agent_bus.bus.messages import ToolInfo
from agent_bus.bus.toolnames import NAME_RULE, NAME_WORDS
from agent_bus.tools._context import ToolContext
from agent_bus.tools._exceptions import ArgumentsError, ToolDefinitionError
from agent_bus.tools._schema import build_args_struct, parse_docstring, provider_schema

# The name is also the service `tool.<name>`: the hub's rule, one for both (bus/toolnames.py).
_NAME_RE = re.compile(NAME_RULE)


class Tool:
    """A function made callable by models: its schema, metadata and argument validation.

    Calling the Tool calls the function unchanged; `run_tool` is how the worker runs it.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        sequential: bool = False,
        idempotent: bool = False,
        timeout: float | None = None,
    ) -> None:
        if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
            raise ToolDefinitionError(f"`{fn.__name__}`: generator functions cannot be tools")
        self.fn = fn
        self.name = name or fn.__name__
        if not _NAME_RE.match(self.name):
            raise ToolDefinitionError(
                f"Tool name `{self.name}` is invalid: use {NAME_WORDS} (`name=` of @tool)"
            )
        if timeout is not None and timeout <= 0:
            raise ToolDefinitionError(f"Tool `{self.name}`: timeout must be > 0, got {timeout!r}")
        summary, param_docs = parse_docstring(fn.__doc__)
        self.description = summary if description is None else description
        self.sequential = sequential
        self.idempotent = idempotent
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn)
        self.args_type, self.context_param = build_args_struct(fn, self.name, param_docs, ToolContext)
        self.parameters = provider_schema(self.args_type, self.name)
        self._decoder = msgspec.json.Decoder(self.args_type)
        # A sync tool's last run was quick: the runner waits for the next one on the event
        # loop's thread, briefly, instead of being woken for it (tools/_threads.py `settle`).
        self.quick_in_thread = True
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Tool {self.name!r} ({'async' if self.is_async else 'sync'})>"

    @property
    def info(self) -> ToolInfo:
        """The catalog entry the worker registers as service `tool.<name>`."""
        return ToolInfo(
            name=self.name,
            description=self.description,
            parameters=msgspec.json.decode(msgspec.json.encode(self.parameters)),  # a fresh copy
            sequential=self.sequential,
            idempotent=self.idempotent,
            timeout=self.timeout,
        )

    def parse_arguments(self, arguments: str | bytes) -> dict[str, Any]:
        """Validate raw JSON arguments; return keyword arguments (without the context).

        Raises ArgumentsError whose message is the model-facing error text. Blank text means `{}`.
        """
        raw = arguments if isinstance(arguments, bytes) else arguments.encode()
        try:
            parsed = self._decoder.decode(raw.strip() or b"{}")
        except msgspec.ValidationError as exc:
            raise ArgumentsError(f"Invalid arguments for {self.name}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ArgumentsError(f"Invalid tool arguments JSON for {self.name}: {exc}") from exc
        return {field: getattr(parsed, field) for field in self.args_type.__struct_fields__}


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    sequential: bool = False,
    idempotent: bool = False,
    timeout: float | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    sequential: bool = False,
    idempotent: bool = False,
    timeout: float | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a plain or async function into a `Tool`; use as `@tool` or `@tool(...)`.

    The parameters' type hints are the argument schema; a parameter annotated `ToolContext` gets the
    call's context and is not part of the schema. The docstring's first paragraph is the
    description (unless `description=` is given) and a Google-style `Args:` section describes the
    parameters. `sequential`: the agent loop must not run this tool in parallel with others.
    `idempotent`: safe to retry. `timeout`: seconds before the call fails with a timeout error.
    Raises ToolDefinitionError when the signature cannot become a schema.
    """
    options: dict[str, Any] = dict(
        name=name,
        description=description,
        sequential=sequential,
        idempotent=idempotent,
        timeout=timeout,
    )
    if fn is not None:
        return Tool(fn, **options)
    return lambda f: Tool(f, **options)
