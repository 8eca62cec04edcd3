"""Turn events into terminal lines (`busctl watch`, `busctl run`) and JSON objects (`--json`)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from typing import Any, TextIO

import msgspec

from agent_bus.bus import events as ev
from agent_bus.bus.messages import AssistantMessage, ToolResultMessage, UserMessage
from agent_bus.bus.protocol import Header

_json = msgspec.json.Encoder()


def to_json_obj(header: Header, event: ev.Event) -> dict[str, Any]:
    """The `--json` shape: envelope fields first, then the payload's own fields."""
    payload = msgspec.to_builtins(event)
    obj: dict[str, Any] = {
        "seq": header.seq,
        "ts": header.ts,
        "type": ev.event_type(event),
        "agent": header.agent,
        "run_id": header.run,
    }
    if header.experiment:
        obj["experiment"] = header.experiment
    if header.parent:
        obj["parent"] = header.parent  # the calling run, for a sub-agent's run
    if header.peer:
        obj["peer"] = header.peer
    payload.pop("type", None)
    obj.update(payload)
    return obj


def json_line(header: Header, event: ev.Event) -> str:
    return _json.encode(to_json_obj(header, event)).decode()


def _clip(text: str, n: int = 120) -> str:
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= n else text[: n - 1] + "…"


def summary(event: ev.Event) -> str:
    """A one-line human description of an event's payload."""
    match event:
        case ev.MessageStart(message=m) | ev.MessageEnd(message=m):
            return _message_summary(m)
        case ev.MessageUpdate(delta=d):
            return f"{d.kind}: {_clip(d.delta)}"
        case ev.ToolExecutionStart(tool_name=name, args=args):
            return f"{name}({_clip(_json.encode(args).decode(), 100)})"
        case ev.ToolExecutionUpdate(tool_name=name, partial=part):
            return f"{name} … {_clip(str(part), 100)}"
        case ev.ToolExecutionEnd(tool_name=name, result=r, is_error=err, duration=d):
            mark = "✗" if err else "✓"
            return f"{mark} {name} {d * 1000:.0f}ms → {_clip(r.text, 100)}"
        case ev.TurnEnd(tool_results=results, turn=turn):
            return f"turn {turn} ({len(results)} tool results)"
        case ev.TurnStart(turn=turn):
            return f"turn {turn}"
        case ev.AgentEnd(final_text=text, stop_reason=reason, error=error):
            return f"[{reason}] {_clip(error or text)}"
        case ev.LlmRetry(attempt=a, delay=d, status=s, error=e, discarded=discarded):
            dropped = "; its streamed text is discarded" if discarded else ""
            return f"attempt {a} failed ({s or e}){dropped}; retrying in {d:.1f}s"
        case ev.Gap(first=first, last=last, reason=reason) if reason:
            # only what the log no longer holds is reported (the rest is filled from the log)
            return (f"!! missed events {first}..{last}: {reason}; they cannot be recovered "
                    f"from this hub (keep more with `busctl hub --retain-days/--retain-bytes`)")
        case ev.Gap(first=first, last=last):
            return (f"!! missed events {first}..{last}; recover them with "
                    f"`busctl watch --no-follow --since {first - 1}`")
        case ev.ExperimentPlan(samples=n, variants=variants, repeats=repeats, planned=planned):
            return (f"{n} samples x {len(variants)} variants ({', '.join(variants)}) x "
                    f"{repeats} repeats = {planned} cells")
        case ev.ExperimentSample():
            return _cell_summary(event)
        case _:
            fields = msgspec.to_builtins(event)
            fields.pop("type", None)
            return " ".join(f"{k}={_clip(str(v), 60)}" for k, v in fields.items())


def _cell_summary(cell: ev.ExperimentSample) -> str:
    """One journaled cell: where it is in the experiment, its outcome and its score."""
    score = "" if cell.score is None else f" score {cell.score:g}"
    why = f" [{cell.stop_reason}]" if cell.stop_reason else ""
    error = f" {_clip(cell.error, 80)}" if cell.error else ""
    return (f"{cell.variant}/{cell.sample}/r{cell.repeat} {cell.status}{score}{why} "
            f"run {cell.run_id[:8] or '-'}{error}")


def _message_summary(message: Any) -> str:
    if isinstance(message, UserMessage):
        text = "".join(getattr(part, "text", "") for part in message.content)
        return f"user{' (hidden)' if message.hidden else ''}: {_clip(text)}"
    if isinstance(message, AssistantMessage):
        calls = ", ".join(c.name for c in message.tool_calls)
        text = _clip(message.error or message.text)
        return f"assistant [{message.stop_reason}] {text}" + (f" → calls {calls}" if calls else "")
    if isinstance(message, ToolResultMessage):
        error = " (error)" if message.is_error else ""
        return f"tool_result {message.tool_name}{error}: {_clip(message.text)}"
    return f"{getattr(message, 'role', type(message).__name__)}"


def is_error(event: ev.Event) -> bool:
    match event:
        case ev.ToolExecutionEnd(is_error=True) | ev.Gap() | ev.WorkerLost() | ev.ProcessGaveUp():
            return True
        case ev.AgentEnd(stop_reason=reason) if reason in ("error", "aborted"):
            return True
        case ev.MessageEnd(message=AssistantMessage(stop_reason="error")):
            return True
    return False


class HumanPrinter:
    """Prints one line per event; streamed text deltas extend one line as they arrive."""

    def __init__(self, out: TextIO, color: bool) -> None:
        self.out = out
        self.color = color
        self._streaming: str | None = None  # run id whose delta line is open
        self._shown = ""  # what the open delta line shows (plain text), to erase on a retry

    def _style(self, text: str, **kw: Any) -> str:
        if not self.color:
            return text
        import click

        return click.style(text, **kw)

    def _close_stream(self) -> None:
        if self._streaming is not None:
            self.out.write("\n")
            self._streaming = None

    def _discard_stream(self) -> None:
        """A retried attempt's text is not part of the answer: erase it on a terminal (else the
        retry line, on a line of its own, says it is discarded)."""
        if not _is_tty(self.out):
            return self._close_stream()
        cols = max(1, shutil.get_terminal_size().columns)
        rows = sum(max(1, -(-len(line) // cols)) for line in self._shown.split("\n"))
        self.out.write("\r\033[K" + "\033[1A\033[K" * (rows - 1))
        self._streaming = None

    def print(self, header: Header, event: ev.Event) -> None:
        type_ = ev.event_type(event)
        if isinstance(event, ev.LlmRetry) and event.discarded and self._streaming == header.run:
            self._discard_stream()
        if isinstance(event, ev.MessageUpdate) and event.delta.kind == "tool_call":
            return  # argument fragments: the tool_execution_start line shows the whole call
        if isinstance(event, ev.MessageUpdate):
            if self._streaming != header.run:
                self._close_stream()
                self.out.write(self._prefix(header, type_))
                self._streaming = header.run
                self._shown = self._prefix(header, type_, plain=True)
            text = event.delta.delta
            self._shown += text
            self.out.write(self._style(text, dim=True) if event.delta.kind == "thinking" else text)
            self.out.flush()
            return
        self._close_stream()
        if is_error(event):  # red from end to end: the prefix's own colours would reset it
            line = self._style(self._prefix(header, type_, plain=True) + summary(event), fg="red")
        else:
            line = self._prefix(header, type_) + summary(event)
        self.out.write(line + "\n")
        self.out.flush()

    def _prefix(self, header: Header, type_: str, plain: bool = False) -> str:
        when = dt.datetime.fromtimestamp(header.ts).strftime("%H:%M:%S.%f")[:-3] if header.ts else "--:--:--"
        who = header.agent or header.peer or "-"
        if header.run:
            who += "/" + header.run[:8]
        seq = str(header.seq) if header.seq else "-"
        if plain:
            return f"{seq:>6} {when} {who} {type_} "
        return f"{seq:>6} {when} {self._style(who, fg='cyan')} {self._style(type_, bold=True)} "


def color_wanted(stream: TextIO) -> bool:
    """Colour on a terminal; never with NO_COLOR set, always with FORCE_COLOR set (no-color.org,
    force-color.org: e.g. a pager that shows colours, or a test)."""
    if os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or _is_tty(stream)


def _is_tty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False
