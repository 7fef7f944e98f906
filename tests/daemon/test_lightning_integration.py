"""A Lightning ``Trainer`` as a swarm peer (``PeerdStrategy``, ``peerd/lightning_strategy.py``): two
trainers, the second finding the first through ``PEERD_INITIAL_PEERS``, train digits together."""

from __future__ import annotations

import pytest
import torch

from peerd.lightning_strategy import INITIAL_PEERS_VARIABLE, PeerdStrategy
from tests.support.script_peers import ScriptPeer


def test_two_lightning_trainers_train_as_one_swarm():
    with ScriptPeer("tests.support.lightning_peer", "--steps", "80") as first:
        address = first.first_json(60)["address"]
        env = {INITIAL_PEERS_VARIABLE: address}
        with ScriptPeer("tests.support.lightning_peer", "--steps", "80", "--shard", "1", env=env) as second:
            results = [second.last_json(120), first.last_json(60)]
    for result in results:
        assert result["after"] >= 0.7 > result["before"], result  # it trains (digits: 0.1 at random)
        assert result["averaged"] >= 2 and result["epoch"] >= 3, result  # with the other peer


def test_the_strategy_reads_initial_peers_as_peerd_join_does(monkeypatch):
    monkeypatch.setenv(INITIAL_PEERS_VARIABLE, "127.0.0.1:1, 127.0.0.1:2")
    assert PeerdStrategy(64, device="cpu")._swarm["initial_peers"] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert PeerdStrategy(64, initial_peers=["10.0.0.1:3"], device="cpu")._swarm["initial_peers"] == ["10.0.0.1:3"]
    assert PeerdStrategy(64, device="cpu").root_device == torch.device("cpu")
    with pytest.raises(TypeError):
        PeerdStrategy()  # the swarm's batch is not optional
