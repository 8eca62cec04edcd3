"""Set-up files: `busctl config` checks and shows topologies, `busctl keys` makes CURVE keys."""

from __future__ import annotations

import os
from pathlib import Path

import click
import msgspec

from agent_bus.commands.base import load_topology_or_exit


@click.group()
def config() -> None:
    """Validate and show topology files.

    \b
    Examples:
      busctl config show > team.toml    # the commented default, to edit
      busctl config check team.toml     # then: busctl up -c team.toml
    """


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate FILE and print the resolved topology as JSON (exit 2 naming the bad key; the
    same checks `busctl up` makes before it starts anything).

    \b
    Example:
      busctl config check team.toml | jq '.agents[].name'
    """
    topology = load_topology_or_exit(file)
    click.echo(msgspec.json.format(msgspec.json.encode(topology)).decode())


@config.command("show")
def config_show() -> None:
    """Print the embedded default topology, commented.

    \b
    Example:
      busctl config show > team.toml && busctl up -c team.toml
    """
    from agent_bus.agents.launch.topology import EXAMPLE

    click.echo(EXAMPLE, nl=False)


@click.group()
def keys() -> None:
    """CurveZMQ keys for a hub that other machines connect to.

    \b
    Example:
      busctl keys generate ./keys --client laptop --client ci
    """


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--client", "clients", multiple=True, default=("client",), show_default=True,
              help="Name of a client key pair to make and authorise (repeatable).")
@click.option("--force", is_flag=True,
              help="Replace key files that already exist (every hub and client using them must change).")
def keys_generate(directory: str, clients: tuple[str, ...], force: bool) -> None:
    """Make a hub key pair and client key pairs in DIRECTORY (files 0600, directory 0700).

    \b
    Example:
      busctl keys generate ./keys --client laptop
    Then:
      busctl hub --hub tcp://0.0.0.0:7400 --curve-secret DIR/hub.key_secret --curve-authorized DIR/authorized
      busctl worker --hub tcp://HOST:7400 --curve-server-key DIR/hub.key --curve-key DIR/client.key_secret
    In a topology ([hub]): curve_secret, curve_authorized, curve_server_key, and curve_client_key =
    DIR/<your client>.key_secret, the owner's key; `busctl up` makes its processes' keys itself.
    """
    import shutil

    from agent_bus.bus.security import generate_keys

    root = Path(directory)
    # New keys lock out every peer holding the old ones: replacing them is asked for, never a rerun.
    existing = [p.name for n in ("hub", *clients) for p in (root / f"{n}.key", root / f"{n}.key_secret")
                if p.exists()]
    if existing and not force:
        raise click.UsageError(f"{root} already holds {', '.join(existing)}: keep them, or give --force "
                               "to replace them (clients with the old keys are then refused)")
    generate_keys(root, "hub")
    authorized = root / "authorized"
    authorized.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in clients:
        public, _ = generate_keys(root, name)
        shutil.copy(public, authorized / public.name)
        os.chmod(authorized / public.name, 0o600)
    click.echo(f"hub keys: {root / 'hub.key'} (give to clients), {root / 'hub.key_secret'} (hub only)")
    click.echo(f"clients: {', '.join(clients)}; authorised public keys in {authorized}")
