"""``peerd swarm``'s table: aligned cells, redrawn in place on a terminal, sparing in a log."""

from __future__ import annotations

import io
import re

from peerd.swarm_table import PLAIN_PERIOD, PROGRESS_PERIOD, TableDisplay, render_table

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


def visible(text: str) -> str:
    """What stays on a terminal's screen after ``text``: control sequences applied (cursor up and
    erase line, as rich's live display moves), styles dropped."""
    screen: list[str] = [""]
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", text):
        if token == "\n":
            screen.append("")
        elif token == "\r":
            continue  # (rich always erases the line it returns to)
        elif token == "\x1b[2K":
            screen[-1] = ""
        elif token == "\x1b[1A":
            screen.pop()
        elif not token.startswith("\x1b"):
            screen[-1] += token
    return "\n".join(line.rstrip() for line in screen)


def test_on_a_terminal_the_table_is_redrawn_in_place():
    stream = io.StringIO()
    display = TableDisplay(stream, interactive=True)
    display.progress("starting peer 0 (1 s)")  # a live line that the table replaces
    display.message("peer 0 up at 127.0.0.1:1")
    display.show([TRAINING, STARTING], elapsed=1)
    display.show([TRAINING, TRAINING], elapsed=2)
    display.message("peer 2 up")  # a message goes above the table, which is drawn again below it
    display.show([TRAINING, TRAINING, None], elapsed=3)
    display.close()
    screen = visible(stream.getvalue())
    assert screen.count("samples/s") == 1 and "starting peer 0" not in screen  # one table on screen
    lines = screen.splitlines()
    assert lines[:2] == ["peer 0 up at 127.0.0.1:1", "peer 2 up"]
    assert lines[2] == "t=3s" and lines[3].split() == [
        "peer",
        "epoch",
        "samples/s",
        "loss",
        "accuracy",
        "bits/byte",
        "peers",
    ]
    assert [line.split()[0] for line in lines[4:7]] == ["0", "1", "2"] and lines[6].split()[-1] == "down"
    assert lines[4].split()[1:4] == ["12", "812.2", "0.432"]


def test_start_up_progress_is_live_on_a_terminal_and_periodic_in_a_log():
    stream = io.StringIO()
    display = TableDisplay(stream, interactive=True)
    for second in range(3):
        display.progress(f"starting peers 1-2 ({second} s)")
    display.close()
    assert visible(stream.getvalue()).strip() == "starting peers 1-2 (2 s)"
    now = [0.0]
    log = io.StringIO()
    display = TableDisplay(log, interactive=False, clock=lambda: now[0])
    for second in range(12):
        now[0] = second
        display.progress(f"starting peers 1-2 ({second} s)")
    assert log.getvalue().splitlines() == [f"starting peers 1-2 ({PROGRESS_PERIOD:.0f} s)", "starting peers 1-2 (10 s)"]


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
