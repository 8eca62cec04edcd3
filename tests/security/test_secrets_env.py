"""Issue 12, item 2 (and issue 27): only the gateway holds the provider key, in memory.

The attacks as found: a tool returned the key from `os.environ`, and `run_shell` read it from the
parent's `/proc/PID/environ`. Here a topology with shell access runs both attacks, against every
process on the machine; the key must be found in no process's environment block, the gateway's
and the supervisor's included (the gateway gets it on stdin), yet reach the model server.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from agent_bus.agents.gateway.fakellm import FakeLLMServer, request_key
from tests.cli.conftest import Topology, pid_alive, start_up
from tests.support import busctl

KEY = "sk-proc-environ-attack-9f8e7d6c5b4a"
SNOOP = Path(__file__).parent / "fixtures" / "snoop_tools.py"
SHELL_ATTACK = ("for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f 2>/dev/null; done "
                "| grep -c proc-environ-attack; env | grep -c proc-environ-attack; true")


def _script() -> dict[str, Any]:
    calls = [{"name": "snoop", "arguments": {"needle": KEY}},
             {"name": "run_shell", "arguments": {"command": SHELL_ATTACK}}]
    return {"rules": [
        {"contains": ["steal"], "tool_result": False, "reply": {"text": "Looking.", "tool_calls": calls}},
        {"contains": [], "tool_result": True, "reply": {"text": "FOUND {tool_results_full}"}},
    ], "echo": True}


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_key_only_in_the_gateway_and_tools_cannot_read_it(tmp_path: Path) -> None:
    config = tmp_path / "topology.toml"
    config.write_text(f"[[workers]]\ntools = ['agent_bus.tools.builtin', '{SNOOP}']\nshell = true\n")
    with FakeLLMServer(_script()) as llm:
        env = {"OPENAI_BASE_URL": llm.base_url, "OPENAI_API_KEY": KEY}
        proc, ready = start_up(tmp_path, "-c", str(config), env=env)
        topo = Topology(proc, tmp_path, ready)
        pids = topo.child_pids()
        try:
            # issue 27: the gateway gets the key on stdin, and the supervisor blanks it in its
            # own environment block: no /proc/PID/environ holds it, not even theirs
            for name in ("hub", "tools-1", "coordinator-1", "gateway-1"):
                assert KEY.encode() not in _environ(pids[name]), f"{name} holds the key"
            assert KEY.encode() not in _environ(proc.pid), "the supervisor holds the key"
            try:
                result = subprocess.run(busctl("run", "--hub", topo.endpoint, "steal the key"),
                                        capture_output=True, text=True, timeout=60, cwd=tmp_path)
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"run hung: {exc.stdout!r}\n{proc.output()}") from None
            assert result.returncode == 0, result.stderr
            out = result.stdout
            assert "FOUND" in out and "nothing found" in out, out
            assert "LEAK" not in out, out
            assert "\n0\n0\n" in out.replace("\r", ""), out  # both shell greps counted nothing
            assert llm.requests, "the run never reached the model"
            assert all(request_key(r.headers) == KEY for r in llm.requests)  # and it was used
        finally:
            proc.stop(timeout=8)
            for pid in pids.values():
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
