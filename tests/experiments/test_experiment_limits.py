"""`busctl experiment run` on a real topology (issue 30, the rest of item 1): `run.per_model`
bounds the sessions at once of the variants on one model, seen in the event stream; and each
sample's `files` land in a fresh workspace of its own on the tool worker, which its tool calls
(and nothing else) see."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents import connect
from agent_bus.agents.coordinator.persistence import ConversationStore, JournaledRun
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.errors import RemoteError
from agent_bus.bus.messages import MAX_WORKSPACE_BYTES, RunWorkspace
from tests.cli.conftest import start_up
from tests.coordinator.conftest import calls, start_stack, text
from tests.examples.helpers import stop_up
from tests.examples.test_examples import ENV
from tests.support import busctl, until

SLOW = 0.4  # seconds each scripted reply waits: the sessions of a cell overlap

SCRIPT = {
    "rules": [
        # workspace samples: read the sample's own file, write one, list the folder
        {"system": ["FILER"], "contains": ["read"], "tool_result": False,
         "reply": {"text": "Reading.", "tool_calls": [
             {"name": "read_file", "arguments": {"path": "input.txt"}},
             {"name": "write_file", "arguments": {"path": "written.txt",
                                                  "content": "by {last_user}"}}]}},
        {"system": ["FILER"], "contains": ["list"], "tool_result": False,
         "reply": {"text": "Listing.", "tool_calls": [
             {"name": "list_dir", "arguments": {"path": "."}}]}},
        {"system": ["FILER"], "contains": ["shell"], "tool_result": False,
         "reply": {"text": "Shell.", "tool_calls": [{"name": "run_shell", "arguments": {
             "command": "cat extra.txt; ls ..; echo mine > mine.txt; echo bad > ../../../../x"
         }}]}},
        {"system": ["FILER"], "tool_result": True,
         "reply": {"text": "Saw: {tool_results_full}"}},
        # a team: the lead asks the filer, whose tools run in the lead's sample's workspace
        {"system": ["LEAD"], "tool_result": False, "reply": {"text": "Asking.", "tool_calls": [
            {"name": "ask_filer", "arguments": {"prompt": "{last_user}"}}]}},
        {"system": ["LEAD"], "tool_result": True, "reply": {"text": "Lead: {tool_results_full}"}},
        {"system": ["ALPHA", "BETA"], "delay": SLOW, "reply": {"text": "done: {last_user}"}},
    ],
}

TOPOLOGY = """
[hub]
heartbeat_interval = 0.2

[models.one]
provider = "openai"
model = "fake-one"
base_url = "{base_url}"

[models.two]
provider = "openai"
model = "fake-two"
base_url = "{base_url}"

[[workers]]
name = "tools"
tools = ["agent_bus.tools.builtin"]
workspace = "shared"
concurrency = 4
shell = true

[[agents]]
name = "alpha"
model = "one"
system_prompt = "You are ALPHA."
tools = []

[[agents]]
name = "beta"
model = "two"
system_prompt = "You are BETA."
tools = []

[[agents]]
name = "filer"
system_prompt = "You are the FILER."
tools = ["read_file", "write_file", "list_dir", "run_shell"]

[[agents]]
name = "lead"
system_prompt = "You are the LEAD."
tools = []
agents = ["filer"]
"""


class Up:
    def __init__(self, endpoint: str, cwd: Path) -> None:
        self.endpoint, self.cwd = endpoint, cwd

    def experiment(self, *args: str) -> subprocess.CompletedProcess[str]:
        hub = ("--hub", self.endpoint) if args[0] != "check" else ()
        return subprocess.run(busctl("experiment", *args, *hub),
                              capture_output=True, text=True, timeout=60, cwd=self.cwd)

    def events(self, *types: str) -> list[dict[str, Any]]:
        flags = [arg for t in types for arg in ("--type", t)]
        out = subprocess.run(busctl("watch", "--hub", self.endpoint, "--json", "--no-follow",
                                    "--since", "0", *flags),
                             capture_output=True, text=True, timeout=30, cwd=self.cwd)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cwd = tmp_path_factory.mktemp("limits")
    (cwd / "shared").mkdir()
    (cwd / "shared" / "input.txt").write_text("the shared one\n")
    with FakeLLMServer(SCRIPT) as srv:
        (cwd / "topology.toml").write_text(TOPOLOGY.replace("{base_url}", srv.base_url))
        proc, ready = start_up(cwd, "-c", "topology.toml")
        try:
            yield Up(ready["endpoint"], cwd)
        finally:
            stop_up(proc)


def write(folder: Path, spec: str, samples: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (folder / "spec.toml").write_text(spec)
    return folder / "spec.toml"


def most_at_once(events: list[dict[str, Any]], tag_prefix: str) -> int:
    """The most runs of experiment tags starting with `tag_prefix` between their agent_start
    and agent_end at one point of the log (the log orders every event)."""
    running = most = 0
    for event in sorted(events, key=lambda e: e["seq"]):
        if not event.get("experiment", "").startswith(tag_prefix):
            continue
        running += 1 if event["type"] == "agent_start" else -1
        most = max(most, running)
    return most


PER_MODEL = """
name = "{name}"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "a"
agent = "alpha"                   # model `one`, from its [[agents]] entry
[[variants]]
name = "b"
agent = "beta"
[run]
concurrency = 3
[run.per_model]
{limits}
"""


def test_per_model_limit_holds_while_the_other_variant_uses_the_rest(up: Up) -> None:
    spec = write(up.cwd / "pm", PER_MODEL.format(name="pm", limits="one = 1"),
                 [{"id": f"s{i}", "input": f"question {i}"} for i in range(6)])
    checked = up.experiment("check", str(spec))
    assert checked.returncode == 0 and json.loads(checked.stdout)["per_model"] == {"one": 1}
    out = up.experiment("run", str(spec), "--name", "pm-1")
    assert out.returncode == 0, out.stdout + out.stderr
    events = up.events("agent_start", "agent_end")
    assert most_at_once(events, "pm-1.a.") == 1  # `one`: one session at a time
    # `two` has no limit of its own: the total's slots a's waiting cells do not hold (a cell
    # waits for its model's slot before one of the total)
    assert most_at_once(events, "pm-1.b.") == 3
    assert most_at_once(events, "pm-1.") == 3

    # a key no variant's model is: refused naming it, before anything is journaled
    bad = write(up.cwd / "pm-bad", PER_MODEL.format(name="pmbad", limits="three = 1"),
                [{"id": "s", "input": "x"}])
    out = up.experiment("run", str(bad), "--name", "pm-bad")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "run.per_model.three: no variant runs on model `three` (the variants' models " \
        "here: one, two" in out.stderr
    out = up.experiment("check", str(write(up.cwd / "pm-form", PER_MODEL.format(
        name="pmform", limits='"a b" = 1'), [{"id": "s", "input": "x"}])))
    assert out.returncode == 2 and "run.per_model.a b: a model alias" in out.stderr


FILES = """
name = "ws"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "f"
agent = "filer"
[[variants]]
name = "team"
agent = "lead"
[run]
concurrency = 2
"""


def test_each_sample_has_its_own_workspace_with_its_files(up: Up) -> None:
    folder = up.cwd / "ws"
    for sub, content in (("one", "first content"), ("two", "second content")):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "input.txt").write_text(content)
    (folder / "extra.txt").write_text("extra")
    # two samples' files of the same name, different content; the third (after one of them:
    # two at once) lists its own folder, where neither's files nor what they wrote are
    spec = write(folder, FILES, [
        {"id": "s1", "input": "read one", "files": {"input.txt": "one/input.txt"}},
        {"id": "s2", "input": "read two", "files": {"input.txt": "two/input.txt"}},
        {"id": "s3", "input": "list three", "files": ["extra.txt"]},
        {"id": "s4", "input": "shell four", "files": ["extra.txt"]}])
    out = up.experiment("run", str(spec), "--name", "ws-1")
    assert out.returncode == 0, out.stdout + out.stderr
    every = [json.loads(line) for line in (up.cwd / "results" / "ws-1.jsonl").read_text()
             .splitlines()]
    rows = {r["sample"]: r for r in every if r["variant"] == "f"}
    team = {r["sample"]: r for r in every if r["variant"] == "team"}
    assert "Lead: Saw: " in team["s2"]["answer"] and "second content" in team["s2"]["answer"]
    assert "first" not in team["s2"]["answer"]
    assert "first content" in rows["s1"]["answer"] and "second" not in rows["s1"]["answer"]
    assert "second content" in rows["s2"]["answer"] and "first" not in rows["s2"]["answer"]
    listed = rows["s3"]["answer"]
    assert "extra.txt" in listed and "written.txt" not in listed and "input.txt" not in listed
    # run_shell runs in the cell's folder; under bubblewrap it sees no other cell's folder and
    # cannot write the rest of the worker's workspace
    shell = rows["s4"]["answer"]
    assert shell.startswith("Saw: extras4\n") and "Read-only file system" in shell, shell
    # the folders are kept, where the report says; the shared workspace is untouched
    runs = up.cwd / "shared" / ".runs" / "ws-1" / "f.r1"
    assert rows["s1"]["workspace"] == "ws-1/f.r1/s1"
    assert (runs / "s1" / "written.txt").read_text() == "by read one"
    assert (runs / "s2" / "input.txt").read_text() == "second content"
    assert (runs / "s4" / "mine.txt").read_text() == "mine\n"
    # the filer asked by the team's lead wrote in the lead's cell's folder
    assert (runs.parent / "team.r1" / "s1" / "written.txt").read_text() == "by read one"
    assert sorted(p.name for p in (up.cwd / "shared").iterdir()) == [".runs", "input.txt"]
    assert (up.cwd / "shared" / "input.txt").read_text() == "the shared one\n"
    report = up.experiment("report", "ws-1")
    assert report.returncode == 0 and ".runs/ws-1/" in report.stdout + report.stderr


def test_files_over_the_limit_are_refused_by_check_and_by_the_coordinator(up: Up) -> None:
    folder = up.cwd / "big"
    folder.mkdir()
    (folder / "big.bin").write_bytes(b"x" * (MAX_WORKSPACE_BYTES + 1))
    spec = write(folder, FILES, [{"id": "b", "input": "read", "files": ["big.bin"]}])
    out = up.experiment("check", str(spec))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"samples.jsonl:1: files: {MAX_WORKSPACE_BYTES + 8} bytes in all" in out.stderr

    async def prompt() -> None:
        async with connect(up.endpoint) as bus:
            big = RunWorkspace(id="x/y", files={"big.bin": b"x" * MAX_WORKSPACE_BYTES})
            await bus.prompt("filer", "read", workspace=big)

    with pytest.raises(RemoteError) as caught:
        anyio.run(prompt)
    assert caught.value.code == "invalid"
    assert "workspace `x/y`: its files are" in str(caught.value)


REPLAYED = """
name = "wsr"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "f"
agent = "filer"
"""


def test_a_cell_replayed_with_live_tools_gets_a_fresh_copy_of_its_workspace(up: Up) -> None:
    """`busctl experiment replay --live-tools` (and `busctl replay --live-tools` of the cell's
    tag) prompt the replayed run with a fresh folder holding the sample's files: its tools read
    the sample's file (not the workers' own) and write beside it, and the replay is identical;
    the cell's own folder is left as the cell left it."""
    folder = up.cwd / "wsr"
    (folder / "one").mkdir(parents=True)
    (folder / "one" / "input.txt").write_text("first content")
    spec = write(folder, REPLAYED, [{"id": "s1", "input": "read one",
                                     "files": {"input.txt": "one/input.txt"}}])
    out = up.experiment("run", str(spec), "--name", "wsr-1")
    assert out.returncode == 0, out.stdout + out.stderr
    runs = up.cwd / "shared" / ".runs"
    (runs / "wsr-1" / "f.r1" / "s1" / "input.txt").write_text("changed by the cell")
    out = up.experiment("replay", "wsr-1", "--sample", "s1", "--live-tools", "--as", "wsr-1-a")
    assert out.returncode == 0 and "identical" in out.stdout, out.stdout + out.stderr
    fresh = runs / "wsr-1-a" / "f.r1" / "s1"
    assert (fresh / "input.txt").read_text() == "first content"
    assert (fresh / "written.txt").read_text() == "by read one"
    assert (runs / "wsr-1" / "f.r1" / "s1" / "input.txt").read_text() == "changed by the cell"
    replayed = subprocess.run(busctl("replay", "--hub", up.endpoint, "--experiment", "wsr-1.f.r1",
                                     "--live-tools", "--as", "wsr-1-b"),
                              capture_output=True, text=True, timeout=60, cwd=up.cwd)
    assert replayed.returncode == 0 and "identical" in replayed.stdout, replayed.stderr
    assert (runs / "wsr-1-b" / "f.r1" / "s1" / "written.txt").read_text() == "by read one"
    # the files are read again from the dataset: another spec than the one it ran is refused
    other = write(up.cwd / "wsr-other", REPLAYED.replace('"f"', '"g"'), [{"id": "s1",
                                                                          "input": "x"}])
    out = up.experiment("replay", "wsr-1", "--sample", "s1", "--live-tools", "--spec",
                        str(other))
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--spec: {other} (or its dataset) is not what experiment `wsr-1` ran" in out.stderr


INSPECT_TASK = """
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.scorer import includes

from agent_bus.agents.experiment.inspect_bridge import bus_agent


@task
def files(hub: str = "") -> Task:
    return Task(dataset=json_dataset(str(Path(__file__).with_name("samples.jsonl"))),
                solver=bus_agent("filer", hub, "insp-ws"), scorer=includes())
"""


def test_inspect_samples_files_land_in_their_own_workspace(up: Up) -> None:
    """The Inspect bridge sends a sample's `files` (Inspect's form: a path next to the dataset,
    or the content itself) as its run's workspace: each sample's tools read its own; one past
    the limit fails, naming it, before any prompt."""
    pytest.importorskip("inspect_ai")
    from inspect_ai.log import read_eval_log

    folder = up.cwd / "insp"
    (folder / "one").mkdir(parents=True)
    (folder / "one" / "input.txt").write_text("first content")
    (folder / "big.bin").write_bytes(b"x" * MAX_WORKSPACE_BYTES)
    (folder / "task.py").write_text(INSPECT_TASK)
    write(folder, "", [
        {"id": "s1", "input": "read one", "target": "first content",
         "files": {"input.txt": "one/input.txt"}},
        {"id": "s2", "input": "read two", "target": "second content",
         "files": {"input.txt": "second content"}},
        {"id": "big", "input": "read", "target": "x", "files": {"big.bin": "big.bin"}}])
    inspect = Path(sys.executable).with_name("inspect")
    done = subprocess.run(
        [str(inspect), "eval", "task.py", "--model", "mockllm/model", "-T",
         f"hub={up.endpoint}", "--log-dir", str(folder / "logs"), "--display", "none",
         "--no-fail-on-error"], capture_output=True, text=True, timeout=120, cwd=folder,
        env={**os.environ, **ENV})
    assert done.returncode == 0, done.stdout + done.stderr
    [log_file] = (folder / "logs").glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.samples is not None
    samples = {str(s.id): s for s in log.samples}
    assert samples["s1"].scores is not None and samples["s2"].scores is not None
    assert samples["s1"].scores["includes"].value == "C"
    assert "second" not in samples["s1"].output.completion
    assert samples["s2"].scores["includes"].value == "C"
    assert "first" not in samples["s2"].output.completion
    error = samples["big"].error
    assert error is not None and "sample big: files: more than 1048576 bytes" in error.message
    # each sample's folder, a fresh one for this sample's attempt, kept with what it wrote
    for sample, word, content in (("s1", "one", "first content"),
                                  ("s2", "two", "second content")):
        bus = samples[sample].metadata["bus"]
        assert bus["workspace"].startswith(f"insp-ws/filer.r1/{sample}/")
        kept = up.cwd / "shared" / ".runs" / bus["workspace"]
        assert (kept / "input.txt").read_text() == content
        assert (kept / "written.txt").read_text() == f"by read {word}"
    assert not (up.cwd / "shared" / ".runs" / "insp-ws" / "filer.r1" / "big").exists()


def test_a_journaled_run_keeps_its_workspace_across_a_restart(tmp_path: Path) -> None:
    """The coordinator journals a run's workspace with it: a run resumed after a coordinator
    restart (agents.coordinator.durable) goes on in the same folder."""
    workspace = RunWorkspace(id="e/v.r1/s", files={"input.txt": b"mine"})
    store = ConversationStore(tmp_path)
    store.run_begin(JournaledRun("r1", "filer", "c.s1", "c", "e.v.r1", workspace=workspace))
    store.run_begin(JournaledRun("r2", "filer", "c.s2", "c", "e.v.r1"))
    store.close()
    store = ConversationStore(tmp_path)  # the restarted coordinator's
    try:
        live = {run.run_id: run for run in store.live_runs("c")}
        assert live["r1"].workspace == workspace and live["r2"].workspace is None
        store.run_end("r1")
        assert [run.run_id for run in store.live_runs("c")] == ["r2"]
    finally:
        store.close()


AGENT_W = """
[[agents]]
name = "w"
model = "x"
tools = ["write_file"]
"""


@pytest.mark.anyio
async def test_a_run_resumed_after_a_coordinator_sigkill_keeps_its_workspace(
        tmp_path: Path) -> None:
    """Durable runs: the coordinator is SIGKILLed while the run waits for the model, after a
    tool call ran in the run's folder; restarted, the run's next tool call runs there too."""
    (tmp_path / "ws").mkdir()
    stack = start_stack(tmp_path, worker=False, coordinator=None, agents=AGENT_W)
    try:
        stack.start("worker", busctl("worker", "--hub", stack.endpoint, "--tools",
                                     "agent_bus.tools.builtin", "--workspace",
                                     str(tmp_path / "ws"), "--name", "worker"))
        stack.coordinator("w", name="coord-w", state="w-state")
        stack.script([calls(("write_file", {"path": "before.txt", "content": "1"})),
                      {"reply": {"text": "never sent"}, "delay": 30}])
        folder = tmp_path / "ws" / ".runs" / "e" / "v.r1" / "s"
        async with connect(stack.endpoint, name="test-ws-restart", resume_wait=30) as bus:
            run = await bus.prompt("w", "go", workspace=RunWorkspace(
                id="e/v.r1/s", files={"in.txt": b"mine"}))
            await until(lambda: len(stack.srv.requests) == 2, 10, "the second model request")
            assert (folder / "before.txt").read_text() == "1"
            stack.procs["coord-w"].signal(signal.SIGKILL)
            stack.stop("coord-w")
            stack.script([calls(("write_file", {"path": "after.txt", "content": "2"})),
                          text("done")])
            stack.coordinator("w", name="coord-w", state="w-state")
            with anyio.fail_after(30):
                result = await run.result()
        assert result.final_text == "done"
        assert (folder / "after.txt").read_text() == "2"
        assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == [".runs"]
    finally:
        stack.close()


SPLIT = """
name = "split"
[dataset]
path = "samples.jsonl"
[[variants]]
name = "v"
agent = "w"
"""


def test_experiment_run_warns_when_a_tools_workers_keep_different_run_folders(
        tmp_path: Path) -> None:
    """With two workers on different workspaces a cell's calls stay on one of them unless it
    is full or gone (worker affinity; tests/experiments/test_worker_affinity.py), when they are
    split between their `.runs`. `experiment run` notes it, naming the tool and the workers;
    two workers on one workspace are one `.runs`: no note."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    spec = write(tmp_path / "spec", SPLIT, [{"id": "s", "input": "go"}])
    stack = start_stack(tmp_path, worker=False, coordinator=None, agents=AGENT_W)
    try:
        stack.coordinator("w", name="coord-w")

        def worker(name: str, folder: str) -> None:
            stack.start(name, busctl("worker", "--hub", stack.endpoint, "--tools",
                                     "agent_bus.tools.builtin", "--workspace",
                                     str(tmp_path / folder), "--name", name))

        def run(name: str) -> str:
            stack.script([text("done")])
            out = subprocess.run(busctl("experiment", "run", str(spec), "--name", name,
                                        "--hub", stack.endpoint),
                                 capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stderr

        worker("wa", "a")
        worker("wa2", "a")
        assert "run folders differ" not in run("split-1")
        worker("wb", "b")
        warned = run("split-2")
        assert "tool `write_file` is served by workers whose run folders differ" in warned
        assert "wa on " in warned and "wa2 on " in warned and "wb on " in warned
    finally:
        stack.close()
