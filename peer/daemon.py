"""The peerd daemon: composes the wire layer (and, as they land, DHT, averaging, experts) into one
trio program. Nothing here knows about argparse; ``peer/cli.py`` turns flags into a config.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import trio

from .address import PeerAddress
from .host import ConnectError, PeerHost, open_peer_host
from .identity import Identity
from .rpc import Request, Router

__all__ = ["DaemonConfig", "BootstrapError", "bootstrap", "run_daemon", "add_builtin_methods"]

log = logging.getLogger("peerd")

# Retrying an initial peer that refused or timed out: start fast (a swarm starting together has
# peers a few hundred ms apart), back off to avoid hammering a dead host.
BOOTSTRAP_RETRY_INITIAL = 0.2
BOOTSTRAP_RETRY_MAX = 2.0


class BootstrapError(Exception):
    """No initial peer could be reached and authenticated; ``failures`` maps address -> reason."""

    def __init__(self, failures: dict[str, str], timeout: float):
        self.failures = failures
        lines = "\n".join(f"  {address}: {reason}" for address, reason in failures.items())
        super().__init__(f"could not reach any initial peer within {timeout:g} s:\n{lines}")


@dataclass
class DaemonConfig:
    identity: Identity
    listen_host: str = "0.0.0.0"
    listen_port: int = 31337
    initial_peers: list[PeerAddress] = field(default_factory=list)
    run_id: str = "default"
    bootstrap_timeout: float = 15.0


def add_builtin_methods(router: Router, host_getter) -> None:
    """Methods every peer serves: ``peer.ping`` answers who we are (a cheap liveness probe)."""

    @router.unary("peer.ping")
    async def ping(request: Request) -> dict:
        host: PeerHost = host_getter()
        return {"peer_id": str(host.peer_id), "time": time.time()}


async def bootstrap(host: PeerHost, initial_peers: list[PeerAddress], timeout: float) -> list[PeerAddress]:
    """Connect to every initial peer we can within ``timeout``; return the ones reached.

    Each address is retried with backoff until the deadline, because peers of a swarm often start
    at the same moment. Raises BootstrapError naming each address and its last failure if none
    answered.
    """
    reached: list[PeerAddress] = []
    failures: dict[str, str] = {}

    async def reach(address: PeerAddress) -> None:
        delay = BOOTSTRAP_RETRY_INITIAL
        while True:
            try:
                connection = await host.connect(address)
                await connection.call("peer.ping", timeout=host.connect_timeout)
            except (ConnectError, OSError) as error:
                failures[str(address)] = str(error).removeprefix(f"{address}: ")
                if "mismatch" in str(error):
                    return  # a wrong identity, run or version will not fix itself by retrying
            except Exception as error:  # a peer answering garbage to ping is as bad as none
                failures[str(address)] = f"{type(error).__name__}: {error}"
            else:
                failures.pop(str(address), None)
                reached.append(address.with_peer_id(connection.remote_peer_id))
                log.info("met peer %s at %s", connection.remote_peer_id, address.endpoint)
                return
            await trio.sleep(delay)
            delay = min(delay * 2, BOOTSTRAP_RETRY_MAX)

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for address in initial_peers:
                failures[str(address)] = "no answer yet"
                nursery.start_soon(reach, address)
    if initial_peers and not reached:
        raise BootstrapError(failures, timeout)
    return reached


async def run_daemon(config: DaemonConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a peer until cancelled. ``task_status.started`` gets the listening address."""
    router = Router()
    holder: list[PeerHost] = []
    add_builtin_methods(router, lambda: holder[0])
    async with open_peer_host(
        config.identity, listen=(config.listen_host, config.listen_port), router=router, run_id=config.run_id
    ) as host:
        holder.append(host)

        def on_connection(connection, incoming: bool) -> None:
            if incoming:
                log.info("peer %s connected", connection.remote_peer_id)

        host.on_connection.append(on_connection)
        assert host.listen_address is not None
        task_status.started(host.listen_address)
        if config.initial_peers:
            await bootstrap(host, config.initial_peers, config.bootstrap_timeout)
        await trio.sleep(math.inf)
