"""The experiment page reads right at a desktop's 1400x900 and a laptop's 1280x800 in a real
headless Chromium (issue 48, item 4): `busctl experiment run` of the shipped example made bigger
(12 samples with long ids x 2 variants x 3 repeats, two scorers, 3 cells timed out, 3 ended by
an error, cents-fraction prices) with `busctl ui` open on it. At each size: nothing of the side
column overlaps the centre (bounding boxes) and nothing spills the page sideways; the totals are
one row per experiment, not one per `E.<variant>.r<repeat>` cell tag; Topology and Services and
the variant table with its score plot are on the first screen; the per-sample roll-up has one
row a sample whose ids are shown whole, equal to the report's `per_sample`, and a sample opens
to its 6 cells; costs keep their significant digits. Screenshots: /tmp/page-1400.png and
/tmp/page-1280.png (and in the test's folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.examples.test_examples import ENV, example
from tests.support import ROOT, busctl, wait_for
from tests.ui.browser import Browser
from tests.ui.test_experiment_page import (
    READ_PAGE,
    check_values,
    chromium,
    report_json,
    start_ui,
)

E = "page-1"
SPEC = "examples/experiment/spec.toml"
SAMPLES = 12
SIZES = [(1400, 900), (1280, 800)]
TIMEOUT = 5  # the spec's wall seconds a cell; solo's q03 answers after 8 s


def long_id(sample: dict[str, Any]) -> str:
    # a long id, with a hyphenated run a browser cannot break at a space
    op = {"+": "addition", "*": "multiplication", "-": "subtraction"}.get(
        sample["metadata"].get("op"), "arithmetic")
    return f"{sample['id']}-{op}-of-two-numbers-from-the-grade-school-arithmetic-set"


def prepare(tmp_path: Path) -> list[str]:
    """The example with long sample ids, 3 repeats, no retries, a second scorer, a price a
    token; solo's q03 times out and solo's q04 ends `error` (a content filter). Returns the
    sample ids run."""
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    spec = (copy / "spec.toml").read_text()
    assert "repeats = 3" in spec
    (copy / "spec.toml").write_text(
        spec.replace("retries = 2", "retries = 0").replace("timeout = 60", f"timeout = {TIMEOUT}")
        + '\n[[scorers]]\nkind = "includes"\n')
    samples = [json.loads(line) for line in (copy / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        s["id"] = long_id(s)
    (copy / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    script = json.loads((copy / "fake_model.json").read_text())
    script["rules"].insert(0, {"system": ["SOLO"], "contains": ["[q04]"],
                               "reply": {"text": "no", "finish": "content_filter"}})
    [slow] = [r for r in script["rules"] if r["system"] == ["SOLO"]
              and r.get("contains") == ["[q03]"]]
    slow["delay"] = TIMEOUT + 3.0
    (copy / "fake_model.json").write_text(json.dumps(script))
    topology = (copy / "topology.toml").read_text()
    (copy / "topology.toml").write_text(topology.replace(
        'model = "demo-model"\n', 'model = "demo-model"\ninput_price = 0.25\noutput_price = 1.25\n'))
    return [s["id"] for s in samples[:SAMPLES]]


# Where things are drawn, at the current size.
LAYOUT = """(() => {
  const box = (n) => n.getBoundingClientRect();
  const side = document.getElementById('side');
  const center = document.getElementById('center');
  const [s, c] = [box(side), box(center)];
  const drawn = (root) => [...root.querySelectorAll('*')].filter((n) => {
    const r = box(n); return r.width > 0 && r.height > 0; });
  const name = (n) => n.outerHTML.slice(0, 160);
  return {
    width: innerWidth, height: innerHeight,
    side: [s.left, s.right], center: [c.left, c.right],
    spill: drawn(side).filter((n) => box(n).right > c.left + 0.5 || box(n).left < s.left - 0.5)
      .map(name),
    intrude: drawn(center).filter((n) => box(n).left < s.right + 0.5).map(name),
    sideOverflow: side.scrollWidth - side.clientWidth,
    pageOverflow: document.documentElement.scrollWidth - innerWidth,
    topology: box(document.getElementById('peers')).top,
    services: box(document.getElementById('services')).top,
    hidden: [...document.querySelectorAll('#experiment-view .wide')].filter((w) =>
      w.scrollWidth > w.clientWidth).map((w) => w.firstElementChild.id),
    variants: box(document.getElementById('exp-variants')).bottom,
    plots: [...document.querySelectorAll('#exp-variants svg.plot')].map((p) => box(p).bottom),
    samplesTop: box(document.querySelector('#exp-samples tbody')).top,
    ids: [...document.querySelectorAll('#exp-samples td.sample-id')].map((td) => ({
      text: td.textContent, clipped: td.scrollWidth > td.clientWidth + 1,
      width: box(td).width})),
  };
})()"""

def resize(browser: Browser, width: int, height: int) -> None:
    browser.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                        "deviceScaleFactor": 1, "mobile": False})
    wait_for(lambda: browser.evaluate("innerWidth") == width, 10, f"the page at {width} px")


def check_layout(at: dict[str, Any], ids: list[str]) -> None:
    where = f"at {at['width']}x{at['height']}"
    assert at["spill"] == [] and at["sideOverflow"] <= 0, (where, at["spill"])
    assert at["intrude"] == [], (where, at["intrude"])
    assert at["pageOverflow"] <= 0, where  # no sideways scrolling of the page
    assert at["hidden"] == [], where  # nor of a table: every column in view
    assert at["side"][1] <= at["center"][0], where
    # the first screen: Topology and Services, the variant table and its plot
    assert at["services"] < at["height"] and at["topology"] < at["height"], where
    assert len(at["plots"]) == 2 and max(at["plots"]) < at["height"], where
    assert at["variants"] < at["samplesTop"] < at["height"], where
    # each sample's id shown whole (wrapped, not clipped) in a column a person can read
    assert [i["text"].lstrip("▸▾") for i in at["ids"]] == sorted(ids), where
    assert not any(i["clipped"] for i in at["ids"]) and min(i["width"] for i in at["ids"]) > 120


def check_rollup(shown: dict[str, Any], report: dict[str, Any], ids: list[str]) -> None:
    """One row a sample, its repeats folded (check_values: equal to the report's
    `per_sample`), a mark a repeat of each variant."""
    assert sorted(s["sample"] for s in shown["samples"]) == sorted(ids)
    assert all(len(v["per_sample"]) == SAMPLES for v in report["variants"])
    assert all(s["marks"] == 2 * 3 for s in shown["samples"])


def check_totals(shown: dict[str, Any], cells: int) -> None:
    exp = [(k, text, title) for k, text, title in shown["totals"] if k.startswith("exp:")]
    assert [k for k, _, _ in exp] == [f"exp:{E}"], exp  # not a row a `E.variant.rN` tag
    runs = int(exp[0][1].split()[0])
    assert runs >= cells and "0 running" in exp[0][1], exp  # cells and the critic's runs
    assert exp[0][2].startswith(f"{E}: 6 cell tags"), exp


def test_the_experiment_page_reads_right_at_two_sizes(tmp_path: Path) -> None:
    binary = chromium()
    ids = prepare(tmp_path)
    browser = Browser(binary, tmp_path / "profile")
    procs: list[Any] = []
    try:
        with example(tmp_path, "experiment", copy=False) as ex:
            run = subprocess.run(busctl("experiment", "run", SPEC, "--name", E, "--limit",
                                        str(SAMPLES), "--hub", ex.endpoint),
                                 capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                 env={**os.environ, **ENV})
            assert run.returncode == 0, run.stdout + run.stderr
            report = report_json(tmp_path, ex.endpoint, E)
            cells = SAMPLES * 2 * 3
            ui = start_ui(ex.endpoint, procs)
            browser.open(f"{ui['url']}#experiment={E}")

            def drawn() -> dict[str, Any]:
                shown: dict[str, Any] = browser.evaluate(READ_PAGE) or {}
                exp = [t for k, t, _ in shown.get("totals", []) if k == f"exp:{E}"]
                ready = len(shown.get("samples", [])) == SAMPLES and exp \
                    and int(exp[0].split()[0]) >= cells and "0 running" in exp[0]
                return shown if ready else {}

            shown = wait_for(drawn, 20, "the experiment and its runs' totals drawn")
            check_values(shown, report)
            assert all(v["cost"] > 0 for v in report["variants"])  # priced: the digits shown
            check_rollup(shown, report, ids)
            check_totals(shown, cells)
            assert shown["failed"].startswith("6 cells ended without a normal answer")

            # the timed-out sample opens to its cells: both variants, every repeat
            slow = next(i for i in ids if i.startswith("q03-"))
            browser.evaluate(f"document.querySelector('tr.sample[data-sample=\"{slow}\"]')"
                             ".click()")
            opened = wait_for(lambda: (s := browser.evaluate(READ_PAGE) or {}).get("cells") and s, 10,
                              "the sample's cells")
            assert sorted((c["variant"], c["repeat"]) for c in opened["cells"]) == [
                (v, str(r)) for v in ("solo", "team") for r in (1, 2, 3)]
            assert all(c["sample"] == slow and c["run"] for c in opened["cells"])

            # a click on a variant's heading: its worst samples first; on "sample": by id
            browser.evaluate("document.querySelector('#exp-samples th[data-variant=solo]')"
                             ".click()")
            worst = wait_for(lambda: (s := browser.evaluate(READ_PAGE) or {}).get("samples")
                             and s["samples"][0]["sample"] != ids[0] and s, 10, "sorted")
            means = [s["per_variant"]["solo"]["mean"] for s in worst["samples"]]
            known = [m for m in means if m is not None]
            assert means == [None] * (len(means) - len(known)) + sorted(known), means
            browser.evaluate("document.querySelector('#exp-samples th.sortable').click()")
            wait_for(lambda: browser.evaluate(READ_PAGE)["samples"][0]["sample"] == ids[0], 10,
                     "sorted by id again")

            for width, height in SIZES:
                resize(browser, width, height)
                shot = tmp_path / f"page-{width}.png"
                browser.screenshot(shot)
                shutil.copy(shot, f"/tmp/page-{width}.png")  # to look at (issue 48)
                assert shot.stat().st_size > 10_000
                check_layout(browser.evaluate(LAYOUT), ids)
    finally:
        browser.close()
        for proc in reversed(procs):
            proc.stop()
