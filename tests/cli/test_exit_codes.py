"""The README's exit-code table (issue 49, item 5) against the commands themselves: every example
in its "e.g." column is run, on one real topology, and must exit with its row's code."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from tests.cli.conftest import running_up
from tests.support import ROOT, busctl


def readme_table() -> dict[int, list[list[str]]]:
    """{exit code: [argv of each example]} from the README's "Exit codes" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    table: dict[int, list[list[str]]] = {}
    for line in section.splitlines():
        row = re.match(r"\| (\d+) \|", line)
        if row is None:
            continue
        examples = line.split("|")[3]  # | exit | meaning | e.g. |
        table[int(row.group(1))] = [shlex.split(example)[1:]  # without `busctl`
                                    for example in re.findall(r"`(busctl [^`]+)`", examples)]
    return table


def test_the_readme_table_holds_for_every_command(tmp_path: Path,
                                                  fake_llm: FakeLLMServer) -> None:
    table = readme_table()
    assert set(table) == {0, 1, 2, 3, 130}, table
    assert len(table[2]) >= 9 and table[1], table  # the unknown names and the idle verbs
    with running_up(tmp_path, env={"OPENAI_BASE_URL": fake_llm.base_url,
                                   "OPENAI_API_KEY": ""}) as topo:
        env = {**os.environ, "BUSCTL_HUB": topo.endpoint}
        wrong = []
        for code, examples in sorted(table.items()):
            for args in examples:
                result = subprocess.run(busctl(*args), capture_output=True, text=True,
                                        timeout=60, cwd=tmp_path, env=env)
                if result.returncode != code:
                    wrong.append(f"busctl {shlex.join(args)}: exit {result.returncode}, the "
                                 f"README says {code}: {result.stderr.strip()[-300:]}")
                elif code in (1, 2):  # one line saying what is wrong, never a traceback
                    assert "Traceback" not in result.stderr and result.stderr.strip(), args
        assert not wrong, "\n".join(wrong)
