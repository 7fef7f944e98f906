"""The table ``peerd swarm`` shows while its peers train.

On a terminal the table is redrawn in place by ``rich`` (a live display: start-up progress, then the
table, with messages printed above it), so a run leaves one table on screen, not one per second.
Into a file or pipe it goes as plain lines, only when a peer came up or went down or every
``PLAIN_PERIOD`` seconds, and start-up progress every ``PROGRESS_PERIOD``, so a log stays readable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["render_table", "rich_table", "TableDisplay", "PLAIN_PERIOD", "PROGRESS_PERIOD"]

PLAIN_PERIOD = 10.0  # seconds between tables in a log: a 5-minute run stays ~30 tables long
PROGRESS_PERIOD = 5.0  # seconds between start-up notes in a log (a terminal's line is live)

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


def rich_table(statuses: Sequence[dict[str, Any] | None], elapsed: float) -> Table:
    """The same table for a terminal: a peer that is down in red, the time in the title."""
    table = Table(title=f"t={elapsed:.0f}s", title_justify="left", box=None, header_style="bold")
    table.add_column("peer", justify="right")
    for title, _, _, _ in COLUMNS:
        table.add_column(title, justify="right")
    table.add_column("", justify="left")
    for index, status in enumerate(statuses):
        if status is None:
            table.add_row(str(index), *("-" for _ in COLUMNS), "down", style="red")
        else:
            table.add_row(str(index), *(_cell(status.get(key), 0, spec) for _, key, _, spec in COLUMNS), "")
    return table


class TableDisplay:
    """Shows successive tables on ``stream``: redrawn in place on a terminal, else appended as
    plain lines when the set of live peers changed or ``PLAIN_PERIOD`` passed."""

    def __init__(self, stream: TextIO, *, interactive: bool | None = None, clock=time.monotonic):
        self.stream = stream
        self.interactive = stream.isatty() if interactive is None else interactive
        self._clock = clock
        self._live: Live | None = None
        if self.interactive:
            console = Console(file=stream, force_terminal=True, highlight=False)
            self._live = Live(console=console, auto_refresh=False, transient=False, redirect_stdout=False,
                              redirect_stderr=False)  # fmt: skip
        self._last_plain: float | None = None
        self._last_progress: float | None = None
        self._last_alive: tuple[bool, ...] | None = None

    def _draw(self, renderable: Any) -> None:
        assert self._live is not None
        if not self._live.is_started:
            self._live.start()
        self._live.update(renderable, refresh=True)

    def show(self, statuses: Sequence[dict[str, Any] | None], elapsed: float, *, force: bool = False) -> None:
        """Draw this table (plain output: only if due, or ``force``, e.g. the last one)."""
        alive = tuple(status is not None for status in statuses)
        if self._live is not None:
            self._draw(rich_table(statuses, elapsed))
        else:
            now = self._clock()
            due = self._last_plain is None or now - self._last_plain >= PLAIN_PERIOD
            if not (due or force) and alive == self._last_alive:
                return
            self.stream.write("\n".join(render_table(statuses, elapsed)) + "\n")
            self.stream.flush()
            self._last_plain = now
        self._last_alive = alive

    def progress(self, text: str) -> None:
        """How start-up goes (called about once a second): on a terminal one live line, in a log
        a line every ``PROGRESS_PERIOD``."""
        if self._live is not None:
            self._draw(Text(text))
            return
        now = self._clock()
        if self._last_progress is None:
            self._last_progress = now  # the first note comes a period in: "starting ..." was just said
        elif now - self._last_progress >= PROGRESS_PERIOD:
            self._last_progress = now
            self.message(text)

    def message(self, text: str) -> None:
        """A line above the table (start-up progress, notes)."""
        if self._live is not None and self._live.is_started:
            self._live.console.print(text, markup=False, highlight=False, soft_wrap=True)  # a command stays copyable
            return
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Stop redrawing; the last table stays on screen."""
        if self._live is not None and self._live.is_started:
            self._live.stop()
