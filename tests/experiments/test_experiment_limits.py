"""`busctl experiment run` on a real topology (issue 30, the rest of item 1): `run.per_model`
bounds the sessions at once of the variants on one model, seen in the event stream; and each
sample's `files` land in a fresh workspace of its own on the tool worker, which its tool calls
(and nothing else) see."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import start_up
from tests.examples.helpers import stop_up
from tests.support import busctl

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
        {"system": ["FILER"], "tool_result": True,
         "reply": {"text": "Saw: {tool_results_full}"}},
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
tools = ["read_file", "write_file", "list_dir"]
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
