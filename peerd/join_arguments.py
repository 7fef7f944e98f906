"""The ``peerd join`` settings, declared once: each one's flag, ``PEERD_*`` variable, config-file
key, type, default and help (``setting_kinds.py`` says what each field means). From this table
come the ``join`` parser (``add_join_arguments``), the config file's list of known keys
(``KNOWN_FILE_KEYS``), the daemon's config (its fields carry the settings' names and defaults:
``daemon_config.py``) and the README's flag table (``readme_table``; ``python -m
peerd.join_arguments`` prints it, and ``tests/test_readme.py`` fails when the README's differs).

A setting that only ``join`` uses (``PEERD_INITIAL_PEERS``, ``PEERD_DATA_SHARD``) is parsed when
``join`` runs, not when the parser is built, so that a bad value breaks ``join`` with a message
naming the variable and never ``peerd status`` or another command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dht import DHTConfig
from peer import PeerAddress
from peer.identity import default_identity_path
from peer.nat_state import RelayLimits

from .arguments import listen_address, peer_list, positive_float, positive_int
from .expert_commands import add_expert_arguments
from .node_ids import NODE_ID_DIFFICULTY
from .private_swarm import ALLOW_PEERS, SWARM_KEY
from .setting_kinds import JoinOnlySetting, Setting, SwitchSetting
from .settings import Settings

__all__ = [
    "AUTO",
    "CONFIG",
    "JOIN_SETTINGS",
    "KNOWN_FILE_KEYS",
    "LOG_LEVEL",
    "NPROC_PER_NODE",
    "add_join_arguments",
    "data_shard",
    "data_shard_from_args",
    "delay_updates_from_args",
    "initial_peers_from_args",
    "readme_table",
]

AUTO = "auto"
MIB = 2**20


def data_shard(text: str) -> tuple[int, int] | str:
    """``I/N`` (0 <= I < N) or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    index, _, count = text.partition("/")
    # ASCII digits only: str.isdigit also accepts superscripts, which int() refuses
    if not (_number(index) and _number(count) and 0 <= int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--data-shard wants I/N with 0 <= I < N, or auto, got {text!r}")
    return int(index), int(count)


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _host_port(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


LISTEN = Setting(
    name="listen", flag="--listen", variable="LISTEN", parse=listen_address, default=("0.0.0.0", 31337),
    show=_host_port, default_text="0.0.0.0:31337", metavar="HOST:PORT", help="where to accept peers (port 0: any)",
)  # fmt: skip
IDENTITY = Setting(
    name="identity", flag="--identity", variable="IDENTITY", parse=Path, metavar="PATH",
    default_text="$XDG_DATA_HOME/peerd/identity.key", local_default=default_identity_path,
    help="Ed25519 key file, created on first use; one process per key",
    doc="Ed25519 key, created on first use with mode 0600 (`$XDG_DATA_HOME` unset: `~/.local/share`); one process "
    "per key, held by a lock on `PATH.lock`",
)  # fmt: skip
INITIAL_PEERS = JoinOnlySetting(
    name="initial_peers", flag="--initial-peer", variable="INITIAL_PEERS", parse=peer_list, action="extend",
    default=(), default_text="none", metavar="ADDR",
    help="a peer to join through, HOST:PORT or HOST:PORT/PEERID (pinned identity); repeatable, or several "
    "separated by commas (the variable: commas or spaces)",
    doc="`HOST:PORT` or `HOST:PORT/PEERID` (pinned identity); repeatable, or several separated by commas (the "
    "variable: commas or spaces)",
)  # fmt: skip
RUN_ID = Setting(
    name="run_id", flag="--run-id", variable="RUN_ID", default="default", metavar="ID",
    help="peers only talk within one run", doc="peers only talk to peers of the same run (and protocol version)",
)  # fmt: skip
BOOTSTRAP_TIMEOUT = Setting(
    name="bootstrap_timeout", flag="--bootstrap-timeout", variable="BOOTSTRAP_TIMEOUT", parse=float,
    default=DHTConfig.bootstrap_timeout, metavar="SECONDS", help="exit 2 if no initial peer answers within this",
    doc="exit 2, naming each address and why, if no initial peer answers within this; initial peers that only refuse "
    f"connections (nothing listens there) are given up after {DHTConfig.refused_grace:g} s",
)  # fmt: skip
TASK = Setting(
    name="task", flag="--task", variable="TASK", metavar="NAME",
    help="train this task: a built-in name (digits, textlm, hf-lm, hf-lm/MODEL_TYPE) or package.module:factory",
    doc="train: `digits` (a small MLP on scikit-learn's digits), `textlm` (a byte-level transformer on Python's "
    "standard library, below), `hf-lm` or `hf-lm/MODEL_TYPE` (a `transformers` causal LM from its config on the "
    "same text, with the `hf` extra: see Hugging Face transformers), or your own `package.module:factory`",
)  # fmt: skip
MODEL_SIZE = Setting(
    name="model_size", flag="--model-size", variable="MODEL_SIZE", metavar="SIZE", default_text="the task's",
    help="model shape for sized tasks (textlm: tiny, small, base, medium, large, xl; hf-lm: tiny, small, "
    "gpt2-small; their default: small)",
    doc="`textlm`'s shape: `tiny` (0.1 M parameters), `small` (its default, 1.9 M, for CPUs), `base` (4.8 M), "
    "`medium` (25 M), `large` (200 M), `xl` (680 M, GPUs); `hf-lm`'s: `tiny`, `small` (its default), `gpt2-small`",
)  # fmt: skip
MODE = Setting(
    name="mode", flag="--mode", variable="MODE", choices=("collaborative", "local-updates"), default="collaborative",
    help="gradient averaging, or DiLoCo-style local steps and outer rounds",
    doc="`collaborative` (gradient averaging) or `local-updates` (DiLoCo)",
)  # fmt: skip
DELAY_UPDATES = SwitchSetting(
    name="delay_updates", flag="--delay-updates", variable="DELAY_UPDATES",
    help="collaborative mode: average an epoch's gradients while the next one accumulates, its step landing one "
    "epoch late (off: averaging and stepping in turn)",
    doc="collaborative mode: an epoch's gradients average in the background while the next epoch accumulates (the "
    "step lands one epoch late, and an epoch that is ready while the last round still averages takes more samples "
    "instead of waiting); off by default: a peer with a round in flight starts its next round after its group "
    "formed ahead has begun, and in the lab's 5-peer swarms peers fell out of step that way",
)  # fmt: skip
COMPRESSION = Setting(
    name="compression", flag="--compression", variable="COMPRESSION", metavar="CODEC",
    default_text="none in collaborative mode, blockwise_8bit in local-updates",
    help="codec for averaged gradients or pseudo-gradients: none, float16, scaled_float16, uint8, blockwise_8bit, "
    "adaptive, topk_2bit, topk_4bit (sparse: local-updates mode)",
    doc="codec of averaged gradients / pseudo-gradients: `none`, `float16`, `scaled_float16`, `uint8`, "
    "`blockwise_8bit` (with error feedback), `adaptive`; in local-updates mode also the sparse `topk_2bit` and "
    "`topk_4bit` (64 of every 4,096 values, ~136x / 120x less than float32, with error feedback; outer lr 1 "
    "without momentum; in robust rounds the reducers reply in 8 bits, which their checks can bound). The codec is "
    "part of what matchmaking matches: peers of other codecs never group",
)  # fmt: skip
AGGREGATION = Setting(
    name="aggregation", flag="--aggregation", variable="AGGREGATION",
    choices=("auto", "mean", "centered-clip", "centered-clip-mixed"),
    default="auto",
    help="how a reducer aggregates its shard: the weighted mean, centered-clip (robust to a hostile minority), or "
    "centered-clip-mixed (the same over nearest-neighbour mixes); auto: centered-clip in a public swarm, mean in "
    "a private one",
    doc="how a reducer aggregates its shard: `mean`, `centered-clip` (CenteredClip, claimed weights capped at 2x the "
    "group's median: a hostile minority moves the result by a bounded amount, `averaging/robust.py`), "
    "`centered-clip-mixed` (each contribution first replaced by the mean of its nearest ones, `averaging/mixing.py`; "
    "every peer of the swarm must choose it), or `auto` (`centered-clip` in a public swarm, `mean` in a private one)",
)  # fmt: skip
SCORE_CONTRIBUTIONS = SwitchSetting(
    name="score_contributions", flag="--score-contributions", variable="SCORE_CONTRIBUTIONS",
    help="score the contributions this peer reduces against the task's loss on data every peer holds, and ban "
    "senders whose contributions keep raising it",
    doc="each round, score every contribution to the shard this peer reduces by its cosine with the gradient of "
    "the task's loss on data every peer holds (where the round's updates start from), and ban a sender whose mean "
    "is below -0.4 after 10 rounds, or from round 5 if it is a standard error below that "
    "(`averaging/contribution_scores.py`): quiet attackers that pull "
    "against the loss (inner-product manipulation, sign flipping) are caught within 5-30 rounds; costs one "
    "forward and backward pass per round and a copy of the model",
)  # fmt: skip
DATA_SHARD = JoinOnlySetting(
    name="data_shard", flag="--data-shard", variable="DATA_SHARD", parse=data_shard, default=AUTO,
    metavar="I/N|auto",
    help="train on shard I of N of the task's data, or auto: the shard that the fewest live peers train (chosen at "
    "start from their progress records)",
    doc="train on shard I of N of the task's data, or `auto`: the shard that the fewest live peers train (chosen at "
    "start from their progress records)",
)  # fmt: skip
NPROC_PER_NODE = Setting(
    name="nproc_per_node", flag="--nproc-per-node", variable="NPROC_PER_NODE", parse=positive_int, default=1,
    metavar="N",
    help="train as N ranks of one torch.distributed job (DDP; gloo on CPU, NCCL on GPUs), rank 0 the one swarm peer",
    doc="train as N ranks of one `torch.distributed` job (DDP: gloo on CPUs, NCCL on GPUs, rank r on `cuda:r`) "
    "that is one swarm peer: gradients or pseudo-gradients are reduced inside the machine, then averaged once with "
    "the swarm by rank 0, and the swarm counts the samples of every rank (launched as torchrun would; under "
    "`torchrun` itself, leave it out)",
)  # fmt: skip
SHARD_MODEL = SwitchSetting(
    name="shard_model", flag="--shard-model", variable="SHARD_MODEL",
    help="with several ranks: FSDP, each rank's device holding 1/N of the model; rank 0's whole model and its "
    "optimizer on the host",
    doc="with several ranks: shard the model over them (FSDP: each device holds 1/N of the parameters and "
    "gradients, and one block gathered at a time) for a model that does not fit one device; rank 0 keeps the "
    "whole model and its optimizer in host memory and steps there (the ZeRO-Offload trade)",
)  # fmt: skip
DEVICE = Setting(
    name="device", flag="--device", variable="DEVICE", metavar="DEVICE", default_text="CUDA if available",
    help="cpu, cuda, cuda:1 ...", doc="`cpu`, `cuda`, `cuda:1` ...: where training (and experts) run",
)  # fmt: skip
STATUS_PORT = Setting(
    name="status_port", flag="--status-port", variable="STATUS_PORT", parse=int, metavar="PORT",
    default_text="none", help="serve /status and /metrics on this port (0: any)",
    doc="serve the dashboard (`/`), `/status` (JSON) and `/metrics` (Prometheus) on this port (0: any)",
)  # fmt: skip
STATUS_HOST = Setting(
    name="status_host", flag="--status-host", variable="STATUS_HOST", default="127.0.0.1", metavar="HOST",
    help="address the status port binds",
    doc="the address the status port binds (`0.0.0.0` exposes it to the network)",
)  # fmt: skip
SERVE_EXPERTS = Setting(
    name="experts", flag="--serve-experts", variable="SERVE_EXPERTS", metavar="PATTERN",
    help="expert IDs to host, e.g. 'ffn.[0:4].[0:4]'",
    doc="also host mixture-of-experts experts, e.g. `'ffn.[0:4].[0:4]'` (the expert flags of `peerd serve-experts`"
    " apply)",
)  # fmt: skip
CLIENT_MODE = SwitchSetting(
    name="client_mode", flag="--client-mode", variable="CLIENT_MODE",
    help="make requests, accept none (not needed behind NAT: relays and hole punching reach such a peer)",
    doc="make requests, accept none (`--no-client-mode` overrides a variable or file); not needed behind NAT, see "
    "below",
)  # fmt: skip
RELAY = SwitchSetting(
    name="relay", flag="--relay", variable="RELAY", default=True,
    help="relay connections for peers behind NAT while this peer is reachable (limited per circuit)",
    doc="do not relay connections for peers behind NAT (a reachable peer relays by default, within per-circuit "
    "limits)",
)  # fmt: skip
RELAY_RATE = Setting(
    name="relay_mib_per_s", flag="--relay-rate", variable="RELAY_RATE", parse=positive_float,
    default=RelayLimits.total_bytes_per_s / MIB, metavar="MIB_PER_S",
    help="the most this peer relays per second, all circuits together (each circuit: at most "
    f"{RelayLimits.circuit_bytes_per_s / MIB:g})",
)  # fmt: skip
UPLINK_MBIT = Setting(
    name="uplink_mbit", flag="--uplink-mbit", variable="UPLINK_MBIT", parse=positive_float, metavar="MBIT_PER_S",
    default_text="not set: measured",
    help="this machine's upload speed: averaging rounds pace their connections to share it, which moves the same "
    "bytes sooner than letting TCP share it (not set: the rounds measure it)",
    doc="this machine's upload speed (a speed test's figure): while an averaging round runs, each of its connections "
    "is capped at its share of it, so the flows end together instead of drifting apart in the router's queue (4 peers"
    " on 100 Mbit/s links: the all-reduce at 0.95 of the line-rate bound, against 0.82 with TCP sharing the link on "
    "its own). The caps add up to 97% of it: too low a figure wastes the difference, one more than ~3% too high "
    "leaves the sharing to TCP. Not set, the rounds measure it: the best sustained upload of a round TCP paced "
    "alone, measured again every 8th round (0.93 of the bound in the same lab, against 0.95 declared)",
)  # fmt: skip
LOCAL_STEPS = Setting(
    # LocalUpdatesOptimizer's default (tests/daemon/test_settings.py holds them equal): the number cannot be
    # imported from averaging/ here, which would load torch into every peerd command.
    name="local_steps", flag="--local-steps", variable="LOCAL_STEPS", parse=int, default=20, metavar="STEPS",
    help="inner steps per round in local-updates mode, per peer on average (faster peers take more)",
    doc="inner steps per round in `local-updates` mode, per peer on average: a round ends when the swarm has taken "
    "that many batches per peer taking part, so faster peers take more",
)  # fmt: skip
FRAGMENTS = Setting(
    name="fragments", flag="--fragments", variable="FRAGMENTS", parse=positive_int, default=1, metavar="N",
    help="local-updates mode: average the model in N fragments taking turns, one every STEPS/N inner steps",
    doc="`local-updates` mode: the model is averaged in N fragments that take turns (streaming DiLoCo), one round of "
    "`--local-steps`/N inner steps each, so every fragment is still averaged once per `--local-steps` and no more "
    "than 1/N of the model is ever in flight; every peer of a run gives the same N",
)  # fmt: skip
OUTER_LR = Setting(
    name="outer_lr", flag="--outer-lr", variable="OUTER_LR", parse=positive_float, metavar="LR",
    default_text="0.7 (1 with a sparse codec)",
    help="local-updates mode: the outer step's learning rate (lower it where the peers' data differ)",
    doc="`local-updates` mode: the learning rate of the outer Nesterov step that every peer takes from the round's "
    "shared start along the averaged direction: DiLoCo's 0.7 (1 without momentum under a sparse codec, which takes "
    "no other). Lower it where rounds are short and the peers' data differ: on digits with label-skewed shards and 5 "
    "inner steps, 0.7 swings (clean runs of 100 rounds end anywhere in 0.92-0.97) and 2 quiet attackers of 8 drive "
    "it down to 0.80, where 0.35 trains to 0.970 and the same attackers cost 0.008 (`benchmarks/byzantine.py`). "
    "Every peer of a run gives the same LR",
)  # fmt: skip
TARGET_BATCH_SIZE = Setting(
    name="target_batch_size", flag="--target-batch-size", variable="TARGET_BATCH_SIZE", parse=int,
    metavar="SAMPLES", default_text="the task's", help="swarm-wide samples per epoch in collaborative mode",
    doc="swarm-wide samples per epoch in `collaborative` mode",
)  # fmt: skip

# Read by cli.py on the top-level parser (and accepted after every subcommand, help.add_everywhere).
# The file named by --config is not itself a key of a file.
CONFIG = Setting(
    name="config", flag="--config", variable="CONFIG", metavar="FILE", help="TOML file of settings",
    doc="a TOML file of settings (below); before or after the command",
)  # fmt: skip
LOG_LEVEL = Setting(
    name="log_level", flag="--log-level", variable="LOG_LEVEL", parse=str.upper,
    choices=("DEBUG", "INFO", "WARNING", "ERROR"), default="INFO", help="log detail",
    doc="log detail on stderr; before or after the command",
)  # fmt: skip

# In the order of ``peerd join --help`` and of the README's table.
JOIN_SETTINGS: tuple[Setting, ...] = (
    LISTEN, IDENTITY, INITIAL_PEERS, RUN_ID, BOOTSTRAP_TIMEOUT, TASK, MODEL_SIZE, MODE, DELAY_UPDATES, COMPRESSION,
    AGGREGATION, SCORE_CONTRIBUTIONS, DATA_SHARD, NPROC_PER_NODE, SHARD_MODEL, DEVICE, STATUS_PORT, STATUS_HOST,
    SERVE_EXPERTS, CLIENT_MODE, RELAY, RELAY_RATE, UPLINK_MBIT, LOCAL_STEPS, FRAGMENTS, OUTER_LR,
    TARGET_BATCH_SIZE,
    NODE_ID_DIFFICULTY, ALLOW_PEERS, SWARM_KEY,
)  # fmt: skip

# What a config file may hold: every other command's settings are among these.
KNOWN_FILE_KEYS = frozenset(setting.file_key for setting in (*JOIN_SETTINGS, LOG_LEVEL))


def add_join_arguments(join: argparse.ArgumentParser, settings: Settings) -> None:
    """Every ``peerd join`` flag, its default from ``settings`` where the variable or the file
    sets it; SettingsError for a value there that does not parse."""
    for setting in JOIN_SETTINGS:
        setting.add_to(join, settings)
    add_expert_arguments(join, flag=None, device=False)  # --serve-experts and --device are above


def readme_table() -> str:
    """The README's table of ``peerd join`` settings (``--config`` and ``--log-level`` with them)."""
    rows = [setting.readme_row() for setting in (*JOIN_SETTINGS, CONFIG, LOG_LEVEL)]
    return "\n".join(["| flag | env | default | meaning |", "|---|---|---|---|", *rows])


def data_shard_from_args(args: argparse.Namespace) -> tuple[int, int] | str:
    """The flag's value, else the setting's (``auto`` by default); SettingsError names the
    variable or file key of a bad setting."""
    return DATA_SHARD.value(args)


def initial_peers_from_args(args: argparse.Namespace) -> list[PeerAddress]:
    """The flags' peers, else the setting's (none by default); SettingsError as above."""
    return list(INITIAL_PEERS.value(args))


def delay_updates_from_args(args: argparse.Namespace) -> bool:
    """Delayed parameter updates: off unless asked for (``--delay-updates``), and only for
    collaborative training; asking for them anywhere else is a ValueError (one line). Off by
    default because a peer with a round in flight starts its next round late, after the group
    formed ahead for it has begun: the lab's swarms fell out of step that way."""
    collaborative = args.task is not None and args.mode == "collaborative"
    if args.delay_updates and not collaborative:
        raise ValueError("--delay-updates applies to training (--task) in collaborative mode only")
    return collaborative and bool(args.delay_updates)


if __name__ == "__main__":
    print(readme_table())
