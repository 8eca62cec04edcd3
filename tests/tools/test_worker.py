"""Acceptance tests: real `busctl worker` processes on a real hub, driven by BusToolExecutor."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.errors import RemoteError
from agent_bus.bus.messages import ToolResult
from agent_bus.tools import check_provider_schema
from tests.support import tight_timing
from tests.tools.fixtures.procs import (
    alive,
    call,
    elapsed,
    executor,
    run_busctl,
    service_load,
    start_worker,
    until,
    workers,
)

pytestmark = pytest.mark.anyio


def pid_of(result: ToolResult) -> int:
    assert not result.is_error, result.text
    return json.loads(result.text)["pid"]


# 1 ------------------------------------------------------------------------------------------


async def test_worker_tools_appear_in_status_with_provider_safe_schemas(hub: dict) -> None:
    async with workers(hub["endpoint"]) as [w]:
        out = run_busctl("status", "--json", "--hub", hub["endpoint"])
        assert out.returncode == 0, out.stderr
        status = msgspec.json.decode(out.stdout, type=p.Status)
        services = {s.name: s for s in status.services}
        expected = {"describe", "sleepy", "sync_sleepy", "fragile", "retryable", "add", "boom",
                    "busy", "gated"}
        assert {f"tool.{n}" for n in expected} <= set(services)
        assert w.ready["tools"] == list(w.ready["tools"]) and set(w.ready["tools"]) == expected
        for name in expected:
            svc = services[f"tool.{name}"]
            assert svc.meta["name"] == name and svc.capacity == 8
            assert check_provider_schema(svc.meta["parameters"]) == [], name
        describe = services["tool.describe"].meta["parameters"]
        assert describe["properties"]["point"]["required"] == ["x", "y"]  # Struct, inlined
        assert describe["properties"]["unit"]["enum"] == ["cm", "in"]  # Literal
        assert describe["properties"]["scale"]["maximum"] == 10  # Annotated
        assert describe["required"] == ["point", "unit"]  # Optional label is not required
        assert services["tool.retryable"].idempotent and services["tool.retryable"].meta["idempotent"]
        assert not services["tool.fragile"].idempotent
        assert services["tool.add"].meta["timeout"] == 30
        [peer] = [x for x in status.peers if x.pid == w.pid]
        assert peer.role == "worker" and peer.name == w.ready["name"]

        async with executor(hub["endpoint"]) as tools:
            catalog = {t.name: t for t in await tools.catalog()}
            assert catalog["describe"].parameters == describe
            sync_result, async_result = await tools.execute_all([
                call("describe", point={"x": 1, "y": 2.5}, unit="cm", label="p", scale=2),
                call("sleepy", seconds=0),
            ])
        assert sync_result.text == "p at (2, 5) cm"
        assert pid_of(async_result) == w.pid


# 2 ------------------------------------------------------------------------------------------


async def test_parallel_batch_spreads_over_workers_and_keeps_call_order(hub: dict) -> None:
    async with workers(hub["endpoint"], 8, "--concurrency", "1") as procs, \
            executor(hub["endpoint"]) as tools:
        batch = [call("sleepy", f"c{i}", seconds=0.5, tag=str(i)) for i in range(8)]
        await tools.catalog()  # warm the cache, as the loop would have for the model call
        t0 = time.monotonic()
        await tools.execute(call("sleepy", "one", seconds=0.5))
        one = elapsed(t0)  # the baseline: one call, on this machine, now
        t0 = time.monotonic()
        results = await tools.execute_all(batch)
        wall = elapsed(t0)
        # no two calls ran one after the other on a worker (that takes one call + 0.5 s)
        assert wall < (0.8 if tight_timing() else one + 0.5), \
            f"8 x 0.5 s over 8 workers took {wall:.2f}s (one call: {one:.2f}s)"
        assert [json.loads(r.text)["tag"] for r in results] == [str(i) for i in range(8)]
        assert {pid_of(r) for r in results} == {w.pid for w in procs}

        for w in procs[1:]:  # a clean leave: the hub stops routing to them at once
            w.signal(signal.SIGTERM)
        for w in procs[1:]:
            assert await anyio.to_thread.run_sync(w.popen.wait, 10) == 0
        t0 = time.monotonic()
        results = await tools.execute_all(batch)
        wall = elapsed(t0)
        # one after the other, and nothing but the calls themselves in between
        assert 3.9 < wall < (5.0 if tight_timing() else 8 * one + 1.0), \
            f"8 x 0.5 s through one worker took {wall:.2f}s (one call: {one:.2f}s)"
        assert [json.loads(r.text)["tag"] for r in results] == [str(i) for i in range(8)]
        assert {pid_of(r) for r in results} == {procs[0].pid}


# 3 ------------------------------------------------------------------------------------------


async def test_worker_attached_mid_batch_takes_its_share(hub: dict, tmp_path: Path) -> None:
    """The batch is held at its first call (a gate file) until the second worker has attached
    and taken a call of its own, so how long the new process takes to start does not matter."""
    gate = str(tmp_path / "gate")
    async with workers(hub["endpoint"], 1, "--concurrency", "1") as [first], \
            executor(hub["endpoint"]) as tools:
        batch = [call("gated", f"c{i}", gate=gate, tag=str(i)) for i in range(8)]
        results: list[ToolResult] = []
        late = None
        try:
            async with anyio.create_task_group() as tg:
                async def run_batch() -> None:
                    results.extend(await tools.execute_all(batch))

                tg.start_soon(run_batch)
                await until(lambda: service_load(tools.peer, "tool.gated"), 10, "the first call")
                late = await start_worker(hub["endpoint"], "--concurrency", "1")
                await until(lambda: _loaded(tools, "tool.gated", 2), 10,
                            "the late worker to take a queued call")
                Path(gate).touch()
            pids = [pid_of(r) for r in results]
            assert [json.loads(r.text)["tag"] for r in results] == [str(i) for i in range(8)]
            # 7 calls were queued when it attached: it takes one at once, then its share
            assert pids.count(late.pid) >= 2 and pids.count(first.pid) >= 2, pids

            following = await tools.execute_all(
                [call("sleepy", f"d{i}", seconds=0.3) for i in range(4)])
            pids = [pid_of(r) for r in following]
            assert sorted(pids.count(w) for w in (first.pid, late.pid)) == [2, 2], pids
        finally:
            if late is not None:
                await anyio.to_thread.run_sync(late.stop)


# 4 ------------------------------------------------------------------------------------------


async def test_worker_killed_mid_call(hub: dict) -> None:
    # default liveness: 3 missed 1 s beats, checked every 0.1 s
    async with workers(hub["endpoint"], 3, "--concurrency", "1") as procs, \
            executor(hub["endpoint"]) as tools:
        by_pid = {w.pid: w for w in procs}
        killed: dict[str, float] = {}

        def killer(name: str) -> Any:
            async def on_update(partial: ToolResult) -> None:
                if name not in killed:  # the first worker that reports in dies
                    by_pid.pop(json.loads(partial.text)["pid"]).signal(signal.SIGKILL)
                    killed[name] = time.monotonic()
            return on_update

        result = await tools.execute(call("fragile", seconds=30), killer("fragile"))
        assert result.is_error
        assert result.text.startswith("Error: worker lost while running 'fragile': peer `worker-")
        assert elapsed(killed["fragile"]) < 3.5

        result = await tools.execute(call("retryable", seconds=0.3), killer("retryable"))
        assert not result.is_error, result.text
        assert pid_of(result) in by_pid  # re-run on a survivor
        assert len(by_pid) == 1


# 5 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_args", "problem"),
    [
        ({"arguments": '{"a": "one", "b": 2}'},
         "Error: Invalid arguments for add: Expected `int`, got `str` - at `$.a`"),
        ({"a": 1}, "Error: Invalid arguments for add: Object missing required field `b`"),
        ({"a": 1, "b": 2, "c": 3}, "Error: Invalid arguments for add: Object contains unknown field `c`"),
        ({"arguments": '{"a": 1, "b": '},
         "Error: Invalid tool arguments JSON for add: Input data was truncated"),
    ],
    ids=["wrong-type", "missing", "extra", "bad-json"],
)
async def test_bad_arguments_are_error_results_and_the_worker_keeps_serving(
    hub: dict, request_args: dict[str, Any], problem: str
) -> None:
    async with workers(hub["endpoint"]) as [w], executor(hub["endpoint"]) as tools:
        result = await tools.execute(call("add", **request_args))
        assert result.is_error and result.text == problem
        # the worker checks too (for callers that skip the executor), and survives garbage
        raw = call("add", **request_args)
        direct = msgspec.msgpack.decode(
            await tools.peer.request("tool.add", p.encode(raw), timeout=5), type=ToolResult)
        assert direct.is_error and direct.text.startswith(problem)
        with pytest.raises(RemoteError, match=r"Malformed request to `tool.add`: expected a msgpack"):
            await tools.peer.request("tool.add", b"\xc1 not msgpack", timeout=5)
        assert (await tools.execute(call("add", a=1, b=2))).text == "3"
        assert w.popen.poll() is None


async def test_tool_errors_unknown_tools_and_progress_events(hub: dict) -> None:
    async with workers(hub["endpoint"]) as [w], executor(hub["endpoint"]) as tools:
        assert (await tools.execute(call("boom", message="it broke"))).text == "Error: it broke"
        unknown = await tools.execute(call("no_such_tool"))
        assert unknown.is_error and unknown.text == "Error: Unknown tool 'no_such_tool'"

        updates: list[Any] = []

        async def on_update(partial: Any) -> None:
            updates.append(partial)

        request = msgspec.structs.replace(call("fragile", "call-7", seconds=0), agent="ag",
                                          run_id="run-1", experiment="exp")
        async with tools.peer.subscribe(["agent/ag/", "ext/ag/"]) as sub:
            assert pid_of(await tools.execute(request, on_update)) == w.pid
            # The worker sends progress to its caller only (the coordinator publishes it with
            # the call's other events): nothing published before a marker sent after the call.
            await tools.peer.publish(ev.TopicMessage(topic="t", text="marker"), agent="ag",
                                     run="run-1")
            seen = []
            with anyio.fail_after(5):
                async for envelope in sub:
                    seen.append(envelope.header.type)
                    if envelope.header.type == "topic_message":
                        break
        assert [json.loads(u.text) for u in updates] == [{"pid": w.pid}]
        assert seen == ["topic_message"], seen


# 6 ------------------------------------------------------------------------------------------


async def test_cancelled_call_kills_the_shell_command(hub: dict, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with workers(hub["endpoint"], 1, "--shell", "--workspace", str(ws),
                       tools="agent_bus.tools.builtin") as [w], executor(hub["endpoint"]) as tools:
        command = "echo $$ > sh.pid; sleep 30 & echo $! > sleep.pid; wait"
        outcome: list[ToolResult] = []
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def run() -> None:
                    outcome.append(await tools.execute(call("run_shell", command=command)))

                tg.start_soon(run)
                await until(lambda: (ws / "sleep.pid").exists() and (ws / "sleep.pid").read_text(),
                            what="the command to start")
                scope.cancel()
        assert outcome == []  # cancellation propagated; no result was made up
        pids = [int((ws / name).read_text()) for name in ("sh.pid", "sleep.pid")]
        await until(lambda: not any(alive(pid) for pid in pids), timeout=5,
                    what=f"shell processes {pids} to be killed")
        await until(lambda: _idle(tools, "tool.run_shell"), timeout=5,
                    what="the worker to free its slot")
        again = await tools.execute(call("run_shell", command="echo still here"))
        assert again.text == "still here\n[exit code 0]"
        assert w.popen.poll() is None


async def _loaded(tools: Any, service: str, load: int) -> bool:
    return await service_load(tools.peer, service) == load


async def _idle(tools: Any, service: str) -> bool:
    return await service_load(tools.peer, service) == 0


# 7 ------------------------------------------------------------------------------------------


async def test_builtin_file_tools_stay_in_the_workspace(hub: dict, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "ok.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    async with workers(hub["endpoint"], 1, "--workspace", str(ws), tools="agent_bus.tools.builtin"), \
            executor(hub["endpoint"]) as tools:
        refused = await tools.execute_all([
            call("read_file", "r1", path="../secret.txt"),
            call("read_file", "r2", path=str(tmp_path / "secret.txt")),
            call("read_file", "r3", path="/etc/passwd"),
            call("write_file", "w1", path="../evil.txt", content="x"),
            call("write_file", "w2", path=str(tmp_path / "evil2.txt"), content="x"),
            call("list_dir", "l1", path="/"),
            call("search_files", "s1", pattern="outside", path=".."),
        ])
        for result in refused:
            assert result.is_error, result.text
            assert "outside the workspace" in result.text, result.text
            assert "outside\n" not in result.text
        assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "evil2.txt").exists()
        ok = await tools.execute(call("read_file", path="ok.txt"))
        assert ok.text == "inside\n"
        # issue 34 item 7: a worker without --shell does not offer run_shell at all
        services = {s.name for s in (await tools.peer.status()).services}
        assert "tool.write_file" in services and "tool.run_shell" not in services


# 8 ------------------------------------------------------------------------------------------


def test_worker_with_a_broken_tool_module_exits_non_zero() -> None:
    module = "tests.tools.fixtures.broken_tools"
    out = run_busctl("worker", "--hub", "tcp://127.0.0.1:9", "--tools", module)
    assert out.returncode == 1
    assert f"Cannot import tool module `{module}`" in out.stderr
    assert "No module named 'no_such_dependency_xyz'" in out.stderr
    assert out.stdout == ""  # no ready line


def test_worker_refuses_a_schema_providers_reject(tmp_path: Path) -> None:
    source = tmp_path / "titled.py"
    source.write_text(
        "from agent_bus.tools import tool\n\n"
        "@tool\ndef titled(x: int) -> int:\n    return x\n\n"
        "titled.parameters['title'] = 'Titled'\n"
    )
    out = run_busctl("worker", "--hub", "tcp://127.0.0.1:9", "--tools", str(source))
    assert out.returncode == 1
    assert "Tool `titled`" in out.stderr and "`title` is not allowed - at `$`" in out.stderr


# leaving ------------------------------------------------------------------------------------


async def test_sigterm_finishes_short_calls_and_cancels_long_ones(hub: dict) -> None:
    async with workers(hub["endpoint"], 1, "--concurrency", "2") as [w], \
            executor(hub["endpoint"]) as tools:
        results: dict[str, ToolResult] = {}
        async with anyio.create_task_group() as tg:
            async def run(key: str, seconds: float) -> None:
                results[key] = await tools.execute(call("sleepy", key, seconds=seconds))

            tg.start_soon(run, "short", 1.0)
            tg.start_soon(run, "long", 30.0)

            await until(lambda: _loaded(tools, "tool.sleepy", 2), what="both calls to run")
            t0 = time.monotonic()
            w.signal(signal.SIGTERM)
        assert pid_of(results["short"]) == w.pid
        assert results["long"].is_error
        assert "worker lost while running 'sleepy'" in results["long"].text
        assert "shut down while running `sleepy`" in results["long"].text
        # the short call's 1 s is let finish, the long one is cancelled at the 2 s shutdown
        # grace; tight: the worker then leaves within 1.5 s
        assert 1.9 < elapsed(t0) < (3.5 if tight_timing() else 10)
        assert await anyio.to_thread.run_sync(w.popen.wait, 10) == 0
        assert "tool.sleepy" not in {s.name for s in (await tools.peer.status()).services}
