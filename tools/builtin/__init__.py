"""Built-in tools: workspace file access, a text-only URL fetch and an opt-in shell.

    read_file(path, offset=1, limit=2000, column=1)   write_file(path, content)
    list_dir(path=".")                                 search_files(pattern, path=".", glob=None)
    fetch_url(url)                                     run_shell(command, timeout=60)

File tools are confined to the worker's workspace (`ToolContext.workspace`); `run_shell` refuses
unless the worker enabled shell access (`ToolContext.allow_shell`); `fetch_url` reaches only
public addresses unless the worker's `BUSCTL_FETCH_ALLOW` lists internal ones (`_netguard`).
Searches and reads stop at a time limit of their own (`search_files` runs patterns on RE2, or
Python's `re` in a killable child process, `_grep`). Serve them all with
`load_tools("agent_bus.tools.builtin")`.
"""

from agent_bus.tools._tool import Tool
from agent_bus.tools.builtin._files import list_dir, read_file, search_files, write_file
from agent_bus.tools.builtin._shell import run_shell
from agent_bus.tools.builtin._web import fetch_url

BUILTIN_TOOLS: list[Tool] = [read_file, write_file, list_dir, search_files, fetch_url, run_shell]

__all__ = [
    "BUILTIN_TOOLS",
    "fetch_url",
    "list_dir",
    "read_file",
    "run_shell",
    "search_files",
    "write_file",
]
