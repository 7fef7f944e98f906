"""``AveragingSettings`` (``averaging/settings.py``): the two optimizers' own defaults, single
fields replaced by keyword, and the options their averagers get."""

from __future__ import annotations

import pytest

from averaging.settings import COLLABORATIVE, LOCAL_UPDATES, AveragingSettings


def test_each_optimizer_has_its_own_defaults():
    # gradient rounds: a short round deadline, lossless; local-updates rounds: longer, 8-bit
    assert (COLLABORATIVE.matchmaking_timeout, COLLABORATIVE.averaging_timeout, COLLABORATIVE.codec) == (
        10.0,
        15.0,
        "none",
    )
    assert (LOCAL_UPDATES.matchmaking_timeout, LOCAL_UPDATES.averaging_timeout, LOCAL_UPDATES.codec) == (
        5.0,
        30.0,
        "blockwise_8bit",
    )
    assert (COLLABORATIVE.progress_interval, LOCAL_UPDATES.progress_interval) == (0.25, 0.5)
    for settings in (COLLABORATIVE, LOCAL_UPDATES):
        assert settings.target_group_size == 4 and settings.min_group_size == 2
        assert settings.aggregation == "auto" and settings.uplink is None
        assert settings.load_state_timeout == 30.0 and settings.average_state_every == 5


def test_replace_changes_single_fields_and_refuses_unknown_names():
    changed = COLLABORATIVE.replace(target_group_size=8, uplink=1e6)
    assert (changed.target_group_size, changed.uplink) == (8, 1e6)
    assert changed.averaging_timeout == COLLABORATIVE.averaging_timeout
    assert COLLABORATIVE.target_group_size == 4  # frozen: the defaults never move
    assert COLLABORATIVE.replace() is COLLABORATIVE
    with pytest.raises(TypeError):
        COLLABORATIVE.replace(delay_updates=True)


def test_senders_get_half_the_round_deadline_reducers_all_of_it():
    options = AveragingSettings(averaging_timeout=20.0, aggregation="mean", uplink=5e6).averager_options()
    assert options["sender_timeout"] == 10.0 and options["reducer_timeout"] == 20.0
    assert options["aggregation"] == "mean" and options["uplink"] == 5e6
    assert "codec" not in options  # each averager of an optimizer has its own codec
