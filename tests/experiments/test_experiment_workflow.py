"""`busctl experiment` (issue 30): the spec and its errors, the scorers, the statistics checked
against hand computations, and the shipped example run on its scripted model: its report's
numbers, then a runner SIGKILLed mid-run and resumed — n per variant exactly as planned, no
cell journaled twice."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agent_bus.agents.experiment import report as rep
from agent_bus.agents.experiment.runner import Journal, SampleResult, read_journal
from agent_bus.agents.experiment.scoring import score
from agent_bus.agents.experiment.spec import Sample, Scorer, SpecError, load_spec
from agent_bus.bus.client import connect
from tests.examples.test_examples import ENV, example
from tests.support import ROOT, Proc, busctl, wait_for

SPEC = ROOT / "examples" / "experiment" / "spec.toml"

GOOD = """
name = "qa"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "solo"
agent = "assistant"
{extra}
"""


def write_spec(tmp_path: Path, extra: str = "", samples: str = "") -> Path:
    (tmp_path / "samples.jsonl").write_text(samples or '{"id": 1, "input": "hi", "target": "x"}\n')
    path = tmp_path / "spec.toml"
    path.write_text(GOOD.format(extra=extra))
    return path


@pytest.mark.parametrize(("extra", "samples", "message"), [
    ('set = { temperature = 3 }', "", "variants[0].set.temperature: Expected `float` <= 2"),
    ('set = { colour = "red" }', "", "variants[0].set.colour: unknown key `colour`"),
    ('set = { max_turns = 0 }', "", "variants[0].set.max_turns: expected a whole number"),
    ('tools = ["read_file"]', "", "variants[0].tools: an agent's tools are fixed"),
    ('[run]\nrepeats = 0', "", "run.repeats: Expected `int` >= 1"),
    ('[run]\nconcurency = 3', "", "run.concurency: unknown key"),
    ('[[scorers]]\nkind = "fuzzy"', "", "scorers[0].kind: 'fuzzy' is not one of the values"),
    ('[[scorers]]\nkind = "python"\nfn = "nosuchmod:f"', "", "scorers[0].fn: 'nosuchmod:f': "
     "cannot import module"),
    ('[[scorers]]\nkind = "regex"\npattern = "("', "", "scorers[0].pattern: not a regular"),
    ("", '{"id": "a", "input": "x"}\n{"id": "a", "input": "y"}\n', "samples.jsonl:2: id: 'a' is"
     " also the id on line 1"),
    ("", '{"id": "a", "input": 3}\n', "samples.jsonl:1: input: Expected `str`"),
    ("", '{"id": "a", "input": "x", "files": ["gone.txt"]}\n', "samples.jsonl:1: files[0]: no "
     "file 'gone.txt'"),
    ("", '{"id": "a", "input": "x", "files": {"in.txt": "gone.txt"}}\n', "samples.jsonl:1: "
     "files.in.txt: no file 'gone.txt'"),
    ("", '{"id": "a", "input": "x", "files": {"../up.txt": "samples.jsonl"}}\n', "samples.jsonl:1:"
     " files.../up.txt: file name '../up.txt': a relative path"),
    ('[run]\nworkspace = "shared"', '{"id": "a", "input": "x", "files": ["samples.jsonl"]}\n',
     'run.workspace: "shared" runs every sample'),
    ('[run.per_model]\nlocal = 0', "", "run.per_model.local: 0 sessions at once; expected 1 to"),
])
def test_spec_errors_name_the_key(tmp_path: Path, extra: str, samples: str, message: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(write_spec(tmp_path, extra, samples))
    assert message in str(caught.value)


def test_check_exits_2_naming_the_key_and_summarises_a_good_spec(tmp_path: Path) -> None:
    bad = subprocess.run(busctl("experiment", "check", str(write_spec(tmp_path, "agent2 = 1"))),
                         capture_output=True, text=True, timeout=20)
    assert bad.returncode == 2 and "variants[0].agent2: unknown key" in bad.stderr, bad.stderr
    good = subprocess.run(busctl("experiment", "check", str(SPEC)), capture_output=True,
                          text=True, timeout=20)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout) == {"name": "arith", "samples": 20, "variants": ["solo", "team"],
                                       "repeats": 3, "sessions": 120, "concurrency": 8,
                                       "scorers": ["number"]}


def test_variant_settings_reach_the_gateway_overlay_per_repeat(tmp_path: Path) -> None:
    loaded = load_spec(write_spec(tmp_path, 'set = { temperature = 0.5, "critic.top_p" = 0.9 }\n'
                                            'model = "b"\n[run]\nseed = 10\nrepeats = 2'))
    variant = loaded.spec.variants[0]
    two = loaded.overrides(variant, 2)
    assert (two["assistant"].temperature, two["assistant"].model, two["assistant"].seed) == \
        (0.5, "b", 11)
    assert two["critic"].top_p == 0.9 and two["critic"].seed is None


def test_scorers() -> None:
    sample = Sample(id="s", input="?", target=42)
    assert score(Scorer(kind="number"), "so it is 41.9 or 42", sample) == 1.0
    assert score(Scorer(kind="number", tolerance=0.2), "about 41.9", sample) == 1.0
    assert score(Scorer(kind="number"), "about 41.9", sample) == 0.0
    assert score(Scorer(kind="exact"), " 42\n", sample) == 1.0
    assert score(Scorer(kind="includes"), "THE answer: 42!", sample) == 1.0
    assert score(Scorer(kind="regex", pattern=r"answer:\s*4\d"), "Answer: 42", sample) == 1.0
    assert score(Scorer(kind="json_field", field="result.value"),
                 'here: {"result": {"value": 42}}', sample) == 1.0
    assert score(Scorer(kind="json_field", field="result.value"), "no json", sample) == 0.0
    assert score(Scorer(kind="python", fn="operator:is_not"), "x", sample) == 1.0
    assert score(Scorer(kind="exact"), "x", Sample(id="t", input="?")) is None  # no target


def _cells(experiment: str, scores: list[float]) -> Journal:
    results = [SampleResult(experiment, "v", f"s{i}", 1, "ok", score=s, scores={"x": s})
               for i, s in enumerate(scores)]
    return Journal(None, {r.key: r for r in results})


def test_compare_pairs_samples_and_names_the_flips() -> None:
    data = rep.compare(_cells("a", [1, 1, 0, 0, 1]), _cells("b", [1, 0, 1, 1, 1]), ("a", "b"))
    [v] = data["variants"]
    assert (v["samples"], v["better"], v["worse"], v["test"]) == (5, 2, 1, "mcnemar_exact")
    assert v["p_value"] == pytest.approx(1.0)
    assert [f["sample"] for f in v["changed"]] == ["s1", "s2", "s3"]


def t95(values: list[float]) -> list[float]:
    """The report's interval by hand: t over per-sample means, kept in [0, 1]."""
    n, mean = len(values), sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = 2.093024054408263 * sd / math.sqrt(n)  # t(0.975, 19)
    return [max(0.0, mean - half), min(1.0, mean + half)]


def journal_of(endpoint: str, experiment: str) -> Journal:
    async def read() -> Journal:
        async with connect(endpoint, name="test-journal") as peer:
            return await read_journal(peer, experiment)
    return anyio.run(read)


def run_cli(ex_cwd: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl("experiment", *args, "--hub", endpoint), capture_output=True,
                          text=True, timeout=60, cwd=ex_cwd)


GRADED = """
name = "graded"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "solo"
agent = "solo"
[[scorers]]
kind = "model"
name = "judge"
template = "You are a strict GRADER. Answer {answer} to {input}, reference {target}."
[[scorers]]
kind = "number"
"""


LIMITED = """
name = "limited"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "team"
agent = "solver"
system_prompt_file = "limited_prompt.txt"
[run]
token_limit = 150
[[scorers]]
kind = "number"
"""


def test_example_report_then_sigkill_and_resume(tmp_path: Path) -> None:
    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    script = json.loads((copy / "fake_model.json").read_text())
    script["rules"].insert(0, {"system": [], "contains": ["strict GRADER"],
                               "reply": {"text": "Looks fine.\nGRADE: C"}})
    (copy / "fake_model.json").write_text(json.dumps(script))
    (copy / "graded.toml").write_text(GRADED)
    (copy / "limited.toml").write_text(LIMITED)
    # the limited run's solver answers only after 5 s: the abort at its limit lands first
    (copy / "limited_prompt.txt").write_text("You are the SOLVER (LIMITED). Work out a draft "
                                              "answer, then have it checked with ask_critic.")
    script["rules"].insert(0, {"system": ["LIMITED"], "tool_result": True, "delay": 5.0,
                               "reply": {"text": "Final answer: {tool_results}"}})
    (copy / "fake_model.json").write_text(json.dumps(script))
    (copy / "nobody.toml").write_text(LIMITED.replace('agent = "solver"', 'agent = "nobody"'))
    (copy / "alias.toml").write_text(LIMITED.replace('agent = "solver"',
                                                     'agent = "solver"\nmodel = "nosuch"'))
    with example(tmp_path, "experiment", copy=False) as ex:
        spec = "examples/experiment/spec.toml"
        out = run_cli(ex.cwd, ex.endpoint, "run", spec, "--name", "arith-1")
        assert out.returncode == 0, out.stdout + out.stderr
        rows = [json.loads(line) for line in
                (ex.cwd / "results" / "arith-1.jsonl").read_text().splitlines()]
        assert len(rows) == 120 and {r["status"] for r in rows} == {"ok"}
        data = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "arith-1", "--json").stdout)
        solo, team = data["variants"]
        # by hand: solo answers 5 of the 20 questions wrong, every repeat; the critic fixes them
        assert (solo["name"], solo["samples"], solo["repeats"], solo["score"]) == \
            ("solo", 20, 3, 0.75)
        assert solo["ci95"] == pytest.approx(t95([0.0] * 5 + [1.0] * 15))
        assert (team["name"], team["n"], team["score"], team["failures"]) == ("team", 60, 1.0, 0)
        assert team["ci95"] == [1.0, 1.0]  # every sample right every time: no spread
        # tokens from the script: solo 48 a sample; team 232 (solver) + 70 (critic, asked)
        assert (solo["tokens"], team["tokens"]) == (60 * 48, 60 * 302)
        assert solo["stop_reasons"] == {"stop": 60} and team["turns_mean"] == 2.0

        # what the running topology refuses exits 2 naming the key, before anything is logged
        for file, key in (("nobody", "variants[0].agent: no live coordinator serves agent "
                                     "`nobody`"),
                          ("alias", "variants (model / set.model): model alias nosuch")):
            out = run_cli(ex.cwd, ex.endpoint, "run", f"examples/experiment/{file}.toml",
                          "--name", file)
            assert out.returncode == 2 and key in out.stderr, out.stderr
            assert journal_of(ex.endpoint, file).plan is None

        # one cell (the team's session and the critic run it asked) replays identical
        out = run_cli(ex.cwd, ex.endpoint, "replay", "arith-1", "--sample", "q03", "--variant",
                      "team", "--repeat", "2")
        assert out.returncode == 0 and "replayed as arith-1.team.r2.replay-" in out.stdout \
            and out.stdout.rstrip().endswith(": identical"), out.stdout + out.stderr

        runner = Proc(busctl("experiment", "run", spec, "--name", "arith-2", "--hub",
                             ex.endpoint), cwd=ex.cwd, env=ENV)
        try:
            wait_for(lambda: len(journal_of(ex.endpoint, "arith-2").results) >= 20, 30,
                     "20 cells journaled")
            runner.signal(signal.SIGKILL)
            runner.popen.wait(5)
        finally:
            runner.stop()
        partial = journal_of(ex.endpoint, "arith-2")
        assert len(partial.results) < 120, "the runner finished before it was killed"
        out = run_cli(ex.cwd, ex.endpoint, "run", spec, "--resume", "arith-2")
        assert out.returncode == 0, out.stdout + out.stderr
        done = journal_of(ex.endpoint, "arith-2")
        assert done.ok_entries == 120  # no cell journaled twice
        data = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "arith-2", "--json").stdout)
        assert [(v["name"], v["n"], v["score"]) for v in data["variants"]] == \
            [("solo", 60, 0.75), ("team", 60, 1.0)]
        assert data["duplicates"] == 0
        compared = json.loads(run_cli(ex.cwd, ex.endpoint, "compare", "arith-1", "arith-2",
                                      "--json").stdout)
        assert [(v["samples"], v["better"], v["worse"]) for v in compared["variants"]] == \
            [(20, 0, 0), (20, 0, 0)]

        # no --name: a fresh id (its journal is not looked for in the log)
        out = run_cli(ex.cwd, ex.endpoint, "run", spec, "--limit", "1")
        assert out.returncode == 0, out.stdout + out.stderr
        fresh = re.search(r"6 results in results/(arith-[0-9a-f]{12})\.jsonl", out.stderr)
        assert fresh, out.stderr
        assert journal_of(ex.endpoint, fresh.group(1)).plan is not None

        # a `model` scorer, graded through the gateway (the script grades every answer C)
        out = run_cli(ex.cwd, ex.endpoint, "run", "examples/experiment/graded.toml", "--name",
                      "graded-1", "--limit", "4")
        assert out.returncode == 0, out.stdout + out.stderr
        [solo] = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "graded-1",
                                    "--json").stdout)["variants"]
        assert (solo["n"], solo["score"]) == (4, 1.0)  # q03 is wrong, by number, not by judge
        assert solo["scores"]["number"]["mean"] == 0.75

        # run.token_limit: the solver's first call (100 tokens) and the critic's (70) pass 150,
        # so the solver is aborted before its answer: `limited`, scored 0 (the failure rule)
        out = run_cli(ex.cwd, ex.endpoint, "run", "examples/experiment/limited.toml", "--name",
                      "limited-1", "--limit", "2")
        assert out.returncode == 0, out.stdout + out.stderr
        [team] = json.loads(run_cli(ex.cwd, ex.endpoint, "report", "limited-1",
                                    "--json").stdout)["variants"]
        assert (team["n"], team["limited"], team["failures"], team["stop_reasons"]) == \
            (2, 2, 2, {"limit": 2})
        # the solver's answer call was under way when the abort came: it is billed as estimated
        # from its request (issue 34: totals are what was billed), on top of the 170
        assert team["tokens"] >= 2 * 170 and team["score"] == 0.0




def test_plot_writes_three_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from agent_bus.agents.experiment.plot import plot

    journal = _cells("p", [1, 0, 1, 1])
    written = plot(rep.report(journal, "p"), tmp_path / "plots")
    assert [p.name for p in written] == ["score.png", "cost.png", "time.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_inspect_eval_through_the_bridge_scores_as_the_report(tmp_path: Path) -> None:
    """Issue 30, acceptance 4: `inspect eval` of the example task on the bus completes, and its
    per-sample scores equal the report's (the `number` scorer and Inspect's numeric `match`
    agree on this dataset)."""
    pytest.importorskip("inspect_ai")
    from inspect_ai.log import read_eval_log

    copy = tmp_path / "examples" / "experiment"
    shutil.copytree(ROOT / "examples" / "experiment", copy)
    spec = (copy / "spec.toml").read_text().replace("repeats = 3", "repeats = 1")
    (copy / "spec.toml").write_text(spec)
    with example(tmp_path, "experiment", copy=False) as ex:
        out = run_cli(ex.cwd, ex.endpoint, "run", "examples/experiment/spec.toml", "--name",
                      "arith-1", "--limit", "6")
        assert out.returncode == 0, out.stdout + out.stderr
        ours = journal_of(ex.endpoint, "arith-1").results
        inspect = Path(sys.executable).with_name("inspect")
        done = subprocess.run(
            [str(inspect), "eval", "examples/experiment/inspect_task.py", "--model",
             "mockllm/model", "-T", "agent=solo", "-T", f"hub={ex.endpoint}", "-T",
             "experiment=insp-1", "--limit", "6", "--log-dir", str(tmp_path / "logs"),
             "--display", "none"], capture_output=True, text=True, timeout=120, cwd=ex.cwd,
            env={**os.environ, **ENV})
        assert done.returncode == 0, done.stdout + done.stderr
        [log_file] = (tmp_path / "logs").glob("*.eval")
        log = read_eval_log(str(log_file))
        assert log.status == "success" and log.samples is not None and len(log.samples) == 6
        theirs = {str(s.id): 1.0 if s.scores["match"].value == "C" else 0.0 for s in log.samples}
        assert theirs == {sample: result.score for (variant, sample, repeat), result
                          in ours.items() if variant == "solo" and repeat == 1}
        assert sorted(theirs.values()) == [0.0] + [1.0] * 5  # q03: solo is wrong
        assert all(s.metadata["bus"]["stop_reason"] == "stop" for s in log.samples)
