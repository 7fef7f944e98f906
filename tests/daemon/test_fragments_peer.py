"""``peerd join --mode local-updates --fragments 2`` as users run it: two processes train digits,
averaging the model's two halves in turn, and a newcomer choosing its data shard counts the peers
of its own swarm, and only those (peers averaging in fragments keep their records under keys that
name the count)."""

from __future__ import annotations

import torch

from peerd.daemon import fragments_for
from tests.daemon.test_machine_peer import start_peer
from tests.support.processes import status_of, wait_until, wait_until_accurate, wait_until_averaged_in

MODE = ("--mode", "local-updates", "--local-steps", "10", "--fragments", "2")


def test_two_peers_averaging_in_fragments_train_digits_and_a_newcomer_takes_the_free_shard(tmp_path):
    first, first_port = start_peer(tmp_path, "first", "0/2", None, *MODE)
    second = None
    try:
        address = status_of(first_port)["address"]
        second, second_port = start_peer(tmp_path, "second", "auto", address, *MODE)
        wait_until(lambda: (status_of(second_port) or {}).get("data_shard") is not None, 60, "a shard chosen")
        assert status_of(second_port)["data_shard"] == "1/2"  # it counted the first peer's claim
        plain, plain_port = start_peer(tmp_path, "plain", "auto", address, "--mode", "local-updates")
        try:  # a peer that averages the whole model is not of their swarm: it counts no one else
            wait_until(lambda: (status_of(plain_port) or {}).get("data_shard") is not None, 60, "a shard chosen")
            assert status_of(plain_port)["data_shard"] == "0/1"
        finally:
            plain.stop()
        wait_until_accurate((first_port, second_port), 90)
        wait_until_averaged_in(second_port, 2, 60, "a fragment's round of both peers")
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_more_fragments_than_the_model_has_tensors_is_the_most_that_split_the_steps():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # 4 tensors
    assert [fragments_for(wanted, 10, model) for wanted in (1, 2, 4, 5, 8)] == [1, 2, 4, 2, 2]
    assert fragments_for(8, 12, model) == 4
