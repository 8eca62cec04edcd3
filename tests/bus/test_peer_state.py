"""The peer's lifecycle (`Peer.state`) through a real hub: connecting, ready, reconnecting after
the hub is killed, ready again on the restarted hub, closed; and a peer that never got in."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent_bus.bus.client import Peer, PeerState
from agent_bus.bus.errors import HubUnreachable
from tests.bus.helpers import kill_hub, restartable_ports, start_hub
from tests.support import Proc, until

pytestmark = pytest.mark.anyio


async def test_state_follows_the_connection_through_a_hub_restart(tmp_path: Path) -> None:
    (port, events), state = restartable_ports(2), tmp_path / "state"
    hub: Proc | None = start_hub(port, events, state)
    restarted: Proc | None = None
    try:
        peer = Peer(f"tcp://127.0.0.1:{port}", name="stateful")
        assert peer.state is PeerState.CONNECTING and not peer.connected
        async with peer:
            assert peer.state is PeerState.READY and peer.connected
            assert hub is not None
            kill_hub(hub, port, events)
            await until(lambda: peer.state is PeerState.RECONNECTING, 15,
                        "the peer to notice the hub is gone")
            assert not peer.connected
            restarted = start_hub(port, events, state)
            await until(lambda: peer.state is PeerState.READY, 15,
                        "the peer to be welcomed by the restarted hub")
            assert (await peer.status()).peers  # requests flow again
        assert peer.state is PeerState.CLOSED and not peer.connected
        with pytest.raises(AttributeError):
            peer.state = PeerState.READY  # type: ignore[misc]  # read-only
    finally:
        for proc in (hub, restarted):
            if proc is not None:
                proc.stop()


async def test_a_peer_that_never_got_in_ends_closed(tmp_path: Path) -> None:
    (port,) = restartable_ports(1)  # nothing listens there
    peer = Peer(f"tcp://127.0.0.1:{port}", name="outsider", connect_timeout=0.5)
    with pytest.raises(HubUnreachable, match="connection refused"):
        await peer.__aenter__()
    assert peer.state is PeerState.CLOSED



async def test_a_peer_left_by_a_cancellation_ends_closed_with_its_socket(hub: dict) -> None:
    """Its block cancelled from outside (a caller's timeout, Inspect cancelling a sample) while
    it waits on a request, the peer still closes all the way: its socket and ZeroMQ context
    too, not left to the garbage collector (a ResourceWarning)."""
    for _ in range(10):  # where the cancellation lands in `aclose` varies
        peers: list[Peer] = []

        async def waiting() -> None:
            async with Peer(hub["endpoint"], name="cancelled") as peer:
                peers.append(peer)
                async with peer.stream("nobody.serves.this", b"", timeout=60) as replies:
                    await replies.__anext__()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            await until(lambda: peers and peers[0].requests_in_flight, 10, "the request")
            tg.cancel_scope.cancel()
        [peer] = peers
        assert peer.state is PeerState.CLOSED and peer.sock is None and peer.ctx.closed
