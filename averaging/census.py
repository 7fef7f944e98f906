"""How many cells a swarm matchmakes in (``cells.py``), counted once per census period beside a
round's matchmaking: the k node IDs nearest the period's target give Kademlia's size estimate, and
every peer that looks up one target finds the same k nodes, so the same count."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .cells import MAX_CELLS, Cells, census_band, census_target, next_cell_count, swarm_estimate

__all__ = ["Census", "CENSUS_SHARE", "CENSUS_TIMEOUT"]

log = logging.getLogger("peerd.averaging")

# The census (one lookup per CENSUS_PERIOD_S) may take this share of a round's matchmaking time, at
# most CENSUS_TIMEOUT; one that does not finish keeps the cells as they were.
CENSUS_SHARE = 0.25
CENSUS_TIMEOUT = 5.0


class Census:
    """The last census of one prefix: its target, its estimate and, until the next round takes
    them, the cells it counted."""

    def __init__(self, prefix: str, counts: str = "matchmaking"):
        """``counts``: what the cells are for, as the log says it."""
        self.prefix, self.counts = prefix, counts
        self.target: int | None = None  # the target of the census that set the cells
        self.estimate = 0.0
        self.counted: Cells | None = None  # the last census's cells, from the next round on
        self.band: set[int] = {1}  # the counts the last census allows (``cells.census_band``)

    def could_hold(self, peers: int) -> bool:
        """Whether the swarm may hold ``peers`` peers: the last census counted as many, or none has
        come in yet (a newcomer's, or ours while lookups time out under churn). A peer that has not
        counted the swarm cannot tell a small swarm from a cell the swarm is not in."""
        return self.target is None or self.estimate >= peers

    def take_donors(self, count: object) -> None:
        """A newcomer's cells until its own census comes in: those of the peer it loaded its state
        from (``count``, from the state's metadata). Its first census takes a round's lookup, under
        churn often more, and newcomers that matchmake in the single key meanwhile gather there and
        average apart from the swarm. The count is the donor's claim: only a count the cells can
        have is taken, from the next round on, and the newcomer's own census replaces it."""
        valid = type(count) is int and 1 <= count <= MAX_CELLS and count & (count - 1) == 0
        if self.target is None and valid:
            self.counted = Cells(self.prefix, count)

    def next_round(self, cells: Cells) -> Cells:
        """The cells a round that starts now matchmakes in: the last census's, once it came in."""
        counted, self.counted = self.counted, None
        return counted or cells

    async def take(self, dht, current: Callable[[], Cells], group_size: int, timeout: float) -> None:
        """Once per census period: count the cells for the rounds after this one (this one's reads
        and declarations keep the cells they started with). A census that fails or runs out of
        time is taken again in the next round. ``current``: the cells this peer matchmakes in when
        the count comes in (a sparse cell may have moved it meanwhile), which the margin is kept from."""
        target = census_target(self.prefix, dht.clock.time())
        if target == self.target:
            return
        with trio.move_on_after(min(CENSUS_TIMEOUT, timeout * CENSUS_SHARE)):
            try:
                nearest = await dht.nearest_node_ids(target)
            except Exception as error:  # (a DHT that cannot look up now: the cells stay as they are)
                log.debug("census failed: %s", error)
                return
            estimate, cells = swarm_estimate(target, nearest, dht.config.k), current()
            count = next_cell_count(cells.count, estimate, group_size)
            if count != cells.count:
                log.info("%s in %d cell(s): the census counts ~%.0f peers", self.counts, count, estimate)
            self.estimate, self.target = estimate, target
            self.band = census_band(estimate, group_size)
            self.counted = Cells(self.prefix, count)
