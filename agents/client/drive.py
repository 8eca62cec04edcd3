"""`busctl run` and `busctl chat`: prompt an agent and show its run as it happens.

Exit codes of `busctl run`: 0 normal stop (also an answer cut at `max_tokens`: stop reason
`length`, said on stderr), 1 error, 3 stopped by its turn limit (`--max-turns` or the agent's
`max_iterations`: the answer is a summary, not the end of the work), 130 aborted. The first
SIGINT aborts the run (the agent ends it with `agent_end` / aborted); a second one exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TextIO

import anyio
import anyio.abc
import anyio.lowlevel
import click

from agent_bus.agents import commands as cmd
from agent_bus.agents.client.remote import AgentBus, Run, connect
from agent_bus.bus import events as ev
from agent_bus.bus.client import Envelope
from agent_bus.bus.errors import BusError
from agent_bus.bus.render import HumanPrinter, color_wanted, json_line
from agent_bus.bus.security import CurveClient

EXIT_OK, EXIT_ERROR, EXIT_MAX_TURNS, EXIT_ABORTED = 0, 1, 3, 130
LENGTH_NOTE = ("length: the answer was cut at the model's output token limit; raise `max_tokens` "
               "(the agent's, or the model's `[models.x] max_tokens` / `*_MAX_TOKENS`) for all of it")


def exit_code(result: cmd.RunResult) -> int:
    if result.stop_reason == "aborted":
        return EXIT_ABORTED
    if result.stop_reason == "max_iterations":  # (2 is click's bad usage)
        return EXIT_MAX_TURNS
    if result.stop_reason == "error" or result.error:
        return EXIT_ERROR
    return EXIT_OK


class RunView:
    """Shows one run. `--json`: every event as a JSON line on stdout. Human: stdout gets the
    answer and nothing else (streamed as it arrives when stdout is a terminal, else written once
    at the end, so `busctl run "…" > answer.txt` captures exactly the final answer); the trace
    (tool calls, thinking, retries, intermediate text) goes to stderr, or nowhere with `quiet`."""

    def __init__(self, out: TextIO, as_json: bool, color: bool, quiet: bool = False,
                 err: TextIO | None = None) -> None:
        self.out = out
        self.as_json = as_json
        err = err or sys.stderr
        # colour where the trace is seen (stderr), whatever stdout is
        self.trace = None if quiet or as_json else HumanPrinter(err, color_wanted(err))
        self.stream_answer = not as_json and _is_tty(out)
        self._open = False  # an answer line is being streamed on stdout
        self._streamed = ""  # the text of the last message streamed on stdout

    def show(self, envelope: Envelope) -> None:
        header, event = envelope.header, envelope.event
        if self.as_json:
            self.out.write(json_line(header, event) + "\n")
            self.out.flush()
            return
        if isinstance(event, ev.MessageStart):
            self._streamed = ""
        if isinstance(event, (ev.MessageStart, ev.MessageEnd, ev.TurnStart, ev.AgentEnd)):
            return  # the human view shows text, tools and the answer; watch shows everything
        if (self.stream_answer and isinstance(event, ev.MessageUpdate)
                and event.delta.kind == "text"):
            self._streamed += event.delta.delta
            self.out.write(event.delta.delta)
            self.out.flush()
            self._open = True
            return
        if self.trace is not None:
            self._close()
            self.trace.print(header, event)

    def _close(self) -> None:
        if self._open:
            self.out.write("\n")
            self.out.flush()
            self._open = False

    def finish(self, result: cmd.RunResult) -> None:
        """The answer (unless it was streamed) on stdout; an error, in red, on stderr."""
        if self.as_json:
            return
        # A trace line (the turn's end) may have closed the streamed answer: it is on the
        # terminal already, so it is not written again.
        streamed = bool(self._streamed) and result.final_text.strip() == self._streamed.strip()
        if self._open:
            self._close()
        elif result.final_text and not streamed:
            self.out.write(result.final_text + "\n")
            self.out.flush()
        if result.error and (self.trace is not None or not result.final_text):
            line = f"{result.stop_reason}: {result.error}"
            sys.stderr.write((click.style(line, fg="red") if color_wanted(sys.stderr) else line)
                             + "\n")
        elif result.stop_reason == "length":
            sys.stderr.write(f"{LENGTH_NOTE}\n")


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


#: Seconds the run's `agent_end` may take to arrive after its result: it is published before
#: the result is sent, but comes on another socket, so it may arrive a moment later.
END_GRACE = 2.0


async def _follow(run: Run, view: RunView, err: TextIO | None = None) -> cmd.RunResult:
    """Show the run's events until its `agent_end`, or until its result arrived and the
    `agent_end` did not follow (the hub's log refused it: the run is over all the same)."""
    missed = False
    async with anyio.create_task_group() as tg:

        async def until_result() -> None:
            nonlocal missed
            # The request ends the wait too: when the agent's process dies it fails
            # (PeerLost) and no `agent_end` will come.
            await run.final_reply()
            if not await run.end_seen(END_GRACE):
                missed = True
                tg.cancel_scope.cancel()

        tg.start_soon(until_result)
        # cancelled inside `events()`: the generator ends there (its `finally` runs)
        async for envelope in run.events():
            view.show(envelope)
    if missed:
        await _say_why_events_are_missing(run, err or sys.stderr)
    return await run.result()


async def _say_why_events_are_missing(run: Run, err: TextIO) -> None:
    """The result came and the run's `agent_end` did not: say so, and why when the hub knows
    (its event log refuses events: `log_error` in `busctl status --json`)."""
    try:
        with anyio.fail_after(5):
            why = (await run.bus.peer.status()).log_error
    except (BusError, TimeoutError):
        why = ""
    cause = (f"the hub's event log refused its events ({why}); they are not in the log"
             if why else f"its `agent_end` event did not arrive within {END_GRACE:g} s of "
             f"the result; the run's events may be missing from the log")
    err.write(f"warning: run {run.run_id} ended, but {cause}\n")
    err.flush()


async def _abort_on_sigint(bus: AgentBus, run: Run, scope: anyio.CancelScope,
                           err: TextIO) -> None:
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        count = 0
        async for _ in signals:
            count += 1
            if count == 1:
                err.write("\naborting the run (Ctrl-C again to quit at once)…\n")
                await bus.abort(run.agent, "Ctrl-C", run=run.run_id, session=run.session)
            else:
                scope.cancel()
                return


async def drive_run(hub: str, curve: CurveClient | None, agent: str, text: str, as_json: bool,
                    new_session: bool, experiment: str, color: bool, max_turns: int = 0,
                    quiet: bool = False, session: str = "", continue_session: bool = False
                    ) -> int:
    """One run in a fresh session, or in `session` / the agent's last one (`continue_session`);
    the session id goes to stderr (unless `quiet`) so the conversation can be continued."""
    out = sys.stdout
    view = RunView(out, as_json, color, quiet)
    async with connect(hub, name="busctl-run", curve=curve) as bus:
        run = await bus.prompt(agent, text, experiment=experiment, new_session=new_session,
                               max_turns=max_turns, session=session,
                               continue_session=continue_session)
        if not quiet:
            sys.stderr.write(f"session {run.session} (continue it: busctl run --agent {agent} "
                             f"-c {run.session} \"…\")\n")
            sys.stderr.flush()
        result: cmd.RunResult | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_abort_on_sigint, bus, run, tg.cancel_scope, sys.stderr)
            result = await _follow(run, view)
            tg.cancel_scope.cancel()
        if result is None:
            return EXIT_ABORTED
        view.finish(result)
        if result.stop_reason == "max_iterations":
            sys.stderr.write(f"run {run.run_id} stopped at its turn limit (--max-turns, or the "
                             f"agent's max_iterations): the answer above is a summary of unfinished "
                             f"work; exit {EXIT_MAX_TURNS}\n")
            sys.stderr.flush()
        return exit_code(result)


class ChatState:
    """One chat: its session (kept for every prompt, "" until the first one) and live run."""

    def __init__(self, agent: str, session: str = "") -> None:
        self.agent = agent
        self.session = session
        self.running: list[Run] = []
        self.aborting = ""  # the run a Ctrl-C is aborting: a second Ctrl-C then quits
        self.interrupted = False  # quit by Ctrl-C: chat exits 130


async def chat(hub: str, curve: CurveClient | None, agent: str, color: bool,
               session: str = "") -> int:
    """Read lines from stdin: a prompt when idle, steering while a run streams. Every prompt
    continues the chat's one session (a fresh one, or `session`); `/reset` starts another.
    Ctrl-C aborts the run in progress and returns to the prompt; at the prompt (or a second
    time while the abort is under way) it quits: returns 130 (0 at the end of input)."""
    out = sys.stdout
    view = RunView(out, False, color)
    state = ChatState(agent, session)
    async with connect(hub, name="busctl-chat", curve=curve) as bus, \
            anyio.create_task_group() as outer:
        outer.start_soon(_chat_sigint, bus, state, outer.cancel_scope, sys.stderr)
        out.write(f"chatting with `{agent}` — /abort, /follow TEXT, /reset, /help, Ctrl-D to quit\n> ")
        out.flush()
        lines = StdinLines(sys.stdin.fileno())
        # The runs' followers: leaving this group at the end of input lets a run in progress
        # finish (Ctrl-C still aborts it) before chat quits.
        async with anyio.create_task_group() as tg:
            while (line := await lines.next()) is not None:
                try:
                    note = await _chat_line(bus, line.strip(), state, view, tg)
                except BusError as exc:  # a refused command must not end the chat
                    note = f"{type(exc).__name__}: {exc}"
                if note:
                    sys.stderr.write(note + "\n")
                    sys.stderr.flush()
        outer.cancel_scope.cancel()
    return EXIT_ABORTED if state.interrupted else EXIT_OK


async def _chat_sigint(bus: AgentBus, state: ChatState, scope: anyio.CancelScope,
                       err: TextIO) -> None:
    """Ctrl-C: abort the run in progress (the prompt comes back when it has ended); at the
    prompt, or again while aborting, quit at once (`scope` is the whole chat's)."""
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            run = state.running[0] if state.running else None
            if run is None or state.aborting == run.run_id:
                state.interrupted = True
                err.write("\n")
                err.flush()
                scope.cancel()
                return
            state.aborting = run.run_id
            err.write("\naborting the run (Ctrl-C again to quit at once)…\n")
            err.flush()
            try:
                await bus.abort(state.agent, "Ctrl-C", run=run.run_id, session=run.session)
            except BusError as exc:  # it may have ended meanwhile: nothing to abort
                err.write(f"{type(exc).__name__}: {exc}\n")


class StdinLines:
    """Lines of a file descriptor, read on the event loop (no thread): a Ctrl-C or the end of
    the chat need not wait for a thread blocked in `readline` (that wait was the hang, and a
    second Ctrl-C interrupted it with a traceback)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    async def next(self) -> str | None:
        """The next line without its newline; the last, unterminated one; None at the end."""
        while b"\n" not in self.buffer and not self.eof:
            await self._readable()
            chunk = os.read(self.fd, 65536)
            self.eof = not chunk
            self.buffer += chunk
        if not self.buffer:
            return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode(errors="replace")

    async def _readable(self) -> None:
        try:
            await anyio.wait_readable(self.fd)
        except OSError:  # a regular file or /dev/null (epoll refuses them): always readable
            await anyio.lowlevel.checkpoint()


#: What `/help` prints (chat answers it itself: it is no prompt for the model).
CHAT_HELP = """commands (anything else is a prompt, or steers the run in progress):
  /abort          abort the run in progress
  /follow TEXT    queue TEXT as a follow-up of the run in progress
  /reset          start a new conversation with your next prompt (not during a run)
  /help           this list
  Ctrl-C          abort the run in progress; at the prompt, quit (exit 130)
  Ctrl-D          quit (a run in progress finishes first)"""


async def _chat_line(bus: AgentBus, line: str, state: ChatState, view: RunView,
                     tg: anyio.abc.TaskGroup) -> str:
    """Act on one line; returns a note for the user ("" when none)."""
    if not line:
        return ""
    run = state.running[0] if state.running else None
    ids = {"run": run.run_id, "session": run.session} if run is not None else {}
    if line in ("/help", "/?"):
        return CHAT_HELP
    if line == "/abort":
        return "aborting…" if run is not None and await bus.abort(state.agent, "chat", **ids) \
            else "no run in progress: nothing to abort"
    if line == "/reset":
        if run is not None:
            return "cannot /reset while a run is in progress: /abort it first (the chat stays open)"
        state.session = ""
        return "a new conversation starts with your next prompt"
    if line.startswith("/follow "):
        if run is None:
            return "no run in progress: type the text as a prompt instead"
        return await bus.follow_up(state.agent, line[8:], **ids)
    if run is not None:
        return await bus.steer(state.agent, line, **ids)
    run = await bus.prompt(state.agent, line, session=state.session)
    state.session = run.session
    state.running.append(run)

    async def follow() -> None:
        try:
            result = await _follow(run, view)
            view.finish(result)
        finally:
            state.running.remove(run)
        view.out.write("> ")
        view.out.flush()

    tg.start_soon(follow)
    return ""
