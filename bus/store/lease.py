"""A leader lease with an epoch, from the JetStream cluster that holds the log: groundwork for
the standby hub (issue 52 item 2; nothing uses it yet).

The lease is one key of a JetStream key-value bucket whose entries expire after `ttl` (the
bucket's max age), replicated like the log. A hub acquires it by creating the key (refused while
another holder's entry lives), and keeps it by updating the key with the revision it last saw
(refused once anyone else wrote it). The revision is the epoch: it only grows, so a deposed
holder's epoch is always older than the current one, and a renewal it attempts is refused.
"""

from __future__ import annotations

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


class Lease(msgspec.Struct, frozen=True):
    holder: str
    epoch: int  # the bucket's revision of the holder's last write: only grows


class LeaseLost(StoreError):
    """A renewal or release refused: another holder wrote the lease since (this one is
    deposed), or the entry expired."""


class JetStreamLease:
    """The lease `bucket` on the cluster `url` names (its replicas), entries living `ttl` s."""

    def __init__(self, url: StoreUrl, bucket: str, ttl: float) -> None:
        require_nats()
        self._conn = NatsConnection(url, "bus-lease")
        self._bucket = bucket
        try:
            self._kv = self._conn.call(self._conn.js.create_key_value(api.KeyValueConfig(
                bucket=bucket, history=1, ttl=ttl, replicas=url.replicas,
                storage=api.StorageType.FILE)), 10)
        except StoreError:
            self._conn.close()
            raise

    def acquire(self, holder: str) -> Lease | None:
        """The lease for `holder`, or None while another holder's entry lives."""
        try:
            epoch = self._conn.call(self._kv.create(KEY, holder.encode()))
        except StoreError as exc:
            if isinstance(exc.__cause__, nats.js.errors.KeyWrongLastSequenceError):
                return None
            raise
        return Lease(holder, int(epoch))

    def renew(self, lease: Lease) -> Lease:
        """The lease kept (a new epoch); LeaseLost when someone else wrote it since."""
        try:
            epoch = self._conn.call(self._kv.update(KEY, lease.holder.encode(), last=lease.epoch))
        except StoreError as exc:
            if isinstance(exc.__cause__, nats.js.errors.KeyWrongLastSequenceError):
                raise LeaseLost(f"lease `{self._bucket}` of {lease.holder} (epoch {lease.epoch}) "
                                "was taken over: this holder is deposed") from exc
            raise
        return Lease(lease.holder, int(epoch))

    def close(self) -> None:
        self._conn.close()
