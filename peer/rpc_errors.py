"""What an RPC can fail with, and how remote failures map to local exception types."""

from __future__ import annotations

from .identity import PeerID

__all__ = [
    "RPCError",
    "RemoteError",
    "UnknownMethodError",
    "BadRequestError",
    "BusyError",
    "CallTimeoutError",
    "ConnectionLost",
    "StreamClosed",
    "BadRequest",
    "remote_error",
]


class RPCError(Exception):
    """Base class of everything a call can fail with."""


class RemoteError(RPCError):
    """The remote handler raised; ``type_name`` and ``remote_message`` say what it raised."""

    def __init__(self, method: str, peer: PeerID, type_name: str, remote_message: str):
        self.method, self.peer, self.type_name, self.remote_message = method, peer, type_name, remote_message
        super().__init__(f"{method} on peer {peer} failed: {type_name}: {remote_message}")


class UnknownMethodError(RemoteError):
    pass


class BadRequestError(RemoteError):
    """The handler rejected the request's arguments (wrong types, sizes or values)."""


class BusyError(RemoteError):
    pass


class CallTimeoutError(RPCError, TimeoutError):
    pass


class ConnectionLost(RPCError):
    pass


class StreamClosed(RPCError):
    """The other side ended the stream; nothing more can be sent on it."""


# Remote exception types that mean "your arguments were wrong" map to BadRequestError; the original
# type name is kept in ``type_name``.
_ERROR_TYPES = {
    "UnknownMethod": UnknownMethodError,
    "BadRequest": BadRequestError,
    "TypeError": BadRequestError,
    "ValueError": BadRequestError,
    "Busy": BusyError,
}


class BadRequest(Exception):
    """Raise from a handler to tell the caller its arguments are wrong (reaches it as BadRequestError)."""


def remote_error(method: str, peer: PeerID, type_name: str, message: str) -> RemoteError:
    """The local exception for a failure the peer reported."""
    return _ERROR_TYPES.get(type_name, RemoteError)(method, peer, type_name, message)
