"""busctl — start, attach to, drive and watch an agent-bus topology.

The entry module: the top-level group and where each command lives. The commands are in
`agent_bus.commands`, one module per family, each imported only when one of its commands is
used (or listed by --help): every process `busctl up` starts runs busctl, so an import here is
paid at every start.

Every command that talks to a hub takes `--hub ADDR` (or `BUSCTL_HUB`). Bus errors become click
errors in one place (`commands.base.BusctlGroup`): exit 2 when the hub cannot be reached, a
flag is wrong or a name (agent, process, experiment) names nothing, exit 1 when a request fails
(README, "Exit codes").
"""

# ruff: noqa: E402  (the SIGINT handler below must be in place before the slow imports)
from __future__ import annotations

import sys

from agent_bus.commands.interrupt import exit_130_while_loading

exit_130_while_loading(__name__ == "__main__" or sys.argv[0].rpartition("/")[2] == "busctl")

import logging
from collections.abc import Callable
from importlib import import_module

import click

from agent_bus.commands.base import BusctlGroup

# Each command: its module in agent_bus/commands/ and the click command's name there.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("topology", "up"),
    "down": ("topology", "down"),
    "submit": ("submit", "submit"),
    "ps": ("processes", "ps"),
    "restart": ("processes", "restart"),
    "scale": ("processes", "scale"),
    "logs": ("processes", "logs"),
    "worker": ("parts", "worker"),
    "gateway": ("parts", "gateway"),
    "coordinator": ("parts", "coordinator"),
    "run": ("agent", "run_cmd"),
    "chat": ("agent", "chat"),
    "steer": ("agent", "steer"),
    "follow-up": ("agent", "follow_up"),
    "abort": ("agent", "abort"),
    "status": ("observe", "status"),
    "watch": ("observe", "watch"),
    "otel": ("observe", "otel"),
    "ui": ("observe", "ui"),
    "export": ("experiment", "export"),
    "replay": ("experiment", "replay"),
    "diff": ("experiment", "diff_experiments"),
    "experiment": ("experiment", "experiment_group"),
    "config": ("keys_config", "config"),
    "keys": ("keys_config", "keys"),
    "mcp": ("mcp", "mcp_group"),
}


def _loader(module: str, name: str) -> Callable[[], click.Command]:
    def load() -> click.Command:
        command = getattr(import_module(f"agent_bus.commands.{module}"), name)
        assert isinstance(command, click.Command), (module, name)
        return command

    return load


def _hub_command() -> click.Command:
    # built when used: its budget options read bus.hub's defaults, which only the hub needs
    from agent_bus.commands.parts import hub_command

    return hub_command()


def _fake_llm_command() -> click.Command:
    # built when used: the fake model server's module alone was a quarter of busctl's import time
    from agent_bus.commands.parts import fake_llm_command

    return fake_llm_command()


@click.group(cls=BusctlGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug output to stderr.")
@click.version_option(package_name="agent-bus")
def main(verbose: bool) -> None:
    """busctl — run and watch an agent-bus topology.

    \b
    Quick start:
      busctl up --demo            # whole topology, scripted model, no key needed
      busctl run "list the files" # in a second terminal
      busctl watch                # every event, live
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")



main.lazy_commands.update({name: _loader(module, attr) for name, (module, attr) in COMMANDS.items()})
main.lazy_commands.update({"hub": _hub_command, "fake-llm": _fake_llm_command})


if __name__ == "__main__":
    main(prog_name="busctl")  # `python cli.py` is busctl too: its help and completion say so
