"""``peerd --help`` and friends teach: every flag with its default and its ``PEERD_*`` variable,
global flags after the subcommand too, and usage errors with their own exit code
(``peerd/help.py``; ``--node-id-difficulty`` of ``peerd/node_ids.py`` among them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from peerd.cli import parse_command_line
from peerd.exit_codes import EXIT_CODES, EXIT_UNREACHABLE, EXIT_USAGE
from tests.support.processes import PEERD

JOIN_VARIABLES = [
    "LISTEN", "IDENTITY", "INITIAL_PEERS", "RUN_ID", "NODE_ID_DIFFICULTY", "BOOTSTRAP_TIMEOUT", "CLIENT_MODE",
    "TASK", "MODE", "LOCAL_STEPS", "TARGET_BATCH_SIZE", "DEVICE", "DATA_SHARD", "STATUS_PORT", "STATUS_HOST",
    "SERVE_EXPERTS", "CONFIG", "LOG_LEVEL",
]  # fmt: skip


def peerd_help(*command: str) -> str:
    environ = {"PATH": "/usr/bin:/bin", "COLUMNS": "200"}  # no PEERD_* from the test's environment
    result = subprocess.run(PEERD + [*command, "--help"], capture_output=True, text=True, timeout=60, env=environ)
    assert result.returncode == 0, result.stderr
    return result.stdout


def options(help_text: str) -> dict[str, str]:
    """``--flag -> its help`` from argparse's options section (a long flag's help is on the next
    lines)."""
    found: dict[str, str] = {}
    flag = None
    for line in help_text.split("options:", 1)[1].split("\n\n", 1)[0].splitlines():
        if line.startswith("  -"):
            names, _, description = line.strip().partition("  ")
            flag = names.split()[0].rstrip(",")
            if flag == "-h":
                flag = None
                continue
            found[flag] = description.strip()
        elif flag is not None:
            found[flag] = (found[flag] + " " + line.strip()).strip()
    return found


def test_join_help_shows_every_default_and_variable():
    text = peerd_help("join")
    flags = options(text)
    assert "[default: 0.0.0.0:31337; env PEERD_LISTEN]" in flags["--listen"]
    assert "[default: default; env PEERD_RUN_ID]" in flags["--run-id"]
    assert "[default: 15.0; env PEERD_BOOTSTRAP_TIMEOUT]" in flags["--bootstrap-timeout"]
    assert "default: auto" in flags["--data-shard"]
    # the key file's default as this machine resolves it (no XDG_DATA_HOME here: under the home)
    assert f"[default: {Path.home()}/.local/share/peerd/identity.key;" in flags["--identity"]
    words = " ".join(text.split())  # (help wraps long lines)
    for name in JOIN_VARIABLES:
        assert f"env PEERD_{name}" in words, name
    assert all(description.strip() for description in flags.values()), flags


def test_swarm_help_describes_every_flag_with_its_default():
    flags = options(peerd_help("swarm"))
    assert {"--peers", "--task", "--mode", "--target-accuracy", "--max-epochs", "--timeout", "--keep-files"} <= set(
        flags
    )
    assert all(description.strip() for description in flags.values()), flags
    assert "[default: 3]" in flags["--peers"] and "[default: 0.9]" in flags["--target-accuracy"]
    assert "[default: 300.0]" in flags["--timeout"]


def test_help_lists_the_exit_codes():
    text = peerd_help()
    for code in EXIT_CODES:
        assert re.search(rf"^\s+{code}\s+\S", text, re.M), code


@pytest.mark.parametrize(
    "argv",
    [["--log-level", "debug", "join"], ["join", "--log-level", "debug"], ["dht", "get", "k", "--initial-peer",
     "127.0.0.1:1", "--log-level", "DEBUG"]],
)  # fmt: skip
def test_log_level_is_accepted_before_or_after_the_subcommand(argv, monkeypatch):
    monkeypatch.delenv("PEERD_LOG_LEVEL", raising=False)
    assert parse_command_line(argv).log_level == "DEBUG"


def test_a_subcommand_without_the_flag_keeps_the_top_level_value(monkeypatch):
    monkeypatch.setenv("PEERD_LOG_LEVEL", "warning")
    assert parse_command_line(["join"]).log_level == "WARNING"
    assert parse_command_line(["--log-level", "error", "join"]).log_level == "ERROR"


@pytest.mark.parametrize("argv", [["join", "--no-such-flag"], ["dht", "get"], ["swarm", "--peers", "many"], []])
def test_usage_errors_have_their_own_exit_code(argv):
    result = subprocess.run(PEERD + argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_USAGE != EXIT_UNREACHABLE, result.stderr
    assert "usage: peerd" in result.stderr and "Traceback" not in result.stderr
