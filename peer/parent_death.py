"""Dying with one's parent: a child process asks the Linux kernel to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), however the parent dies (SIGKILL, the OOM killer, a crash) and
whatever the child is doing then, without a watcher thread. The one race, the parent dying before
the call took effect, is closed by checking the parent's PID right after. Elsewhere than Linux
there is no such call (``available()`` is false) and such a child outlives its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["available", "die_with_parent"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # a Linux without a loadable libc
    _libc = None


def available() -> bool:
    return _libc is not None


def die_with_parent(parent_pid: int) -> None:
    """In the child (between fork and exec, or first thing in a worker): be SIGKILLed when
    ``parent_pid`` dies; exits at once if it already has. Does nothing where unavailable."""
    if _libc is None:
        return
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
