"""The web view's experiment page (issue 30, item 3): `busctl experiment run` of the shipped
example (6 samples x 2 variants x 1 repeat, one cell made to fail) with `busctl ui` open on it
in a real headless Chromium; then what the page shows — progress, per variant n, mean score,
interval bounds, tokens, time, failures, and the per-sample rows — equals `busctl experiment
report E --json`, live and in a `busctl ui` started after the experiment (replayed from the log).
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

# What the page shows, read from its DOM: the unrounded values are in data-* attributes.
READ_PAGE = """(() => {
  const q = (s) => [...document.querySelectorAll(s)];
  const p = document.querySelector('#exp-progress [data-done]');
  return {
    progress: p && Object.fromEntries(['planned', 'done', 'running', 'failed'].map(
      (k) => [k, p.dataset[k]])),
    variants: q('#exp-variants tbody tr').map((tr) => {
      const d = (k) => { const c = tr.querySelector(`[data-${k}]`); return c && c.dataset[k]; };
      return {name: tr.dataset.variant, n: d('n'), score: d('score'), lo: d('lo'), hi: d('hi'),
              tokens: d('tokens'), cost: d('cost'), p50: d('p50'), p95: d('p95'),
              stops: d('stops'), failures: d('failures'),
              text: [...tr.children].map((td) => td.textContent)};
    }),
    samples: q('#exp-samples tbody tr').map((tr) => ({
      sample: tr.dataset.sample, variant: tr.dataset.variant, repeat: tr.dataset.repeat,
      status: tr.dataset.status, score: tr.dataset.score,
      run: (tr.querySelector('[data-run-link]') || {dataset: {}}).dataset.runLink || '',
      text: [...tr.children].map((td) => td.textContent)})),
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


def check_page(shown: dict[str, Any], report: dict[str, Any]) -> None:
    assert shown["progress"] == {"planned": "12", "done": str(report["done"]), "running": "0",
                                 "failed": str(sum(v["failures"] for v in report["variants"]))}
    assert [v["name"] for v in shown["variants"]] == [v["name"] for v in report["variants"]]
    for page, want in zip(shown["variants"], report["variants"], strict=True):
        # the exact values (JavaScript's shortest round-trip text of the same doubles)
        assert int(page["n"]) == want["n"] and int(page["failures"]) == want["failures"]
        assert float(page["score"]) == want["score"]
        assert [float(page["lo"]), float(page["hi"])] == want["ci95"]
        assert int(page["tokens"]) == want["tokens"] and float(page["cost"]) == want["cost"]
        assert float(page["p50"]) == want["time_p50"] and float(page["p95"]) == want["time_p95"]
        assert json.loads(page["stops"]) == want["stop_reasons"]
        # and as a person reads them
        lo, hi = want["ci95"]
        assert page["text"][1:4] == [f"{want['n']}/{want['planned']}", fmt(want["score"]),
                                     f"[{fmt(lo)}, {fmt(hi)}] {want['ci_method']}"]
        assert page["text"][9] == str(want["failures"])


def check_samples(shown: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    want = [(r["sample"], r["variant"], str(r["repeat"]), r["status"], r["run_id"],
             fmt(r.get("score_number"))) for r in rows]
    got = [(s["sample"], s["variant"], s["repeat"], s["status"], s["run"], s["text"][3])
           for s in shown["samples"]]
    assert got == want


def report_json(cwd: Path, endpoint: str) -> dict[str, Any]:
    out = subprocess.run(busctl("experiment", "report", E, "--json", "--hub", endpoint),
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
            assert report["done"] == 11 and report["variants"][0]["failures"] == 1
            rows = [json.loads(line) for line in
                    (tmp_path / "results" / f"{E}.jsonl").read_text().splitlines()]

            def served_report() -> dict[str, Any] | None:
                with owner_get(ui, f"experiment?name={E}") as answer:
                    served: dict[str, Any] = json.loads(answer.read())["report"]
                return served if served["done"] + sum(
                    v["failures"] for v in served["variants"]) == 12 else None

            # the view reads the journal each 0.5 s: wait for the last cell, then compare
            served = wait_for(served_report, 15, "the view's report with every cell")
            assert served == report  # the server side computes it with report.py

            def drawn(page: Browser) -> dict[str, Any]:
                shown: dict[str, Any] = page.evaluate(READ_PAGE)
                ok = shown["progress"] and shown["progress"]["done"] == "11" \
                    and shown["progress"]["running"] == "0" and len(shown["samples"]) == 12
                return shown if ok else {}

            shown = wait_for(lambda: drawn(live), 15, "the finished experiment on the page")
            check_page(shown, report)
            check_samples(shown, rows)
            # live: drawn as the cells finished, not only at the end (solo q06 ran on alone)
            seen = live.evaluate("window.progressSeen")
            assert any(0 < int(d) < 11 and int(r) >= 1 and "ETA" in t for d, r, t in seen), seen
            live.screenshot(tmp_path / "experiment.png")

            # a view started afterwards replays the log: the same page
            later = open_page(start_ui(ex.endpoint, procs))
            replayed = wait_for(lambda: drawn(later), 15, "the experiment replayed")
            check_page(replayed, report)
            assert replayed["samples"] == shown["samples"]
            wait_for(lambda: later.evaluate(  # the list comes with the next status snapshot
                "document.querySelector('#experiments [data-experiment=\"ui-1\"]')"
                "?.textContent") == "ui-1 11/12, 1 failed", 10, "the experiment in the list")

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
