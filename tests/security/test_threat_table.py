"""docs/security.md's threat table matches the code (issue 44, acceptance 2): every function it
names exists where it says, every test it names exists, and every test file of tests/security/
is named in it, so a fence added without its row fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support import ROOT

DOC = ROOT / "docs" / "security.md"
HERE = Path(__file__).parent
ROW = re.compile(r"^\| (?P<threat>[^|]+?) \| `(?P<code>[^`]+)` \| `(?P<test>[^`]+)` \|$")


def rows() -> list[dict[str, str]]:
    text = DOC.read_text()
    section = text.split("## Threats and where each is held", 1)[1].split("\n## ", 1)[0]
    found = [m.groupdict() for line in section.splitlines() if (m := ROW.match(line))]
    assert len(found) >= 20, f"the threat table of {DOC} has {len(found)} rows"
    return found


def defined_names(path: Path) -> set[str]:
    """Every function, method and class name defined in a module."""
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_named_function_exists_where_the_table_says() -> None:
    for row in rows():
        path, _, name = row["code"].partition(": ")
        assert (ROOT / path).is_file(), f"{row['threat']}: no file {path}"
        assert name in defined_names(ROOT / path), f"{row['threat']}: no `{name}` in {path}"


def test_every_named_test_exists() -> None:
    for row in rows():
        file, _, name = row["test"].partition("::")
        assert (HERE / file).is_file(), f"{row['threat']}: no tests/security/{file}"
        assert name in defined_names(HERE / file), f"{row['threat']}: no test {name} in {file}"


def test_every_security_test_file_has_a_row() -> None:
    named = {row["test"].partition("::")[0] for row in rows()}
    files = {p.name for p in HERE.glob("test_*.py")} - {Path(__file__).name}
    assert files <= named, f"tests/security files with no row in the threat table: {files - named}"
