"""Train a small model whose middle layer is a mixture of experts hosted by other processes.

Starts two expert servers on 127.0.0.1 (``peerd serve-experts``, each hosting half of a 2 x 4 grid
of FFN experts; the second joins the DHT through the first), then trains
``Linear -> RemoteMixtureOfExperts -> Linear`` on a synthetic regression task from this plain,
non-trio script. The servers are stopped (and write their checkpoints) when it ends.

    python examples/remote_moe.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe.client import MoEClient  # noqa: E402
from moe.mixture import RemoteMixtureOfExperts  # noqa: E402
from peer import LOCAL_DIFFICULTY  # noqa: E402

HIDDEN = 32


def peerd_command() -> list[str]:
    """``peerd``, run by this interpreter so that it uses this checkout."""
    return [sys.executable, "-m", "peerd.cli"]


# A local run: the servers use the low node-ID difficulty, as this script's client does by default.
LOCAL_RUN = ["--node-id-difficulty", str(LOCAL_DIFFICULTY)]


def start_server(pattern: str, initial_peer: str | None, checkpoint_dir: Path) -> tuple[subprocess.Popen, str]:
    command = peerd_command() + ["serve-experts", "--experts", pattern, "--hidden-dim", str(HIDDEN), *LOCAL_RUN]
    command += ["--listen", "127.0.0.1:0", "--checkpoint-dir", str(checkpoint_dir), "--expert-lr", "3e-3"]
    if initial_peer:
        command += ["--initial-peer", initial_peer]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline, line = time.monotonic() + 60, b""
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline or not selector.select(max(0.0, deadline - time.monotonic())):
                process.kill()
                raise RuntimeError(f"{pattern}: the expert server did not start")
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{pattern}: the expert server exited with {process.wait()}")
            line += chunk
    print(line.decode().strip())
    return process, line.decode().rsplit(" at ", 1)[-1].strip()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: the server saves its checkpoints and exits
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.5 * x[:, 4:].prod(dim=1, keepdim=True)

    servers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="peerd-moe-") as checkpoints:
        try:
            first, address = start_server("ffn.[0:1].[0:4]", None, Path(checkpoints) / "a")
            servers.append(first)
            second, _ = start_server("ffn.[1:2].[0:4]", address, Path(checkpoints) / "b")
            servers.append(second)
            with MoEClient.start([address]) as client:
                model = torch.nn.Sequential(
                    torch.nn.Linear(8, HIDDEN),
                    RemoteMixtureOfExperts(
                        in_features=HIDDEN, grid_size=(2, 4), uid_prefix="ffn", client=client, k_best=3, k_min=1
                    ),
                    torch.nn.Linear(HIDDEN, 1),
                )
                optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
                for step in range(args.steps):
                    batch = torch.randint(0, len(x), (64,))
                    loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    if step % 5 == 0 or step == args.steps - 1:
                        with torch.no_grad():
                            full = torch.nn.functional.mse_loss(model(x), y).item()
                        print(f"step {step:3d}  batch loss {loss.item():.4f}  full loss {full:.4f}")
        finally:
            for process in servers:
                stop(process)


if __name__ == "__main__":
    main()
