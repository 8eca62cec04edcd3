"""Types are part of the test run, so CI fails on them: `mypy` strict ([tool.mypy] in pyproject.toml)
on the whole product, the `agent_bus` package (mypy comes with the test extra). By hand:

    mypy agent_bus
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

CHECKED = ["agent_bus"]  # bus/, agents/, tools/ and cli.py, linked in


def _mypy(tmp_path: Path, *targets: str) -> list[str]:
    """The lines of mypy's errors on `targets` (with their notes, when it found any)."""
    # A cache of its own: parallel runs sharing the checkout's .mypy_cache could read half-written
    # files. It starts as a copy of that cache when there is one (CI runs mypy just before the
    # suite): mypy checks every entry against the sources and options, and a warm start takes
    # ~1 s instead of ~10 s on the 2-core VM.
    cache = tmp_path / "cache"
    warm = ROOT / ".mypy_cache"
    if warm.is_dir():
        shutil.copytree(warm, cache, ignore_dangling_symlinks=True, dirs_exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache),
                             "--no-error-summary", "--no-pretty", *targets],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode in (0, 1), result.stdout[-4000:] + result.stderr[-2000:]  # 2: mypy failed
    return result.stdout.splitlines()


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    errors = [line for line in _mypy(tmp_path, *CHECKED) if ": error:" in line]
    assert not errors, "\n".join(errors)


MODEL_CLIENTS = """
from __future__ import annotations

from agent_bus.agents.loop import Abort, LlmClient
from agent_bus.bus.messages import AssistantMessage, LlmRequest


class TakesAbort:
    async def complete(self, request: LlmRequest, on_delta: object = None, *,
                       abort: Abort | None = None) -> AssistantMessage:
        return AssistantMessage()


class WithoutAbort:
    async def complete(self, request: LlmRequest, on_delta: object = None) -> AssistantMessage:
        return AssistantMessage()


fine: LlmClient = TakesAbort()
wrong: LlmClient = WithoutAbort()
"""


def test_a_model_client_that_takes_no_abort_is_a_type_error(tmp_path: Path) -> None:
    # The loop passes every call an `Abort` (agents/loop/abort.py): a client must take it.
    clients = tmp_path / "clients.py"
    clients.write_text(MODEL_CLIENTS)
    errors = [line for line in _mypy(tmp_path, str(clients)) if ": error:" in line]
    assert len(errors) == 1 and '"WithoutAbort"' in errors[0], "\n".join(errors)
