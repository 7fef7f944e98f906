"""One process per identity file: a peer's key is its name in the swarm, and two processes under
one name replace each other's connections and records until one of them gives up.

``lock_identity`` takes an exclusive ``flock`` on ``KEY.lock`` beside the key and holds it for the
life of the process. The kernel drops the lock when the process ends, however it ends (SIGKILL
included), so a crash never leaves a stale lock; the file itself stays, holding the last owner's
process ID for the message the next contender sees.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["IdentityInUseError", "lock_identity", "lock_path"]

_held: dict[Path, int] = {}  # lock file -> descriptor, open until the process exits


class IdentityInUseError(Exception):
    """Another process runs with this identity file."""

    def __init__(self, path: Path, owner: str):
        self.path = path
        super().__init__(
            f"identity file {path} is in use by another process ({owner}); two peers must not share an"
            " identity: give this one its own key with --identity OTHER_FILE (or PEERD_IDENTITY)"
        )


def lock_path(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name + ".lock")


def lock_identity(identity_path: Path) -> None:
    """Hold ``identity_path``'s lock until this process exits; raises IdentityInUseError at once
    (no waiting) if another process holds it. Locking the same file twice in one process is a
    no-op."""
    path = lock_path(Path(identity_path).expanduser().resolve())
    if path in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 64).decode(errors="replace").strip()
        os.close(fd)
        raise IdentityInUseError(Path(identity_path), f"pid {owner}" if owner.isdigit() else f"lock {path}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[path] = fd
