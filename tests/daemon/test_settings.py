"""Settings from flags, ``PEERD_*`` variables and a TOML file, in that order."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from peer import LOCAL_DIFFICULTY
from peerd.cli import build_parser, main, parse_command_line
from peerd.join_arguments import KNOWN_FILE_KEYS, LOCAL_STEPS, data_shard_from_args, delay_updates_from_args
from peerd.settings import Settings, SettingsError
from tests.support.processes import PEERD

CONFIG = """
run_id = "from-file"
initial_peers = ["127.0.0.1:4001", "127.0.0.1:4002"]
local_steps = 7
client_mode = true
data_shard = "1/3"
target_batch_size = 512
"""


def write_config(tmp_path, text: str = CONFIG):
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def join_args(settings: Settings, *flags: str):
    args = build_parser(settings).parse_args(["join", *flags])
    settings.check_known(KNOWN_FILE_KEYS)
    return args


def test_the_file_fills_what_neither_flags_nor_environment_give(tmp_path):
    settings = Settings.load(write_config(tmp_path), environ={})
    args = join_args(settings)
    assert args.run_id == "from-file"
    assert args.local_steps == 7 and args.client_mode is True
    assert data_shard_from_args(args) == (1, 3) and args.target_batch_size == 512
    assert args.initial_peers_setting[0] == "127.0.0.1:4001 127.0.0.1:4002"
    assert args.mode == "collaborative"  # not in the file: the built-in default


def test_environment_beats_the_file_and_flags_beat_both(tmp_path):
    environ = {"PEERD_RUN_ID": "from-env", "PEERD_LOCAL_STEPS": "9", "PEERD_CLIENT_MODE": "0"}
    settings = Settings.load(write_config(tmp_path), environ=environ)
    args = join_args(settings, "--local-steps", "11")
    assert args.run_id == "from-env"
    assert args.client_mode is False
    assert args.local_steps == 11


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "{path}", "join"],
        ["join", "--config", "{path}"],
        ["--conf", "{path}", "join"],  # abbreviated, as argparse allows for every flag
        ["join", "--conf={path}"],
    ],
)
def test_config_is_read_wherever_the_flag_stands(tmp_path, monkeypatch, argv):
    for name in [name for name in os.environ if name.startswith("PEERD_")]:
        monkeypatch.delenv(name)
    path = write_config(tmp_path)
    args = parse_command_line([arg.format(path=path) for arg in argv])
    assert args.run_id == "from-file" and args.local_steps == 7


def test_a_flag_turns_off_what_the_file_turns_on(tmp_path):
    settings = Settings.load(write_config(tmp_path), environ={})
    assert join_args(settings, "--no-client-mode").client_mode is False


def test_collaborative_training_delays_updates_only_when_asked():
    def delay(environ, *flags):
        return delay_updates_from_args(join_args(Settings.load(None, environ=environ), *flags))

    assert delay({}, "--task", "digits") is False
    assert delay({}, "--task", "digits", "--delay-updates") is True
    assert delay({"PEERD_DELAY_UPDATES": "1"}, "--task", "digits") is True
    assert delay({"PEERD_DELAY_UPDATES": "1"}, "--task", "digits", "--no-delay-updates") is False
    # Nothing to delay: off without a word, and refused in one line only where asked for.
    assert delay({}) is False and delay({}, "--task", "digits", "--mode", "local-updates") is False
    with pytest.raises(ValueError, match="collaborative mode only"):
        delay({}, "--task", "digits", "--mode", "local-updates", "--delay-updates")


def test_peerd_config_variable_names_the_file(tmp_path):
    path = write_config(tmp_path)
    settings = Settings.load(None, environ={"PEERD_CONFIG": str(path)})
    assert join_args(settings).run_id == "from-file"
    assert Settings.load(None, environ={}).get("RUN_ID") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run_idd = 'typo'\n", "unknown setting run_idd"),
        ("run_id = \n", "not valid TOML"),
        ("[join]\nrun_id = 'x'\n", "'join' must be a string, number, boolean or list of strings"),
        ("local_steps = 'many'\n", "local_steps in "),
        ("client_mode = 'maybe'\n", "expected a boolean"),
        ("listen = 'nowhere'\n", "listen in "),
        ("mode = 'local_updates'\n", "expected one of collaborative, local-updates"),
        ("log_level = 'verbose'\n", "log_level in .*expected one of DEBUG, INFO, WARNING, ERROR"),
    ],
)
def test_a_bad_file_is_refused_with_a_clear_error(tmp_path, text, message):
    with pytest.raises(SettingsError, match=message):
        join_args(Settings.load(write_config(tmp_path, text), environ={}))


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.load(tmp_path / "absent.toml", environ={})


def test_the_command_exits_1_naming_the_bad_setting(tmp_path, capsys):
    path = write_config(tmp_path, "run_id = 'x'\nstatus_prot = 8080\n")
    assert main(["--config", str(path), "keygen", "--identity", str(tmp_path / "k.key")]) == 1
    error = capsys.readouterr().err
    assert "unknown setting status_prot" in error and "status_port" in error
    assert not (tmp_path / "k.key").exists()


def test_join_reads_its_initial_peers_from_the_file(tmp_path):
    """End to end: a real ``peerd join --config`` whose only initial peer (from the file) is dead
    exits 2 naming that address, within the file's bootstrap timeout."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    path = write_config(
        tmp_path,
        f'listen = "127.0.0.1:0"\ninitial_peers = ["127.0.0.1:{dead_port}"]\nbootstrap_timeout = 2\n'
        f'identity = "{tmp_path / "id.key"}"\nnode_id_difficulty = {LOCAL_DIFFICULTY}\n',
    )
    environ = {key: value for key, value in os.environ.items() if not key.startswith("PEERD_")}
    start = time.monotonic()
    result = subprocess.run(
        PEERD + ["join", "--config", str(path)], capture_output=True, text=True, timeout=30, env=environ
    )
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{dead_port}: " in result.stderr
    assert time.monotonic() - start < 2 + 5
    assert (tmp_path / "id.key").exists()


def test_an_abbreviated_config_flag_overrides_a_bad_peerd_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PEERD_CONFIG", str(tmp_path / "missing.toml"))
    path = write_config(tmp_path)
    assert parse_command_line(["join", "--conf", str(path)]).run_id == "from-file"
    with pytest.raises(SettingsError, match="missing.toml"):
        parse_command_line(["join"])


def test_aggregation_comes_from_flag_variable_or_file_and_defaults_to_auto(tmp_path):
    assert join_args(Settings.load(None, environ={})).aggregation == "auto"
    settings = Settings.load(write_config(tmp_path, 'aggregation = "mean"\n'), environ={})
    assert join_args(settings).aggregation == "mean"
    settings = Settings.load(None, environ={"PEERD_AGGREGATION": "centered-clip"})
    assert join_args(settings).aggregation == "centered-clip"
    with pytest.raises(SystemExit):
        join_args(Settings.load(None, environ={}), "--aggregation", "median")


def test_the_uplink_comes_from_flag_variable_or_file_and_is_unset_by_default(tmp_path):
    assert join_args(Settings.load(None, environ={})).uplink_mbit is None
    settings = Settings.load(write_config(tmp_path, "uplink_mbit = 40\n"), environ={})
    assert join_args(settings).uplink_mbit == 40.0
    assert join_args(Settings.load(None, environ={"PEERD_UPLINK_MBIT": "12.5"})).uplink_mbit == 12.5
    assert join_args(Settings.load(None, environ={}), "--uplink-mbit", "100").uplink_mbit == 100.0
    for bad in ("0", "-5", "fast"):
        with pytest.raises(SystemExit):
            join_args(Settings.load(None, environ={}), "--uplink-mbit", bad)


def test_the_local_steps_default_is_the_optimizers():
    """peerd declares it (the CLI must not load torch to read it); the two must not drift apart."""
    import inspect

    from averaging import LocalUpdatesOptimizer

    assert LOCAL_STEPS.default == inspect.signature(LocalUpdatesOptimizer).parameters["local_steps"].default
