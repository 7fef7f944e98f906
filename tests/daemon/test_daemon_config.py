"""The daemon's config holds the ``peerd join`` settings by their declaration: its defaults are the
declared ones, and the parsed flags, variables and file fill it without a hand-written copy."""

from __future__ import annotations

from dataclasses import fields

import pytest

from peerd.cli import build_parser
from peerd.daemon_config import AveragingConfig, NetworkConfig, StatusConfig, TrainingConfig
from peerd.join_arguments import JOIN_SETTINGS, RELAY_RATE
from peerd.setting_kinds import from_args
from peerd.settings import Settings

GROUPS = (NetworkConfig, TrainingConfig, AveragingConfig, StatusConfig)


def test_every_field_that_holds_a_setting_holds_a_declared_one_with_its_default():
    declared = {setting.name: setting for setting in JOIN_SETTINGS}
    for group in GROUPS:
        built = group()
        for item in fields(group):
            setting = item.metadata.get("setting")
            if setting is None:
                continue
            assert declared[setting.name] is setting, item.name
            if item.name != "node_id_difficulty":  # the library's default is the local one
                default = getattr(built, item.name)
                assert (tuple(default) if isinstance(default, list) else default) == setting.default, item.name
    assert NetworkConfig().relay_mib_per_s == RELAY_RATE.default == 32.0
    assert NetworkConfig().initial_peers is not NetworkConfig().initial_peers  # (a list each)


def test_the_parsed_settings_fill_each_group_by_name():
    environ = {"PEERD_RELAY_RATE": "5", "PEERD_LOCAL_STEPS": "7"}
    args = build_parser(Settings(environ=environ)).parse_args(
        ["join", "--listen", "127.0.0.1:0", "--mode", "local-updates", "--uplink-mbit", "40", "--status-port", "9",
         "--outer-lr", "0.35"]
    )  # fmt: skip
    network = from_args(NetworkConfig, args, initial_peers=[], node_id=None, access=None)
    assert network.listen == ("127.0.0.1", 0) and network.relay_mib_per_s == 5.0 and network.relay is True
    training = from_args(TrainingConfig, args, data_shard=None)
    assert training.mode == "local-updates" and training.local_steps == 7 and training.task is None
    assert training.outer_lr == 0.35 and TrainingConfig().outer_lr is None  # None: the optimizer's default
    averaging = from_args(AveragingConfig, args, delay_updates=False)
    assert averaging.uplink_mbit == 40.0 and averaging.aggregation == "auto"
    status = from_args(StatusConfig, args)
    assert (status.host, status.port) == ("127.0.0.1", 9)


def test_a_value_for_a_field_that_does_not_exist_is_refused():
    args = build_parser(Settings(environ={})).parse_args(["join"])
    with pytest.raises(TypeError, match="no field relay_rate"):
        from_args(NetworkConfig, args, relay_rate=3.0)
