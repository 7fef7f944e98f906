"""How matchmaking fails, for the averager and the optimizer to tell apart: alone, out of reach
of the swarm's round, a leader that did not serve us, or no group within the deadline."""

from __future__ import annotations

from .matchmaking_rules import in_reach, round_to_join

__all__ = [
    "LeaderDeclined",
    "LeaderFailed",
    "LeaderFollows",
    "LeaderHoldsExcluded",
    "MatchmakingError",
    "NoOtherPeers",
    "OutOfReach",
    "no_group",
    "too_few",
]


class MatchmakingError(RuntimeError):
    """No group of at least ``min_group_size`` formed before the deadline."""


class NoOtherPeers(MatchmakingError):
    """No other peer declared itself for the round before the deadline: this peer is alone."""


class OutOfReach(MatchmakingError):
    """No group formed, and the peers that declared are all more than a round from ours: this peer
    was left behind (or ran ahead). ``swarm_round``: the lower median of their rounds, which a
    minority of liars cannot move; a peer whose round is only a label for matching (a bare
    averager, not a training epoch) can declare it next time, as a newcomer does."""

    def __init__(self, message: str, swarm_round: int):
        super().__init__(message)
        self.swarm_round = swarm_round


class LeaderFailed(MatchmakingError):
    """The elected leader answered garbage, left us out, or did not answer in time."""


class LeaderDeclined(MatchmakingError):
    """The elected leader has matched our round without us: our view elected it from a
    declaration that outlived its choice."""


class LeaderFollows(MatchmakingError):
    """The elected leader follows another leader for our round: ``leader``, the one it named, at
    ``address``, where it read it."""

    def __init__(self, message: str, leader, address):
        super().__init__(message)
        self.leader, self.address = leader, address


class LeaderHoldsExcluded(LeaderFailed):
    """The elected leader's group holds a peer this one excludes: passed over for the round, but
    not remembered, since the excluded peer, not the leader, chose to join it."""


def no_group(message: str, own_round: int, far_rounds: list[int], rounds: list[int], alone: bool) -> MatchmakingError:
    """What a round that formed no group raises. ``far_rounds``: declarations out of reach were
    why; ``rounds``: every other peer's declared round. The swarm's round is the lower median of
    all of them, so a minority of liars declaring far rounds cannot move it; only when that median
    is itself out of our reach are we stranded (``OutOfReach``)."""
    if far_rounds and rounds:
        swarm_round = round_to_join(0, rounds)
        if not in_reach(own_round, swarm_round):
            return OutOfReach(message, swarm_round=swarm_round)
    return (NoOtherPeers if alone else MatchmakingError)(message)


def too_few(found: int, min_group_size: int, far: int, round_number: int) -> str:
    message = f"only {found} matching peer(s) declared (need {min_group_size})"
    return message + (f"; {far} more declared rounds too far from our {round_number}" if far else "")
