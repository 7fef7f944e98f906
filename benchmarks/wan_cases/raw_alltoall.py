"""Plain TCP moving an all-reduce's traffic: every host sends the same bytes to every other host at
once, with no dependencies between them, through the lab's shaped links. What the all-reduce is
measured against, beyond the single stream of ``raw_tcp.py``: the same matrix of bytes, moved by
the kernel alone.

    raw_alltoall.py INDEX PORT BYTES_PER_PEER CHUNK

prints ``ready`` once listening; then takes commands on stdin, one per line:

* ``connect ADDRESS...``: dial every other host (their addresses, ours left out) and wait for
  theirs; prints ``connected``;
* ``round parallel``: one thread per destination sends BYTES_PER_PEER, as a program with a stream
  per peer does, and the kernel shares the link between them;
* ``round rotating``: one thread sends CHUNK bytes to one destination at a time, taking turns so
  that at each turn every host sends to a different host (a permutation: host ``i`` sends to
  ``i + 1 + turn mod (n - 1)``), with the kernel's unsent queue kept short (``TCP_NOTSENT_LOWAT``,
  as peerd's connections) so that the turns are the wire's and not only the program's.

After a round it prints ``{"started": t, "finished": t}`` (``time.monotonic``, one clock for every
namespace of the host): from the command to the last byte received from every other host.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

UNSENT_LIMIT = 256 * 1024  # peer/tcp_options.py's
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def receive_rounds(connection: socket.socket, per_round: int, finished: list, done: threading.Semaphore) -> None:
    """Read ``per_round`` bytes per round until the connection ends; note when each round's last
    byte came."""
    buffer = bytearray(1 << 20)
    while True:
        left = per_round
        while left:
            count = connection.recv_into(buffer, min(left, len(buffer)))
            if not count:
                return
            left -= count
        finished.append(time.monotonic())
        done.release()


def send_parallel(outgoing: list[socket.socket], total: int, chunk: int) -> None:
    block = bytes(chunk)

    def one(connection: socket.socket) -> None:
        for start in range(0, total, chunk):
            connection.sendall(memoryview(block)[: min(chunk, total - start)])

    threads = [threading.Thread(target=one, args=(connection,)) for connection in outgoing]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def rotation_target(me: int, hosts: int, turn: int) -> int:
    """Whom host ``me`` sends to at ``turn``: every host shifts by the same step, so each turn is a
    permutation (no host receives from two at once) and no host sends to itself."""
    return (me + 1 + turn % (hosts - 1)) % hosts


def send_rotating(outgoing: dict[int, socket.socket], me: int, hosts: int, total: int, chunk: int) -> None:
    block = memoryview(bytes(chunk))
    turns = -(-total // chunk) * (hosts - 1)
    sent = dict.fromkeys(outgoing, 0)
    for turn in range(turns):
        target = rotation_target(me, hosts, turn)
        count = min(chunk, total - sent[target])
        outgoing[target].sendall(block[:count])
        sent[target] += count


def main() -> None:
    me, port, total, chunk = (int(value) for value in sys.argv[1:5])
    server = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    finished: list[float] = []
    done = threading.Semaphore(0)
    incoming: list[socket.socket] = []
    outgoing: dict[int, socket.socket] = {}
    for line in sys.stdin:
        command = line.split()
        if command[0] == "connect":
            addresses = command[1:]
            hosts = len(addresses) + 1
            for index, address in enumerate(addresses):
                peer = index if index < me else index + 1
                connection = socket.create_connection((address, port), timeout=60)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                outgoing[peer] = connection
            for _ in addresses:
                connection, _ = server.accept()
                incoming.append(connection)
                threading.Thread(target=receive_rounds, args=(connection, total, finished, done), daemon=True).start()
            print("connected", flush=True)
        elif command[0] == "round":
            started = time.monotonic()
            finished.clear()
            rotating = command[1] == "rotating"
            for connection in outgoing.values():
                connection.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, UNSENT_LIMIT if rotating else 1 << 30)
            if rotating:
                send_rotating(outgoing, me, hosts, total, chunk)
            else:
                send_parallel(list(outgoing.values()), total, chunk)
            for _ in incoming:
                done.acquire()
            print(json.dumps({"started": started, "finished": max(finished)}), flush=True)


if __name__ == "__main__":
    main()
