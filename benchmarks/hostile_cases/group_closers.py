"""Attacks on matchmaking's claims, made against averagers embedded in this process (a script's
``GroupAverager`` on its own DHT node, over TCP), whose DHT is the bootstrap target. Any peer can
ask any leader to admit it (``avg.join``), naming its own patience; an attacker that reads the
swarm's declarations asks every leader, every round:

- *short patience*: one identity joins with just more patience than a leader still choosing its
  role lets a join wait with (``MIN_PATIENCE_LEFT``). A leader that counted it would answer within
  a fraction of a second, closing its group without the members still on their way;
- *fill*: fresh identities (no declaration, no node-ID proof), as many as a group has places for
  followers, join with an hour's patience. A leader that gave them places would be full at once.

Bound: every round forms one group of all the honest peers and no attacker
(``averaging/gathering.py`` ``Gathering.answer_by``, ``has_place``)."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack

import torch
import trio

from averaging.averager import GroupAverager
from averaging.group import AveragingMode
from averaging.joins import FOLLOWING, MIN_PATIENCE_LEFT, NOT_LEADING
from averaging.matchmaking import Declaration, Matchmaker
from peer import Identity, PeerHost, Router, open_peer_host

from .averaging import _node, honest_round
from .bench import Bench, Outcome
from .target import RUN_ID

HONEST = 4
MATCHMAKING_S = 3.0
ATTACK_POLL_S = 0.05  # how often the attacker reads the declarations and asks every leader again
# Refusals that only a leader gathering its group gives: the attack reached the rules it attacks.
AT_A_GATHERING = {
    "the group's places left are kept for the members it expects",
    "too many joins wait on this peer",
    "group is already full or formed",
    "the group did not form within the joiner's patience",
    "the group did not form",
}


async def group_closers(bench: Bench, out: Outcome) -> None:
    target = await bench.bootstrap()
    async with bench.watch(target, out):
        attacks = (("short patience", MIN_PATIENCE_LEFT + 0.1, 1), ("fill", 3600.0, HONEST - 1))
        for attack, patience, identities in attacks:
            harmed, counts, durations = await _rounds_under_attack(
                target.address, attack, patience, identities, bench.settings.leader_rounds
            )
            asks = counts["asks"]
            refusals = ", ".join(f"{n} '{why}'" for why, n in counts["refusals"].most_common(3))
            out.notes.append(
                f"{attack}: {len(durations)} rounds of {HONEST} honest peers, {harmed} without all of them or "
                f"with an attacker; {asks} joins asked, {counts['admitted']} of them answered with a group "
                f"(refusals: {refusals or 'none'}); round s " + ", ".join(f"{d:.1f}" for d in durations)
            )
            if harmed:
                out.exceeded.append(f"{attack}: {harmed} rounds formed without all honest peers (bound 0)")
            reached = counts["admitted"] + sum(n for why, n in counts["refusals"].items() if why in AT_A_GATHERING)
            if reached == 0:
                out.notes.append(f"{attack}: no join reached a gathering: the attack did not reach matchmaking")


async def _rounds_under_attack(boot, attack: str, patience: float, identities: int, rounds: int):
    """(rounds harmed, joins the attackers asked, joins answered with a group, each round's seconds)."""
    prefix = f"{RUN_ID}.closers.{attack.replace(' ', '-')}"
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        honest = [await nursery.start(_node, [boot]) for _ in range(HONEST)]
        reader = await nursery.start(_node, [boot])
        hosts = [open_peer_host(Identity.generate(), run_id=RUN_ID) for _ in range(identities)]
        attackers = [await stack.enter_async_context(host) for host in hosts]
        averagers = [
            GroupAverager(
                [torch.tensor([float(i)])],
                node,
                prefix=prefix,
                target_group_size=HONEST,
                settle_time=0.2,
                aggregation="mean",
                matchmaking_timeout=MATCHMAKING_S,
            )
            for i, node in enumerate(honest)
        ]
        matchmaker = Matchmaker(reader.host, reader, prefix, router=Router())
        me = Declaration(reader.peer_id, None, 1.0, AveragingMode.NODE, averagers[0].schema, 0)
        honest_ids = {node.peer_id for node in honest}
        counts: dict = {"asks": 0, "admitted": 0, "refusals": Counter()}
        harmed, durations = 0, []
        for _ in range(rounds):
            started = trio.current_time()
            async with trio.open_nursery() as round_:
                attack_scope = trio.CancelScope()
                round_.start_soon(_attack, matchmaker, me, attackers, prefix, patience, counts, attack_scope)
                results, failures = await honest_round(averagers)
                attack_scope.cancel()
            durations.append(trio.current_time() - started)
            whole = all({m.peer_id for m in r.group.members} == honest_ids for r in results)
            harmed += bool(failures) or not whole
        nursery.cancel_scope.cancel()
    return harmed, counts, durations


async def _attack(matchmaker, me, attackers: list[PeerHost], prefix, patience, counts, scope) -> None:
    """Read the declarations and ask every declared leader to admit each attacker, again and again."""
    with scope:
        async with trio.open_nursery() as asks:
            while True:
                try:
                    found = await matchmaker.read_candidates(me)
                except Exception:  # noqa: BLE001 (a failed read: read again)
                    found = {}
                for peer, declaration in found.items():
                    if peer == me.peer_id or declaration.address is None:
                        continue
                    for host in attackers:
                        asks.start_soon(_ask, host, declaration, prefix, patience, counts)
                await trio.sleep(ATTACK_POLL_S)


async def _ask(host: PeerHost, leader: Declaration, prefix: str, patience: float, counts: dict) -> None:
    mine = Declaration(host.peer_id, host.listen_address, 1.0, AveragingMode.NODE, leader.schema, leader.round)
    counts["asks"] += 1
    try:
        with trio.fail_after(5.0):
            address = leader.address.with_peer_id(leader.peer_id)
            await host.call(address, f"avg.join.{prefix}", {**mine.to_wire(), "patience": patience})
        counts["admitted"] += 1
    except Exception as error:  # noqa: BLE001 (refused, full, timed out: what the attack is for)
        kind = getattr(error, "type_name", None)  # (a Following refusal's message is an address)
        counts["refusals"][kind if kind in (FOLLOWING, NOT_LEADING) else str(error).rpartition(": ")[2][:60]] += 1
