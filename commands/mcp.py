"""MCP: `busctl mcp serve` (the bus's agents and tools as an MCP server), and the worker's flags
that name MCP servers read into specs."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from agent_bus.bus.security import CurveClient
from agent_bus.commands.base import hub_options, run_async


def mcp_specs(commands: tuple[str, ...], prefix: str) -> list[Any]:
    """`--mcp` values as server specs; a usage error naming the flag when one is not usable."""
    if not commands:
        return []
    from agent_bus.tools.mcp import parse_mcp_command

    specs = []
    for text in commands:
        try:
            specs.append(msgspec.structs.replace(parse_mcp_command(text), prefix=prefix))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--mcp") from None
    return specs


def _loopback_addr(addr: str) -> tuple[str, int]:
    """`--http HOST:PORT` on a loopback host: the MCP endpoint has no keys or TLS of its own."""
    host, _, port = addr.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]") or not port.isdigit():
        raise click.BadParameter(f"expected a loopback HOST:PORT such as 127.0.0.1:8765, got "
                                 f"{addr!r} (this endpoint has no authentication: loopback only)",
                                 param_hint="--http")
    return host.strip("[]"), int(port)


def mcp_url_specs(urls: tuple[str, ...], headers: tuple[str, ...], prefix: str) -> list[Any]:
    """`--mcp-url` values (with every `--mcp-header K=V`) as server specs."""
    from agent_bus.tools.mcp import McpServerSpec

    pairs = {}
    for item in headers:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected K=V, got {item.split('=')[0]!r}…",
                                     param_hint="--mcp-header")  # never echo a secret value
        pairs[key.strip()] = value
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--mcp-url")
    return [McpServerSpec(url=url, headers=pairs, prefix=prefix) for url in urls]


def require_mcp_sdk(flag: str) -> None:
    try:
        import mcp  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise click.UsageError(f"{flag} needs the MCP SDK: pip install 'agent-bus[mcp]'") from None


def mcp_json_specs(source: Any) -> list[Any]:
    if source is None:
        return []
    from agent_bus.tools.mcp import McpServerSpec

    try:
        return msgspec.json.decode(source.read(), type=list[McpServerSpec])
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not a JSON list of MCP servers: {exc}",
                                 param_hint="--mcp-servers") from None


# --- busctl mcp -------------------------------------------------------------------------


@click.group("mcp")
def mcp_group() -> None:
    """The bus as an MCP server (for Claude Desktop/Code, Cursor, VS Code, other agents).

    \b
    Examples:
      busctl mcp serve                        # stdio, for a client that launches it
      busctl mcp serve --http 127.0.0.1:8765  # streamable HTTP at http://127.0.0.1:8765/mcp
    """


@mcp_group.command("serve")
@hub_options
@click.option("--agent", "agents", multiple=True,
              help="Expose only this agent as `ask_<agent>` (repeatable) [default: every live one].")
@click.option("--tools", "with_tools", is_flag=True, help="Also expose every live bus tool.")
@click.option("--http", "http_addr", default="", metavar="HOST:PORT",
              help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (loopback only).")
def mcp_serve(hub: str, curve: CurveClient | None, agents: tuple[str, ...],
              with_tools: bool, http_addr: str) -> None:
    """Serve MCP over stdin/stdout: each agent is a tool `ask_<agent>` (prompt, session).

    \b
    An MCP client's configuration that launches it:
      {"mcpServers": {"bus": {"command": "busctl", "args": ["mcp", "serve"]}}}
    Examples:
      busctl mcp serve --agent assistant --tools
      busctl mcp serve --http 127.0.0.1:8765
    """
    require_mcp_sdk("busctl mcp serve")
    from agent_bus.agents.client.mcp_server import serve_http, serve_stdio

    try:
        if http_addr:
            host, port = _loopback_addr(http_addr)
            run_async(serve_http, hub, curve, list(agents), with_tools, host, port)
        else:
            run_async(serve_stdio, hub, curve, list(agents), with_tools)
    except KeyboardInterrupt:
        pass
