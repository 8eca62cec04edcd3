"""The web view's experiment page (issue 30, item 3): `busctl experiment run` of the shipped
example (6 samples x 2 variants x 1 repeat, one cell made to fail) with `busctl ui` open on it
in a real headless Chromium; then what the page shows — progress, every value of the variant
table (score, interval, tokens, cost, times, stop reasons...), the per-sample roll-up and each
sample's cells — equals `busctl experiment report E --json` and the results file, live and in a `busctl ui` started after the experiment (replayed from the log).
The page's layout at two window sizes: tests/ui/test_experiment_layout.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from tests.examples.test_examples import ENV, example
from tests.support import ROOT, Proc, busctl, wait_for
from tests.ui.browser import Browser, find_chromium
from tests.ui.owner import owner_get

E = "ui-1"
SPEC = "examples/experiment/spec.toml"

# What the page shows, read from its DOM: each report value whole (JSON) in its cell's
# data-value, under the report's keys in data-key.
READ_PAGE = """(() => {
  const q = (s, root) => [...(root || document).querySelectorAll(s)];
  const values = (root) => Object.fromEntries(q('td[data-key]', root).flatMap((td) => {
    const v = JSON.parse(td.dataset.value);
    return td.dataset.key.split(' ').map((k, i) => [k, v[i]]);
  }));
  const texts = (root) => Object.fromEntries(q('td[data-key]', root).map((td) =>
    [td.dataset.key, td.textContent]));
  const p = document.querySelector('#exp-progress [data-done]');
  return {
    progress: p && Object.fromEntries(['planned', 'done', 'running', 'failed'].map(
      (k) => [k, p.dataset[k]])),
    totals: q('#totals tr[data-key]').map((tr) => [tr.dataset.key, tr.children[1].textContent,
                                                   tr.title]),
    variants: q('#exp-variants tbody tr').map((tr) => ({name: tr.dataset.variant,
      values: values(tr), texts: texts(tr)})),
    scorers: q('#exp-scorers tbody tr').map((tr) => ({scorer: tr.dataset.scorer,
      variant: tr.dataset.variant, values: values(tr)})),
    samples: q('#exp-samples tr.sample').map((tr) => ({sample: tr.dataset.sample,
      per_variant: Object.fromEntries(q('td[data-key]', tr).map((td) =>
        [td.dataset.variant, JSON.parse(td.dataset.value)[0]])),
      marks: q('.mark', tr).length, text: [...tr.children].map((td) => td.textContent)})),
    cells: q('#exp-samples tr.cell').map((tr) => ({
      sample: tr.dataset.sample, variant: tr.dataset.variant, repeat: tr.dataset.repeat,
      status: tr.dataset.status, score: tr.dataset.score,
      run: (tr.querySelector('[data-run-link]') || {dataset: {}}).dataset.runLink || '',
      text: [...tr.children].map((td) => td.textContent)})),
    failed: document.querySelector('#exp-failed-box summary').textContent,
  };
})()"""


# Every progress line the page draws, as it draws it (done, running, text).
WATCH_PROGRESS = """(() => {
  window.progressSeen = [];
  new MutationObserver(() => {
    const p = document.querySelector('#exp-progress [data-done]');
    if (p) window.progressSeen.push([p.dataset.done, p.dataset.running, p.textContent]);
  }).observe(document.getElementById('exp-progress'), {childList: true, subtree: true});
})()"""


def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    return path


def prepare(tmp_path: Path) -> None:
    """The example, one repeat, no retries; solo's q04 ends `error` (a content filter), and
    solo's q06 answers after 2 s: the page shows the others done while it runs."""
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    spec = (copy / "spec.toml").read_text()
    (copy / "spec.toml").write_text(spec.replace("repeats = 3", "repeats = 1")
                                    .replace("retries = 2", "retries = 0"))
    script = json.loads((copy / "fake_model.json").read_text())
    script["rules"].insert(0, {"system": ["SOLO"], "contains": ["[q04]"],
                               "reply": {"text": "no", "finish": "content_filter"}})
    [slow] = [r for r in script["rules"] if r["system"] == ["SOLO"]
              and r.get("contains") == ["[q06]"]]
    slow["delay"] = 2.0
    (copy / "fake_model.json").write_text(json.dumps(script))


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def check_values(shown: dict[str, Any], report: dict[str, Any]) -> None:
    """Every report value the page draws equals `busctl experiment report --json`'s (a key the
    report does not have is drawn as "-" and kept as null); per variant, the roll-up's rows are
    its `per_sample` entries; and as a person reads them: the score's 3 decimals, and the cost
    to 3 significant digits (a cell's $0.00004 is not $0.0000)."""
    assert [v["name"] for v in shown["variants"]] == [v["name"] for v in report["variants"]]
    for page, want in zip(shown["variants"], report["variants"], strict=True):
        assert page["values"] and page["values"] == {k: want.get(k) for k in page["values"]}
        assert page["texts"]["score"] == fmt(want["score"])
        cost = float(page["texts"]["cost"].lstrip("$"))
        assert abs(cost - want["cost"]) <= 0.005 * want["cost"], page
        by_sample = {s["sample"]: s["per_variant"][want["name"]] for s in shown["samples"]}
        assert by_sample == {e["sample"]: e for e in want["per_sample"]}
    many = len(report["scorers"]) > 1  # with one, the variant table's score is it
    assert [(s["scorer"], s["variant"]) for s in shown["scorers"]] == [
        (s, v["name"]) for s in report["scorers"] for v in report["variants"] if many]
    for row in shown["scorers"]:
        [want] = [v["scores"][row["scorer"]] for v in report["variants"]
                  if v["name"] == row["variant"]]
        assert row["values"] == {k: want.get(k) for k in row["values"]}


def check_page(shown: dict[str, Any], report: dict[str, Any], rows: list[dict[str, Any]]
               ) -> None:
    failed = sum(r["status"] == "error" for r in rows)  # what a resume runs again
    assert shown["progress"] == {"planned": "12", "done": str(report["done"]), "running": "0",
                                 "failed": str(failed)}
    check_values(shown, report)


def check_cells(shown: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The samples opened: their cells are the results file's rows."""
    want = sorted((r["sample"], r["variant"], str(r["repeat"]), r["status"], r["run_id"],
                   fmt(r.get("score_number"))) for r in rows)
    got = sorted((s["sample"], s["variant"], s["repeat"], s["status"], s["run"], s["text"][2])
                 for s in shown["cells"])
    assert got == want


def report_json(cwd: Path, endpoint: str, name: str = E) -> dict[str, Any]:
    out = subprocess.run(busctl("experiment", "report", name, "--json", "--hub", endpoint),
                         capture_output=True, text=True, timeout=30, cwd=cwd)
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def start_ui(endpoint: str, procs: list[Proc]) -> dict[str, Any]:
    procs.append(Proc(busctl("ui", "--hub", endpoint, "--port", "0")))
    return procs[-1].wait_ready()


def test_experiment_page_live_and_replayed_equals_the_report(tmp_path: Path) -> None:
    binary = chromium()
    prepare(tmp_path)
    procs: list[Proc] = []
    browser = Browser(binary, tmp_path / "profile")

    def open_page(ui: dict[str, Any]) -> Browser:
        # the owner's link, with the experiment's address kept through the token's hand-over;
        # a new tab: the browser talks to it from now
        browser.open(f"{ui['url']}#experiment={E}")
        return browser

    try:
        with example(tmp_path, "experiment", copy=False) as ex:
            ui = start_ui(ex.endpoint, procs)
            live = open_page(ui)  # open before the experiment: the page fills in live
            wait_for(lambda: "no experiment ui-1 journaled" in (live.evaluate(
                "document.getElementById('exp-progress').textContent") or ""), 15,
                "the page saying the experiment is not there yet")
            live.evaluate(WATCH_PROGRESS)
            with pytest.raises(urllib.error.HTTPError) as missing:
                owner_get(ui, f"experiment?name={E}")
            assert missing.value.code == 404
            missing.value.close()
            run = subprocess.run(busctl("experiment", "run", SPEC, "--name", E, "--limit", "6",
                                        "--hub", ex.endpoint), capture_output=True, text=True,
                                 timeout=60, cwd=tmp_path, env={**os.environ, **ENV})
            assert run.returncode == 0, run.stdout + run.stderr
            report = report_json(tmp_path, ex.endpoint)
            rows = [json.loads(line) for line in
                    (tmp_path / "results" / f"{E}.jsonl").read_text().splitlines()]
            assert report["done"] == 11 and sum(r["status"] != "ok" for r in rows) == 1

            def served_report() -> dict[str, Any] | None:
                with owner_get(ui, f"experiment?name={E}") as answer:
                    served: dict[str, Any] = json.loads(answer.read())["report"]
                return served if served["done"] + sum(
                    v["failures"] for v in served["variants"]) == 12 else None

            # the view reads the journal each 0.5 s: wait for the last cell, then compare
            served = wait_for(served_report, 15, "the view's report with every cell")
            assert served == report  # the server side computes it with report.py

            def drawn(page: Browser) -> dict[str, Any]:
                shown: dict[str, Any] = page.evaluate(READ_PAGE) or {}  # None: between pages
                ok = shown.get("progress") and shown["progress"]["done"] == "11" \
                    and shown["progress"]["running"] == "0" and len(shown["samples"]) == 6
                return shown if ok else {}

            def opened(page: Browser) -> dict[str, Any]:
                """Every sample opened to its cells (one click: expand all)."""
                wait_for(lambda: drawn(page), 15, "the finished experiment on the page")
                page.evaluate("document.getElementById('exp-expand').click()")
                return wait_for(lambda: (s := page.evaluate(READ_PAGE) or {}).get("cells") and s, 10,
                                "the samples opened")

            shown = opened(live)
            check_page(shown, report, rows)
            check_cells(shown, rows)
            # live: drawn as the cells finished, not only at the end (solo q06 ran on alone)
            seen = live.evaluate("window.progressSeen")
            assert any(0 < int(d) < 11 and int(r) >= 1 and "ETA" in t for d, r, t in seen), seen
            live.screenshot(tmp_path / "experiment.png")

            # a view started afterwards replays the log: the same page
            later = open_page(start_ui(ex.endpoint, procs))
            replayed = opened(later)
            check_page(replayed, report, rows)
            assert (replayed["samples"], replayed["cells"]) == (shown["samples"], shown["cells"])
            wait_for(lambda: later.evaluate(  # the list comes with the next status snapshot
                "document.querySelector('#experiments [data-experiment=\"ui-1\"]')"
                "?.textContent") == "ui-1 11/12, 1 in error", 10, "the experiment in the list")

            # a sample's run id opens that run in the runs view, with its transcript
            run_id = next(r["run_id"] for r in rows if r["variant"] == "team")
            later.evaluate(f"document.querySelector('[data-run-link=\"{run_id}\"]').click()")
            wait_for(lambda: later.evaluate(
                f"!document.getElementById('runs-view').hidden && !!document.querySelector("
                f"'#timeline .lane.selected[data-run=\"{run_id}\"]') && document.querySelectorAll("
                f"'#transcript-body .msg[data-role]').length >= 2"), 15,
                "the sample's run shown with its transcript")
    finally:
        browser.close()
        for proc in reversed(procs):
            proc.stop()
    assert (tmp_path / "experiment.png").stat().st_size > 1000
