"""A simulated internet for running many real peers in one process (tests and benchmarks only).

``SimNetwork`` gives each simulated host an address and a ``Transport`` for ``PeerHost``; its
``NetworkModel`` (plain object, seeded) decides latencies, bandwidths and which links are alive.
Nothing in the library imports this package: the default transport is TCP (``peer/transport.py``).

What one seed fixes: every host's address, position, access delay and bandwidths (in the order
hosts are added), the identities ``SimNetwork.identity()`` hands out (so peer IDs and node IDs),
and thus every RTT and every transfer's timing for a given order of sends. What it does not fix:
trio runs the tasks woken together in a random order (by design, to flush out ordering bugs),
Noise ephemeral keys, nonces and swarm tokens come from the OS, and the DHT picks refresh targets
with the ``random`` module; so two runs with one seed see the same network but may interleave
their messages differently, and what depends on that order (which contact answered first, which
replica a get read) may differ. Under ``MockClock`` the simulated time of an event never depends
on how fast the machine is: CPU work takes no simulated time.
"""

from .model import BANDWIDTH_MIXES, MBIT, HostProfile, NetworkModel, Segment
from .network import SimListener, SimNetwork, SimTransport
from .streams import RECEIVE_WINDOW_BYTES, SEGMENT_BYTES, Flow, SimStream

__all__ = [
    "BANDWIDTH_MIXES",
    "MBIT",
    "HostProfile",
    "NetworkModel",
    "Segment",
    "SimNetwork",
    "SimTransport",
    "SimListener",
    "SimStream",
    "Flow",
    "SEGMENT_BYTES",
    "RECEIVE_WINDOW_BYTES",
]
