"""Connection reversal (``peer/relay_dials.py``): a dialer others can reach asks the relay to have
the peer behind NAT dial it back, so that reaching a NAT'd peer costs no circuit; the dial back a
relay asks of a peer is a claim about an address, held to budgets and to addresses we may dial."""

from __future__ import annotations

import contextlib

import pytest
import trio

from peer import Identity, PeerAddress, open_peer_host
from peer.relay import (
    DIALS_BACK_BURST,
    DIALS_BACK_PER_RELAY_BURST,
    DIALS_BACK_PER_RELAY_PER_S,
    DIALS_BACK_PER_S,
    REVERSALS_PER_REQUESTER_BURST,
    REVERSALS_PER_TARGET_BURST,
    Relay,
    RelayClient,
)
from peer.rpc_errors import BadRequestError, BusyError
from tests.wire.test_relay import echo_router


async def test_a_reachable_dialer_is_dialed_back_and_no_circuit_is_opened():
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate(), router=echo_router()) as dialer,
    ):
        relay = Relay(relay_host)
        await RelayClient(behind).reserve(relay_host.listen_address)
        dials = RelayClient(dialer, reachable=lambda: True).dials
        listen = relay_host.listen_address
        address = PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id)
        with trio.fail_after(10):
            connection = await dialer.connect(address)
        assert connection.relayed_via is None and dials.reversed == 1
        assert (await connection.call("echo", "back", timeout=5)).body["echo"] == "back"
        assert relay.book.circuits == 0 and relay.bytes_relayed == 0
        # the NAT'd peer holds the same connection: it dialed it
        assert behind.connection_to(dialer.peer_id) is not None


async def test_a_dialer_that_cannot_be_reached_is_dialed_through_a_circuit_as_before():
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), router=echo_router()) as behind,
        open_peer_host(Identity.generate()) as dialer,
    ):
        relay = Relay(relay_host)
        await RelayClient(behind).reserve(relay_host.listen_address)
        dials = RelayClient(dialer).dials  # (reachability unknown: not reachable)
        listen = relay_host.listen_address
        connection = await dialer.connect(PeerAddress(listen.host, listen.port, behind.peer_id, relay_host.peer_id))
        assert connection.relayed_via == relay_host.peer_id and dials.reversed == 0
        assert relay.book.circuits == 1


async def test_a_relay_cannot_aim_its_peers_at_names_or_local_services():
    """``relay.incoming {dial}`` comes from a relay we reserved with, but the address in it is the
    relay's claim: never a name, an unspecified or multicast address, or (for a peer not on
    loopback itself) this machine."""
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate(), listen=("0.0.0.0", 0)) as behind,
    ):
        Relay(relay_host)
        await RelayClient(behind).reserve(relay_host.listen_address)
        to_behind = relay_host.connection_to(behind.peer_id)
        source = Identity.generate().peer_id.to_bytes()
        for claim in ("example.com:80", "0.0.0.0:6379", "127.0.0.1:6379", "224.0.0.1:9", "127.0.0.1:9/x/relay", 7):
            with pytest.raises(BadRequestError):
                await to_behind.call("relay.incoming", {"source": source, "dial": claim}, timeout=5)


async def test_relays_cannot_have_their_peers_dial_again_and_again():
    """Dials back are held to a budget per relay (a group's worth at once, then one a second) and
    one for all relays together, whatever sources a relay names (each dial here is refused at
    once: the port is closed)."""
    async with contextlib.AsyncExitStack() as stack:
        relays = [await stack.enter_async_context(open_peer_host(Identity.generate())) for _ in range(3)]
        behind = await stack.enter_async_context(open_peer_host(Identity.generate()))
        client = RelayClient(behind)
        for relay_host in relays:
            Relay(relay_host)
            await client.reserve(relay_host.listen_address)
        closed = trio.socket.socket()
        await closed.bind(("127.0.0.1", 0))
        claim = f"127.0.0.1:{closed.getsockname()[1]}"
        closed.close()

        async def ask(relay_host) -> bool:
            source = Identity.generate().peer_id.to_bytes()
            connection = relay_host.connection_to(behind.peer_id)
            try:
                await connection.call("relay.incoming", {"source": source, "dial": claim}, timeout=5)
            except BusyError:
                return False
            finally:
                while client.setting_up:  # (the refused dial is over: no cap on dials in flight binds)
                    await trio.sleep(0.005)
            return True

        started = trio.current_time()
        first = [await ask(relays[0]) for _ in range(int(DIALS_BACK_PER_RELAY_BURST) + 8)]
        refilled = DIALS_BACK_PER_RELAY_PER_S * (trio.current_time() - started)
        assert DIALS_BACK_PER_RELAY_BURST <= first.count(True) <= DIALS_BACK_PER_RELAY_BURST + refilled + 1, first
        rest = [await ask(relay_host) for relay_host in relays[1:] for _ in range(int(DIALS_BACK_PER_RELAY_BURST) + 8)]
        refilled = DIALS_BACK_PER_S * (trio.current_time() - started)
        assert first.count(True) + rest.count(True) <= DIALS_BACK_BURST + refilled + 1, rest  # all relays together


async def test_a_relay_passes_on_a_burst_of_reversals_per_asker_and_per_target():
    """Reversals cost the target a dial each: a relay passes on at most a burst of them per asking
    host and per target (the target's below what the target takes from one relay, so an honest
    relay's reversals are never refused by its target); the rest of the askers get circuits. One
    host asks here, so the lesser of the two bursts binds."""
    async with (
        open_peer_host(Identity.generate()) as relay_host,
        open_peer_host(Identity.generate()) as behind,
        open_peer_host(Identity.generate()) as asker,
    ):
        Relay(relay_host)
        client = RelayClient(behind)
        await client.reserve(relay_host.listen_address)
        to_relay = await asker.connect(relay_host.listen_address)
        reversed_, refused = 0, 0
        burst = min(REVERSALS_PER_REQUESTER_BURST, REVERSALS_PER_TARGET_BURST)
        assert REVERSALS_PER_TARGET_BURST < DIALS_BACK_PER_RELAY_BURST
        for _ in range(int(burst) + 8):
            try:
                reply = await to_relay.call(
                    "relay.connect", {"target": behind.peer_id.to_bytes(), "reverse": True}, timeout=5
                )
            except BusyError:
                refused += 1
                continue
            assert reply.body == {"reversed": True}
            reversed_ += 1
            while client.setting_up:
                await trio.sleep(0.005)
        assert burst <= reversed_ <= burst + 1 and refused >= 7
