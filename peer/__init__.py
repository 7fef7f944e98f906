"""peerd's wire layer: identity, secure channel, framing, RPC and the connection pool.

This package must not import the daemon (``peerd``): ``dht`` and the layers
above import these wire modules, and the daemon imports them all.
"""

__version__ = "0.1.0"

from .access import SwarmAccess
from .address import PeerAddress
from .clock import SYSTEM_CLOCK, Clock
from .host import ConnectError, PeerHost, open_peer_host
from .identity import Identity, IdentityError, PeerID
from .node_id import DEFAULT_DIFFICULTY, LOCAL_DIFFICULTY, NodeIDProof
from .router import Message, Request, Router
from .rpc import ClientStream, Connection, ServerStream
from .rpc_errors import (
    BadRequest,
    BadRequestError,
    Busy,
    BusyError,
    CallTimeoutError,
    ConnectionLost,
    DeadlineExceededError,
    MessageTooLargeError,
    RemoteError,
    RPCError,
    StreamClosed,
    UnknownMethodError,
)
from .secure_channel import (
    PROTOCOL_VERSION,
    AccessRefused,
    HandshakeError,
    HelloMismatch,
    NodeIDRefused,
    PeerIDMismatch,
)
from .transport import TcpTransport, Transport

__all__ = [
    "__version__",
    "PeerAddress",
    "SwarmAccess",
    "AccessRefused",
    "ConnectError",
    "PeerHost",
    "open_peer_host",
    "Identity",
    "IdentityError",
    "PeerID",
    "NodeIDProof",
    "DEFAULT_DIFFICULTY",
    "LOCAL_DIFFICULTY",
    "BadRequest",
    "BadRequestError",
    "Busy",
    "BusyError",
    "CallTimeoutError",
    "ClientStream",
    "Connection",
    "ConnectionLost",
    "DeadlineExceededError",
    "Message",
    "MessageTooLargeError",
    "RemoteError",
    "Request",
    "Router",
    "RPCError",
    "ServerStream",
    "StreamClosed",
    "UnknownMethodError",
    "PROTOCOL_VERSION",
    "HandshakeError",
    "HelloMismatch",
    "NodeIDRefused",
    "PeerIDMismatch",
    "Transport",
    "TcpTransport",
    "Clock",
    "SYSTEM_CLOCK",
]
