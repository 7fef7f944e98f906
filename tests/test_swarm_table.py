"""``peerd swarm``'s table: aligned cells, redrawn in place on a terminal, sparing in a log."""

from __future__ import annotations

import io

from peer.daemon.swarm_table import PLAIN_PERIOD, TableDisplay, render_table

TRAINING = {"epoch": 12, "samples_per_s": 812.25, "loss": 0.4321, "accuracy": 0.87, "peers_known": 3}
STARTING = {"epoch": 0, "samples_per_s": None, "loss": None, "accuracy": None, "peers_known": 1}


def column_ends(line: str) -> list[int]:
    """Where each non-blank cell of a row ends."""
    return [i + 1 for i, char in enumerate(line) if char != " " and (i + 1 == len(line) or line[i + 1] == " ")]


def test_missing_values_are_aligned_under_their_headers():
    header, training, starting, down = render_table([TRAINING, STARTING, None], elapsed=12.3)
    ends = column_ends(header)[1:]  # (the first header cell is the time, above no column)
    assert column_ends(training) == column_ends(starting) == ends
    assert column_ends(down)[:-1] == ends and down.endswith("down")
    assert starting.split()[2:5] == ["-", "-", "-"]


def test_a_claim_of_the_wrong_type_is_shown_not_fatal():
    [_, row] = render_table([{**TRAINING, "loss": "lots", "epoch": [1]}], elapsed=1)
    assert "lots" in row


def test_on_a_terminal_the_table_is_redrawn_in_place():
    stream = io.StringIO()
    display = TableDisplay(stream, interactive=True)
    display.show([TRAINING, STARTING], elapsed=1)
    first = stream.getvalue()
    assert "\x1b[" not in first and first.count("\n") == 3
    display.show([TRAINING, TRAINING], elapsed=2)
    assert stream.getvalue()[len(first) :].startswith("\x1b[3F\x1b[J")  # up 3 lines, clear, redraw
    display.message("peer 2 up")  # a message replaces the table, which is drawn again below it
    display.show([TRAINING, TRAINING, STARTING], elapsed=3)
    tail = stream.getvalue().split("peer 2 up\n", 1)[1]
    assert "\x1b[" not in tail and tail.count("\n") == 4


def test_in_a_log_tables_come_only_on_change_or_every_period():
    now = [0.0]
    stream = io.StringIO()
    display = TableDisplay(stream, interactive=False, clock=lambda: now[0])
    for second in range(1, 6):  # five polls, nothing but numbers changed: one table
        now[0] = second
        display.show([TRAINING, TRAINING], elapsed=second)
    assert stream.getvalue().count("samples/s") == 1 and "\x1b[" not in stream.getvalue()
    now[0] = 6
    display.show([TRAINING, None], elapsed=6)  # a peer went down: shown at once
    assert stream.getvalue().count("samples/s") == 2
    now[0] = 6 + PLAIN_PERIOD
    display.show([TRAINING, None], elapsed=now[0])  # the period passed
    assert stream.getvalue().count("samples/s") == 3
    display.show([TRAINING, None], elapsed=now[0], force=True)  # the last table of a run
    assert stream.getvalue().count("samples/s") == 4
