"""Every input path stays where it was said to be (issue 44, break 5): a dataset's sample `files`
resolve inside the dataset's folder. An absolute path, a `..` and a symlink out of the folder
(a third-party dataset naming the user's key) are refused by `busctl experiment check` and
`busctl experiment run`, naming the sample and the field, before anything is read or sent."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agent_bus.agents.experiment.spec import SpecError, load_spec
from tests.support import busctl

SPEC = """
name = "qa"
[dataset]
path = "data/samples.jsonl"
[[variants]]
name = "solo"
agent = "assistant"
"""


def dataset(tmp_path: Path, files: object) -> Path:
    """A spec whose one sample (id `s1`) places `files`; the user's secret lies outside."""
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "id_rsa").write_text("PRIVATE KEY")
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("fine")
    (data / "samples.jsonl").write_text(json.dumps({"id": "s1", "input": "read notes.txt",
                                                    "files": files}) + "\n")
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    return spec


def refused(spec: Path, *args: str) -> str:
    result = subprocess.run(busctl("experiment", *args, str(spec)), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "PRIVATE KEY" not in result.stdout + result.stderr
    return result.stderr


def secret(tmp_path: Path) -> str:
    return str(tmp_path / "home" / ".ssh" / "id_rsa")


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink", "symlinked folder"])
def test_check_and_run_refuse_files_outside_the_dataset(tmp_path: Path, how: str) -> None:
    spec = dataset(tmp_path, {})
    data = tmp_path / "data"
    if how == "absolute":
        files: object = {"notes.txt": secret(tmp_path)}
    elif how == "dotdot":
        files = {"notes.txt": "../home/.ssh/id_rsa"}
    elif how == "symlink":
        (data / "key.txt").symlink_to(secret(tmp_path))
        files = ["key.txt"]
    else:
        (data / "sub").symlink_to(tmp_path / "home" / ".ssh")
        files = {"notes.txt": "sub/id_rsa"}
    (data / "samples.jsonl").write_text(json.dumps({"id": "s1", "input": "x", "files": files})
                                        + "\n")
    key = "files[0]" if isinstance(files, list) else "files.notes.txt"
    for command in (("check",), ("run", "--hub", "tcp://127.0.0.1:9", "--name", "e1")):
        err = refused(spec, *command)
        assert f"samples.jsonl:1: sample 's1': {key}:" in err, err
        assert "inside the dataset's folder" in err and str(data) in err, err


def test_files_inside_the_folder_still_pass_and_a_later_swap_is_caught(tmp_path: Path) -> None:
    spec = dataset(tmp_path, {"notes.txt": "notes.txt", "same.txt": "./notes.txt"})
    (tmp_path / "data" / "inner").symlink_to(tmp_path / "data")  # a link that stays inside
    loaded = load_spec(spec)
    variant, sample = loaded.spec.variants[0], loaded.samples[0]
    workspace = loaded.workspace("e1", variant, sample, 1)
    assert workspace is not None and workspace.files == {"notes.txt": b"fine", "same.txt": b"fine"}
    # swapped for a link out after the check: the read (when the cell starts) refuses it too
    (tmp_path / "data" / "notes.txt").unlink()
    (tmp_path / "data" / "notes.txt").symlink_to(secret(tmp_path))
    with pytest.raises(SpecError, match="inside the dataset's folder"):
        loaded.workspace("e1", variant, sample, 1)
