"""agent-bus as an Inspect AI plugin (issue 48, item 6), with a real `inspect eval` on a real
topology answered by the scripted model: `agent_bus/bus_task`, `--solver agent_bus/bus_agent`
and `--model agent-bus/<agent>` resolve by name through the `inspect_ai` entry point; the log
`inspect log dump` reads back has the session's tokens against the model the eval names; each
eval is its own bus experiment; a session past its timeout is the sample's recorded error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import start_up
from tests.examples.helpers import stop_up
from tests.support import busctl, until, wait_for

pytest.importorskip("inspect_ai")

USAGE = {"input": 11, "output": 7}  # every scripted reply's, so the totals are known

SCRIPT = {"rules": [
    # a team: the lead (on model `two`) asks the solver (on `one`), then answers with its reply
    {"system": ["LEAD"], "tool_result": False, "reply": {"text": "Asking.", "usage": USAGE,
     "tool_calls": [{"name": "ask_solver", "arguments": {"prompt": "{last_user}"}}]}},
    {"system": ["LEAD"], "tool_result": True,
     "reply": {"text": "lead: {tool_results_full}", "usage": USAGE}},
    # answered while the caller's event loop is blocked (the stalled-host tests)
    {"system": ["SOLVER"], "contains": ["stalled host"], "delay": 1,
     "reply": {"text": "answer: {last_user}", "usage": USAGE}},
    # past the eval's timeout (12 s: room for a busy machine's answered samples, which take
    # ~0.1 s quiet): aborted long before this answers
    {"system": ["SOLVER"], "contains": ["slow"], "delay": 120,
     "reply": {"text": "too late", "usage": USAGE}},
    {"system": ["SOLVER"], "reply": {"text": "answer: {last_user}", "usage": USAGE}},
]}

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

[[agents]]
name = "solver"
model = "one"
system_prompt = "You are the SOLVER."
tools = []

[models.three]
provider = "openai"
model = "fake-three"
base_url = "{broken_url}"

[[agents]]
name = "broken"
model = "three"
system_prompt = "You are BROKEN."
tools = []

[[agents]]
name = "lead"
model = "two"
system_prompt = "You are the LEAD."
tools = []
agents = ["solver"]
"""

# the model of agent `broken`: refuses every request (an HTTP 400 is not retried)
BROKEN = {"steps": [{"fail": {"kind": "status", "status": 400, "message": "no such model"}}] * 20}

SAMPLES = [{"id": "a", "input": "say alpha", "target": "alpha"},
           {"id": "b", "input": "say beta", "target": "beta"}]
SLOW = {"id": "slow", "input": "slow one", "target": "x"}


class Bus:
    def __init__(self, endpoint: str, cwd: Path, llm: FakeLLMServer) -> None:
        self.endpoint, self.cwd, self.llm = endpoint, cwd, llm

    def inspect(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Inspect's own CLI (from the venv, as a user runs it), in the test's folder, with the
        installed agent-bus only (no PYTHONPATH to the checkout: its build metadata there would
        hide the installed distribution's, and with it the plugin's package name)."""
        inspect = str(Path(sys.executable).with_name("inspect"))
        env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        return subprocess.run([inspect, *args], capture_output=True, text=True, timeout=120,
                              cwd=self.cwd, env=env)

    def eval(self, logs: str, *args: str) -> dict[str, Any]:
        """`inspect eval ARGS`, then its one log as `inspect log dump` prints it."""
        done = self.inspect("eval", *args, "--log-dir", logs, "--display", "plain",
                            "--no-fail-on-error")
        assert done.returncode == 0, done.stdout + done.stderr
        [log_file] = (self.cwd / logs).glob("*.eval")
        dump = self.inspect("log", "dump", str(log_file))
        assert dump.returncode == 0, dump.stderr
        log: dict[str, Any] = json.loads(dump.stdout)
        return log

    def ends(self) -> list[dict[str, Any]]:
        out = subprocess.run(busctl("watch", "--hub", self.endpoint, "--json", "--no-follow",
                                    "--since", "0", "--type", "agent_end"),
                             capture_output=True, text=True, timeout=30, cwd=self.cwd)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    cwd = tmp_path_factory.mktemp("inspect")
    with FakeLLMServer(SCRIPT) as srv, FakeLLMServer(BROKEN) as broken:
        (cwd / "topology.toml").write_text(TOPOLOGY.replace("{base_url}", srv.base_url)
                                           .replace("{broken_url}", broken.base_url))
        proc, ready = start_up(cwd, "-c", "topology.toml")
        try:
            yield Bus(ready["endpoint"], cwd, srv)
        finally:
            stop_up(proc)


def jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path.name


def test_inspect_eval_by_plugin_name_records_tokens_model_experiment_and_timeout(bus: Bus) -> None:
    dataset = jsonl(bus.cwd / "samples.jsonl", [*SAMPLES, SLOW])
    # the task by name: no task file, no --model (the task's model is agent-bus/solver)
    log = bus.eval("logs1", "agent_bus/bus_task", "-T", f"dataset={dataset}",
                   "-T", "agent=solver", "-T", "scorer=includes", "-T", f"hub={bus.endpoint}",
                   "-T", "timeout=12")
    assert log["eval"]["model"] == "agent-bus/solver"
    samples = {s["id"]: s for s in log["samples"]}
    # the two answered sessions' tokens, recorded by Inspect against the eval's model
    usage = log["stats"]["model_usage"]["agent-bus/solver"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (22, 14, 36)
    for sample in ("a", "b"):
        answered = samples[sample]
        assert answered["scores"]["includes"]["value"] == "C"
        assert answered["model_usage"]["agent-bus/solver"]["total_tokens"] == 18
        assert answered["output"]["model"] == "fake-one"  # the model the agent called
        assert answered["metadata"]["bus"]["usage"]["fake-one"]["total"] == 18
    # one bus experiment per eval, named after its task and run
    run_id = log["eval"]["run_id"]
    experiment = f"inspect-agent_bus-bus_task-{run_id}"
    assert {s["metadata"]["bus"]["experiment"] for s in samples.values()
            if "bus" in s["metadata"]} == {experiment}
    # the session past its timeout: the sample's error, not an empty "success"
    error = samples["slow"]["error"]
    assert error is not None and "BusEvalError" in error["traceback"]
    assert "agent `solver`: no answer within 12 s" in error["message"]
    assert not samples["slow"].get("scores")

    # a second eval, a team's agent as the solver by name, the experiment overridden: its
    # own, and its tokens the whole team's (the lead's two turns on `two`, the solver's one on
    # `one`, for each sample), by model in the metadata
    second = bus.eval("logs2", "agent_bus/bus_task", "-T", f"dataset={jsonl(bus.cwd / 'two.jsonl', SAMPLES)}",
                      "-T", "agent=lead", "-T", "scorer=includes", "--solver",
                      "agent_bus/bus_agent", "-S", "agent=lead", "-S", f"hub={bus.endpoint}",
                      "-S", "experiment=insp-mine")
    assert second["eval"]["run_id"] != run_id and second["eval"]["model"] == "agent-bus/lead"
    assert second["stats"]["model_usage"]["agent-bus/lead"]["total_tokens"] == 2 * 54
    for sample in second["samples"]:
        assert sample["scores"]["includes"]["value"] == "C"
        assert sample["metadata"]["bus"]["experiment"] == "insp-mine"
        assert sample["output"]["model"] == "fake-one, fake-two"
        by_model = sample["metadata"]["bus"]["usage"]
        assert (by_model["fake-two"]["total"], by_model["fake-one"]["total"]) == (36, 18)

    # the bus saw the same: each eval's sessions under its own experiment, the timed-out run
    # aborted (cancelling the prompt aborts it)
    def ended() -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for end in bus.ends():
            found.setdefault(end.get("experiment", ""), []).append(end.get("stop_reason", "stop"))  # a default is left out
        return found if len(found.get(experiment, [])) == 3 else {}

    by_experiment = wait_for(ended, 15, "the timed-out run's agent_end")
    assert sorted(by_experiment[experiment]) == ["aborted", "stop", "stop"]
    assert by_experiment["insp-mine"] == ["stop"] * 4  # two leads', two solvers' runs


def test_a_failed_session_and_an_unreachable_hub_are_the_samples_errors(bus: Bus) -> None:
    """Not answers: Inspect records them as errors (and scores nothing)."""
    dataset = jsonl(bus.cwd / "one.jsonl", SAMPLES[:1])
    log = bus.eval("logs-broken", "agent_bus/bus_task", "-T", f"dataset={dataset}",
                   "-T", "agent=broken", "-T", f"hub={bus.endpoint}")
    [sample] = log["samples"]
    assert "BusEvalError" in sample["error"]["traceback"] and not sample.get("scores")
    assert "agent `broken`: run " in sample["error"]["message"]
    assert " ended error: " in sample["error"]["message"]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    log = bus.eval("logs-nohub", "agent_bus/bus_task", "-T", f"dataset={dataset}",
                   "-T", "agent=solver", "-T", f"hub={nobody}")
    [sample] = log["samples"]
    assert "BusEvalError" in sample["error"]["traceback"]
    assert f"HubUnreachable: cannot reach the hub at {nobody}" in sample["error"]["message"]


GENERATE_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate


@task
def plain() -> Task:
    return Task(dataset=[Sample(id="a", input="say alpha", target="alpha")],
                solver=generate(), scorer=includes())
"""


def test_a_plain_generate_task_runs_on_the_bus_with_model_agent_bus(bus: Bus) -> None:
    """`--model agent-bus/<agent>` (the provider by name, its args as -M): a task of Inspect's
    own `generate()` is answered by a bus session, its tokens recorded."""
    (bus.cwd / "plain.py").write_text(GENERATE_TASK)
    log = bus.eval("logs-plain", "plain.py", "--model", "agent-bus/solver",
                   "-M", f"hub={bus.endpoint}", "-M", "experiment=insp-plain")
    assert log["eval"]["model"] == "agent-bus/solver"
    [sample] = log["samples"]
    assert sample["output"]["completion"] == "answer: say alpha"
    assert sample["scores"]["includes"]["value"] == "C"
    assert log["stats"]["model_usage"]["agent-bus/solver"]["total_tokens"] == 18
    assert sample["output"]["metadata"]["bus"]["experiment"] == "insp-plain"


def asked(bus: Bus, text: str) -> bool:
    """Whether the scripted model was asked `text`: that prompt's session is in flight."""
    return any(text in json.dumps(request.body) for request in bus.llm.requests)


async def generate(bus: Bus, experiment: str, text: str) -> Any:
    """The bridge's `agent-bus/solver` model answering `text`, as Inspect calls it (on the
    caller's event loop), outside an eval: no sample, so no workspace of its own."""
    from inspect_ai.model import ChatMessageUser, GenerateConfig

    from agent_bus.agents.experiment.inspect_model import BusModel

    model = BusModel("solver", hub=bus.endpoint, experiment=experiment)
    return await model.generate([ChatMessageUser(content=text)], [], "auto", GenerateConfig())


@pytest.fixture
def bridge_thread() -> Iterator[None]:
    """The bridge's bus thread (started by the test's first call) stopped after the test, even
    when it failed, and gone."""
    from agent_bus.agents.experiment.inspect_model import BUS_THREAD

    try:
        yield
    finally:
        BUS_THREAD.close()
    assert BUS_THREAD.name not in {thread.name for thread in threading.enumerate()}


@pytest.mark.anyio
@pytest.mark.usefixtures("bridge_thread")
async def test_a_blocked_host_loop_does_not_lose_the_bridges_session(bus: Bus) -> None:
    """Inspect may block its event loop (writing logs, scoring; on a loaded machine) for longer
    than the hub's liveness window (here 3 x 0.2 s; by default 3 x 1 s): the session in flight
    survives, as the bridge's bus client does not need the host's loop for its heartbeats."""
    outputs: list[Any] = []

    async def answer() -> None:
        outputs.append(await generate(bus, "insp-stall", "stalled host"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer)
        await until(lambda: asked(bus, "stalled host"), 30, "the session's model call")
        time.sleep(5)  # the fault injected (not a wait): the host's event loop blocked
    [output] = outputs
    assert output.completion == "answer: stalled host"


@pytest.mark.anyio
@pytest.mark.usefixtures("bridge_thread")
async def test_cancelling_the_bridges_generate_aborts_its_run(bus: Bus) -> None:
    """Inspect cancelling a sample (its time limit, an interrupt) cancels the session the
    bridge runs for it on its own loop: the run is aborted, not left to answer."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(generate, bus, "insp-cancel", "slow one, cancelled")
        await until(lambda: asked(bus, "slow one, cancelled"), 30, "the session's model call")
        tg.cancel_scope.cancel()

    def ended() -> list[str]:
        return [end.get("stop_reason", "stop") for end in bus.ends()
                if end.get("experiment") == "insp-cancel"]

    assert await anyio.to_thread.run_sync(wait_for, ended, 15, "the run's agent_end") == ["aborted"]
