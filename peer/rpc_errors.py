"""What an RPC can fail with, and how remote failures map to local exception types.

An ERROR header names what failed with a type name: one of the codes below, each of which arrives
as its own exception type, or the class name of whatever else a handler raised, which arrives as
``RemoteError`` carrying that name (``TypeError`` and ``ValueError`` as ``BadRequestError``: in a
handler they mean the arguments were wrong).
"""

from __future__ import annotations

from .identity import PeerID

__all__ = [
    "Busy",
    "RPCError",
    "RemoteError",
    "UnknownMethodError",
    "BadRequestError",
    "BusyError",
    "MessageTooLargeError",
    "DeadlineExceededError",
    "CallTimeoutError",
    "ConnectionLost",
    "StreamClosed",
    "BadRequest",
    "remote_error",
    "error_code",
    "UNKNOWN_METHOD",
    "BAD_REQUEST",
    "BUSY",
    "DEADLINE_EXCEEDED",
    "MESSAGE_TOO_LARGE",
]

# The wire's error codes (the type_name of an ERROR header).
UNKNOWN_METHOD = "UnknownMethod"  # no handler of that name and kind, or a client-mode peer
BAD_REQUEST = "BadRequest"  # the handler raised BadRequest: the arguments were wrong
BUSY = "Busy"  # no room for the call now: the connection's call limit, or a handler raised Busy
DEADLINE_EXCEEDED = "DeadlineExceeded"  # the handler ran past the time budget the caller sent
MESSAGE_TOO_LARGE = "MessageTooLarge"  # a stream message larger than its receiver accepts on that stream


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


class MessageTooLargeError(RemoteError):
    """A stream message larger than its receiver accepts on that stream (``max_message``): the
    receiver refused it and ended the call, or its sender found so before sending it."""


class DeadlineExceededError(RemoteError, TimeoutError):
    """The handler ran out of the time budget the call carried and was cancelled there.

    A ``TimeoutError`` like ``CallTimeoutError``: whichever side's clock ran out first, the call
    took too long."""


class CallTimeoutError(RPCError, TimeoutError):
    pass


class ConnectionLost(RPCError):
    pass


class StreamClosed(RPCError):
    """The other side ended the stream; nothing more can be sent on it."""


# Remote exception types that mean "your arguments were wrong" map to BadRequestError; the original
# type name is kept in ``type_name``.
_ERROR_TYPES: dict[str, type[RemoteError]] = {
    UNKNOWN_METHOD: UnknownMethodError,
    BAD_REQUEST: BadRequestError,
    TypeError.__name__: BadRequestError,
    ValueError.__name__: BadRequestError,
    BUSY: BusyError,
    DEADLINE_EXCEEDED: DeadlineExceededError,
    MESSAGE_TOO_LARGE: MessageTooLargeError,
}


class BadRequest(Exception):
    """Raise from a handler to tell the caller its arguments are wrong (reaches it as BadRequestError)."""


class Busy(Exception):
    """Raise from a handler that has no room for this call now (reaches the caller as BusyError)."""


def error_code(error: BaseException) -> str:
    """The type name an ERROR header carries for an exception a handler raised."""
    if isinstance(error, BadRequest):
        return BAD_REQUEST
    if isinstance(error, Busy):
        return BUSY
    return type(error).__name__


def remote_error(method: str, peer: PeerID, type_name: str, message: str) -> RemoteError:
    """The local exception for a failure the peer reported."""
    return _ERROR_TYPES.get(type_name, RemoteError)(method, peer, type_name, message)
