"""Method name -> handler, and what handlers receive and return."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .address import PeerAddress
from .identity import PeerID
from .message import Message
from .rpc_protocol import MAX_STREAM_MESSAGE
from .rpc_streams import ServerStream

__all__ = ["Message", "Request", "Router", "UnaryHandler", "StreamHandler", "StreamPrepare"]


@dataclass(frozen=True)
class Request:
    """What a unary handler receives: who called, what it sent, where the caller accepts
    connections (``listen_address``, as it announced it at the handshake; None for a client-mode
    peer) and the connection the call came on, for what its handshake established (the caller's
    node-ID proof, whether it came through a relay, its socket's remote address). That connection,
    not whichever the host's pool holds for the caller now: a call that crossed the connection's
    GOAWAY is served on a connection the pool no longer hands out. A handler answers by returning,
    and calls back through the pool like any other call. (``connection`` is None only for requests
    a test builds by hand.)"""

    peer: PeerID
    body: Any
    payload: bytes | bytearray
    listen_address: PeerAddress | None
    connection: Any = None  # a ``peer.rpc.Connection`` (which builds requests: this module sits below it)


UnaryHandler = Callable[[Request], Awaitable[Any]]
StreamHandler = Callable[[ServerStream], Awaitable[None]]
# Called with a stream as soon as its call opens, before any of its messages is processed (the
# handler task itself starts a little later, by which time data may have arrived).
StreamPrepare = Callable[[ServerStream], None]


class Router:
    """Method name -> handler. Unary handlers return a body or a ``Message``; stream handlers
    receive a ``ServerStream`` and return when done."""

    def __init__(self) -> None:
        self._unary: dict[str, UnaryHandler] = {}
        self._stream: dict[str, StreamHandler] = {}
        self._prepare: dict[str, StreamPrepare] = {}
        self._max_message: dict[str, int] = {}

    def add_unary(self, name: str, handler: UnaryHandler) -> None:
        self._check_free(name)
        self._unary[name] = handler

    def add_stream(
        self,
        name: str,
        handler: StreamHandler,
        *,
        prepare: StreamPrepare | None = None,
        max_message: int = MAX_STREAM_MESSAGE,
    ) -> None:
        """``prepare(stream)``, if given, runs synchronously when a call opens, before any of its
        messages is processed: the place to ``set_buffer_provider`` so that even the first
        payloads land in the handler's buffers. ``max_message``: the largest message payload the
        handler accepts from its caller; a larger one ends the call with ``MessageTooLarge``
        before any of it is received."""
        self._check_free(name)
        self._stream[name] = handler
        if prepare is not None:
            self._prepare[name] = prepare
        self._max_message[name] = max_message

    def _check_free(self, name: str) -> None:
        # A silent replacement or skip would leave one of two registrants without its calls.
        if name in self._unary or name in self._stream:
            raise ValueError(f"RPC method {name!r} is already registered on this peer; a method has one handler")

    def unary(self, name: str) -> Callable[[UnaryHandler], UnaryHandler]:
        def register(handler: UnaryHandler) -> UnaryHandler:
            self.add_unary(name, handler)
            return handler

        return register

    def stream(self, name: str) -> Callable[[StreamHandler], StreamHandler]:
        def register(handler: StreamHandler) -> StreamHandler:
            self.add_stream(name, handler)
            return handler

        return register

    def max_message(self, name: str) -> int:
        """The largest message payload a stream method accepts (``add_stream``)."""
        return self._max_message.get(name, MAX_STREAM_MESSAGE)

    def lookup(self, name: str, unary: bool) -> UnaryHandler | StreamHandler | None:
        return (self._unary if unary else self._stream).get(name)

    def preparation(self, name: str) -> StreamPrepare | None:
        return self._prepare.get(name)

    @property
    def methods(self) -> list[str]:
        return sorted([*self._unary, *self._stream])
