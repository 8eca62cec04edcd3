"""Each example in `examples/` runs to completion against its scripted model (issue 7,
acceptance 3), the way its README says: `busctl up -c examples/X/topology.toml` from the
repository root (here: a temporary copy of it), then the example's driver script."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import start_up
from tests.examples.helpers import corpus_word_count, stop_up
from tests.support import ROOT, Proc, busctl

EXAMPLES = ROOT / "examples"
# Topology `processes` run `busctl fake-llm ...` from PATH: make it this venv's busctl.
ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
       "PYTHONPATH": str(ROOT)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Example:
    def __init__(self, cwd: Path, name: str, endpoint: str) -> None:
        self.cwd, self.name, self.endpoint = cwd, name, endpoint

    def driver(self, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, f"examples/{self.name}/run.py", "--hub",
                               self.endpoint, *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.cwd, env={**os.environ, **ENV})

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(busctl(args[0], "--hub", self.endpoint, *args[1:]),
                              capture_output=True, text=True, timeout=20, cwd=self.cwd)

    def watch(self, *args: str) -> list[dict[str, Any]]:
        out = self.cli("watch", "--json", "--no-follow", "--since", "0", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@contextmanager
def example(tmp_path: Path, name: str, copy: bool = True) -> Iterator[Example]:
    """`busctl up -c examples/<name>/topology.toml` in a copy of the repository layout (already
    made unless `copy`), with the scripted model moved to a free port."""
    target = tmp_path / "examples" / name
    if copy:
        shutil.copytree(EXAMPLES / name, target)
    topology = target / "topology.toml"
    text = topology.read_text()
    ports = set(re.findall(r'"--port", "(\d+)"', text))
    assert len(ports) == 1, ports
    topology.write_text(text.replace(ports.pop(), str(free_port())))
    proc, ready = start_up(tmp_path, "-c", f"examples/{name}/topology.toml", env=ENV)
    try:
        yield Example(tmp_path, name, ready["endpoint"])
    finally:
        stop_up(proc)



def test_fanout_orchestrator_asks_four_agents_in_one_parallel_batch(tmp_path: Path) -> None:
    with example(tmp_path, "fanout") as ex:
        out = ex.driver("--experiment", "fan-1")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Merged plan for: Should we launch a paid tier" in out.stdout
        for marker in ("MARKET:", "TECH:", "RISK:", "COST:", "Recommendation: go ahead"):
            assert marker in out.stdout, out.stdout
        events = ex.watch("--experiment", "fan-1")
    starts = {e["agent"]: e for e in events if e["type"] == "agent_start"}
    assert set(starts) == {"orchestrator", "market", "tech", "risk", "cost"}
    parent = starts["orchestrator"]["run_id"]
    workers = [a for a in starts if a != "orchestrator"]
    assert all(starts[a]["parent_run_id"] == parent for a in workers)
    # One batch: the four ask_* calls are in one assistant message, and all four specialist
    # runs start before any of them ends.
    calls = [e for e in events if e["type"] == "message_end" and e["agent"] == "orchestrator"
             and e["message"]["role"] == "assistant"][0]["message"]["content"]
    assert sorted(c["name"] for c in calls if c.get("type") == "tool_call") == [
        "ask_cost", "ask_market", "ask_risk", "ask_tech"]
    ends = [e["seq"] for e in events if e["type"] == "agent_end" and e["agent"] in workers]
    assert len(ends) == 4 and max(starts[a]["seq"] for a in workers) < min(ends)


def test_debate_judge_declares_a_winner_and_the_debaters_hear_it_on_the_topic(
        tmp_path: Path) -> None:
    with example(tmp_path, "debate") as ex:
        out = ex.driver("--experiment", "debate-1")
        assert out.returncode == 0, out.stdout + out.stderr
        text = out.stdout
        for marker in ("[pro] PRO OPENING:", "[con] CON OPENING:", "[pro] PRO REBUTTAL:",
                       "[con] CON REBUTTAL:", "[judge] The winner is PRO.",
                       "[pro, on the topic] PRO: Thank you", "[con, on the topic] CON: I accept"):
            assert marker in text, text
        events = ex.watch("--experiment", "debate-1")
    starts = [e for e in events if e["type"] == "agent_start"]
    judge = next(e["run_id"] for e in starts if e["agent"] == "judge")
    asked = [e for e in starts if e.get("parent_run_id") == judge]
    assert sorted(e["agent"] for e in asked) == ["con", "con", "pro", "pro"]  # two rounds
    topics = [e for e in events if e["type"] == "topic_message"]
    assert len(topics) == 1 and topics[0]["topic"] == "debate" and topics[0]["sender"] == "judge"
    after = [e["agent"] for e in starts if e["seq"] > topics[0]["seq"]]
    assert sorted(after) == ["con", "pro"]  # each debater got the verdict exactly once


def test_mapreduce_spreads_map_calls_over_both_hosts_and_reduces(tmp_path: Path) -> None:
    with example(tmp_path, "mapreduce") as ex:
        out = ex.driver("--experiment", "mr-1")
        assert out.returncode == 0, out.stdout + out.stderr
        status = json.loads(ex.cli("status", "--json").stdout)
        events = ex.watch("--experiment", "mr-1", "--type", "tool_execution_end")
    assert {"host-a-1", "host-b-1"} <= {p["name"] for p in status["peers"]}
    maps = [e for e in events if e["tool_name"] == "count_words"]
    assert len(maps) == 4 and not any(e.get("is_error") for e in maps)
    hosts = [json.loads(e["result"]["content"][0]["text"])["host"] for e in maps]
    assert set(hosts) == {"host-a", "host-b"}, hosts  # the hub spread the map calls
    words = corpus_word_count(EXAMPLES / "mapreduce" / "host-a" / "corpus")
    reduced = json.loads(out.stdout.split("reduce_counts reported:\n", 1)[1].strip())
    assert reduced["reduced"] and reduced["files"] == 4 and reduced["words"] == words
    assert set(reduced["by_host"]) == {"host-a", "host-b"}
    assert sum(reduced["by_host"].values()) == 4
    assert "Map-reduce done." in out.stdout


QUICK_SCRIPT = {
    "rules": [
        {"contains": ["list the files"],
         "reply": {"text": "Listing.", "tool_calls": [{"name": "list_dir", "arguments": {"path": "."}}]}},
        {"tool_result": True, "reply": {"text": "Files: {tool_results}"}},
    ],
    "echo": True,
}


def test_quick_experiment_from_the_readme(tmp_path: Path) -> None:
    """`examples/quick_experiment.py` against `busctl up` (the default topology: agent
    `assistant`, built-in tools) with its gateway pointed at a scripted model through
    OPENAI_BASE_URL. Fast hub heartbeats: each `prompt()` waits up to one heartbeat for its
    event subscription to be in place (see the report), and this script makes 21 of them."""
    (tmp_path / "notes.txt").write_text("A file to list.\n")
    (tmp_path / "fast.toml").write_text("[hub]\nheartbeat_interval = 0.2\n")
    with FakeLLMServer(QUICK_SCRIPT) as srv:
        proc, ready = start_up(tmp_path, "-c", "fast.toml",
                               env={**ENV, "OPENAI_BASE_URL": srv.base_url, "OPENAI_API_KEY": ""})
        try:
            out = subprocess.run([sys.executable, str(EXAMPLES / "quick_experiment.py")],
                                 capture_output=True, text=True, timeout=30, cwd=tmp_path,
                                 env={**os.environ, **ENV, "BUSCTL_HUB": ready["endpoint"]})
            export = subprocess.run(
                busctl("export", "--hub", ready["endpoint"], "--experiment", "e1"),
                capture_output=True, text=True, timeout=20, cwd=tmp_path)
        finally:
            stop_up(proc)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[1] == "AgentStart"
    assert "ToolExecutionEnd" in [line.split()[1] for line in lines if line[:1].isdigit()]
    assert any(line.startswith("Files: - ") for line in lines) and "notes.txt  (16 bytes)" in out.stdout
    for i in range(20):
        assert any(re.fullmatch(rf"[0-9a-f]{{8}} echo: task {i} \{{.*\}}", line)
                   for line in lines), (i, out.stdout)
    assert lines[-1] == "20 runs"
    assert len(json.loads(export.stderr.strip().splitlines()[-1])["runs"]) == 21


def test_mapreduce_with_host_b_attached_separately_over_curve(tmp_path: Path) -> None:
    """The README's two-machine recipe on one machine: keys, CURVE on, host-b not started by
    `busctl up` but attached with `busctl worker --hub ... --curve-*`."""
    keys = subprocess.run(busctl("keys", "generate", "keys", "--client", "local", "--client",
                                 "host-b"), capture_output=True, text=True, cwd=tmp_path, timeout=20)
    assert keys.returncode == 0, keys.stderr
    shutil.copytree(EXAMPLES / "mapreduce", tmp_path / "src")
    text = (tmp_path / "src" / "topology.toml").read_text()
    text = text.replace('endpoint = "tcp://127.0.0.1:7400"', '''endpoint = "tcp://127.0.0.1:7400"
curve_secret = "keys/hub.key_secret"
curve_authorized = "keys/authorized"
curve_server_key = "keys/hub.key"
curve_client_key = "keys/local.key_secret"''')
    text = text.replace('name = "host-b"                   # on a second machine: see README.md',
                        'name = "host-b"\ncount = 0')
    assert "count = 0" in text and "curve_secret" in text
    (tmp_path / "src" / "topology.toml").write_text(text)
    (tmp_path / "examples").mkdir()
    shutil.move(tmp_path / "src", tmp_path / "examples" / "mapreduce")
    with example(tmp_path, "mapreduce", copy=False) as ex:
        curve = ["--curve-server-key", "keys/hub.key"]
        worker = Proc(busctl("worker", "--hub", ex.endpoint, *curve, "--curve-key",
                             "keys/host-b.key_secret", "--tools", "agent_bus.tools.builtin", "--tools",
                             "examples/mapreduce/mr_tools.py", "--workspace",
                             "examples/mapreduce/host-b", "--concurrency", "2",
                             "--name", "host-b-1"), cwd=tmp_path)
        try:
            worker.wait_ready(15)
            out = ex.driver("--experiment", "mr-curve", *curve, "--curve-key",
                            "keys/local.key_secret")
        finally:
            worker.stop()
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r'"by_host": \{"host-a": \d, "host-b": \d\}', out.stdout), out.stdout
