"""The arithmetic of a machine of several ranks (``peerd/machine.py``) on a real two-rank gloo group:
gradients over the machine's samples however they split between ranks, orders and parameters from
rank 0; and the pieces that need no group (torchrun's variables, the ranks' shards, the launcher's
arguments)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from averaging.optimizer_state import FUSED_ON_CPU
from peerd.exit_codes import EXIT_OK
from peerd.machine import ParameterWrites
from peerd.machine_launch import without_nproc_flag
from peerd.machine_sharded import ShardedCompute
from peerd.ranks import RankError, RankPlace, follow_signals, rank_place
from peerd.task_types import ShardSpec
from tests.support import rank_slice

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_rank_slice(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """``tests/support/rank_slice.py`` on two ranks: what each ended with."""
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "tests.support.rank_slice", str(tmp_path), *extra]
        ranks.append(subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True))
    for process in ranks:
        _, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
    zero, one = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    return zero, one


def test_a_slice_is_the_gradient_of_the_machines_samples_and_rank_0_leads(tmp_path):
    zero, one = run_rank_slice(tmp_path)
    net = rank_slice.model()
    inputs, targets = rank_slice.data()
    rank_slice.loss_fn(net, (inputs, targets)).backward()  # the mean over all 10 samples at once
    for expected, got0, got1 in zip([p.grad for p in net.parameters()], zero["grads"], one["grads"], strict=True):
        torch.testing.assert_close(got0, expected)
        torch.testing.assert_close(got1, expected)
    assert zero["samples"] == one["samples"] == [8, 2]
    assert one["orders"] == 3
    for ours, theirs, start in zip(zero["params"], one["params"], net.parameters(), strict=True):
        torch.testing.assert_close(theirs, ours)
        torch.testing.assert_close(ours, start.detach() * -2.0)


def test_a_sharded_slice_delivers_the_machines_gradient_to_rank_0s_whole_model(tmp_path):
    zero, one = run_rank_slice(tmp_path, "sharded")
    assert zero["kind"] == one["kind"] == ShardedCompute.kind == "fsdp"
    net = rank_slice.Stack()
    inputs, targets = rank_slice.data()
    (2 * rank_slice.loss_fn(net, (inputs, targets))).backward()  # two slices of the mean over all 10
    for param, got in zip(net.parameters(), zero["grads"], strict=True):
        if param.requires_grad:
            torch.testing.assert_close(got, param.grad)
        else:
            assert got is None  # frozen: no gradient for the optimizer to decay it by
    assert one["grads"] == [None] * len(one["grads"])  # a follower's model is only its shards
    assert zero["passes"] == 4 == one["received_passes"]  # rank 0's buffers reach its host model, then all
    for ours, theirs, start in zip(zero["params"], one["params"], net.parameters(), strict=True):
        torch.testing.assert_close(theirs, ours)  # each rank's shards make up rank 0's parameters
        torch.testing.assert_close(ours, start.detach() * -2.0)


def test_torchruns_variables_place_a_rank_and_a_lone_process_is_none():
    assert rank_place({}) is None
    assert rank_place({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert rank_place({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == RankPlace(1, 4, 1)
    with pytest.raises(RankError, match="outside"):
        rank_place({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(RankError, match="integers"):
        rank_place({"RANK": "a", "WORLD_SIZE": "2"})


def test_the_ranks_split_the_machines_shard_exactly():
    from peerd.machine import RankGroup, rank_shard

    items = list(range(103))
    machine = ShardSpec(1, 3)
    parts = []
    for rank in range(4):
        group = RankGroup(rank, 4, "gloo", torch.device("cpu"), None)
        shard = rank_shard(machine, group)
        parts.append(set(items[shard.index :: shard.count]))
    assert set().union(*parts) == set(items[machine.index :: machine.count])
    assert sum(len(part) for part in parts) == len(items[machine.index :: machine.count])


def test_the_launcher_passes_every_argument_but_its_own():
    argv = ["join", "--nproc-per-node", "2", "--task", "digits", "--nproc-per-node=3", "--listen", "127.0.0.1:0"]
    assert without_nproc_flag(argv) == ["join", "--task", "digits", "--listen", "127.0.0.1:0"]


def test_peerd_status_shows_the_ranks_on_one_line():
    from peerd.cli import ranks_line

    ranks = {
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "ranks": [{"rank": 0, "samples": 64}, {"rank": 1, "samples": 64}],
    }
    assert ranks_line(ranks) == "2 ranks (gloo on cpu): rank 0 64 samples, rank 1 64 samples"
    ranks["model"] = "fsdp"
    assert ranks_line(ranks) == "2 ranks (gloo on cpu, sharded): rank 0 64 samples, rank 1 64 samples"


async def test_the_dashboard_lists_a_machines_ranks(tmp_path):
    import functools

    import trio

    from peerd.status_pages import StatusPages
    from peerd.status_server import serve_http
    from tests.daemon.test_status_pages import RenderedDashboard, chromium, headless

    browser = chromium()
    rows = [{"rank": rank, "samples": 64 * (rank + 1), "loss": 0.5, "batch_ms": 1.5} for rank in range(3)]
    ranks = {"world_size": 3, "backend": "gloo", "device": "cpu", "parameters_shared": 7, "ranks": rows}
    status = {"peer_id": "machine", "run_id": "r", "epoch": 2, "ranks": ranks}
    pages = StatusPages(lambda: status)
    pages.sample()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_http, host="127.0.0.1"), 0, pages.routes())
        url = f"http://127.0.0.1:{port}/"
        html = (await trio.to_thread.run_sync(headless, browser, tmp_path / "profile", url, "--dump-dom")).stdout
        nursery.cancel_scope.cancel()
    assert RenderedDashboard(html).badge.startswith("live")
    assert [int(rank) for rank in re.findall(r'<tr data-rank="(\d+)"', html)] == [0, 1, 2]
    assert "3 ranks · gloo on cpu · parameters shared 7 times" in html
    assert 'id="ranks-section" hidden' not in html


def test_a_stop_signal_while_a_follower_writes_a_log_line_ends_it_quietly(capsys):
    """The signal lands inside logging's ``emit``, whose ``except Exception`` printed a traceback
    and went on when the stop was an Exception (seen in the full suite: a follower told to stop
    while it logged why it stops)."""

    class SignallingFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            os.kill(os.getpid(), signal.SIGTERM)
            return super().format(record)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SignallingFormatter())
    logger = logging.getLogger("peerd-test-follower")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        assert follow_signals(lambda: logger.warning("rank 1 stops") or 7) == EXIT_OK
    finally:
        logger.removeHandler(handler)
    assert "Traceback" not in capsys.readouterr().err


def test_a_stop_signal_while_the_launcher_starts_rank_zero_still_stops_the_machine(tmp_path, monkeypatch):
    """SIGTERM before rank 0's process exists reached no rank, and the launcher waited for a
    second one: here rank 0 would otherwise run on until its unreachable swarm gave up."""
    from peerd import machine_launch

    start = machine_launch._start_rank

    def start_after_a_signal(rank, *args):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler takes it now
        return start(rank, *args)

    monkeypatch.setattr(machine_launch, "_start_rank", start_after_a_signal)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    argv = ["join", "--listen", "127.0.0.1:0", "--identity", str(tmp_path / "id.key"),
            "--initial-peer", f"127.0.0.1:{dead}", "--task", "digits"]  # fmt: skip
    assert machine_launch.launch_ranks(argv, 2) == EXIT_OK


def test_every_rank_refuses_the_same_device_mistakes():
    from peerd.machine import rank_device

    second = RankPlace(1, 2, 1)
    assert rank_device(None, second, 0) == torch.device("cpu")
    assert rank_device(None, second, 2) == torch.device("cuda", 1)
    assert rank_device("cpu", second, 2) == torch.device("cpu")
    for device, devices, said in [
        ("cuda", 0, "no CUDA device"),
        ("cuda", 1, "2 ranks need as many CUDA devices; this machine has 1"),
        ("cuda:1", 2, "names one GPU for 2 ranks"),
    ]:
        for place in (RankPlace(0, 2, 0), second):  # rank 0 says it for the machine
            with pytest.raises(ValueError, match=said):
                rank_device(device, place, devices)


@pytest.mark.skipif(not FUSED_ON_CPU, reason="torch before 2.4 has no fused Adam on a CPU")
def test_a_fused_optimizer_step_counts_as_a_write_to_share():
    """A fused kernel writes the parameters without bumping their version counters, which alone
    left a machine's other ranks on rank 0's old parameters after every fused step."""
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    writes = ParameterWrites([param], optimizer)
    assert not writes.take()
    param.grad = torch.ones(4)
    optimizer.step()
    assert writes.take() and param.abs().sum() > 0
    assert not writes.take()  # (shared by the take before)
    with torch.no_grad():
        param.copy_(torch.ones(4))  # a loaded state, an averaged one
    assert writes.take()
