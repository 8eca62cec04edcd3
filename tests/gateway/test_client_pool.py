"""The gateway spreads concurrent model streams over a few httpx clients (agents/gateway/engine.py
`_ClientPool`): one client's cost per call grows with the calls in flight on it."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from agent_bus.agents.gateway.engine import _ClientPool

pytestmark = pytest.mark.anyio


async def test_streams_spread_over_clients_least_busy_first() -> None:
    first = httpx.AsyncClient()
    pool = _ClientPool(first, grow=True)
    per, size = _ClientPool.PER_CLIENT, _ClientPool.SIZE
    with ExitStack() as leases:
        got = [leases.enter_context(pool.lease()) for _ in range(per)]
        assert set(map(id, got)) == {id(first)}  # one client until it carries PER_CLIENT
        got += [leases.enter_context(pool.lease()) for _ in range(per * size)]
        clients = {id(c) for c in got}
        assert len(clients) == size  # never more than SIZE
        counts = [sum(id(c) == cid for c in got) for cid in clients]
        assert max(counts) - min(counts) <= 1 + per  # spread, least busy first
    with pool.lease() as again:  # all released: the least busy (any) is reused, none created
        assert id(again) in clients
    await pool.aclose(keep=None)


async def test_a_client_handed_in_is_used_alone_and_not_closed() -> None:
    mine = httpx.AsyncClient()
    pool = _ClientPool(mine, grow=False)
    with ExitStack() as leases:
        got = {id(leases.enter_context(pool.lease())) for _ in range(3 * _ClientPool.PER_CLIENT)}
    assert got == {id(mine)}
    await pool.aclose(keep=mine)
    assert not mine.is_closed
    await mine.aclose()
