"""Ctrl-C and SIGTERM as an exception raised wherever the main thread happens to be.

The launcher and a torchrun follower rank both turn a stop signal into ``Stopped`` so that their
clean-up runs whatever they were doing. ``Stopped`` is a BaseException, as KeyboardInterrupt is:
the signal can land inside library code that wraps ``except Exception`` around a call (logging
while it writes a line; typing_extensions while torch is being imported, which re-raises anything
as a TypeError), and an Exception would be swallowed or turned into a traceback there.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Stopped", "STOP_SIGNALS", "stop_signals_raise"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    # A second signal while the first unwinds (in an ``except`` or ``finally`` on its way to the
    # clean-up) would cut that clean-up short: the stop signals are ignored from the first on,
    # until the block is left.
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise ``Stopped``; on leaving it the handlers from
    before come back, whatever the block set meanwhile (a clean-up may ignore the signals)."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, _raise_stopped)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
