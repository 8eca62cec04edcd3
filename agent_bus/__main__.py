"""`python -m agent_bus ...`: the same commands as `agent-bus` / `busctl`."""

from agent_bus.cli import main

main(prog_name="agent-bus")
