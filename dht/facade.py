"""``DHT``: the synchronous face of a ``DHTNode`` for plain scripts.

The node runs in the process-wide background trio loop (``peer.background``), shared with any other
facade of this process; each method hands one coroutine to that loop and waits for it (or returns a
``concurrent.futures.Future`` with ``return_future=True``). Trio code should use ``DHTNode``
directly instead.

    dht = DHT(initial_peers=["10.0.0.5:31337"], start=True)
    dht.store("key", {"any": "msgpack"}, expiration_time=time.time() + 60)
    dht.get("key", latest=True)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

from peer import LOCAL_DIFFICULTY, Identity, PeerAddress, PeerID
from peer.background import BackgroundLoop, ServiceHandle, get_loop

from .node import DHTConfig, DHTNode
from .records import DHTValue
from .validation import RecordValidator

__all__ = ["DHT"]


class DHT:
    """A DHT node for synchronous code. ``start=True`` joins at once; otherwise call ``run()``."""

    def __init__(
        self,
        initial_peers: Iterable[PeerAddress | str] = (),
        *,
        start: bool = False,
        identity: Identity | None = None,
        listen: tuple[str, int] | None = ("127.0.0.1", 0),
        client_mode: bool = False,
        run_id: str = "default",
        node_id_difficulty: int = LOCAL_DIFFICULTY,
        validators: Iterable[RecordValidator] = (),
        config: DHTConfig | None = None,
        loop: BackgroundLoop | None = None,
    ):
        """``node_id_difficulty`` must be the run's: ``peerd join`` defaults to
        ``DEFAULT_DIFFICULTY``, local swarms use ``LOCAL_DIFFICULTY`` (also this default, so that
        scripts start at once); a mismatch is refused at the first handshake, naming both values."""
        self._options = dict(
            node_id_difficulty=node_id_difficulty,
            identity=identity or Identity.generate(),
            listen=listen,
            initial_peers=list(initial_peers),
            client_mode=client_mode,
            run_id=run_id,
            validators=list(validators),
            config=config,
        )
        self._loop = loop or get_loop()
        self._service: ServiceHandle[DHTNode] | None = None
        if start:
            self.run()

    # ------------------------------------------------------------------ lifetime
    def run(self) -> None:
        """Join the swarm; raises DHTBootstrapError if no initial peer answers."""
        if self._service is not None and not self._service.closed:
            raise RuntimeError("this DHT is already running")
        self._service = self._loop.start_service(lambda: DHTNode.open(**self._options))

    def shutdown(self) -> None:
        """Leave the swarm: close the node's connections and stop its background tasks."""
        if self._service is not None:
            self._service.close()
            self._service = None

    def __enter__(self) -> DHT:
        if self._service is None:
            self.run()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._service is not None and not self._service.closed

    @property
    def loop(self) -> BackgroundLoop:
        """The background trio loop the node runs in: other facades of this process (an averager,
        an optimizer) run their coroutines there too."""
        return self._loop

    @property
    def node(self) -> DHTNode:
        """The trio node (use its methods only from the background loop)."""
        if self._service is None:
            raise RuntimeError("the DHT is not running; call run() or pass start=True")
        return self._service.value

    @property
    def peer_id(self) -> PeerID:
        return self._options["identity"].peer_id

    @property
    def address(self) -> PeerAddress | None:
        """Where other peers can reach this node (None in client mode)."""
        return self.node.address

    # ------------------------------------------------------------------ records
    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        *,
        return_future: bool = False,
    ) -> bool | concurrent.futures.Future[bool]:
        """Store on the k nearest peers until ``expiration_time``; True if at least one accepted."""
        future = self._loop.submit(self.node.store, key, value, expiration_time, subkey)
        return future if return_future else future.result()

    def get(
        self, key: Any, latest: bool = False, *, return_future: bool = False
    ) -> DHTValue | None | concurrent.futures.Future[DHTValue | None]:
        """The value under ``key`` (see ``DHTNode.get``), or None if nobody holds a live one."""
        future = self._loop.submit(self.node.get, key, latest)
        return future if return_future else future.result()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else "stopped"
        return f"DHT({self.peer_id}, {state})"
