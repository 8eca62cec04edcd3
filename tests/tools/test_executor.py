"""BusToolExecutor against a real hub and `busctl worker`: batches, catalog, timeouts, hub loss."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from agent_bus.bus import protocol as p
from agent_bus.bus.client import connect
from agent_bus.bus.messages import RunWorkspace, ToolCallRequest, ToolResult
from agent_bus.tools.executor import BusToolExecutor, arguments_problem
from tests.tools.fixtures.procs import (
    call,
    elapsed,
    executor,
    fast_hub,
    service_load,
    start_worker,
    until,
    workers,
)

pytestmark = pytest.mark.anyio


async def _running(tools: BusToolExecutor) -> bool:
    return await service_load(tools.peer, "tool.sleepy") == 1


def tag(result: ToolResult) -> str:
    assert not result.is_error, result.text
    return json.loads(result.text)["tag"]


async def test_parallel_batch_yields_as_completed_and_sequential_in_order(hub: dict) -> None:
    async with workers(hub["endpoint"], 1, "--concurrency", "3"), \
            executor(hub["endpoint"]) as tools:
        batch = [call("sleepy", f"c{i}", seconds=s, tag=str(i)) for i, s in
                 enumerate([0.4, 0.05, 0.2])]
        seen = [(i, tag(r)) async for i, r in tools.execute_batch(batch)]
        assert seen == [(1, "1"), (2, "2"), (0, "0")]

        t0 = time.monotonic()
        seen = [(i, tag(r)) async for i, r in tools.execute_batch(batch, "sequential")]
        assert seen == [(0, "0"), (1, "1"), (2, "2")]
        assert elapsed(t0) >= 0.65

        with pytest.raises(ValueError, match="mode must be 'parallel' or 'sequential'"):
            await tools.execute_all(batch, "random")  # type: ignore[arg-type]


async def test_updates_carry_the_call_index(hub: dict) -> None:
    async with workers(hub["endpoint"]) as [w], executor(hub["endpoint"]) as tools:
        updates: list[tuple[int, str]] = []

        async def on_update(index: int, partial: ToolResult) -> None:
            updates.append((index, partial.text))

        batch = [call("add", "a", a=1, b=1), call("fragile", "f", seconds=0)]
        results = await tools.execute_all(batch, on_update=on_update)
        assert results[0].text == "2"
        assert updates == [(1, json.dumps({"pid": w.pid}, separators=(",", ":")))]


async def test_invalid_json_is_refused_before_dispatch(hub: dict) -> None:
    assert arguments_problem(call("x", arguments="")) is None  # blank means {}
    async with workers(hub["endpoint"]), executor(hub["endpoint"]) as tools:
        await tools.catalog()  # cached from here on
        before = (await tools.peer.status()).counters.get("requests", 0)
        results = await tools.execute_all([call("add", "j1", arguments="{'a': 1}"),
                                           call("add", "j2", arguments="[1, 2")])
        after = (await tools.peer.status()).counters.get("requests", 0)
        assert [r.text.split(":")[0:2] for r in results] == [
            ["Error", " Invalid tool arguments JSON for add"]] * 2
        assert all(r.is_error for r in results)
        assert after - before == 1  # only the second status request: no call was dispatched


async def test_catalog_is_cached_and_refreshed_for_new_tools(hub: dict) -> None:
    async with executor(hub["endpoint"]) as tools:
        assert await tools.catalog() == []
        missing = await tools.execute(call("add", a=1, b=2))
        assert missing.text == "Error: Unknown tool 'add'"
        async with workers(hub["endpoint"]):
            # a lookup miss refreshes the cached (empty) catalog at once
            assert (await tools.execute(call("add", a=1, b=2))).text == "3"
            names = [t.name for t in await tools.catalog()]
            assert names == sorted(names) and "sleepy" in names
            assert (await tools.catalog())[0].parameters["type"] == "object"


async def test_executor_timeout_becomes_a_timed_out_result(hub: dict) -> None:
    async with workers(hub["endpoint"]) as [w], executor(hub["endpoint"]) as tools:
        quick = BusToolExecutor(tools.peer, default_timeout=0.3)
        t0 = time.monotonic()
        result = await quick.execute(call("sleepy", seconds=5))
        assert result.is_error and result.text == "Tool 'sleepy' timed out after 0.3s"
        assert elapsed(t0) < 2.0
        info = {t.name: t for t in await quick.catalog()}
        assert quick.timeout_for(info["add"]) == 35  # the tool's own 30 s + margin
        assert (await tools.execute(call("add", a=2, b=2))).text == "4"
        assert w.popen.poll() is None


async def _served(peer: object, service: str) -> bool:
    status = await peer.status()  # type: ignore[attr-defined]
    return any(s.name == service and s.peers for s in status.services)


async def test_a_call_from_a_stale_catalog_waits_for_a_worker_only_server_wait(hub: dict) -> None:
    """The catalog is cached: a call made from it after the tool's last worker left is held by
    the hub for a worker only `server_wait` (header `wait`), then fails as an unknown tool, not
    at its timeout (`add`: 35 s). A worker that comes back within the wait serves it."""
    endpoint = hub["endpoint"]
    async with executor(endpoint) as shared:
        peer = shared.peer

        async def stale_catalog(server_wait: float) -> BusToolExecutor:
            tools = BusToolExecutor(peer, catalog_ttl=300, server_wait=server_wait)
            worker = await start_worker(endpoint)
            try:
                assert "add" in [t.name for t in await tools.catalog()]
            finally:
                await anyio.to_thread.run_sync(worker.stop)
            await until(lambda: not_served(), what="the hub to drop tool.add")
            return tools

        async def not_served() -> bool:
            return not await _served(peer, "tool.add")

        tools = await stale_catalog(server_wait=0.5)
        result = await tools.execute(call("add", a=1, b=2))
        # (without the wait, the hub holds it to its deadline: "timed out after 35s")
        assert result.is_error and result.text == "Error: Unknown tool 'add'"
        assert (await peer.status()).counters.get("waits_expired") == 1

        tools = await stale_catalog(server_wait=60)
        async with anyio.create_task_group() as tg:
            results: list[ToolResult] = []

            async def run() -> None:
                results.append(await tools.execute(call("add", a=2, b=3)))

            tg.start_soon(run)
            back = await start_worker(endpoint)
        await anyio.to_thread.run_sync(back.stop)
        assert results[0].text == "5"


async def test_hub_loss_mid_call_is_an_error_result(tmp_path: Path) -> None:
    with fast_hub(tmp_path) as hub:
        async with workers(hub["endpoint"]), executor(hub["endpoint"]) as tools:
            await tools.catalog()
            async with anyio.create_task_group() as tg:
                results: list[ToolResult] = []

                async def run() -> None:
                    results.append(await tools.execute(call("sleepy", seconds=30)))

                tg.start_soon(run)
                await until(lambda: _running(tools), what="the call to reach the worker")
                hub["proc"].signal(signal.SIGKILL)
            [result] = results
            assert result.is_error
            assert result.text.startswith("Error: lost the hub while running 'sleepy'")


async def test_a_call_refused_by_a_leaving_worker_is_sent_again(hub: dict) -> None:
    from agent_bus.bus import protocol as p
    from agent_bus.bus.client import IncomingRequest, connect
    from agent_bus.bus.errors import RequestError
    from tests.tools.fixtures.worker_tools import add

    async with connect(hub["endpoint"], name="leaving") as leaving:
        refused: list[str] = []

        async def refuse(req: IncomingRequest) -> bytes:  # what a worker mid-`leave()` answers
            refused.append(req.id)
            await leaving.unserve("tool.add")
            raise RequestError("`tool.add` is not served here", p.NO_SERVICE)

        await leaving.serve("tool.add", refuse, capacity=100, meta=msgspec.to_builtins(add.info))
        await leaving.status()  # registered first: the hub picks it first
        async with workers(hub["endpoint"]) as [_], executor(hub["endpoint"]) as tools:
            result = await tools.execute(call("add", a=20, b=22))
            assert (result.text, len(refused)) == ("42", 1)


def _in(workspace: str, call_id: str, **args: object) -> ToolCallRequest:
    return msgspec.structs.replace(call("sleepy", call_id, seconds=0.01, **args),
                                   workspace=RunWorkspace(id=workspace))


async def test_a_workspaces_calls_stay_on_the_worker_of_its_first_call(hub: dict) -> None:
    """Two workers: calls without a workspace rotate over both; a workspace's calls, its first
    batch of parallel calls included, all go to one worker, which `worker_of` names. When that
    worker is gone the workspace moves to the one that served it next (not to each in turn);
    a released workspace is forgotten, and unheld ones past `affinity_limit` oldest first."""
    async with workers(hub["endpoint"], 2, "--concurrency", "4") as procs, \
            connect(hub["endpoint"], name="test-client") as peer:
        tools = BusToolExecutor(peer, affinity_limit=2)
        pids = {await _pid(tools, call("sleepy", f"n{i}", seconds=0.01)) for i in range(4)}
        assert pids == {p.pid for p in procs}
        tools.hold_workspace("w/1")
        for batch in range(3):
            results = await tools.execute_all([_in("w/1", f"c{batch}.{i}") for i in range(3)])
            pids = {json.loads(r.text)["pid"] for r in results}
            assert len(pids) == 1, pids
        [home] = [p for p in procs if p.pid in pids]
        assert tools.worker_of("w/1") == _peer_id(await peer.status(), home.pid)
        # its worker stops: a new one starts; the workspace moves to one of them and stays
        other = next(p for p in procs if p is not home)
        await anyio.to_thread.run_sync(home.stop)
        async with workers(hub["endpoint"], 1, "--concurrency", "4") as [new]:
            await until(lambda: _catalog_without(tools, home.pid), 10, "the catalog refreshed")
            moved = {await _pid(tools, _in("w/1", f"m{i}")) for i in range(4)}
            assert len(moved) == 1 and moved <= {other.pid, new.pid}, moved
            for name in ("w/2", "w/3", "w/4"):  # unheld: at most 2 kept besides held ones
                await tools.execute(_in(name, "x"))
            assert [bool(tools.worker_of(n)) for n in ("w/1", "w/2", "w/3", "w/4")] == [
                True, False, True, True]
            tools.release_workspace("w/1")
            assert tools.worker_of("w/1") == ""


async def _pid(tools: BusToolExecutor, request: ToolCallRequest) -> int:
    result = await tools.execute(request)
    assert not result.is_error, result.text
    return int(json.loads(result.text)["pid"])


def _peer_id(status: p.Status, pid: int) -> str:
    return next(peer.peer for peer in status.peers if peer.pid == pid)


async def _catalog_without(tools: BusToolExecutor, pid: int) -> bool:
    """The executor's catalog (and its live peers) fetched since `pid` left the hub."""
    status = await tools.peer.status()
    if any(peer.pid == pid for peer in status.peers):
        return False
    await tools._tools(refresh=True)
    return True


async def test_tools_the_workspaces_worker_lacks_stay_on_one_worker_of_theirs(
        hub: dict, tmp_path: Path) -> None:
    """The workspace's first call goes to a worker of the test tools; its file tools are served
    only by two built-in workers with different workspaces: the first file call picks one of
    them, and every later file call (any file tool, several at once) goes there too."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    async with workers(hub["endpoint"], 1, "--concurrency", "4"), \
            workers(hub["endpoint"], 1, "--workspace", str(tmp_path / "a"), "--concurrency", "4",
                    tools="agent_bus.tools.builtin"), \
            workers(hub["endpoint"], 1, "--workspace", str(tmp_path / "b"), "--concurrency", "4",
                    tools="agent_bus.tools.builtin"), \
            executor(hub["endpoint"]) as tools:
        assert not (await tools.execute(_in("w/5", "s"))).is_error
        files = [call("write_file", "w1", path="one.txt", content="1"),
                 call("write_file", "w2", path="two.txt", content="2")]
        reads = [call("read_file", f"r{i}", path=name) for i, name in
                 enumerate(["one.txt", "two.txt"] * 2)]
        for batch in (files, reads):
            results = await tools.execute_all(
                [msgspec.structs.replace(r, workspace=RunWorkspace(id="w/5")) for r in batch])
            assert not any(r.is_error for r in results), [r.text for r in results]
        assert tools.worker_of("w/5", "read_file") == tools.worker_of("w/5", "write_file")
        assert tools.worker_of("w/5", "read_file") not in ("", tools.worker_of("w/5"))
        assert len([f for f in ("a", "b") if (tmp_path / f / ".runs" / "w" / "5").exists()]) == 1
