"""The exit statuses every ``peerd`` command shares (the README's table lists the same).

Distinct codes for distinct remedies: a usage error wants the flags fixed, a bad setting the
config, "unreachable" the network or the initial peers, "in use" another port or key file.
"""

from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_BAD_INPUT",
    "EXIT_UNREACHABLE",
    "EXIT_IN_USE",
    "EXIT_TARGET_MISSED",
    "EXIT_RANK_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_CODES",
]

EXIT_OK = 0
EXIT_BAD_INPUT = 1  # a bad setting, config file, task or key file (and `dht get`: not found)
EXIT_UNREACHABLE = 2  # no initial peer answered within the bootstrap timeout
EXIT_IN_USE = 3  # a port to listen on, or the identity file, is held by another process
EXIT_TARGET_MISSED = 4  # `peerd swarm` stopped (timeout, --max-epochs) before the target accuracy
EXIT_RANK_FAILED = 5  # a rank of this machine's torch.distributed job died or the ranks' group broke
EXIT_USAGE = 64  # unknown flag, missing or malformed argument (EX_USAGE of sysexits.h)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)
EXIT_TERMINATED = 143  # `peerd swarm` stopped by SIGTERM (128 + SIGTERM); `join` exits 0 on it

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done (`swarm`: target reached; `join`: stopped by SIGTERM)",
    EXIT_BAD_INPUT: "bad setting, config file, task or key file; `dht get`: key not found",
    EXIT_UNREACHABLE: "swarm unreachable: no initial peer answered",
    EXIT_IN_USE: "a port or the identity file is in use by another process",
    EXIT_TARGET_MISSED: "`swarm`: stopped before the target accuracy",
    EXIT_RANK_FAILED: "`join` as a torch.distributed job: a rank of this machine ended or failed",
    EXIT_USAGE: "usage error: unknown flag, missing or malformed argument",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_TERMINATED: "`swarm`: stopped by SIGTERM",
}
