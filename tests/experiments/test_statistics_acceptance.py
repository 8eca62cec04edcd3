"""Issue 48, acceptance 1: a known dataset on a real topology — the scripted model (`busctl
fake-llm`), 15 samples × 3 repeats × 2 variants, some cells timing out — and the report's
headline, every scorer, the interval and the paired comparison checked against a computation
per sample made here from the script (with scipy.stats); then the table, `--json` and the
results file agree, and a resume (which runs the cells in error again) has a progress line
counting the whole experiment's tokens.

The model is deterministic: a variant answers a sample the same way in every repeat, so each
sample has one 0/1 outcome a variant for `number` (McNemar's exact test), while the `words`
scorer (a `python` scorer kept next to the spec, found with no PYTHONPATH) gives fractions
(the paired t test)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from scipy import stats as sp

from tests.examples.test_examples import ENV, example
from tests.support import ROOT, busctl

E = "st-1"
SAMPLES = 15
REPEATS = 3
TIMEOUT = 4.0  # run.timeout: a timed-out sample's reply waits 60 s
# per variant: the samples (1-based) answered right, answered wrong, timing out, and ending in
# an error (a content filter; run.retries = 0)
PLAN = {"a": {"right": range(1, 11), "wrong": range(11, 14), "slow": range(14, 16)},
        "b": {"right": [*range(1, 9), *range(11, 15)], "wrong": [9], "slow": [15],
              "error": [10]}}
# the answers' words (the `words` scorer: min(1, words / 5)): a's right answers have 4
ANSWER = {("a", "right"): "The answer is {t}", ("b", "right"): "So the answer is {t}",
          ("a", "wrong"): "Maybe 7", ("b", "wrong"): "Maybe 7"}

SPEC = f"""name = "stats"
[dataset]
path = "stats.jsonl"
[[variants]]
name = "a"
agent = "solo"
[[variants]]
name = "b"
agent = "solo"
system_prompt_file = "b_prompt.txt"
[run]
repeats = {REPEATS}
concurrency = 8
retries = 0
timeout = {TIMEOUT}
[[scorers]]
kind = "number"
[[scorers]]
kind = "python"
name = "words"
fn = "word_scorer:words"
"""

SCORER = """def words(answer, sample):
    return min(1.0, len(answer.split()) / 5)
"""


def target(i: int) -> int:
    return 10 * i + 3


def script() -> dict[str, Any]:
    """One rule a variant and sample; b's first (its prompt says SOLO-B, a's SOLO)."""
    rules = []
    for variant, system in (("b", "SOLO-B"), ("a", "SOLO")):
        for kind, samples in PLAN[variant].items():
            for i in samples:
                rule: dict[str, Any] = {"system": [system], "contains": [f"[s{i:02d}]"],
                                        "reply": {"usage": {"input": 10, "output": 5}}}
                if kind == "slow":
                    rule["delay"], rule["reply"]["text"] = 60.0, "too late"
                elif kind == "error":
                    rule["reply"] |= {"text": "no", "finish": "content_filter"}
                else:
                    rule["reply"]["text"] = ANSWER[(variant, kind)].format(t=target(i))
                rules.append(rule)
    return {"rules": rules}


def expected(variant: str, scorer: str) -> dict[str, float]:
    """Each sample's score by the documented rule (a timeout or an error scores 0), from the
    script."""
    out = {}
    for kind, samples in PLAN[variant].items():
        for i in samples:
            if kind in ("slow", "error"):
                value = 0.0
            elif scorer == "number":
                value = 1.0 if kind == "right" else 0.0
            else:
                value = min(1.0, len(ANSWER[(variant, kind)].split()) / 5)
            out[f"s{i:02d}"] = value
    return out


def t_ci(values: list[float]) -> list[float]:
    n = len(values)
    lo, hi = sp.t.interval(0.95, n - 1, loc=sum(values) / n, scale=sp.sem(values))
    return [max(0.0, lo), min(1.0, hi)]


def prepare(tmp_path: Path) -> Path:
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    (copy / "stats.toml").write_text(SPEC)
    (copy / "word_scorer.py").write_text(SCORER)
    (copy / "b_prompt.txt").write_text("You are SOLO-B, a careful calculator.")
    (copy / "stats.jsonl").write_text("".join(
        json.dumps({"id": f"s{i:02d}", "input": f"[s{i:02d}] What is {target(i)} + 0?",
                    "target": target(i)}) + "\n" for i in range(1, SAMPLES + 1)))
    (copy / "fake_model.json").write_text(json.dumps(script()))
    topology = copy / "topology.toml"  # priced: a cell costs $0.00002, printed with its digits
    topology.write_text(topology.read_text().replace(
        'base_url = "http://127.0.0.1:7483/v1"',
        'base_url = "http://127.0.0.1:7483/v1"\ninput_price = 1.0\noutput_price = 2.0'))
    return copy


def cli(cwd: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(busctl("experiment", *args, "--hub", endpoint), capture_output=True,
                         text=True, timeout=180, cwd=cwd, env={**env, **ENV})
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def on_a_terminal(cwd: Path, endpoint: str, *args: str) -> str:
    """stderr of a busctl run on a pseudo-terminal (the progress line is drawn only there)."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(busctl("experiment", *args, "--hub", endpoint), cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=follower, timeout=120,
                              env={**os.environ, **ENV})
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the writer is gone and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
    assert proc.returncode == 0
    return b"".join(chunks).decode()


def test_known_dataset_headline_scorers_interval_comparison_and_agreement(
        tmp_path: Path) -> None:
    prepare(tmp_path)
    with example(tmp_path, "experiment", copy=False) as ex:
        cli(ex.cwd, ex.endpoint, "run", "examples/experiment/stats.toml", "--name", E)
        data = json.loads(cli(ex.cwd, ex.endpoint, "report", E, "--json").stdout)
        table = cli(ex.cwd, ex.endpoint, "report", E).stdout
        plots = cli(ex.cwd, ex.endpoint, "report", E, "--plot", "plots").stderr
        within = json.loads(cli(ex.cwd, ex.endpoint, "compare", E, "--variants", "a", "b",
                                "--json").stdout)
        words = json.loads(cli(ex.cwd, ex.endpoint, "compare", E, "--variants", "a", "b",
                               "--scorer", "words", "--json").stdout)
        compare_text = cli(ex.cwd, ex.endpoint, "compare", E, "--variants", "a", "b").stdout
        env = {**os.environ, **ENV}
        unknown = subprocess.run(busctl("experiment", "compare", E, "--variants", "a", "c",
                                        "--hub", ex.endpoint), capture_output=True, text=True,
                                 timeout=60, cwd=ex.cwd, env=env)
        assert unknown.returncode == 2 and "--variants" in unknown.stderr and \
            "has no variant `c` (its variants: a, b)" in unknown.stderr, unknown.stderr
        resumed = on_a_terminal(ex.cwd, ex.endpoint, "run", "examples/experiment/stats.toml",
                                "--resume", E)
    rows = [json.loads(line) for line in (ex.cwd / "results" / f"{E}.jsonl").read_text().splitlines()]

    # the headline and every scorer, per variant, against the per-sample computation
    assert (data["samples"], data["repeats"], data["done"], data["counted"], data["planned"]) == \
        (15, 3, 87, 90, 90)  # b's 3 cells in error are not done: a resume runs them again
    for v in data["variants"]:
        slow = len(PLAN[v["name"]]["slow"]) * REPEATS
        errors = len(PLAN[v["name"]].get("error", [])) * REPEATS
        assert (v["samples"], v["repeats"], v["cells"]) == (15, 3, 45)
        assert (v["timed_out"], v["limited"], v["errors"]) == (slow, 0, errors)
        for scorer in ("number", "words"):
            means = list(expected(v["name"], scorer).values())
            got = v["scores"][scorer]
            assert got["mean"] == pytest.approx(sum(means) / 15)
            assert got["ci95"] == pytest.approx(t_ci(means), rel=1e-9)
            assert (got["samples"], got["cells"], got["method"]) == (15, 45, "t_samples")
        assert (v["score"], v["ci95"]) == (v["scores"]["number"]["mean"],
                                           v["scores"]["number"]["ci95"])
        assert v["tokens"] == (45 - slow) * 15  # a timed-out cell has no reply
        assert v["cost"] == pytest.approx((45 - slow) * 0.00002)
        assert {r["sample"]: r["mean"] for r in v["per_sample"]} == \
            pytest.approx(expected(v["name"], "number"))
        assert all(len(r["statuses"]) == 3 for r in v["per_sample"])
    a, b = data["variants"]
    assert (a["score"], b["score"]) == (pytest.approx(10 / 15), pytest.approx(12 / 15))

    # the paired comparison: number is one 0/1 outcome a sample: McNemar exact, per sample
    ea, eb = expected("a", "number"), expected("b", "number")
    better = sum(eb[s] > ea[s] for s in ea)
    worse = sum(eb[s] < ea[s] for s in ea)
    [v] = within["variants"]
    assert (v["test"], v["samples"], v["better"], v["worse"]) == \
        ("mcnemar_exact", 15, better, worse) == ("mcnemar_exact", 15, 4, 2)  # s09, s10 worse
    assert v["p_value"] == pytest.approx(sp.binomtest(worse, better + worse).pvalue)
    diffs = [eb[s] - ea[s] for s in ea]
    assert v["effect"] == pytest.approx(sum(diffs) / 15)
    lo, hi = sp.t.interval(0.95, 14, loc=sum(diffs) / 15, scale=sp.sem(diffs))
    assert v["ci95"] == pytest.approx([lo, hi], rel=1e-9)
    # words: fractions, so the paired t test on the per-sample means
    wa, wb = expected("a", "words"), expected("b", "words")
    [w] = words["variants"]
    assert w["test"] == "paired_t" and w["p_value"] == pytest.approx(
        sp.ttest_rel([wb[s] for s in wa], [wa[s] for s in wa]).pvalue, rel=1e-9)
    assert f"effect {v['effect']:+.3f} 95% CI [{lo:.3f}, {hi:.3f}]" in compare_text
    assert f"McNemar exact p = {v['p_value']:.3g}" in compare_text

    # the table says what --json says
    for v in data["variants"]:
        [line] = [x for x in table.splitlines() if x.startswith(f"{v['name']} ")]
        lo, hi = v["ci95"]
        assert re.search(rf"15×3\s+{v['score']:.3f}\s+\[{lo:.3f}, {hi:.3f}\]\s+"
                         rf"{v['timed_out']}\s+0\s+{v['errors']}\s+{v['tokens']}\s+\$0\.000",
                         line), line
        [words_line] = [x for x in table.splitlines()[table.splitlines().index(line) + 1:]
                        if "words" in x][:1]
        assert f"{v['scores']['words']['mean']:.3f}" in words_line

    # the results file: the rule's statuses and scores, and the report follows from its rows
    assert len(rows) == 90 and {r["status"] for r in rows} == {"ok", "timed_out", "error"}
    assert all(r["score_number"] == r["score_words"] == r["score"] == 0.0
               for r in rows if r["status"] != "ok")
    for v in data["variants"]:
        for scorer in ("number", "words"):
            per: dict[str, list[float]] = {}
            for r in rows:
                if r["variant"] == v["name"]:
                    per.setdefault(r["sample"], []).append(r[f"score_{scorer}"])
            means = [sum(x) / len(x) for x in per.values()]
            assert sum(means) / len(means) == pytest.approx(v["scores"][scorer]["mean"])
        assert sum(r["tokens"] for r in rows if r["variant"] == v["name"]) == v["tokens"]
        for status, key in (("timed_out", "timed_out"), ("error", "errors")):
            assert sum(r["status"] == status for r in rows
                       if r["variant"] == v["name"]) == v[key]

    # plots: 1200 px wide, written after the report
    assert "score.png" in plots
    for name in ("score", "cost", "time"):
        png = (ex.cwd / "plots" / f"{name}.png").read_bytes()
        assert struct.unpack(">II", png[16:24]) == (1200, 600)

    # the resume runs b's 3 cells in error again (they fail again, the same way): its
    # progress line counts the 87 cells kept too, failures and tokens
    last = resumed.replace("\r", "\n").split("\x1b[K")[-1]
    total = sum(v["tokens"] for v in data["variants"])
    assert "90/90 done, 0 running, 12 failed, ETA " in last, resumed
    assert f" {total} tokens, $0.00" in last, resumed
