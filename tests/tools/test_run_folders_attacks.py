"""A foreign peer's tool call names a run workspace (docs/protocol.md, "Run workspaces"): ids and
file names that climb out of the worker's workspace, absolute paths, dot files, and a `.runs`
that is a link out of the workspace are refused, and nothing is written outside."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_bus.bus.messages import RunWorkspace
from agent_bus.tools import WorkspaceError
from agent_bus.tools.workspaces import RUNS_DIR, run_folder

HOSTILE_IDS = ["..", "../escape", "e/../../x", "/abs", "e//x", ".hidden", "a/b/c/d/e", "x" * 129, ""]
HOSTILE_NAMES = ["../x", "a/../../x", "/etc/passwd", ".bashrc", "a/.git/config", "a//b", ""]


def _outside(tmp_path: Path, ws: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if not p.is_relative_to(ws)]


@pytest.mark.parametrize("run_id", HOSTILE_IDS)
def test_a_hostile_id_is_refused(tmp_path: Path, run_id: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(WorkspaceError, match="workspace id"):
        run_folder(ws, RunWorkspace(run_id, {"f.txt": b"x"}))
    assert not _outside(tmp_path, ws) and not (ws / RUNS_DIR).exists()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_file_name_is_refused(tmp_path: Path, name: str) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(WorkspaceError, match="file name"):
        run_folder(ws, RunWorkspace("e/v.r1/s1", {name: b"x"}))
    assert not _outside(tmp_path, ws) and not (ws / RUNS_DIR).exists()


def test_a_runs_folder_linked_out_of_the_workspace_is_refused(tmp_path: Path) -> None:
    ws, elsewhere = tmp_path / "ws", tmp_path / "elsewhere"
    ws.mkdir()
    elsewhere.mkdir()
    (ws / RUNS_DIR).symlink_to(elsewhere)  # e.g. planted by a tool of an earlier run
    with pytest.raises(WorkspaceError):
        run_folder(ws, RunWorkspace("e/v.r1/s1", {"f.txt": b"x"}))
    assert not any(elsewhere.iterdir())


def test_a_good_spec_makes_its_folder_once(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    folder = run_folder(ws, RunWorkspace("e/v.r1/s1", {"in/a.txt": b"one"}))
    assert folder == (ws / RUNS_DIR / "e" / "v.r1" / "s1").resolve()
    assert (folder / "in" / "a.txt").read_bytes() == b"one"
    (folder / "in" / "a.txt").write_bytes(b"changed by a tool")
    again = run_folder(ws, RunWorkspace("e/v.r1/s1", {"in/a.txt": b"one"}))
    assert (again / "in" / "a.txt").read_bytes() == b"changed by a tool"  # reused as it is
