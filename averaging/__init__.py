"""Group averaging: DHT matchmaking, fault-tolerant butterfly all-reduce, compression, state sharing,
and the optimizers built on them (collaborative, local-updates) with the schedules they take."""

from .allreduce import AllReduceError, AllReduceResult
from .averager import AveragingRound, GroupAverager
from .facade import Averager
from .group import AveragingMode
from .local_rounds import OverlappedRounds, SequentialRounds
from .local_updates import LocalUpdatesOptimizer
from .match_ahead import MatchAhead, MatchAtStep
from .matchmaking import MatchmakingError
from .optimizer import CollaborativeOptimizer
from .settings import AveragingSettings
from .update_schedules import DelayedUpdates, ImmediateUpdates

__all__ = [
    "AllReduceError",
    "AllReduceResult",
    "Averager",
    "AveragingMode",
    "AveragingRound",
    "AveragingSettings",
    "CollaborativeOptimizer",
    "DelayedUpdates",
    "GroupAverager",
    "ImmediateUpdates",
    "LocalUpdatesOptimizer",
    "MatchAhead",
    "MatchAtStep",
    "MatchmakingError",
    "OverlappedRounds",
    "SequentialRounds",
]
