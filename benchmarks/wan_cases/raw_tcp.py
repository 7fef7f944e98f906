"""Raw TCP through one lab link, the wire's own speed: ``recv PORT`` prints ``ready``, takes one
connection and prints ``{"bytes", "seconds"}`` at EOF; ``send HOST PORT BYTES`` sends that much."""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            received, started = 0, None
            while chunk := connection.recv(CHUNK):
                started = started or time.monotonic()
                received += len(chunk)
    print(json.dumps({"bytes": received, "seconds": time.monotonic() - (started or time.monotonic())}), flush=True)


def send(host: str, port: int, total: int) -> None:
    block = bytes(CHUNK)
    with socket.create_connection((host, port), timeout=60) as connection:
        for _ in range(total // CHUNK):
            connection.sendall(block)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        receive(int(sys.argv[2]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
