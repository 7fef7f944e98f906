"""A peer for the hole-punching lab test and ``benchmarks/nat.py``, run inside a NAT'd namespace.

``target``: for each try, a fresh host on ``--host:--port+i`` reserves a slot on ``--relay`` and
prints ``{"try": i, "address": RELAYED_ADDRESS}``; it moves to the next try when a line arrives on
stdin (the dialer is done), and ends at end of input.

``dialer``: for each relayed address read from stdin, a fresh host on ``--host:--port+i`` dials it
through the relay, on the first try measures the relayed stream throughput (``--megabytes``),
punches, on the first try measures the direct throughput, and prints ``{"try", "punched",
"punch_s", "remote", "relayed_mb_s", "direct_mb_s"}`` (a try that raised: ``punched`` false and
its ``error``). Each try has its own ports: a closed connection's 4-tuple lingers (TIME_WAIT).

Both learn their public host once, on the first try, by asking the relay (a public peer) for a
dial-back's observed address (which takes the dial-back's timeout: nobody can dial them), unless
``--observed`` names it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import trio

from peer import LOCAL_DIFFICULTY, Identity, PeerAddress, Router, open_peer_host
from peer.holepunch import HolePuncher
from peer.reachability import ReachabilityService, check_reachability
from peer.relay import RelayClient

CHUNK = 1 << 20


def sink_router() -> Router:
    router = Router()

    @router.stream("sink")
    async def sink(stream):
        total = 0
        async for message in stream:
            total += len(message.payload)
        await stream.send(total)

    return router


async def throughput(connection, megabytes: int) -> float:
    """MB/s of one stream of ``megabytes`` 1 MiB messages (until the receiver has counted them)."""
    block = bytes(CHUNK)
    started = time.perf_counter()
    async with connection.stream("sink", timeout=120) as stream:
        for _ in range(megabytes):
            await stream.send(None, payload=block)
        await stream.end()
        received = (await stream.receive()).body
    assert received == megabytes * CHUNK, received
    return megabytes / (time.perf_counter() - started)


async def lines():
    """stdin lines, read in a thread (stdin is a pipe from the test process)."""
    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return
        yield line.strip()


def say(record: dict) -> None:
    print(json.dumps(record), flush=True)


async def open_host(args, index: int):
    difficulty = int(os.environ.get("PEERD_NODE_ID_DIFFICULTY", LOCAL_DIFFICULTY))
    return open_peer_host(
        Identity.generate(),
        listen=(args.host, args.port + index),
        router=sink_router(),
        run_id=args.run_id,
        node_id_difficulty=difficulty,
    )


async def observed_host(host, relay: PeerAddress) -> str | None:
    result = await check_reachability(host, [relay])
    return result.observed[0] if result.observed else None


async def target(args) -> None:
    relay = PeerAddress.parse(args.relay)
    index = 0
    public = args.observed
    inputs = lines().__aiter__()
    while index < args.tries:
        async with await open_host(args, index) as host:
            host.service(ReachabilityService)
            client = RelayClient(host)
            public = public or await observed_host(host, relay)
            HolePuncher(host, lambda public=public: public)
            relay_id, _ = await client.reserve(relay)
            address = PeerAddress(relay.host, relay.port, host.peer_id, relay_id)
            say({"try": index, "address": str(address), "observed": public})
            try:
                await inputs.__anext__()
            except StopAsyncIteration:
                return
        index += 1


async def dialer(args) -> None:
    relay = PeerAddress.parse(args.relay)
    index = 0
    public = args.observed
    async for line in lines():
        address = PeerAddress.parse(line)
        async with await open_host(args, index) as host:
            host.service(ReachabilityService)
            RelayClient(host)
            public = public or await observed_host(host, relay)
            record: dict = {"try": index, "observed": public, "punched": False, "remote": None}
            try:
                with trio.fail_after(60):
                    await one_try(host, address, public, record, measure=bool(args.megabytes) and index == 0, args=args)
            except Exception as failure:  # a failed try is a result (a miss), not the end of the run
                logging.exception("try %d failed", index)
                record["error"] = repr(failure)
            say(record)
        index += 1


async def one_try(host, address: PeerAddress, public, record: dict, *, measure: bool, args) -> None:
    """Dial ``address`` through its relay, punch, and fill ``record`` (throughputs when ``measure``)."""
    relayed = await host.connect(address)
    first_contact = time.perf_counter()
    if measure:
        record["relayed_mb_s"] = round(await throughput(relayed, args.megabytes), 2)
    puncher = HolePuncher(host, lambda public=public: public)
    started = time.perf_counter()
    punched = await puncher.punch(relayed)
    record["punched"] = punched
    record["punch_s"] = round(time.perf_counter() - started, 3)
    record["since_contact_s"] = round(time.perf_counter() - first_contact, 3)
    direct = host.connection_to(address.peer_id)
    if punched and direct is not None and direct.relayed_via is None:
        record["remote"] = "{}:{}".format(*direct.channel.stream.socket.getpeername()[:2])
        if measure:
            record["direct_mb_s"] = round(await throughput(direct, args.megabytes), 2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["target", "dialer"])
    parser.add_argument("--relay", required=True, help="RELAY_HOST:PORT/RELAY_ID")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=40000)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--tries", type=int, default=1)
    parser.add_argument("--megabytes", type=int, default=0)
    parser.add_argument("--observed", default=None, help="our public host, if known (skips the dial-back)")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    trio.run(target if arguments.role == "target" else dialer, arguments)
