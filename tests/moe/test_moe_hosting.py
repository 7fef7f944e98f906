"""``serve-experts`` flags, and hosting experts on an existing peer (what ``peerd join`` does)."""

from __future__ import annotations

import argparse

import trio

from dht.node import DHTNode
from moe.announce import get_expert_addresses
from moe.hosting import ExpertHostingConfig, host_experts
from peerd.expert_commands import add_serve_experts_command, config_from_args, run_serve_experts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_experts_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_flags_become_a_config(tmp_path) -> None:
    args = parse(
        ["serve-experts", "--experts", "ffn.[0:4].[0:4]", "--hidden-dim", "64", "--initial-peer", "127.0.0.1:5000"]
        + ["--checkpoint-dir", str(tmp_path), "--listen", "127.0.0.1:0"]
    )
    config = config_from_args(args)
    assert (config.pattern, config.hidden_dim, config.checkpoint_dir) == ("ffn.[0:4].[0:4]", 64, tmp_path)
    assert args.listen == ("127.0.0.1", 0) and str(args.initial_peer[0]) == "127.0.0.1:5000"


def test_bad_configuration_is_refused_before_serving(capsys) -> None:
    for flags in (["--experts", "ffn.[4:0]"], ["--experts", "ffn.0", "--expert-type", "nope"], []):
        assert run_serve_experts(parse(["serve-experts", *flags, "--listen", "127.0.0.1:0"])) == 1
    assert "empty range" in capsys.readouterr().err


async def test_host_experts_on_an_existing_peer() -> None:
    config = ExpertHostingConfig(pattern="ffn.[0:2].0", hidden_dim=8, device="cpu")
    async with DHTNode.open() as node, DHTNode.open(initial_peers=[node.address], client_mode=True) as client:
        async with trio.open_nursery() as nursery:
            uids = await nursery.start(host_experts, node.host, node, config)
            assert uids == ["ffn.0.0", "ffn.1.0"]
            found = await get_expert_addresses(client, uids)
            assert set(found.values()) == {node.address}
            nursery.cancel_scope.cancel()


def test_hosting_defaults_mirror_the_server() -> None:
    from moe import announce, hosting, server

    assert hosting.DEFAULT_MAX_BATCH_SIZE == server.DEFAULT_MAX_BATCH_SIZE
    assert hosting.HEARTBEAT_PERIOD == announce.HEARTBEAT_PERIOD


def test_a_heartbeat_slower_than_the_dht_keeps_expert_records_is_refused(capsys) -> None:
    """Announcements live three periods and nodes keep expert records at most 600 s: at a 400 s
    period every announcement was refused and the server ran with nothing announced."""
    args = parse(["serve-experts", "--experts", "ffn.0", "--heartbeat-period", "400", "--listen", "127.0.0.1:0"])
    assert run_serve_experts(args) == 1
    assert "--heartbeat-period must be in (0, 200]" in capsys.readouterr().err
    assert ExpertHostingConfig(pattern="ffn.0", heartbeat_period=200).heartbeat_period == 200
