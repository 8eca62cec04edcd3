"""Abort as anyio cancellation, in one place: the run's `AbortSignal` and the `Abort` a model call gets.

The loop runs each interruptible step under its run's `AbortSignal`: a tool batch or the hooks
between turns in `signal.scope()`, cancelled the moment the run is aborted; a model call in
`signal.graceful()`, which hands the model client an `Abort`. A client that runs its call under
`abort.cancels()` is stopped at once (its scope is cancelled) and returns what streamed so far as
the aborted message: it may know more than the text deltas the loop saw (thinking, tool calls,
the model in use). It has `ABORT_GRACE` seconds for that before the step is cancelled outright.
A client that never enters `abort.cancels()` has nothing to hand back and is cancelled at once.

Setting an `Abort` cancels the scopes entered with it itself, so no call pays for a watcher
task (~60 us of CPU per model call). The gateway engine and the coordinator's bus client take
the same `Abort`. Pure anyio: the loop imports no transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio

#: After an abort, how long a model client watching its `Abort` may take to return its partial
#: message before its call is cancelled outright.
ABORT_GRACE = 2.0


class Abort:
    """A request to stop one call, made by its caller: `set()` cancels every scope the callee
    entered with `cancels()`, and any it enters later at once. Setting it twice is harmless."""

    def __init__(self) -> None:
        self._set = False
        self._watched = False
        self._scopes: list[anyio.CancelScope] = []

    def is_set(self) -> bool:
        return self._set

    @property
    def watched(self) -> bool:
        """Whether the callee ever entered `cancels()`: it then returns what it has when set."""
        return self._watched

    def set(self) -> None:
        self._set = True
        for scope in self._scopes:
            scope.cancel()

    @contextmanager
    def cancels(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that `set()` cancels (already cancelled when the abort is set)."""
        scope = anyio.CancelScope()
        if self._set:
            scope.cancel()
        self._watched = True
        self._scopes.append(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.remove(scope)


class AbortSignal:
    """Abort request shared by a run and whoever may stop it (the Agent's abort(), another task).

    The loop wraps each interruptible step (model call, tool batch, hooks between turns) in
    `scope()` or `graceful()`; `abort()` cancels those scopes, so the loop itself survives to emit
    the closing events. Aborting twice is harmless.
    """

    def __init__(self) -> None:
        self.aborted = False
        self._scopes: set[anyio.CancelScope] = set()
        self._graceful: set[tuple[Abort, anyio.CancelScope]] = set()

    def abort(self) -> None:
        self.aborted = True
        for scope in list(self._scopes):
            scope.cancel()
        for step, scope in list(self._graceful):
            _stop_gracefully(step, scope)

    @contextmanager
    def graceful(self) -> Iterator[Abort]:
        """Like `scope()`, but abort first sets the yielded `Abort`, so a callee watching it can
        return what it has (a model client's partial message); the step is cancelled outright
        only after `ABORT_GRACE` s, or at once when the callee does not watch it."""
        step, scope = Abort(), anyio.CancelScope()
        entry = (step, scope)
        self._graceful.add(entry)
        if self.aborted:
            _stop_gracefully(step, scope)
        try:
            with scope:
                yield step
        finally:
            self._graceful.discard(entry)

    @contextmanager
    def scope(self) -> Iterator[anyio.CancelScope]:
        scope = anyio.CancelScope()
        if self.aborted:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)


def _stop_gracefully(step: Abort, scope: anyio.CancelScope) -> None:
    step.set()
    if not step.watched:  # nothing will come back: no reason to wait
        scope.cancel()
        return
    scope.deadline = min(scope.deadline, anyio.current_time() + ABORT_GRACE)
