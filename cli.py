"""busctl: the command line (placeholder until the CLI lands)."""
import click


@click.group()
def main() -> None:
    """busctl — run and watch an agent-bus topology."""
