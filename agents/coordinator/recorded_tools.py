"""A coordinator's side of a replay: the tool results `busctl replay` logged, served to the calls
of the experiment in replay (`replay@<coordinator>`, agents/replay_wire.py's `ToolBook`), in
order, instead of running the tools again."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from agent_bus.agents.loop.run import ToolExecutor, UpdateSink
from agent_bus.agents.replay_wire import ToolBook, ToolEntry, always_live, tool_key
from agent_bus.bus.messages import ToolCallRequest, ToolInfo, ToolResult, error_result

TOOL_BOOKS_KEPT = 16


class LoggedTools:
    """One experiment's logged tool results by call key, in order, and the tools' names (they
    are offered to the model even when no worker serves them any more)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.results: dict[str, deque[ToolEntry]] = {}
        self.names = list(names)


class RecordedTools:
    """A `ToolExecutor` that answers the calls of an experiment in replay with their logged
    results (`books`: experiment -> key -> results in order) and passes everything else on."""

    def __init__(self, inner: ToolExecutor, books: dict[str, LoggedTools], agent: str,
                 experiment: Callable[[], str],
                 on_abort: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.books = books
        self.agent = agent
        self.experiment = experiment
        #: called when a served result is one an abort gave (`ToolEntry.aborted`): the run was
        #: aborted while this call ran, and its replay must end the same way after the turn
        self.on_abort = on_abort

    async def catalog(self) -> list[ToolInfo]:
        tools = await self.inner.catalog()
        book = self.books.get(self.experiment())
        if book is None:
            return tools
        live = {t.name for t in tools}
        return tools + [ToolInfo(name=n, description="(results from the log)")
                        for n in book.names if n not in live]

    async def execute(self, request: ToolCallRequest,
                      on_update: UpdateSink | None = None) -> ToolResult:
        experiment = request.experiment or self.experiment()
        book = self.books.get(experiment)
        if book is None or always_live(request.name):
            return await self.inner.execute(request, on_update)
        results = book.results.get(tool_key(self.agent, request.name, request.arguments))
        if not results:
            return error_result(f"Error: replay of experiment `{experiment}`: no logged result "
                                f"left for this call of `{request.name}`; the run diverged "
                                f"from the log")
        entry = results.popleft()
        if entry.aborted and self.on_abort is not None:
            self.on_abort()
        logged_result = entry.result
        return ToolResult(content=list(logged_result.content), is_error=logged_result.is_error,
                          details=logged_result.details)


def load_tool_book(books: dict[str, LoggedTools], body: bytes) -> int:
    """Store a `ToolBook` request body in `books` (the oldest goes beyond TOOL_BOOKS_KEPT);
    returns the number of results. Raises msgspec errors for a malformed body."""
    book = msgspec.msgpack.decode(body, type=ToolBook)
    served = books[book.experiment] = LoggedTools(book.tools)
    for entry in book.entries:
        served.results.setdefault(entry.key, deque()).append(entry)
    while len(books) > TOOL_BOOKS_KEPT:
        del books[next(iter(books))]
    return len(book.entries)


__all__ = ["TOOL_BOOKS_KEPT", "LoggedTools", "RecordedTools", "load_tool_book"]
