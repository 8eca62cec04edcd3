"""MCP servers' tools on the bus: real MCP servers (from PyPI and our own SDK server) behind a
real `busctl worker --mcp`, called through a real hub with the bus's own tool executor."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.bus import protocol as p
from agent_bus.bus.messages import ImagePart, ToolResult, ToolTrace
from agent_bus.bus.tracecontext import span_id, trace_id
from agent_bus.tools import check_provider_schema
from tests.mcp.conftest import DEMO, mcp_worker
from tests.support import until
from tests.tools.fixtures.procs import call, executor, run_busctl

pytestmark = pytest.mark.anyio


def status_services(endpoint: str) -> dict[str, p.ServiceInfo]:
    out = run_busctl("status", "--json", "--hub", endpoint)
    assert out.returncode == 0, out.stderr
    return {s.name: s for s in msgspec.json.decode(out.stdout, type=p.Status).services}


async def test_time_server_tools_are_live_and_answer(hub: dict) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", f"{sys.executable} -m mcp_server_time") as w:
        assert {"get_current_time", "convert_time"} <= set(w.ready["tools"])
        services = status_services(endpoint)
        meta = services["tool.get_current_time"].meta
        assert check_provider_schema(meta["parameters"]) == [], meta
        assert "timezone" in meta["parameters"]["properties"]
        async with executor(endpoint) as tools:
            result = await tools.execute(call("get_current_time", timezone="UTC"))
        assert not result.is_error, result.text
        answer = json.loads(result.text)  # the server's own JSON answer, passed through
        assert answer["timezone"] == "UTC" and answer["datetime"][:4].isdigit()


def make_repo(repo: Path) -> Path:
    """A git repository with one commit (`a.txt`) and one untracked file (`b.txt`)."""
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=T", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("hello\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first commit"], check=True)
    (repo / "b.txt").write_text("untracked\n")
    return repo


async def test_git_server_status_and_log_with_ref_free_schemas(hub: dict, tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    endpoint = hub["endpoint"]
    command = f"{sys.executable} -m mcp_server_git --repository {repo}"
    async with mcp_worker(endpoint, "--mcp", command) as w:
        assert {"git_status", "git_log"} <= set(w.ready["tools"])
        for name, svc in status_services(endpoint).items():
            if name.startswith("tool.git_"):
                schema = svc.meta["parameters"]
                assert "$ref" not in json.dumps(schema) and "$defs" not in schema, name
                assert check_provider_schema(schema) == [], (name, schema)
        async with executor(endpoint) as tools:
            status = await tools.execute(call("git_status", repo_path=str(repo)))
            log = await tools.execute(call("git_log", repo_path=str(repo)))
    assert not status.is_error and "b.txt" in status.text, status.text
    assert not log.is_error and "first commit" in log.text, log.text


async def test_progress_results_and_errors_of_an_sdk_server(hub: dict, tmp_path: Path) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", DEMO), executor(endpoint) as tools:
        updates: list[ToolResult] = []

        async def on_update(partial: Any) -> None:
            updates.append(partial)

        request = msgspec.structs.replace(call("progress", "call-3", steps=3), agent="ag",
                                          run_id="run-1")
        result = await tools.execute(request, on_update)
        assert result.text == "done" and not result.is_error
        # (the caller, e.g. the coordinator, publishes them as `tool_execution_update`)
        assert [u.text for u in updates] == ["step 1 (1/3)", "step 2 (2/3)", "step 3 (3/3)"]

        picture = await tools.execute(call("picture"))
        assert picture.text == "a dot" and isinstance(picture.content[1], ImagePart)
        assert picture.content[1].data.startswith(b"\x89PNG")
        failed = await tools.execute(call("fail"))
        assert failed.is_error and failed.text == "it broke"
        bad = await tools.execute(call("progress", steps="many"))
        assert bad.is_error and "progress" in bad.text, bad.text


async def test_abort_mid_call_cancels_at_the_server_and_answers_at_once(
        hub: dict, tmp_path: Path) -> None:
    endpoint = hub["endpoint"]
    # the workspace: the server writes its marker there (the rest of /tmp is the sandbox's own)
    async with mcp_worker(endpoint, "--workspace", str(tmp_path), "--mcp", f"{DEMO} {tmp_path}"), \
            executor(endpoint) as tools:
        t0 = time.monotonic()
        baseline = await tools.execute(call("slow", seconds=0.05, tag="base"))
        quick = time.monotonic() - t0
        assert baseline.text == "slept 0.05"
        started = anyio.Event()

        async def on_update(_: Any) -> None:
            started.set()

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(tools.execute, call("slow", seconds=30, tag="abort"), on_update)
                with anyio.fail_after(10):
                    await started.wait()
                t0 = time.monotonic()
                scope.cancel()
        # the server saw `notifications/cancelled` for its request
        await until(lambda: (tmp_path / "cancelled-abort").exists(), 10, "the server's cancel")
        assert time.monotonic() - t0 < 3 + quick
        # the worker's slot is free again: the next call runs at once
        assert (await tools.execute(call("whoami"))).text.isdigit()
        assert await _service_load(tools.peer, "tool.slow") == 0


async def test_the_calls_trace_context_reaches_the_server_in_meta(hub: dict, tmp_path: Path
                                                                 ) -> None:
    """An MCP call carries `_meta.traceparent` naming the call's `execute_tool` span (as
    `busctl otel` exports it) in the root run's trace, so an instrumented MCP server's spans land
    under it; a call outside any run carries none."""
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", f"{DEMO} {tmp_path}"), executor(endpoint) as tools:
        in_run = call("trace_meta", call_id="c7")
        in_run.run_id, in_run.trace = "sub", ToolTrace(root_run_id="top")
        result = await tools.execute(in_run)
        span = f"{span_id('sub', 'tool', 'c7'):016x}"
        assert result.text == f"00-{trace_id('top'):032x}-{span}-01", result.text
        assert (await tools.execute(call("trace_meta"))).text == "none"


async def _service_load(peer: Any, service: str) -> int:
    for svc in (await peer.status()).services:
        if svc.name == service:
            return svc.load
    return -1


async def test_list_changed_registers_new_tools(hub: dict) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", DEMO, "--mcp-prefix", "demo_") as w, \
            executor(endpoint) as tools:
        assert "demo_extra" not in w.ready["tools"] and "demo_whoami" in w.ready["tools"]
        assert (await tools.execute(call("demo_add_tool"))).text == "added"
        await until(lambda: "tool.demo_extra" in status_services(endpoint), 10, "demo_extra")
        result = await tools.execute(call("demo_extra", word="hi"))
        assert result.text == "extra hi", result.text


async def test_a_crashed_server_is_restarted_and_works_again(hub: dict) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--mcp", DEMO, verbose=True) as w, \
            executor(endpoint) as tools:
        first = (await tools.execute(call("whoami"))).text
        crashed = await tools.execute(call("crash"))
        assert crashed.is_error and "demo_server" in crashed.text, crashed.text

        async def new_pid() -> str | None:
            result = await tools.execute(call("whoami"))
            return result.text if result.text.isdigit() and result.text != first else None

        second = await until(new_pid, 15, "the restarted server")
        assert second != first
        await until(lambda: "crashing on demand" in w.output(), 5, "the server's stderr logged")
        # logged at INFO (servers write routine chatter there), not as a worker WARNING
        assert ("tools.mcp.tests.mcp.fixtures.demo_server INFO [tests.mcp.fixtures.demo_server] "
                "demo server crashing on demand") in w.output(), w.output()[-2000:]


async def test_a_clash_with_another_workers_tool_is_refused_naming_both(hub: dict) -> None:
    endpoint = hub["endpoint"]
    async with mcp_worker(endpoint, "--name", "clocks", "--tools",
                          "tests.mcp.fixtures.clash_tools"), \
            mcp_worker(endpoint, "--mcp", f"{sys.executable} -m mcp_server_time") as w:
        assert w.ready["tools"] == ["convert_time"]
        assert ("tool `get_current_time` of MCP server `mcp_server_time` clashes with the live "
                "`get_current_time` of `clocks`") in w.output()
        async with executor(endpoint) as tools:
            assert (await tools.execute(call("get_current_time", city="Oslo"))).text == \
                "noon in Oslo"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_http_server_restart_is_survived_transparently(hub: dict) -> None:
    from tests.support import Proc

    endpoint, port = hub["endpoint"], _free_port()
    server_args = [sys.executable, "-m", "tests.mcp.fixtures.demo_server", "--http", str(port)]
    server = Proc(server_args)
    try:
        await until(lambda: _listening(port), 20, "the demo HTTP server")
        async with mcp_worker(endpoint, "--mcp-url", f"http://127.0.0.1:{port}/mcp",
                              "--mcp-header", "X-Token=hunter2") as w, \
                executor(endpoint) as tools:
            assert "whoami" in w.ready["tools"]
            first = (await tools.execute(call("whoami"))).text
            assert first == str(server.pid), first
            server.stop()
            server = Proc(server_args)  # same URL, new process: our session id is unknown to it
            await until(lambda: _listening(port), 20, "the restarted demo HTTP server")
            again = await tools.execute(call("whoami"))
            assert again.text == str(server.pid), again.text  # no error seen by the caller
            assert "hunter2" not in w.output()
    finally:
        server.stop()
