"""A whole topology in real processes, shared by a test module: hub, gateway (against an in-test
FakeLLMServer), a tool worker with `fixtures/my_tools.py`, and a coordinator.

Each test scripts the fake model with `stack.script([...steps])` and uses its own agent (or a
new session), so tests do not depend on each other's conversation.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer, load_script
from tests.support import Proc, busctl

HERE = Path(__file__).resolve().parent
TOOLS = str(HERE / "fixtures" / "my_tools.py")
HEARTBEAT = "0.2"  # fast hub heartbeats: subscriptions are in place within one interval
# ...and a liveness window (HEARTBEAT x LIVENESS = 2 s) longer than this test process ever stops:
# its own peers send no heartbeat while its cyclic GC runs, up to 229 ms for one collection in
# test_fuzz's hostile-bodies test on a quiet machine (2-3x that on a slow hour). With 3 intervals
# (0.6 s) such a pause can get the test's peer dropped, its call in flight failed with hub_lost:
# one of the two causes found for that test's failure in CI (the other, the hub's own pauses:
# bus/pauses.py).
LIVENESS = "10"

AGENTS_TOML = """
[[agents]]
name = "a"
model = "x"
tools = ["*"]

[[agents]]
name = "s"
model = "x"
tools = ["slow", "echo"]
tool_execution = "sequential"

[[agents]]
name = "p"
model = "x"
tools = []

[[agents]]
name = "h"
model = "x"
tools = ["echo"]
experiment = "spec-exp"
hooks = { before_tool_call = "tests.coordinator.fixtures.hooks:no_shouting" }
"""


def topology_text(base_url: str, agents: str = AGENTS_TOML) -> str:
    return f"""
[models.x]
provider = "openai"
base_url = "{base_url}"
model = "m"
context_window = 32000
timeout = 10.0
{agents}"""


def text(value: str) -> dict[str, Any]:
    return {"reply": {"text": value}}


def calls(*items: tuple[str, dict[str, Any]], text: str = "") -> dict[str, Any]:
    return {"reply": {"text": text, "tool_calls": [
        {"name": name, "arguments": args, "id": f"call_{i}_{name}"}
        for i, (name, args) in enumerate(items)]}}


@dataclass
class Stack:
    dir: Path
    endpoint: str
    srv: FakeLLMServer
    topology: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    def script(self, steps: Sequence[dict[str, Any]]) -> None:
        """Replace the fake model's script (steps are consumed one per request, in order)."""
        script = load_script(list(steps))
        script.echo = True
        self.srv.set_script(script, clear_requests=True)

    def start(self, name: str, args: list[str], timeout: float = 15.0) -> Proc:
        proc = Proc(args)
        self.procs[name] = proc
        proc.wait_ready(timeout)
        return proc

    def gateway(self, name: str = "gateway") -> Proc:
        return self.start(name, busctl("gateway", "--hub", self.endpoint, "--topology",
                                       str(self.topology), "--name", name))

    def worker(self, name: str = "worker") -> Proc:
        # the tools' files (gates, markers) are in each test's own tmp_path: the workspace is
        # pytest's base folder that holds them all, since a sandboxed worker has a private /tmp
        return self.start(name, busctl("worker", "--hub", self.endpoint, "--tools", TOOLS,
                                       "--workspace", str(self.dir.parent),
                                       "--concurrency", "8", "--name", name))

    def coordinator(self, *agents: str, name: str = "coordinator", state: str = "agents") -> Proc:
        args = busctl("coordinator", "--hub", self.endpoint, "--topology", str(self.topology),
                      "--state-dir", str(self.dir / state), "--name", name)
        for agent in agents:
            args += ["--agent", agent]
        return self.start(name, args)

    def stop(self, name: str) -> int | None:
        proc = self.procs.pop(name, None)
        return proc.stop() if proc is not None else None

    async def watch(self, run_id: str) -> list[dict[str, Any]]:
        """The run's events as `busctl watch --json --since 0 --no-follow` prints them."""
        return await self.watch_all("--since", "0", "--run", run_id)

    async def watch_all(self, *args: str) -> list[dict[str, Any]]:
        """`busctl watch --json --no-follow ARGS...` (e.g. `--type topic_message --since N`).

        Runs in a thread: blocking the event loop would silence the test's own peers, and the hub
        drops a peer that is silent for its liveness window."""
        command = busctl("watch", "--hub", self.endpoint, "--json", "--no-follow", *args)
        out = await anyio.to_thread.run_sync(functools.partial(
            subprocess.run, command, capture_output=True, text=True, timeout=20, check=True))
        return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop(name)
        self.srv.close()


def start_stack(tmp: Path, *, gateway: bool = True, worker: bool = True,
                coordinator: Sequence[str] | None = ("a", "s", "h"),
                agents: str = AGENTS_TOML, store: str = "") -> Stack:
    """`agents`: the topology's `[[agents]]` tables (TOML text); `store`: the hub's `--store`
    ("": SQLite in its state dir)."""
    srv = FakeLLMServer().start()
    topology = tmp / "topology.toml"
    topology.write_text(topology_text(srv.base_url, agents))
    hub = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir", str(tmp / "hub"),
                      "--heartbeat-interval", HEARTBEAT, "--liveness", LIVENESS,
                      *(["--store", store] if store else [])))
    stack = Stack(tmp, "", srv, topology, {"hub": hub})
    try:
        stack.endpoint = hub.wait_ready()["endpoint"]
        if gateway:
            stack.gateway()
        if worker:
            stack.worker()
        if coordinator is not None:
            stack.coordinator(*coordinator)
    except BaseException:
        stack.close()
        raise
    return stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def collapse(names: list[str], repeated: str = "message_update") -> list[str]:
    """Runs of `repeated` collapsed to one `repeated+` entry."""
    out: list[str] = []
    for name in names:
        label = f"{repeated}+" if name == repeated else name
        if label == f"{repeated}+" and out and out[-1] == label:
            continue
        out.append(label)
    return out


def role(event: dict[str, Any]) -> str:
    return event.get("message", {}).get("role", "")
