"""Which of the hubs sharing one JetStream store leads (issue 52 item 2, docs/reliability.md
"The standby hub"): every such hub takes part in the lease (bus/store/lease.py); the holder is
the primary, the others are standbys that follow the log's head and take the lease once it
lapses.

The lease is kept on the lease connection's own loop thread (a task: renewals never wait behind
the routing loop, nor the routing loop behind them). The hub's loop reads a few plain fields,
written by that task (`until`, `epoch`, `leader`, `head`): it is the primary while
`time.monotonic() < until`.

Why `until` is safe: a renewal counts from when it was *sent*; the store's entry expires `ttl`
after the server stored it, which is later. A hub therefore stops acting as primary before the
entry it wrote can expire, so before any other hub can acquire the lease, give or take the
clocks' rates (`MARGIN` of the TTL covers that). What a hub paused past that point (SIGSTOP, a
swapped-out VM) may still try to write is refused by the store itself: see `JetStreamStore`'s
expected-last-sequence and the new leader's epoch marker (bus/hub.py `_take_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from agent_bus.bus.store import StoreError
from agent_bus.bus.store.jetstream import _errors
from agent_bus.bus.store.lease import JetStreamLease, Lease, LeaseLost, bucket_name
from agent_bus.bus.store.url import StoreUrl

log = logging.getLogger("bus.hub")

DEFAULT_TTL = 5.0  # seconds; why this value: docs/reliability.md, "The standby hub"
RENEW_FRACTION = 4  # renewed every ttl/4: three renewals may fail before the lease lapses
MARGIN = 0.1  # of the TTL: a primary stops this much before its entry can expire
RETRY = 0.2  # seconds between attempts while the store does not answer
LATE_TTLS = 2  # a primary started while another leads leaves a free lease alone this long


class Leadership:
    """This hub's part in the lease of the store `url` names, as `endpoint` (advertised in the
    lease's value, so standbys can name the leader). `standby`: leave the lease to another hub
    for one TTL at the start (the primary of a pair started together takes it)."""

    def __init__(self, url: StoreUrl, ttl: float, endpoint: str, standby: bool) -> None:
        self.ttl = ttl
        self.endpoint = endpoint
        self.holder = uuid.uuid4().hex[:12]
        self.until = 0.0  # monotonic: this hub is the primary while now < until
        self.epoch = 0  # this hub's term while it leads (or led last)
        self.leader = ""  # the leading hub's endpoint, when known ("" when nobody leads)
        self.leader_epoch = 0
        self.head = 0  # the log's last seq as last read (a standby follows it)
        self.error = ""  # why the lease cannot be read or kept now ("" when fine)
        self._lease: Lease | None = None
        self._stream = url.stream
        started = time.monotonic()
        self._grace = started + ttl if standby else 0.0
        self._resigned_until = 0.0
        self._late_until = 0.0
        self._first_look = not standby  # a primary's first look: is a standby following?
        self._closing = False
        self._store = JetStreamLease(url, bucket_name(url.stream), ttl)
        conn = self._store.conn
        try:  # the first step now, so the hub knows its role before it says it is ready
            conn.call(self._step(), conn.url.timeout * 3 + 2)
        except StoreError as exc:
            self.error = str(exc)
        # A primary (not `standby`) started while another hub leads: the old primary
        # restarted by its supervisor. It leaves a lease that lapses soon to the standby that
        # was following, for LATE_TTLS TTLs (Binary Star: the restarted primary comes back as
        # the standby; fail-back is by hand). Alone, it takes the lease that much later.
        if not standby and self.leader and self._lease is None:
            self._late_until = started + LATE_TTLS * ttl
        self._task = asyncio.run_coroutine_threadsafe(self._run(), conn.thread.loop)

    def resign(self) -> None:
        """Stop renewing (the store refused this hub's write: another writer is ahead of it).
        The entry lapses by itself; this hub stays out of the race for two TTLs. (A lease that
        merely lapsed is not resigned: the task keeps renewing it, and a renewal the store
        takes proves nobody held it since.)"""
        self.until = 0.0
        self._resigned_until = time.monotonic() + 2 * self.ttl
        self._lease = None

    def close(self) -> None:
        """Stop taking part; a primary that still holds the lease gives it up (a standby takes
        over at its next look, not a TTL later). Called once the hub routes nothing more."""
        self._closing = True
        self._task.cancel()
        lease, self._lease = self._lease, None
        if lease is not None and time.monotonic() < self.until:
            self.until = 0.0
            try:
                self._store.release(lease)
            except StoreError as exc:  # it lapses by itself within the TTL
                log.warning("could not give the lease up (%s): it lapses within %g s", exc,
                            self.ttl)
        self._store.close()

    # --- the lease task (the lease connection's loop thread) -----------------------------------

    async def _run(self) -> None:
        failures: tuple[type[BaseException], ...] = (*_errors(), StoreError)
        while not self._closing:
            try:
                await self._step()
                self.error = ""
                pause = self.ttl / RENEW_FRACTION
            except failures as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:300]
                pause = RETRY  # a renewal that failed is tried again soon, until `until`
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(pause)

    async def _step(self) -> None:
        if self._lease is not None:
            await self._renew(self._lease)
            return
        await self._follow()

    async def _renew(self, lease: Lease) -> None:
        sent = time.monotonic()
        try:
            renewed = await self._store.arenew(lease)
        except LeaseLost as exc:
            self.until, self._lease = 0.0, None
            log.warning("%s", exc)
            return
        if self._lease is None:  # resigned while the renewal was in flight: stay resigned
            return
        self._lease = renewed
        self.until = sent + self.ttl * (1 - MARGIN)

    async def _follow(self) -> None:
        """A standby's step: the log's head, who leads, and the lease if it lapsed."""
        info = await self._store.conn.js.stream_info(self._stream)
        self.head = int(info.state.last_seq)
        current = await self._store.aread()
        if current is not None:
            self.leader, self.leader_epoch = current.endpoint, current.epoch
            self._grace = 0.0  # the start's grace was for a primary to take it: one has
            self._first_look = False
            await self._store.afollowing(self.holder, self.endpoint)
            return
        self.leader = ""
        now = time.monotonic()
        if self._first_look:
            # A primary restarted by its supervisor after its lease lapsed (a slow start, a
            # busy machine) finds no leader, but a standby that was following: it leaves the
            # lease to that one (Binary Star: fail-back is by hand), as when the lease lives.
            self._first_look = False
            follower = await self._store.afollower()
            if follower is not None and follower.holder != self.holder:
                self._late_until = now + LATE_TTLS * self.ttl
        if now < self._grace or now < self._resigned_until or now < self._late_until:
            await self._store.afollowing(self.holder, self.endpoint)
            return
        sent = time.monotonic()
        lease = await self._store.aacquire(self.holder, self.endpoint)
        if lease is None:
            await self._store.afollowing(self.holder, self.endpoint)
            return
        self._lease = lease
        self.leader, self.leader_epoch, self.epoch = self.endpoint, lease.epoch, lease.epoch
        self.until = sent + self.ttl * (1 - MARGIN)
