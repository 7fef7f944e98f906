"""``AveragingSettings``: what both optimizers (and the daemon that builds them) say about how a
replica averages with the swarm, in one place.

Each optimizer has its own defaults (``COLLABORATIVE``, ``LOCAL_UPDATES``): a gradient round is
exact and frequent, so its round deadline is short and its codec lossless; a local-updates round
moves a model-sized pseudo-gradient once per many batches, over the slow links it is meant for, so
its round deadline is longer and it is compressed to 8 bits by default (``local_updates.py``).
Keyword arguments given to an optimizer replace single fields of its defaults (or of ``settings=``).

Matchmaking's deadline is the time a group has to form, on the internet peers train over: a
declaration's store, a settle, a read and the joins take round trips of up to ~300 ms and DHT
operations that wait on peers that left. On the simulated internet (24 collaborative peers,
``tests/support/sim_training.py``, seeds 1-4) a 3-s deadline averaged 0.65-0.93 of the epochs,
5 s 0.90-0.96, 10 s 0.97-1.0. Where groups form (a LAN: well under a second) the deadline is
not reached; a round whose group does not form waits it out (a peer late for its group, a state
round), except a peer with no other in view, which matches briefly (``CollaborativeOptimizer``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["AveragingSettings", "COLLABORATIVE", "LOCAL_UPDATES"]


@dataclass(frozen=True)
class AveragingSettings:
    """How a replica averages: its groups, their deadlines and codec, and its progress records."""

    target_group_size: int = 4
    min_group_size: int = 2
    matchmaking_timeout: float = 10.0
    # a round's deadline: reducers get all of it, senders half (``averager_options``)
    averaging_timeout: float = 15.0
    settle_time: float | None = None  # None: matchmaking's own default (``Matchmaker.form_group``)
    codec: str = "none"  # what the optimizer's own round (gradients, deltas) is compressed with
    aggregation: str = "auto"  # ``GroupAverager``'s ``aggregation``
    uplink: float | None = None  # bytes/s, if known: rounds pace their connections to share it
    progress_interval: float = 0.25  # how often progress records are exchanged through the DHT
    load_state_timeout: float = 30.0  # how long a newcomer waits for a donor's state
    average_state_every: int = 5  # epochs (rounds) between averagings of the state (0: never)

    def replace(self, **changes: Any) -> AveragingSettings:
        """These settings with some fields changed (an unknown name raises TypeError)."""
        return dataclasses.replace(self, **changes) if changes else self

    def averager_options(self) -> dict[str, Any]:
        """``GroupAverager`` options for an optimizer's averagers (the codec is each one's own:
        only the optimizer's own round goes through ``codec``). Senders get half the round's
        deadline, so a dead sender is dropped while the reducers still have time to answer."""
        return {
            "target_group_size": self.target_group_size,
            "min_group_size": self.min_group_size,
            "matchmaking_timeout": self.matchmaking_timeout,
            "sender_timeout": self.averaging_timeout / 2,
            "reducer_timeout": self.averaging_timeout,
            "settle_time": self.settle_time,
            "aggregation": self.aggregation,
            "uplink": self.uplink,
        }


COLLABORATIVE = AveragingSettings()
LOCAL_UPDATES = AveragingSettings(
    matchmaking_timeout=5.0, averaging_timeout=30.0, codec="blockwise_8bit", progress_interval=0.5
)
