"""The table ``peerd swarm`` shows while its peers train.

On a terminal the table is redrawn in place (ANSI: cursor up, clear to the end of the screen), so
a run leaves one table on screen, not one per second. Into a file or pipe it goes as plain lines,
only when a peer came up or went down or every ``PLAIN_PERIOD`` seconds, so a log stays readable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["render_table", "TableDisplay", "PLAIN_PERIOD"]

PLAIN_PERIOD = 10.0  # seconds between tables in a log: a 5-minute run stays ~30 tables long

# (header, status key, width, format of a present value); a missing value is "-" at the same width
COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("epoch", "epoch", 6, "d"),
    ("samples/s", "samples_per_s", 10, ".1f"),
    ("loss", "loss", 8, ".3f"),
    ("accuracy", "accuracy", 9, ".3f"),
    ("bits/byte", "bits_per_byte", 9, ".3f"),
    ("peers", "peers_known", 6, "d"),
)


def _cell(value: Any, width: int, spec: str) -> str:
    if value is None:
        return f"{'-':>{width}}"
    try:
        return f"{value:>{width}{spec}}"
    except (TypeError, ValueError):  # a peer's status is its claim: show it, do not crash on it
        return f"{str(value)[:width]:>{width}}"


def render_table(statuses: Sequence[dict[str, Any] | None], elapsed: float) -> list[str]:
    """One header and one row per peer (``None``: the peer is down); every cell right-aligned
    under its header, '-' cells included."""
    header = f"{'t=' + format(elapsed, '.0f') + 's':>7} {'peer':>4}" + "".join(
        f" {title:>{width}}" for title, _, width, _ in COLUMNS
    )
    rows = [header]
    for index, status in enumerate(statuses):
        row = f"{'':>7} {index:>4}"
        if status is None:
            row += "".join(f" {'-':>{width}}" for _, _, width, _ in COLUMNS) + "  down"
        else:
            row += "".join(f" {_cell(status.get(key), width, spec)}" for _, key, width, spec in COLUMNS)
        rows.append(row)
    return rows


class TableDisplay:
    """Shows successive tables on ``stream``: redrawn in place on a terminal, else appended as
    plain lines when the set of live peers changed or ``PLAIN_PERIOD`` passed."""

    def __init__(self, stream: TextIO, *, interactive: bool | None = None, clock=time.monotonic):
        self.stream = stream
        self.interactive = stream.isatty() if interactive is None else interactive
        self._clock = clock
        self._drawn_lines = 0  # lines of the last table, still on screen below the cursor's row
        self._last_plain: float | None = None
        self._last_alive: tuple[bool, ...] | None = None

    def show(self, statuses: Sequence[dict[str, Any] | None], elapsed: float, *, force: bool = False) -> None:
        """Draw this table (plain output: only if due, or ``force``, e.g. the last one)."""
        lines = render_table(statuses, elapsed)
        alive = tuple(status is not None for status in statuses)
        if self.interactive:
            if self._drawn_lines:
                self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")  # up to the table's top, clear below
            self.stream.write("\n".join(lines) + "\n")
            self._drawn_lines = len(lines)
        else:
            now = self._clock()
            due = self._last_plain is None or now - self._last_plain >= PLAIN_PERIOD
            if not (due or force) and alive == self._last_alive:
                return
            self.stream.write("\n".join(lines) + "\n")
            self._last_plain = now
        self._last_alive = alive
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line above the table (start-up progress, notes): on a terminal the table is redrawn
        below it at the next ``show``."""
        if self.interactive and self._drawn_lines:
            self.stream.write(f"\x1b[{self._drawn_lines}F\x1b[J")
            self._drawn_lines = 0
        self.stream.write(text + "\n")
        self.stream.flush()
