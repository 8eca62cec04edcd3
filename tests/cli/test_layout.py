"""busctl's layout: `cli.py` names where each command lives (`agent_bus.commands.<family>`), a
command loads only its own family's module, and nothing below the CLI imports it."""

from __future__ import annotations

import subprocess
import sys

import click

from agent_bus import cli
from tests.test_import_graph import product_modules, project_imports

CLI = ("agent_bus.cli", "agent_bus.commands")
ENTRIES = ("agent_bus.__main__",)  # `python -m agent_bus` is busctl too


def test_nothing_below_the_cli_imports_it() -> None:
    modules = product_modules()
    known = set(modules)
    wrong = [f"{name} imports {used}" for name, path in modules.items()
             if not name.startswith(CLI) and name not in ENTRIES
             for used in project_imports(name, path, known) if used.startswith(CLI)]
    assert not wrong, wrong


def test_each_listed_command_is_in_its_family_module() -> None:
    for name, (module, attribute) in cli.COMMANDS.items():
        command = getattr(__import__(f"agent_bus.commands.{module}", fromlist=["_"]), attribute)
        assert isinstance(command, click.Command) and command.name == name, (name, module)


def test_a_command_loads_only_its_own_family() -> None:
    """`busctl worker` (what `busctl up` starts for each worker) imports parts.py, not the
    modules of the other families."""
    probe = ("import sys\nfrom agent_bus.cli import main\n"
             "main.get_command(main.make_context('busctl', ['worker', '--help'], resilient_parsing=True),"
             " 'worker')\n"
             "print(sorted(m for m in sys.modules if m.startswith('agent_bus.commands.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(["agent_bus.commands.base", "agent_bus.commands.interrupt",
                       "agent_bus.commands.mcp", "agent_bus.commands.parts"]), out
