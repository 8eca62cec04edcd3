"""Clients of the bus: the Python API for scripts (`remote`), `busctl run`/`chat` (`drive`) and the MCP
server that offers the bus's agents to other programs (`mcp_server`).
"""
