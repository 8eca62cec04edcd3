"""The leader lease of the hubs that share one JetStream store (issue 52 item 2; the hub's side
is bus/store/leader.py).

The lease is one key of a JetStream key-value bucket whose entries expire after `ttl` (the
bucket's max age), replicated like the log. A hub acquires it by creating the key (refused while
another holder's entry lives), and keeps it by updating the key with the revision it last wrote
(refused once anyone else wrote it, or once it expired). Revisions only grow (they are the
bucket's stream sequence), so:

- the epoch of a term is the revision of its acquire: every later term has a greater epoch than
  any revision of an earlier one, and a deposed holder's renewal (its old revision) is refused;
- the value names the holder and its advertised endpoint, so a standby can say who leads.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agent_bus.bus.store import StoreError
from agent_bus.bus.store.jetstream import NatsConnection, require_nats
from agent_bus.bus.store.url import StoreUrl

try:
    import nats.js.errors
    from nats.js import api
except ImportError:  # the `nats` extra: require_nats() says so
    pass

KEY = "leader"
# A hub that follows (a standby) says so here, every look: a primary restarted while the lease
# lapses leaves it to that hub (bus/store/leader.py). Its entry lives `ttl` like the lease's.
FOLLOWER_KEY = "follower"


class LeaseValue(msgspec.Struct, frozen=True):
    """What the key holds: who leads, where its peers reach it, and since which epoch (0 in the
    acquire's own write, whose revision is the epoch: a reader takes the entry's revision)."""

    holder: str
    endpoint: str = ""
    epoch: int = 0


class Lease(msgspec.Struct, frozen=True):
    holder: str
    endpoint: str
    epoch: int  # the revision of this term's acquire: greater than any earlier term's revision
    revision: int  # the revision of the holder's last write (a renewal must name it)


class LeaseLost(StoreError):
    """A renewal refused: another holder wrote the lease since (this one is deposed), or the
    entry expired."""


def bucket_name(stream: str) -> str:
    """The lease bucket of the hubs that write `stream` (one lease per log)."""
    return f"{stream}_leader"


class JetStreamLease:
    """The lease `bucket` on the cluster `url` names (its replicas), entries living `ttl` s.
    The `a*` methods run on the connection's loop (`conn.thread`); the others wrap them."""

    def __init__(self, url: StoreUrl, bucket: str, ttl: float) -> None:
        require_nats()
        self.conn = NatsConnection(url, "bus-lease")
        self._bucket = bucket
        self.ttl = ttl
        try:
            self._kv = self.conn.call(self.conn.js.create_key_value(api.KeyValueConfig(
                bucket=bucket, history=1, ttl=ttl, replicas=url.replicas,
                storage=api.StorageType.FILE)), 10)
        except StoreError as exc:
            self.conn.close()
            raise StoreError(f"lease bucket `{bucket}` (ttl {ttl:g} s): {exc}; every hub of "
                             "a pair must give the same `lease_ttl` (--lease-ttl): the bucket "
                             "was made with another one. To change it, stop every hub of the "
                             f"pair, remove the bucket (`nats kv del {bucket}`), start them "
                             "again") from exc

    async def aacquire(self, holder: str, endpoint: str) -> Lease | None:
        """The lease for `holder`, or None while another holder's entry lives."""
        value = msgspec.json.encode(LeaseValue(holder, endpoint))
        try:
            revision = int(await self._kv.create(KEY, value))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        return Lease(holder, endpoint, revision, revision)

    async def arenew(self, lease: Lease) -> Lease:
        """The lease kept (a new revision, the same epoch); LeaseLost when someone else wrote
        it since, or it expired."""
        value = msgspec.json.encode(LeaseValue(lease.holder, lease.endpoint, lease.epoch))
        try:
            revision = int(await self._kv.update(KEY, value, last=lease.revision))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise LeaseLost(f"lease `{self._bucket}` of {lease.holder} (epoch {lease.epoch}) "
                            "was taken over or expired: this holder is deposed") from exc
        return msgspec.structs.replace(lease, revision=revision)

    async def arelease(self, lease: Lease) -> bool:
        """Give the lease up (a clean stop): the key deleted if this holder's write is still
        its last, so a standby takes it at its next look instead of after the TTL."""
        try:
            await self._kv.delete(KEY, last=lease.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False  # someone else's now, or expired: nothing of ours to give up
        return True

    async def aread(self) -> LeaseValue | None:
        """Who holds the lease now (the epoch filled in), or None when nobody does."""
        entry = await self._entry(KEY)
        if entry is None:
            return None
        try:
            value = msgspec.json.decode(entry.value, type=LeaseValue)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return LeaseValue("?", "", int(entry.revision))  # not a hub's: held, by no one we know
        return value if value.epoch else msgspec.structs.replace(value, epoch=int(entry.revision))

    async def afollowing(self, holder: str, endpoint: str) -> None:
        """Say that `holder` follows the log, ready to take the lease (the entry lapses `ttl`
        after its last look)."""
        await self._kv.put(FOLLOWER_KEY, msgspec.json.encode(LeaseValue(holder, endpoint)))

    async def afollower(self) -> LeaseValue | None:
        """The hub that said last, within `ttl`, that it follows (None: none did)."""
        entry = await self._entry(FOLLOWER_KEY)
        try:
            return None if entry is None else msgspec.json.decode(entry.value, type=LeaseValue)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _entry(self, key: str) -> Any:
        """The live entry of `key` (it has a value), or None: never written, deleted, expired."""
        try:
            entry: Any = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return None if entry.value is None else entry

    def acquire(self, holder: str, endpoint: str = "") -> Lease | None:
        return self.conn.call(self.aacquire(holder, endpoint))

    def renew(self, lease: Lease) -> Lease:
        return self.conn.call(self.arenew(lease))  # (LeaseLost is no nats error: it passes)

    def release(self, lease: Lease) -> bool:
        return self.conn.call(self.arelease(lease))

    def read(self) -> LeaseValue | None:
        return self.conn.call(self.aread())

    def close(self) -> None:
        self.conn.close()
