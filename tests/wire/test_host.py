"""What a host offers the parts of NAT traversal, in public: tasks it owns (``start_soon``,
``start``), its hello, and its presence (``peer/presence.py``: announced relayed addresses, the relay dialer, the
circuit relay); and its pool of connections (``peer/connection_pool.py``). Relays, hole punching and
reachability are run here against hosts that let them see nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from peer import ConnectError, Identity, PeerAddress, Router, open_peer_host
from peer.connection_pool import ConnectionPool
from peer.holepunch import HolePuncher
from peer.reachability import PUBLIC, ReachabilityService, check_reachability
from peer.relay import Relay, RelayClient


class PublicOnly:
    """A host as a part that uses it sees it: every public attribute of the real one, and no
    private one (reading ``host._anything`` fails the test)."""

    def __init__(self, host):
        object.__setattr__(self, "real", host)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AssertionError(f"reached the host's private {name}")
        return getattr(self.real, name)

    def __setattr__(self, name: str, value) -> None:
        raise AssertionError(f"wrote the host's {name}")


async def until(condition) -> None:
    """Poll ``condition`` (the caller's deadline bounds the wait)."""
    while not condition():
        await trio.sleep(0.01)


def echo_router() -> Router:
    router = Router()

    @router.unary("echo")
    async def echo(request):
        return request.body

    return router


async def test_relays_hole_punching_and_reachability_need_only_the_hosts_public_api(monkeypatch):
    monkeypatch.setattr("peer.host.RELAY_HANDOVER_GRACE", 0.2)
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate()) as dialer,
    ):
        relay = Relay(PublicOnly(relay_host))
        ReachabilityService(PublicOnly(relay_host))
        client = RelayClient(PublicOnly(behind))
        RelayClient(PublicOnly(dialer))
        punchers = [HolePuncher(PublicOnly(host), lambda: "127.0.0.1") for host in (behind, dialer)]
        with trio.fail_after(20):
            reachability = await check_reachability(PublicOnly(dialer), [relay_host.listen_address])
            assert reachability.status == PUBLIC, reachability
            await client.reserve(relay_host.listen_address)
            listen = relay_host.listen_address
            address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
            relayed = await dialer.connect(address)
            assert relayed.relayed_via == relay_host.peer_id and relay.book.circuits == 1
            assert (await relayed.call("echo", "through the relay", timeout=10)).body == "through the relay"
            # the dialer's puncher started its punch as a task of the host (``start_soon``), and
            # the reached side's dial after the sync likewise
            await until(lambda: punchers[1].successes + punchers[1].failures > 0)
            assert punchers[1].successes == 1, punchers[1].status()
            await until(lambda: (c := dialer.connection_to(behind.peer_id)) is not None and c.relayed_via is None)
            direct = dialer.connection_to(behind.peer_id)
            assert (await direct.call("echo", "direct", timeout=10)).body == "direct"


async def test_the_announced_addresses_are_what_the_hello_and_public_address_name():
    async with open_peer_host(Identity.generate()) as host:
        listen = host.listen_address
        assert host.public_address == listen
        assert host.hello().listen_addresses == (listen.endpoint,)
        relay_id = Identity.generate().peer_id
        relayed = PeerAddress("192.0.2.1", 4000, None, relay_id)
        host.presence.announce([relayed])
        assert host.presence.announced == (relayed,)
        assert host.public_address == relayed.with_peer_id(host.peer_id)
        assert host.hello().listen_addresses == (str(relayed),)
        assert host.hello().node_id_nonce == host.node_id.nonce
        host.presence.announce([])
        assert host.public_address == listen


async def test_a_host_takes_one_relay_and_one_relay_dialer():
    async with open_peer_host(Identity.generate()) as host, open_peer_host(Identity.generate()) as other:
        relayed = PeerAddress("192.0.2.1", 4000, other.peer_id, Identity.generate().peer_id)
        with pytest.raises(ConnectError, match="does not dial through relays"):
            await host.connect(relayed)
        relay = Relay(host)
        with pytest.raises(ValueError, match="already relays"):
            host.presence.serve_circuits(relay)
        RelayClient(host)
        with pytest.raises(ValueError, match="already has a relay dialer"):
            host.presence.dial_relayed_with(lambda address: other.open_stream(address))


async def test_the_tasks_a_host_runs_end_with_it():
    ended = trio.Event()

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.set()

    async def ready(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started("ready")

    async with open_peer_host(Identity.generate()) as host:
        host.start_soon(forever)
        assert await host.start(ready) == "ready"
        await wait_all_tasks_blocked()
        assert not ended.is_set()
    assert ended.is_set()
    with pytest.raises(RuntimeError):
        host.start_soon(forever)


class _Pooled(SimpleNamespace):  # a connection is keyed by identity, as the pool's idle looks do
    __eq__, __hash__ = object.__eq__, object.__hash__


def pooled(peer: str, *, relayed_via=None):
    return _Pooled(remote_peer_id=peer, relayed_via=relayed_via, takes_calls=True, retired=False)


def test_the_pool_keeps_one_connection_per_peer_and_a_direct_one_replaces_a_relayed_one():
    pool = ConnectionPool()
    relayed = pooled("b", relayed_via="r")
    assert pool.add(relayed, 0.0) is None and pool.get("b") is relayed
    assert pool.add(pooled("b", relayed_via="r"), 0.0) is None and pool.get("b") is relayed  # the first stays
    direct = pooled("b")
    assert pool.add(direct, 0.0) is relayed  # handed back, for its calls' grace period
    assert pool.get("b") is direct and pool.add(pooled("b"), 0.0) is None and pool.get("b") is direct
    pool.remove(relayed, 0.0)  # not the pooled one: nothing changes
    assert pool.peers == ["b"]
    direct.takes_calls = False  # closed, closing or retiring: no new call goes on it
    assert pool.get("b") is None and pool.peers == []
    pool.remove(direct, 0.0)
    fresh = pooled("b")
    assert pool.add(fresh, 0.0) is None and pool.get("b") is fresh


async def test_concurrent_connects_share_one_dial_and_its_failure():
    pool = ConnectionPool()
    dials: list[PeerAddress] = []
    release = trio.Event()
    peer = Identity.generate().peer_id
    address = PeerAddress("192.0.2.1", 4000)

    async def dial(target: PeerAddress):
        dials.append(target)
        await release.wait()
        if len(dials) == 1:
            raise ConnectError(f"{target}: refused", refused=True)
        return pooled(peer)

    errors: list[ConnectError] = []

    async def connect() -> None:
        try:
            await pool.connect(address, dial)
        except ConnectError as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(connect)
        await wait_all_tasks_blocked()
        release.set()
    assert len(dials) == 1 and len(errors) == 3 and all(error.refused for error in errors)
    connection = await pool.connect(address, dial)  # dials again, and remembers who is there
    assert len(dials) == 2 and connection.remote_peer_id == peer
    pool.add(connection, 0.0)  # as the host does once the connection runs
    assert await pool.connect(address, dial) is connection and len(dials) == 2
