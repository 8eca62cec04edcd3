"""`busctl chat`, `steer`, `follow-up`, `abort` and `ps` against a running topology."""

from __future__ import annotations

import subprocess

from tests.cli.conftest import Topology
from tests.support import busctl


def test_chat_prompts_and_prints_the_answer(up_default: Topology) -> None:
    result = subprocess.run(busctl("chat", "--hub", up_default.endpoint), input="hello chat\n",
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "echo: hello chat" in result.stdout


def test_agent_verbs_and_ps(up_default: Topology) -> None:
    hub = up_default.endpoint
    for args in (("steer", "assistant", "look here"), ("follow-up", "assistant", "then this"),
                 ("abort", "assistant")):
        result = subprocess.run(busctl(*args, "--hub", hub), capture_output=True, text=True,
                                timeout=20)
        assert result.returncode == 0, result.stderr
        assert "sent to assistant" in result.stdout
    unknown = subprocess.run(busctl("steer", "nobody", "x", "--hub", hub), capture_output=True,
                             text=True, timeout=20)
    assert unknown.returncode != 0 and "agent.nobody" in unknown.stderr
    ps = subprocess.run(busctl("ps", "--hub", hub), capture_output=True, text=True, timeout=20)
    assert ps.returncode == 0
    for name in ("gateway-1", "tools-1", "coordinator-1"):
        assert name in ps.stdout
