"""`busctl chat`, `steer`, `follow-up`, `abort` and `ps` against a running topology."""

from __future__ import annotations

import subprocess

from tests.cli.conftest import FIXTURES, Topology
from tests.support import busctl, running, wait_for


def test_chat_prompts_and_prints_the_answer(up_default: Topology) -> None:
    result = subprocess.run(busctl("chat", "--hub", up_default.endpoint), input="hello chat\n",
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "echo: hello chat" in result.stdout


def test_agent_verbs_and_ps(up_default: Topology) -> None:
    """steer / follow-up are queued on the running run, abort ends it; ps lists the children."""
    from agent_bus.agents.client.remote import connect_blocking

    hub = up_default.endpoint
    tools = str(FIXTURES / "my_tools.py")
    with running(busctl("worker", "--hub", hub, "--tools", tools)) as worker, \
            connect_blocking(hub) as bus:
        worker.wait_ready()
        with running(busctl("run", "--hub", hub, "--json", "be slow")) as run:
            run.wait_line(lambda s: '"tool_execution_start"' in s, 20)
            for args in (("steer", "assistant", "look here"),
                         ("follow-up", "assistant", "then this")):
                result = _busctl(*args, "--hub", hub)
                assert result.returncode == 0 and "sent to assistant" in result.stdout, result
            state = bus.state("assistant")
            assert state.is_running
            assert (state.queued_steering, state.queued_follow_up) == (1, 1), state
            result = _busctl("abort", "assistant", "--hub", hub)
            assert result.returncode == 0 and "sent to assistant" in result.stdout, result
            ended = run.wait_line(lambda s: '"agent_end"' in s, 20)
            assert '"aborted"' in ended, ended
        wait_for(lambda: not bus.state("assistant").is_running, 10, "the run to end")
    unknown = _busctl("steer", "nobody", "x", "--hub", hub)
    assert unknown.returncode != 0 and "agent.nobody" in unknown.stderr
    ps = _busctl("ps", "--hub", hub)
    assert ps.returncode == 0
    for name in ("gateway-1", "tools-1", "coordinator-1"):
        assert name in ps.stdout


def _busctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(busctl(*args), capture_output=True, text=True, timeout=20)
