"""peerd.stop_signals: a stop signal that lands inside library code which wraps
``except Exception`` around what it calls still reaches the launcher's clean-up. The launcher's
Ctrl-C once arrived while torch was being imported; typing_extensions turned the stop into a
TypeError there, and the swarm died with a traceback instead of a summary."""

from __future__ import annotations

import os
import signal

import pytest

from peerd.stop_signals import Stopped, stop_signals_raise


def _library_call_that_wraps_every_exception(signum: int) -> None:
    try:
        os.kill(os.getpid(), signum)  # the handler runs here, inside the library's try
    except Exception as error:  # what typing_extensions and logging do around their calls
        raise TypeError("the library's own error") from error


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_passes_through_a_library_that_catches_every_exception(signum):
    with pytest.raises(Stopped) as stopped, stop_signals_raise():
        _library_call_that_wraps_every_exception(signum)
    assert stopped.value.signum == signum


def test_the_handlers_from_before_come_back_whatever_the_block_set():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with stop_signals_raise():
        assert signal.getsignal(signal.SIGINT) not in (before[signal.SIGINT], signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a clean-up that ignores a second Ctrl-C
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_a_second_signal_while_the_first_unwinds_does_not_cut_the_clean_up_short():
    cleaned = []
    with stop_signals_raise():
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except Stopped:
            os.kill(os.getpid(), signal.SIGTERM)  # (a second one, during the clean-up: ignored)
            cleaned.append(True)
    assert cleaned == [True]
