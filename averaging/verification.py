"""Reducers are checked: a sender recomputes one part of another reducer's shard, sans I/O.

A reducer could answer anything it likes for its shard; robust aggregation (``robust.py``) only
helps while the reducer runs it. So, in the style of BTARD's verification (Gorbunov et al. 2022),
in a round that uses CenteredClip each sender, before it uses any reducer's averages, picks at
random and in private one part of each other reducer's shard (of each with a probability that
bounds what the checks cost the reducer's uplink, ``reducer_checks.CHECK_SHARE``, on all but
small vectors) and asks that reducer (``avg.check``) for the part's inputs: the contributions it
aggregated, each as its sender sent it with its sender's signed commitment (``commitments.py``),
the weights they claimed,
and the clip radius it used. The reducer keeps them from the moment each part is aggregated until
``KEEP_SECONDS`` after its round (the last ``KEPT_ROUNDS`` rounds, and older ones within
``KEPT_VALUES``). The sender then

1. finds its own weight among the inputs, as it sent it, and takes its own contribution as it
   sent it (the answer leaves it out, ``part_inputs.py``, or carries it exactly), unless the
   reply named the part's contributors without us (a reducer drops a sender that falls silent
   for a stall interval and says so openly, and the sender's values for that part then stay in
   its own error feedback; that is the round's fault handling, not a lie, and the rest of the
   check judges the aggregate of the inputs the reducer did take); requires
   every other input to be the one its sender committed to, for this round, this reducer, this
   part and the weight stated with it (its digest in a commitment the sender signed), and decodes
   the inputs itself;
2. recomputes the radius the reducer's start (the contribution it names, its own unless another
   is closer-knit, ``robust.py``) gives, and requires that start to be a plausible one: its radius
   at most ``START_MARGIN * START_SLACK`` times the smallest of the radii every contribution would
   give (a start far out makes tau huge and CenteredClip the mean: a reducer that starts from a
   quiet attacker's contribution hands the attackers its shard);
3. recomputes CenteredClip over the inputs from that start with that radius, and compares it
   with the reply it got for that part, within ``CHECK_TOLERANCE * tau`` (plus what a lossy codec
   rounds; a sparse reply, which keeps each chunk's largest values, is bounded in which values it
   kept as well: ``sparse_reply_verdict``).

Any failure, no answer within ``CHECK_TIMEOUT``, or an answer that does not parse, leaves that
reducer's shard with the sender's own values and puts the reducer on this peer's ban list:
matchmaking leaves it out of our groups. A wrong or malformed answer is a lie and is banned for
``BAN_SECONDS``; a check that went unanswered (no reply in time, the connection lost, or a refusal
such as "no inputs kept") only for ``UNANSWERED_BAN_SECONDS``: an honest reducer cut off by a
network outage cannot answer either, and a long ban would keep the swarm split for minutes after
the link heals. A liar that never answers gains nothing by it: its shard is never used.

Why this is sound without trusting any third peer: the verdict depends only on the reducer's own
answer, on what this sender itself sent and received, and on the other senders' commitments. A
reducer that returns anything but the aggregate of its claimed inputs is caught by whoever checks
that part; one that makes its claimed inputs fit a false answer must misstate some honest sender's
contribution or weight. It answers each checker in private, so it could state the checker's own
contribution truly and misstate only the others'; but it cannot sign for them, so any such input
fails its commitment check. Nor can a sender frame an honest reducer: a sender whose commitment
is not signed by it, and a part that does not match its sender's commitment, are refused at
receipt (``allreduce_protocol.py``) and never become an input. A
reducer that lies on its whole shard is therefore caught in its first round by every sender that
checks it (all of them on small vectors), and its lie is never used by those; one that lies on a
single part of ``P`` is caught by each checking sender with probability ``1 / P`` per round. The
honest cost per round: per reducer checked, one RPC carrying one part's inputs (the other senders'
parts as encoded, and those of their commitments this peer does not hold: ``part_inputs.py``),
their decoding, a hash per input, and one
CenteredClip of that part; a signature verification only per commitment this peer has not met yet
(each sender signs one per round, and a peer that reduces has verified all of them already); a
reducer keeps a copy of its inputs (decoded, and as sent) for a few rounds; in a checked round
every part sent is encoded before the first goes out and hashed, every part received hashed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from peer import PeerID

from .commitments import Commitment, VerifiedSignatures, part_digest
from .mixing import distances, mix, mixes, sets_hold, tau_floor
from .part_inputs import AskerHolds, PartInputs
from .robust import (
    GRAM_LIMIT,
    RADIUS_SHARE,
    START_SLACK,
    Aggregation,
    centered_clip,
    clip_radius,
    clip_weights,
    row_distances,
    start_radii,
)
from .sparse_codec import CHUNK, kept_per_chunk

__all__ = [
    "BAN_SECONDS",
    "UNANSWERED_BAN_SECONDS",
    "CHECK_METHOD",
    "CHECK_TIMEOUT",
    "MAX_BANNED",
    "BanList",
    "AskerHolds",
    "KeptInputs",
    "PartInputs",
    "PartCheck",
]

CHECK_METHOD = "avg.check"
# Senders check as soon as they have our replies, before our round is over: the check's own
# deadline after the round leaves slow links room.
KEEP_SECONDS = 20.0
# A peer runs one or two averagers (gradients, state), each a round at a time; a round's inputs
# are about one vector's worth (every sender's part of our shard). The last KEPT_ROUNDS are always
# kept; older rounds within KEEP_SECONDS too, while all kept inputs stay within KEPT_VALUES
# (float32: 64 MiB). A small model's rounds come many a second, and a sender whose own round was
# held up by a dead peer checks ours only after it ends: had we forgotten our round by then, it
# would ban us, an honest reducer, for "no inputs kept" (seen in the lab's partition test).
KEPT_ROUNDS = 2
KEPT_VALUES = 1 << 24
MAX_KEPT_ROUNDS = 1024
# One part's inputs (group size x part size float32, at most 8 x 2 MiB by default) over a slow
# link, and one CenteredClip of them.
CHECK_TIMEOUT = 10.0
# The reducer judges its start on radii estimated from a sample of coordinates, we on exact ones:
# this margin keeps an honest reducer's borderline choice from looking like a lie.
START_MARGIN = 1.25
# Two honest CenteredClips with one radius from different starts end within TOLERANCE * tau of the
# fixed point (``robust.py``); a reducer may be off by this share of tau before it counts as a lie,
# far less than a single contribution may move the aggregate by (tau * its weight share).
CHECK_TOLERANCE = 0.01
# A sparse reply is held to this share of tau instead: the reducer's CenteredClip runs from the
# start and radius it states, as ours does, so the two differ by float noise and at most one more
# iteration (a step under ``robust.TOLERANCE * tau``); the values it keeps can be chosen among
# near-ties only this close, and a liar must stay this close to drop or swap any.
SPARSE_CHECK_TOLERANCE = 2e-4
# Bans are kept per peer we were grouped with: this bounds them against Sybils.
MAX_BANNED = 4096
# Long enough to keep a caught reducer out of many rounds, short enough that a peer banned by
# mistake (it crashed while answering) comes back.
BAN_SECONDS = 600.0
# An unanswered check: long enough to leave the reducer out of the next few rounds, short enough
# that peers on both sides of a healed partition group together again soon after.
UNANSWERED_BAN_SECONDS = 60.0


class KeptInputs:
    """A reducer's inputs of its last rounds, part by part, for the senders' checks. A round is
    registered as it starts, with a function that gives a part's inputs once it is aggregated:
    a sender may ask as soon as it has our reply for that part, before our round is over."""

    def __init__(self) -> None:
        # group ID -> (expires at, senders, a part's inputs, how many values they hold at most)
        self._rounds: dict[bytes, tuple[float, list[PeerID], Callable[[int], PartInputs | None], int]] = {}

    def keep(
        self,
        group_id: bytes,
        senders: list[PeerID],
        inputs: Callable[[int], PartInputs | None],
        now: float,
        values: int = 0,
    ) -> None:
        """Register (or, at the end of the round, renew) round ``group_id``'s inputs, ``values``
        of them at most (senders x our shard)."""
        self._expire(now)
        self._rounds.pop(group_id, None)
        self._rounds[group_id] = (now + KEEP_SECONDS, senders, inputs, values)
        held = sum(kept[3] for kept in self._rounds.values())
        while len(self._rounds) > KEPT_ROUNDS and (held > KEPT_VALUES or len(self._rounds) > MAX_KEPT_ROUNDS):
            held -= self._rounds.pop(next(iter(self._rounds)))[3]

    def answer(self, group_id: Any, index: Any, asker: PeerID, now: float) -> PartInputs:
        """Part ``index``'s inputs of round ``group_id``, for one of that round's senders."""
        self._expire(now)
        kept = self._rounds.get(group_id) if isinstance(group_id, bytes) else None
        if kept is None:
            raise ValueError("no inputs kept for that round")
        _expires, senders, inputs, _values = kept
        if asker not in senders:
            raise ValueError("only the round's senders may check it")
        found = inputs(index) if type(index) is int and index >= 0 else None
        if found is None:
            raise ValueError("no such part aggregated")
        return found

    def __len__(self) -> int:
        """How many rounds' inputs are kept (expired ones until the next call that expires them)."""
        return len(self._rounds)

    def _expire(self, now: float) -> None:
        for group_id in [g for g, (expires, *_rest) in self._rounds.items() if expires <= now]:
            del self._rounds[group_id]


@dataclass
class PartCheck:
    """One sender's check of one part: what it sent (as the reducer decoded it) and with which
    weight, whom the reply named, and the reply itself; ``verdict`` judges the reducer's answer."""

    me: PeerID
    reducer: PeerID
    own: torch.Tensor  # our contribution to the part, as the reducer decoded it
    weight: float
    contributors: list[PeerID]  # named in the reply for this part
    reply: torch.Tensor  # the part's aggregate as we received (decoded) it
    requantize: Any = None  # values -> values as the reply's codec would round them, if lossy
    group_id: bytes = b""  # the round
    part: int = 0  # the part's index in the reducer's shard
    verified: VerifiedSignatures | None = None  # commitments this peer verified lately
    sparse_reply: bool = False  # the reply keeps a chunked top-k in 8 bits (``sparse_reply_verdict``)
    aggregation: Aggregation = Aggregation.CENTERED_CLIP  # the round's rule, which every reducer must use
    held: dict[PeerID, Commitment] = field(default_factory=dict)  # this round's commitments we hold, by sender

    def holds(self) -> AskerHolds:
        """What the answer may leave out: our own input and the commitments we hold."""
        return AskerHolds(self.me, self.own, self.held)

    def verdict(self, inputs: PartInputs) -> str | None:
        """Why the reducer lied, or None if its answer holds."""
        if inputs.aggregation is not self.aggregation:
            return f"it aggregates with {inputs.aggregation.value}, not the round's {self.aggregation.value}"
        if not set(inputs.senders) <= set(self.contributors):
            return "its inputs name senders its reply left out"
        if len(inputs.signed) != len(inputs.senders):
            return "its inputs are not signed"
        ours = None
        if self.weight > 0 and self.me in self.contributors:  # (a reply that names us must hold us)
            if self.me not in inputs.senders:
                return "it left our contribution out of its inputs"
            ours = inputs.senders.index(self.me)
            if inputs.weights[ours] != self.weight:
                return f"it misstated our weight ({inputs.weights[ours]!r}, we sent {self.weight!r})"
            if not torch.equal(inputs.values[ours], self.own):
                return "it misstated our contribution"
        for row, (sender, weight, signed) in enumerate(zip(inputs.senders, inputs.weights, inputs.signed, strict=True)):
            if row == ours:  # what we sent, as we sent it: our own signature would prove nothing more
                continue
            try:
                digest = part_digest(signed.meta, inputs.row_payload(row))
            except (TypeError, ValueError):
                digest = None
            if digest is None or digest != signed.commitment.digest(self.reducer, self.part):
                return f"it states an input of {sender} that {sender} did not commit to"
            if not signed.commitment.verify(self.group_id, sender, weight, self.verified):
                return f"it states an input of {sender} under a commitment {sender} did not sign"
        values, n, floor = inputs.values, len(inputs.senders), 0.0
        if mixes(inputs.aggregation, n):
            between = distances(values)
            why = sets_hold(between, inputs.neighbours)  # nearest sets, up to near-ties
            if why is not None:
                return why
            values, floor = mix(values, inputs.neighbours), tau_floor(between)
        elif inputs.neighbours is not None:
            return "it states neighbour sets for inputs it did not mix"
        parts = list(values.unbind(0))
        # The reducer starts from the contribution it names (its own, or one closer-knit; the
        # coordinate-wise median if it sent none), and its radius follows from that start:
        # recompute it exactly as the reducer must have.
        trusted = inputs.senders.index(self.me) if self.me in inputs.senders else inputs.start
        between = None  # small parts: every distance between inputs at once (their radii too)
        if inputs.start is not None and n * parts[0].numel() <= GRAM_LIMIT:
            assert trusted is not None
            between = pairwise_distances(values, trusted)
            start, radius = parts[inputs.start], float(np.sort(between[inputs.start])[n // 2])
        elif inputs.start is not None:
            start, radius = parts[inputs.start], radius_from(values, inputs.start)
        if inputs.start is not None:
            expected = max(RADIUS_SHARE * radius, floor)  # (the start's radius, as ``robust.py`` scales it)
        else:
            start, expected = None, max(clip_radius(parts, None), floor)
        if abs(inputs.tau - expected) > 1e-4 * expected + 1e-30:
            return f"its clip radius {inputs.tau:.6g} is not the one its inputs give ({expected:.6g})"
        recomputed = torch.empty_like(self.reply)
        weights = clip_weights(inputs.weights)
        centered_clip(parts, weights, recomputed, center=start, tau=inputs.tau, choose_start=False)
        scale = 1e-5 * float(recomputed.double().norm()) + 1e-6  # (float64: float32 overflows near 1e19)
        allowed = CHECK_TOLERANCE * inputs.tau + scale
        if self.sparse_reply:
            why = sparse_reply_verdict(recomputed, self.reply, SPARSE_CHECK_TOLERANCE * inputs.tau + scale)
            if why is not None:
                return why
        else:
            if self.requantize is not None:
                rounded = self.requantize(recomputed)
                allowed += 2 * float((rounded - recomputed).norm())
            off = float((recomputed - self.reply).norm())
            if not off <= allowed:
                return f"its reply is {off:.4g} away from the aggregate of its own inputs (allowed {allowed:.4g})"
        if inputs.start is not None:  # (the median needs no bound)
            if between is not None:
                radii = np.sort(between, axis=1)[:, n // 2].tolist()
            else:
                radii = start_radii(values, values[trusted], exact=True)
            smallest = min(radii)
            if radius > START_MARGIN * START_SLACK * smallest:
                return f"it started far from the others (radius {radius:.4g}, smallest {smallest:.4g})"
        return None


def sparse_reply_verdict(recomputed: torch.Tensor, reply: torch.Tensor, epsilon: float) -> str | None:
    """Why a sparse reply (``sparse_codec``: the aggregate's largest values of each chunk, in 8
    bits in a checked round) is not the one an honest reducer makes from the aggregate we
    recomputed, or None. ``epsilon`` bounds how far the reducer's own aggregate is from ours (L2,
    so also any one value's difference).

    The reducer chooses which values to keep, so the check bounds its choice, chunk by chunk, as
    well as its values. An honest reducer keeps each chunk's ``k`` largest of its own aggregate;
    with ``t`` our chunk's ``k``-th largest magnitude, that means:

    1. at most ``k`` values of the chunk kept;
    2. every kept value at least ``t - 2 * epsilon`` in ours (it was among the reducer's largest);
    3. every value above ``t + 2 * epsilon`` in ours kept (it was among them too);
    4. each kept value within its rounding of ours: 8 bits leave half of 1/128 of its chunk's
       range of kept magnitudes, which ``epsilon`` widens by ``2 * epsilon``, plus ``epsilon``.

    So a liar may choose only among near-ties, and move each kept value only by its rounding."""
    numel = recomputed.numel()
    kept, ours = reply != 0, recomputed.double()
    rounding, margin, full = 0.0, 2 * epsilon, numel - numel % CHUNK
    blocks = [(0, CHUNK, kept[:full].view(-1, CHUNK), ours[:full].abs().view(-1, CHUNK))] if full else []
    if full < numel:  # the part's shorter last chunk
        blocks.append((full, numel - full, kept[full:].view(1, -1), ours[full:].abs().view(1, -1)))
    for first, length, mask, magnitudes in blocks:
        why, block_rounding = _chunks_verdict(first, length, mask, magnitudes, margin)
        if why is not None:
            return why
        rounding += block_rounding
    off = float((reply.double() - torch.where(kept, ours, 0.0)).norm())
    allowed = epsilon + math.sqrt(rounding) * (1 + 1e-5)
    if not off <= allowed:
        return f"its sparse reply is {off:.4g} away from the aggregate of its own inputs (allowed {allowed:.4g})"
    return None


def _chunks_verdict(
    first: int, length: int, mask: torch.Tensor, magnitudes: torch.Tensor, margin: float
) -> tuple[str | None, float]:
    """``sparse_reply_verdict``'s rules 1-3 for chunks of ``length`` values, one per row (the
    first at ``first``), all at once: why the first chunk that breaks one does, or None and the
    rounding (rule 4) the chunks' kept values allow, squared and summed in chunk order."""
    keep = kept_per_chunk(length)
    counts = mask.sum(dim=1)
    threshold = torch.topk(magnitudes, keep, dim=1).values[:, -1]
    lowest_kept = torch.where(mask, magnitudes, math.inf).min(dim=1).values
    highest_kept = torch.where(mask, magnitudes, -math.inf).max(dim=1).values
    too_many = counts > keep
    too_low = (counts > 0) & (lowest_kept < threshold - margin)
    left_out = ((magnitudes > (threshold + margin)[:, None]) & ~mask).any(dim=1)
    broken = torch.nonzero(too_many | too_low | left_out)
    if len(broken):
        row = int(broken[0, 0])
        start = first + row * length
        if too_many[row]:
            return f"its reply keeps {int(counts[row])} values of a chunk of {length}", 0.0
        if too_low[row]:
            return f"its reply keeps a value of the chunk at {start} below the chunk's largest {keep}", 0.0
        return f"its reply leaves out a value among the largest {keep} of the chunk at {start}", 0.0
    some = counts > 0
    spans = highest_kept[some] - lowest_kept[some] + margin
    rounding = 0.0
    for term in (counts[some].double() * (spans / 256) ** 2).tolist():  # (summed in chunk order)
        rounding += term
    return None, rounding


def pairwise_distances(values: torch.Tensor, trusted: int) -> np.ndarray:
    """The distances between the rows of ``values``, from their float64 Gram matrix relative to
    row ``trusted`` (small where the rows are close to it), exact where that cancels
    (``row_distances``)."""
    return row_distances(values, values[trusted])


def radius_from(values: torch.Tensor, row: int) -> float:
    """The radius ``centered_clip`` picks for the rows of ``values`` starting from row ``row``."""
    distances = torch.linalg.vector_norm(values - values[row], dim=1)
    if not torch.isfinite(distances).all():  # beyond float32 (hostile values)
        rows = values.double()
        distances = torch.linalg.vector_norm(rows - rows[row], dim=1)
    return float(distances.sort().values[values.shape[0] // 2])


@dataclass
class BanList:
    """Peers caught lying, each until its ban expires (monotonic seconds)."""

    until: dict[PeerID, float] = field(default_factory=dict)
    reasons: dict[PeerID, str] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic  # the service's: trio's, so simulated runs' bans expire too

    def ban(self, peer: PeerID, reason: str, seconds: float = BAN_SECONDS) -> None:
        """Ban ``peer`` for ``seconds`` from now; a longer ban it is already under stands."""
        if len(self.until) >= MAX_BANNED and peer not in self.until:  # drop the ban closest to expiry
            evicted = min(self.until, key=self.until.__getitem__)
            del self.until[evicted]
            self.reasons.pop(evicted, None)
        until = self.clock() + seconds
        if peer in self and self.until[peer] >= until:
            return
        self.until[peer] = until
        self.reasons[peer] = reason

    def __contains__(self, peer: object) -> bool:
        expires = self.until.get(peer)  # type: ignore[call-overload]
        if expires is None:
            return False
        if expires <= self.clock():
            del self.until[peer]  # type: ignore[arg-type]
            self.reasons.pop(peer, None)  # type: ignore[call-overload]
            return False
        return True

    def __len__(self) -> int:
        return sum(1 for peer in list(self.until) if peer in self)
