"""The simulated internet that real peers run on: a ``NetworkModel`` (``model.py``), the listeners
and connections between its hosts (``streams.py``), and a ``Transport`` per host for ``PeerHost``.

For tests and benchmarks only: a host uses it when it is opened with ``transport=`` one of these;
nothing in the library or in ``peerd`` picks it.

    network = SimNetwork(seed=7)
    transport = network.add_host()
    async with open_peer_host(network.identity(), transport=transport, listen=(transport.address, 0)) as host:
        ...

Run under ``trio.testing.MockClock(autojump_threshold=0)`` with ``peer.clock.TrioClock`` as the
DHT's clock, simulated seconds pass without real ones: the loop jumps to the next event whenever
every task waits. A dial takes one RTT (SYN, SYN-ACK); it gets no answer while the link is dead
(the connect deadline ends it) and is refused at once where a live host has no listener. A
listener holds at most ``LISTEN_BACKLOG`` connections not yet accepted; a dial beyond them gets no
answer (a full SYN queue drops the SYN) and tries again, an RTT each time, once one is accepted.

Hosts may sit behind NAT (``add_host(behind_nat=True)``, ``nat.py``): their connections are seen
from their NAT's public address, and a SYN to them gets in only through a mapping their own SYN
opened; one that is dropped is sent again after ``SYN_RTO`` and then twice as long each time, as
Linux does. Two dials from bound ports at each other's endpoints that cross become one connection
(TCP's simultaneous open: hole punching), and a dial from a port to an endpoint it is already
connected to fails with ``EADDRINUSE``.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..address import PeerAddress
from ..connection_pool import ConnectError
from ..identity import Identity
from ..transport import CONNECT_TIMEOUT
from .model import HostProfile, NetworkModel
from .nat import SimNats
from .streams import Flow, SimStream

__all__ = ["SimNetwork", "SimTransport", "SimListener"]

FIRST_LISTEN_PORT = 4000
FIRST_EPHEMERAL_PORT = 50000
# Connections a listener holds before it accepts them: Linux's cap on a listen backlog
# (net.core.somaxconn) before 5.4.
LISTEN_BACKLOG = 128
# A SYN that got no answer is sent again this long after, then twice as long each time (Linux's
# initial retransmission timeout).
SYN_RTO = 1.0


class SimListener(trio.abc.Listener[SimStream]):
    """Connections dialed to one endpoint of a simulated host, in the order they were made, at most
    ``LISTEN_BACKLOG`` of them waiting to be accepted."""

    def __init__(self, network: SimNetwork, endpoint: tuple[str, int]):
        self.network, self.endpoint = network, endpoint
        self._arrivals, self._pending = trio.open_memory_channel[SimStream](LISTEN_BACKLOG)
        self._room = trio.lowlevel.ParkingLot()  # dials waiting for the backlog to take them

    def has_room(self) -> bool:
        return self._arrivals.statistics().current_buffer_used < LISTEN_BACKLOG

    async def wait_for_room(self) -> None:
        """Until an accept (or the listener's closing) may have made room in the backlog."""
        await self._room.park()

    def arrive(self, stream: SimStream) -> None:
        self._arrivals.send_nowait(stream)

    async def accept(self) -> SimStream:
        try:
            stream = await self._pending.receive()
        except (trio.ClosedResourceError, trio.EndOfChannel):
            raise trio.ClosedResourceError("the listener is closed") from None
        self._room.unpark_all()
        return stream

    async def aclose(self) -> None:
        """Stop listening; connections never accepted are closed, so their dialers see them end."""
        self.network.unbind(self)
        self._arrivals.close()
        self._room.unpark_all()  # their next try finds nothing listening: refused
        unaccepted = []
        while True:
            try:
                unaccepted.append(self._pending.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._pending.close()
        for stream in unaccepted:
            await stream.aclose()
        await trio.lowlevel.checkpoint()


class SimNetwork:
    """Hosts, listeners and live connections of one simulated internet, all from one seed."""

    def __init__(self, seed: int, **model_options: object):
        self.seed = seed
        self.model = NetworkModel(seed, **model_options)  # type: ignore[arg-type]
        self._identities = random.Random(f"peerd-simnet-identities-{seed}")
        self._listeners: dict[tuple[str, int], SimListener] = {}
        self._streams: set[SimStream] = set()
        # the open ends at or to each host: a departure wakes only their flows, not the whole network's
        self._streams_of: dict[str, set[SimStream]] = {}
        self._next_port: dict[tuple[str, int], int] = {}  # per host and range: the next free port
        self._link_lot = trio.lowlevel.ParkingLot()
        self.nats = SimNats()
        # dials from a bound port, by (host, port, remote host, remote port), while their SYN is out
        self._crossing: dict[tuple[str, int, str, int], _Crossing] = {}
        self.connections_total = 0  # connections ever made, for reports: each costs its peers a handshake

    def add_host(self, *, connect_timeout: float = CONNECT_TIMEOUT, behind_nat: bool = False) -> SimTransport:
        """A new host on the network (the next address, seeded latency and bandwidth) and the
        transport its ``PeerHost`` dials and listens through; ``behind_nat``: behind a NAT of
        its own (``nat.py``)."""
        profile = self.model.add_host()
        if behind_nat:
            self.nats.add(profile.address)
        return SimTransport(self, profile, connect_timeout=connect_timeout)

    def identity(self) -> Identity:
        """The next identity of this seed's sequence (same seed, same peers and node IDs)."""
        private = Ed25519PrivateKey.from_private_bytes(self._identities.randbytes(32))
        return Identity(private)

    # ------------------------------------------------------------------ faults
    def cut(self, a: str, b: str) -> None:
        """The link between hosts ``a`` and ``b`` goes dead (until ``heal``)."""
        with self._changing_links():
            self.model.cut(a, b)

    def heal(self, a: str, b: str) -> None:
        with self._changing_links():
            self.model.heal(a, b)

    def partition(self, *sides: list[str]) -> None:
        """Hosts reach only those on their own side (hosts on no side form one more)."""
        with self._changing_links():
            self.model.partition(sides)

    def heal_partition(self) -> None:
        with self._changing_links():
            self.model.heal_partition()

    def leave(self, address: str) -> None:
        """Host ``address`` drops off the network: its own connection ends break at once, the far
        ends hear nothing more (they find out by their deadlines), and dials to it go unanswered.
        The peer's tasks are the caller's to cancel (a crashed process, a switched-off machine)."""
        self.model.remove_host(address)
        for flow in self._flows(self._streams_of.get(address, ())):  # (each runs from or to it)
            flow.notify()  # (its own ends raise; the far ends look at the dead link)
        self._link_lot.unpark_all()

    @contextmanager
    def _changing_links(self) -> Iterator[None]:
        """Wake the waiters of every flow whose link goes dead or comes back within the block: a
        swarm holds thousands of connections, and waking them all to look at links that did not
        change would cost a trip through the scheduler each."""
        flows = self._flows()
        linked = self.model.linked
        before = [linked(flow.source, flow.destination) for flow in flows]
        yield
        for flow, was in zip(flows, before, strict=True):
            if linked(flow.source, flow.destination) != was:
                flow.notify()
        self._link_lot.unpark_all()

    def _flows(self, streams: Iterable[SimStream] | None = None) -> list[Flow]:
        """The flows of ``streams`` (default: every open end), each once."""
        chosen = self._streams if streams is None else streams
        return list({id(flow): flow for stream in chosen for flow in stream.flows}.values())

    # ------------------------------------------------------------------ listeners and dials
    def bind(self, address: str, port: int) -> SimListener:
        if port == 0:
            port = self._port(address, FIRST_LISTEN_PORT)
        if (address, port) in self._listeners:
            raise OSError(errno.EADDRINUSE, f"{address}:{port} is in use")
        listener = self._listeners[(address, port)] = SimListener(self, (address, port))
        return listener

    def unbind(self, listener: SimListener) -> None:
        if self._listeners.get(listener.endpoint) is listener:
            del self._listeners[listener.endpoint]

    def forget(self, stream: SimStream) -> None:
        self._streams.discard(stream)
        outgoing = stream.flows[0]
        for host in {outgoing.source, outgoing.destination}:  # (the machines: not a NAT's public address)
            ends = self._streams_of.get(host)
            if ends is not None:
                ends.discard(stream)
                if not ends:
                    del self._streams_of[host]

    async def dial(self, source: str, host: str, port: int, local_port: int | None = None) -> SimStream:
        """A connection from ``source`` (from ``local_port``, else an ephemeral one) to
        ``host:port`` after one RTT of a live link; waits while the link is dead, the SYN is
        dropped (a NAT, a full backlog) or goes nowhere; ConnectionRefusedError where nothing
        listens; OSError(EADDRINUSE) from a port already connected to that endpoint."""
        sport = self._port(source, FIRST_EPHEMERAL_PORT) if local_port is None else local_port
        seen = (self.nats.seen_as(source), sport)
        crossing = None
        if local_port is not None:
            key = (source, sport, host, port)
            if key in self._crossing or self._connected(source, sport, (host, port)):
                raise OSError(errno.EADDRINUSE, "Address already in use")
            crossing = self._crossing[key] = _Crossing()
        try:
            return await self._send_syns(source, (host, port), seen, crossing)
        except BaseException:
            if crossing is not None and crossing.end is not None:
                crossing.end.close()  # (met by the other side's SYN, then given up: it hears the close)
            raise
        finally:
            if crossing is not None:
                del self._crossing[(source, sport, host, port)]

    async def _send_syns(
        self, source: str, remote: tuple[str, int], seen: tuple[str, int], crossing: _Crossing | None
    ) -> SimStream:
        host, port = remote
        target = self.nats.machine(host, source)
        if target is None:
            await trio.sleep_forever()  # a private address of another home: the SYN goes nowhere
        self.nats.opened(source, seen[1], host, trio.current_time())
        rto = SYN_RTO
        while True:
            while not self.model.linked(source, target):
                await self._link_lot.park()
            sent_at = trio.current_time()
            with trio.move_on_after(self.model.rtt(source, target)):
                await (crossing.met.wait() if crossing is not None else trio.sleep_forever())
            if crossing is not None and crossing.end is not None:
                return crossing.end  # the other side's SYN met ours
            if not self.model.linked(source, target):
                continue
            partner = self._crossing.get((target, port, *seen))
            if partner is not None and partner.end is None:  # simultaneous open: one connection
                ours, theirs = self._connect((source, seen[1]), remote, (target, port), seen)
                partner.end = theirs
                partner.met.set()
                return ours
            if not self.nats.admits(target, port, seen[0], trio.current_time()):
                with trio.move_on_at(sent_at + rto):  # dropped by the NAT: sent again later
                    await (crossing.met.wait() if crossing is not None else trio.sleep_forever())
                rto *= 2
                if crossing is not None and crossing.end is not None:
                    return crossing.end
                continue
            listener = self._listeners.get((target, port))
            if listener is None:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
            if listener.has_room():
                break
            await listener.wait_for_room()  # the SYN was dropped: try again once one is accepted
        client, server = self._connect((source, seen[1]), remote, (target, port), seen)
        listener.arrive(server)
        return client

    def _connect(
        self, local: tuple[str, int], remote: tuple[str, int], far: tuple[str, int], seen: tuple[str, int]
    ) -> tuple[SimStream, SimStream]:
        """A new connection between ``local`` (which dialed ``remote``) and ``far`` (the host that
        dial reached, which sees it from ``seen``): the two ends."""
        source, target = local[0], far[0]
        there, back = Flow(source, target), Flow(target, source)
        near_end = SimStream(self.model, local, remote, there, back, self.forget)
        far_end = SimStream(self.model, far, seen, back, there, self.forget)
        self._streams.update((near_end, far_end))
        for end in (self._streams_of.setdefault(source, set()), self._streams_of.setdefault(target, set())):
            end.update((near_end, far_end))
        self.connections_total += 1
        return near_end, far_end

    def open_ends(self, host: str) -> int:
        """How many connection ends at or to ``host`` are open (for tests and reports)."""
        return len(self._streams_of.get(host, ()))

    def _connected(self, host: str, port: int, remote: tuple[str, int]) -> bool:
        """Whether an open end on ``host``'s ``port`` already runs to ``remote``."""
        return any(end.local == (host, port) and end.remote == remote for end in self._streams_of.get(host, ()))

    def _port(self, address: str, first: int) -> int:
        port = self._next_port.get((address, first), first)
        self._next_port[(address, first)] = port + 1
        return port


class _Crossing:
    """A dial from a bound port while its SYN is out: a SYN of the far end's that crosses it
    joins the two dials into one connection (``end``: ours, once that happened)."""

    def __init__(self) -> None:
        self.end: SimStream | None = None
        self.met = trio.Event()


class SimTransport:
    """The ``Transport`` of one simulated host: binds its own address, dials from it."""

    def __init__(self, network: SimNetwork, profile: HostProfile, *, connect_timeout: float = CONNECT_TIMEOUT):
        self.network, self.profile = network, profile
        self.connect_timeout = connect_timeout

    @property
    def address(self) -> str:
        return self.profile.address

    async def listen(self, host: str, port: int) -> tuple[tuple[str, int], list[SimListener]]:
        """Listen on this host's address (``host`` is ignored: a simulated host has one)."""
        await trio.lowlevel.checkpoint()
        listener = self.network.bind(self.address, port)
        return listener.endpoint, [listener]

    async def connect(self, address: PeerAddress) -> SimStream:
        try:
            with trio.fail_after(self.connect_timeout):
                return await self.network.dial(self.address, address.host, address.port)
        except trio.TooSlowError:
            raise ConnectError(f"{address}: no answer within {self.connect_timeout} s") from None
        except ConnectionRefusedError:
            raise ConnectError(f"{address}: connection refused", refused=True) from None

    async def connect_from(self, local: tuple[str, int], remote: tuple[str, int], timeout: float) -> SimStream:
        """From this host's ``local[1]`` (``local[0]`` is ignored: a simulated host has one address)."""
        with trio.fail_after(timeout):
            return await self.network.dial(self.address, remote[0], remote[1], local_port=local[1])

    def remote_address(self, stream: SimStream) -> tuple[str, int]:
        return stream.remote

    def remote_host(self, stream: SimStream) -> str:
        return stream.remote[0]

    def remote_endpoint(self, stream: SimStream) -> str:
        return f"{stream.remote[0]}:{stream.remote[1]}"

    async def peek_first_byte(self, stream: SimStream) -> bytes:
        return await stream.peek_first_byte()
