"""The experiment page's bookkeeping (agents/experiment/pages.py), fed journal entries and run events
as the view gets them: progress (done / running / failed of planned), the ETA at the current
stretch's pace, and a report equal to `report.report` over the same journal; and the journal
followed from the log across a hub restart."""

from __future__ import annotations

import json
import subprocess
import urllib.error
from pathlib import Path
from typing import Any

import anyio
import msgspec

from agent_bus.agents.experiment.pages import ExperimentBook
from agent_bus.agents.experiment.report import report
from agent_bus.agents.experiment.runner import PLAN_TYPE, SAMPLE_TYPE, Plan, SampleResult
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from tests.support import Proc, busctl, wait_for
from tests.ui.owner import owner_get


def entry(type_: str, body: Plan | SampleResult, ts: float, experiment: str = "e"
          ) -> tuple[bytes, bytes]:
    # stamped as the hub stamps a journal entry from an identity that may write it
    header = p.Header(kind=p.EVENT, type=type_, experiment=experiment, ts=ts, granted="*")
    return p.encode(header), msgspec.msgpack.encode(body)


def run_event(event: ev.Event, run: str, ts: float, tag: str = "e.v.r1", parent: str = ""
              ) -> tuple[p.Header, ev.Event]:
    return p.Header(kind=p.EVENT, type=ev.event_type(event), run=run, experiment=tag, ts=ts,
                    parent=parent), event


def test_progress_eta_and_report() -> None:
    book = ExperimentBook()
    plan = Plan("e", "d", "spec.toml", samples=4, variants=["v"], repeats=1, planned=4,
                scorers=["x"])
    book.add_entries([entry(PLAN_TYPE, plan, 100.0),
                      entry(PLAN_TYPE, plan, 100.0, experiment="other"),
                      (b"not a header", b""),           # counted, skipped
                      entry("experiment_other", plan, 100.0)])  # another type: not an entry
    assert book.bad == 1 and [x["name"] for x in book.summary()] == ["e", "other"]
    for run in ("r1", "r2"):
        book.note_event(*run_event(ev.AgentStart(), run, 110.0))
    book.note_event(*run_event(ev.AgentStart(), "child", 110.0, parent="r1"))  # not a cell
    book.note_event(*run_event(ev.AgentStart(), "x", 110.0, tag="not-a-cell"))
    cells = [SampleResult("e", "v", "s1", 1, "ok", score=1.0, scores={"x": 1.0}, wall=2.0,
                          tokens=10, run_id="r1", answer="long " * 100),
             SampleResult("e", "v", "s2", 1, "error", error="boom", run_id="r2")]
    book.note_event(*run_event(ev.AgentEnd(), "r1", 112.0))
    book.note_event(*run_event(ev.AgentEnd(stop_reason="error"), "r2", 112.0))
    book.note_event(*run_event(ev.AgentStart(), "r3", 112.5))  # the next cell, running
    book.add_entries([entry(SAMPLE_TYPE, c, 112.0) for c in cells])
    x = book.experiments["e"]
    assert (x.stretch_start, x.stretch_done) == (110.0, 2)
    progress = x.progress(now=120.0)
    # 2 cells in 10 s since the stretch began, 2 left: 10 s more
    assert progress == {"planned": 4, "done": 1, "failed": 1, "running": 1, "left": 2,
                        "eta": 10.0, "timed_out": 0, "limited": 0}
    page = book.page("e")
    assert page is not None and page["report"] == report(x.journal, "e")
    assert [r["sample"] for r in page["samples"]] == ["s1", "s2"]
    assert len(page["samples"][0]["answer"]) == 300
    assert page["progress"]["failed"] == 1 and book.page("nope") is None
    # a cell starting long after the last one ended (a resume): the pace is measured anew
    book.note_event(*run_event(ev.AgentEnd(), "r3", 113.0))
    book.note_event(*run_event(ev.AgentStart(), "r4", 200.0))
    assert (x.stretch_start, x.stretch_done) == (200.0, 0)
    assert x.progress(now=201.0)["eta"] is None  # nothing finished since: no pace yet


def test_the_page_follows_the_journal_across_a_hub_restart(tmp_path: Path) -> None:
    """Real processes: a hub, `busctl ui`, journal entries published as the runner does; the hub
    restarted (the same log): the page's data reads on with no entry twice, and equals
    `busctl experiment report --json`."""
    endpoint = f"ipc://{tmp_path}/hub.sock"
    procs: list[Proc] = []

    def hub() -> Proc:
        procs.append(Proc(busctl("hub", "--hub", endpoint, "--state-dir", str(tmp_path / "hub"),
                                 "--heartbeat-interval", "0.2")))
        procs[-1].wait_ready()
        return procs[-1]

    def publish(*entries: Plan | SampleResult) -> None:
        async def go() -> None:
            async with connect(endpoint, name="test-runner") as peer:
                for body in entries:
                    await peer.publish_raw(body.type, msgspec.msgpack.encode(body),
                                           experiment="e", confirm=True)
        anyio.run(go)

    def page(ui: dict[str, Any]) -> dict[str, Any]:
        try:
            with owner_get(ui, "experiment?name=e") as answer:
                data: dict[str, Any] = json.loads(answer.read())
                return data
        except urllib.error.HTTPError as exc:
            exc.close()
            return {}

    plan = Plan("e", "d", "spec.toml", samples=2, variants=["v"], repeats=1, planned=2,
                scorers=["x"])
    cells = [SampleResult("e", "v", f"s{i}", 1, "ok", score=s, scores={"x": s}, wall=1.0 + i)
             for i, s in enumerate((1.0, 0.0))]
    try:
        first = hub()
        procs.append(Proc(busctl("ui", "--hub", endpoint, "--port", "0")))
        ui = procs[-1].wait_ready()
        publish(plan, cells[0])
        wait_for(lambda: page(ui).get("progress", {}).get("done") == 1, 10, "the first cell")
        first.stop()
        hub()
        publish(cells[1])
        data = wait_for(lambda: (d := page(ui)).get("progress", {}).get("done") == 2 and d, 15,
                        "the second cell, after the restart")
        out = subprocess.run(busctl("experiment", "report", "e", "--json", "--hub", endpoint),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert data["report"] == json.loads(out.stdout)
        assert data["report"]["duplicates"] == 0 and data["report"]["done"] == 2
        assert data["progress"] == {"planned": 2, "done": 2, "failed": 0, "running": 0,
                                    "left": 0, "eta": None, "timed_out": 0, "limited": 0}
    finally:
        for proc in reversed(procs):
            proc.stop()
