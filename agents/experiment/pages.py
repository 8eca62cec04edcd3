"""The web view's experiment page: each experiment's journal (`busctl experiment run`'s
`experiment_plan` / `experiment_sample` events), kept up to date from the hub's log, and its
report computed by `agents.experiment.report` — the very function `busctl experiment report
--json` calls, over the same journal read the same way (`Journal.add_logged`), so the page's
numbers are the report's by construction, not by a port of the statistics to JavaScript that
would have to be kept equal to it by hand.

The journal's events are `ext` types the view's subscription does not decode (it skips them, as
every reader skips types it does not know): they are read on their own, by topic, from a cursor
(`hub.replay` of `ext///experiment_`, which reads no other row's body), each time the view polls
the hub's status. What the journal cannot say — the cells running now — comes from the main
stream: the top-level runs tagged `E.<variant>.r<repeat>` started and not yet ended.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import msgspec

from agent_bus.agents.experiment.report import report
from agent_bus.agents.experiment.runner import JOURNAL_TOPIC, PLAN_TYPE, SAMPLE_TYPE, Journal, result_rows
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer
from agent_bus.bus.experiments import parse_cell
from agent_bus.bus.watch import replay_batch

# The experiment id out of a cell's session tag `E.<variant>.r<repeat>` (spec.experiment_tag).
# A cell starting this long after the experiment's last cell ended, none running: a runner
# (re)started (`--resume`), and the ETA's pace is measured from there, not from the first run.
IDLE = 30.0
ANSWER_CHARS = 300  # of each answer on the page (its tooltip): a refetch stays small; the
# results file and `busctl export` have them whole


class Tracked:
    """One experiment: its journal, its running cells, and the pace of the current stretch."""

    def __init__(self) -> None:
        self.journal = Journal(None, {})
        self.running: set[str] = set()   # run ids of its cells started, not ended
        self.stretch_start = 0.0         # ts the runner (last) started from idle
        self.last_end = 0.0              # ts the last of its cells ended
        self.stretch_done = 0            # cells journaled since then
        self.version = 0

    def progress(self, now: float) -> dict[str, Any]:
        """done / running / failed of planned, and the ETA at the current stretch's pace. By the
        report's failure rule (`SampleResult.outcome`): `done` is the report's (every cell but
        those in error), `timed_out` and `limited` are part of it (scored 0), and `failed` is
        the cells in error (the ones `--resume` runs again)."""
        outcomes = Counter(c.outcome for c in self.journal.results.values())
        failed = outcomes["error"]
        done = len(self.journal.results) - failed
        plan = self.journal.plan
        planned = plan.planned if plan else None
        left = max(0, planned - done - failed) if planned is not None else None
        eta = None
        if left and self.running and self.stretch_done and self.stretch_start:
            eta = (now - self.stretch_start) / self.stretch_done * left
        return {"planned": planned, "done": done, "failed": failed,
                "timed_out": outcomes["timed_out"], "limited": outcomes["limited"],
                "running": len(self.running) if left else 0, "left": left, "eta": eta}


class ExperimentBook:
    """Every journaled experiment, shared by the bus task (writes) and the page threads (read)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.experiments: dict[str, Tracked] = {}
        self.cursor = 0
        self.bad = 0  # journal headers that did not decode

    def _get(self, name: str) -> Tracked:
        return self.experiments.setdefault(name, Tracked())

    def note_event(self, header: p.Header, event: ev.Event) -> None:
        """A run of a cell starting or ending (from the view's own subscription)."""
        if header.parent or not isinstance(event, (ev.AgentStart, ev.AgentEnd)):
            return
        cell = parse_cell(header.experiment)
        if cell is None:
            return
        with self.lock:
            x = self._get(cell.experiment)
            if isinstance(event, ev.AgentStart):
                if not x.running and header.ts - x.last_end > IDLE:  # a (re)started runner
                    x.stretch_start, x.stretch_done = header.ts, 0
                x.running.add(header.run)
            else:
                x.running.discard(header.run)
                x.last_end = header.ts
            x.version += 1

    def add_entries(self, events: list[tuple[bytes, bytes]]) -> None:
        with self.lock:
            for header_bytes, body in events:
                try:
                    header = p.decode_header(header_bytes)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.bad += 1  # counted, like the report's unreadable entries
                    continue
                if header.type not in (PLAN_TYPE, SAMPLE_TYPE):
                    continue  # another `ext` type whose name starts the same
                x = self._get(header.experiment)
                x.journal.add_logged(header.experiment, header_bytes, body)
                if header.type == SAMPLE_TYPE and header.ts >= x.stretch_start:
                    x.stretch_done += 1
                x.version += 1

    async def catch_up(self, peer: Peer) -> None:
        """Read the journal events logged since the last call (a batch at a time)."""
        while True:
            batch = await replay_batch(peer, p.ReplayRequest(since=self.cursor,
                                                              topics=[JOURNAL_TOPIC]))
            self.add_entries(batch.events)
            if batch.upto <= self.cursor:
                return
            self.cursor = batch.upto
            if batch.upto >= batch.head:
                return

    def summary(self) -> list[dict[str, Any]]:
        """The experiment list the page shows (and the versions it refetches a page on)."""
        now = time.time()
        with self.lock:
            return [{"name": name, "version": x.version, **x.progress(now)}
                    for name, x in sorted(self.experiments.items()) if x.journal.plan
                    or x.journal.results]

    def page(self, name: str) -> dict[str, Any] | None:
        """The experiment page's data: `busctl experiment report --json`'s object, the progress,
        and the per-sample rows (the results file's: `runner.result_rows`, answers clipped)."""
        with self.lock:
            x = self.experiments.get(name)
            if x is None or not (x.journal.plan or x.journal.results):
                return None
            rows = result_rows(x.journal.results.values(),
                               x.journal.plan.scorers if x.journal.plan else ())
            for row in rows:
                row["answer"] = row["answer"][:ANSWER_CHARS]
            return {"experiment": name, "version": x.version,
                    "progress": x.progress(time.time()),
                    "report": report(x.journal, name), "samples": rows}
