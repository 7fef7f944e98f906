"""Group averaging: DHT matchmaking, fault-tolerant butterfly all-reduce, compression, state sharing,
and the optimizers built on them (collaborative, local-updates)."""

from .allreduce import AllReduceError, AllReduceResult
from .averager import GroupAverager
from .facade import Averager
from .group import AveragingMode
from .local_updates import LocalUpdatesOptimizer
from .matchmaking import MatchmakingError
from .optimizer import CollaborativeOptimizer

__all__ = [
    "AllReduceError",
    "AllReduceResult",
    "Averager",
    "AveragingMode",
    "CollaborativeOptimizer",
    "GroupAverager",
    "LocalUpdatesOptimizer",
    "MatchmakingError",
]
