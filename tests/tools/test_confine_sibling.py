"""`confine()` compares paths, not strings (issue 29, item 6; a mutant of run_mutants.py): a
sibling whose name starts with the workspace's (`ws-evil` next to `ws`) is outside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_bus.tools import WorkspaceError
from agent_bus.tools._context import confine


def test_a_sibling_sharing_the_workspace_prefix_is_refused(tmp_path: Path) -> None:
    ws, evil = tmp_path / "ws", tmp_path / "ws-evil"
    ws.mkdir()
    evil.mkdir()
    (evil / "secret.txt").write_text("secret")
    for path in ("../ws-evil/secret.txt", str(evil / "secret.txt"), "../ws-evil"):
        with pytest.raises(WorkspaceError, match="outside the workspace"):
            confine(ws, path)
    assert confine(ws, "ok.txt") == (ws / "ok.txt").resolve()  # inside: fine
