"""Hostile peers, parts 1 and 3: a catalogue of attacks against a real ``peerd join`` process.

Every attack is made the way an attacker would make it: over TCP to a real peer started as
``peerd join --listen 127.0.0.1:0 --status-port 0 --identity ...`` (a bootstrap peer, or a training
peer with ``--task digits`` where the attack needs one). Where an honest implementation would refuse
to misbehave, the bytes are driven by hand over a real Noise handshake (``secure_handshake``).
Attack traffic comes from 127.0.0.66, legitimate peers from 127.0.0.1, so per-address admission
limits are measured as they would act on the internet (both are loopback on Linux).

Catalogue (the rows of the table):
  remote_crash          a fake DHT peer answers ``dht.find`` with contacts that share one host:port
  empty_payloads        calls whose payload is ``b""`` (the library's own, and by hand), one connection
  stalled_payloads      4 calls announce 256 MiB payloads; 1 MiB of each arrives, then nothing
  half_sent_records     many connections leave a 1 MiB transport record half sent
  idle_flood            1,000 idle TCP connections (held open, refilled) that never handshake
  connection_burst      2,000 quick connections that send a first Noise message and hang up
  status_flood          1,500 idle connections to the status port (held, refilled) while the operator
                        runs ``peerd status`` and GETs /status
  forge_matchmaking     rewrite another peer's matchmaking declaration with a 24 h expiration, under
                        its owner-signed subkey and under its plain peer ID (the old layout)
  store_flood           100 ``dht.store`` requests of 24 h records, then an honest short-lived store
  contact_reflection    a liar among the initial peers of ``peerd dht store`` and ``get`` names 5
                        foreign endpoints 4 times each in every find reply: the dials each one gets
  fake_leader           a signed declaration that sorts first, of a leader that never serves a join
                        (client mode, or silent): the rounds it fails, the times it is tried
  group_closers         an attacker asks every leader to admit it, every round: with little patience,
                        or as fresh identities filling the group's places
  small_group           a liar alone with an honest peer sends 1e30, or claims a weight of 2**40:
                        how far it moves the honest peer against twice the peer's own update
  unread_replies        40 finds of a 15 MiB dictionary over one connection, none of them read
  credit_overshoot      stream DATA past the granted credit window (training peer, ``avg.reduce``)
  oversized_message     4 streams to a reducer, each opened by one message larger than it accepts
  forge_progress        rewrite the training peer's own progress record the same two ways
  kept_graphs           32 expert forwards of 4096 x 256 asking for gradients, no backward ever
  sybil_placement       node IDs that pass the puzzle per second on one core, and the time to place
                        20 of them near a key (measured at the run's difficulty, estimated at the
                        public default; key grinding, what an ID cost before the puzzle, as baseline)

fake_leader, group_closers and small_group attack averagers embedded in this process (a script's ``GroupAverager``
on its own DHT node, over TCP, the bootstrap target their DHT); contact_reflection's victims are the
operator's ``peerd dht`` commands; every other case attacks a ``peerd join`` process (a bootstrap
peer, a training peer, or one that also hosts an expert).

Scoring, per case: *crash* = the target exited, or neither its status endpoint nor ``peer.ping``
answered; *degraded* = the target is alive but a legitimate peer could not get service (a
connect + ``peer.ping`` during or after the attack, a join under a flood, an honest store);
*forgery* = a forged record that a reader accepts (read back and parsed the way peers parse it) or
that blocks its owner's re-store; *bound exceeded* = a bound the case checks beyond health (dials of
a foreign endpoint per command, rounds a fake leader fails, how far a liar moves an honest peer);
*rss growth* = peak VmRSS (and VmHWM, reset through /proc/PID/clear_refs) minus the case's
baseline, taken once the target has finished starting (``bench.settle``). Failures are results,
reported as numbers; the benchmark itself never fails because an attack succeeded. Every process it
starts is killed and reaped, every socket closed, also on Ctrl-C, SIGTERM or an error.

    python benchmarks/hostile.py --quick     # about a minute on 2 cores (within 180 s)
    python benchmarks/hostile.py             # longer holds, more connections, larger Sybil swarm

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.hostile_cases import (  # noqa: E402
    admission,
    averaging,
    contacts,
    crash,
    group_closers,
    memory,
    pins,
    records,
    sybil,
)
from benchmarks.hostile_cases.bench import Bench, Outcome, Settings  # noqa: E402
from benchmarks.hostile_cases.target import reap_all  # noqa: E402

# The rows of the table, in the order they run.
CASES = [
    ("remote_crash", crash.remote_crash),
    ("empty_payloads", crash.empty_payloads),
    ("stalled_payloads", memory.stalled_payloads),
    ("half_sent_records", memory.half_sent_records),
    ("idle_flood", admission.idle_flood),
    ("connection_burst", admission.connection_burst),
    ("status_flood", admission.status_flood),
    ("forge_matchmaking", records.forge_matchmaking),
    ("store_flood", records.store_flood),
    ("contact_reflection", contacts.contact_reflection),
    ("fake_leader", averaging.fake_leader),
    ("group_closers", group_closers.group_closers),
    ("small_group", averaging.small_group),
    ("unread_replies", pins.unread_replies),
    ("credit_overshoot", memory.credit_overshoot),
    ("oversized_message", pins.oversized_message),
    ("forge_progress", records.forge_progress),
    ("kept_graphs", pins.kept_graphs),
    ("sybil_placement", sybil.sybil_placement),
]


def _describe(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"[:200]


async def run_cases(bench: Bench, names: list[str], outcomes: list[Outcome]) -> None:
    for name, case in CASES:
        if names and name not in names:
            continue
        out = Outcome(name)
        outcomes.append(out)
        started = time.monotonic()
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            with trio.move_on_after(bench.settings.case_timeout_s) as scope:
                await case(bench, out)
            if scope.cancelled_caught:
                out.error = f"case ran past {bench.settings.case_timeout_s:.0f} s"
        except Exception as error:  # a failure of the benchmark's own, reported, never raised
            out.error = _describe(error)
        except BaseException:  # Ctrl-C or SIGTERM: the case is cut short; cleanup runs on the way out
            out.error = "interrupted"
            raise
        print(f"[{name}] {out.result} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        if name == "store_flood":
            bench.drop_bootstrap()  # its store is full of junk now; nothing later needs it


async def main_async(settings: Settings, names: list[str], outcomes: list[Outcome], bench: Bench) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    print(f"hostile: received {signal.Signals(signum).name}; cleaning up", file=sys.stderr)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
            await run_cases(bench, names, outcomes)
            nursery.cancel_scope.cancel()


def print_report(outcomes: list[Outcome], figures: dict[str, Any], settings: Settings, wall: float) -> None:
    rows = [("case", "result", "rss MiB", "notes")]
    for out in outcomes:
        error = [f"benchmark error: {out.error}"] if out.error else []
        exceeded = [f"BOUND EXCEEDED: {text}" for text in out.exceeded]
        notes = "; ".join(error + exceeded + out.notes + ([out.rss_note] if out.rss_note else []))
        rows.append((out.case, out.result, f"{out.rss_growth_mb:.0f}", notes))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    failed = [out.case for out in outcomes if out.result in ("FAIL", "ERROR")]
    print(f"\nfailing cases: {', '.join(failed) if failed else 'none'}")
    summary = {
        "benchmark": "hostile",
        "quick": settings.quick,
        "cases": len(outcomes),
        "crashes": sum(out.crashed for out in outcomes),
        "degraded": sum(out.degraded for out in outcomes),
        "accepted_forgeries": sum(out.forgeries for out in outcomes),
        "bounds_exceeded": sum(len(out.exceeded) for out in outcomes),
        "max_rss_growth_mb": round(max((out.rss_growth_mb for out in outcomes), default=0.0), 1),
        "legit_join_s_under_flood": figures.get("legit_join_s_under_flood"),
        "legit_joined_under_flood": figures.get("legit_joined_under_flood"),
        "legit_join_s_under_burst": figures.get("legit_join_s_under_burst"),
        "sybil_20_ids_s": figures.get("sybil_20_ids_s"),
        "sybil_swarm_n": figures.get("sybil_swarm_n"),
        "sybil_ids_per_s": figures.get("sybil_ids_per_s"),
        "sybil_difficulty": figures.get("sybil_difficulty"),
        "sybil_public_difficulty": figures.get("sybil_public_difficulty"),
        "sybil_public_ids_per_s": figures.get("sybil_public_ids_per_s"),
        "sybil_public_20_ids_s": figures.get("sybil_public_20_ids_s"),
        "sybil_free_ids_per_s": figures.get("sybil_free_ids_per_s"),
        "errors": sum(out.error is not None for out in outcomes),
        "failed_cases": failed,
        "wall_s": round(wall, 1),
    }
    print(json.dumps(summary), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the issue's sizes, short holds (within 180 s)")
    parser.add_argument("--case", action="append", default=[], choices=[name for name, _ in CASES])
    args = parser.parse_args(argv)
    settings = Settings.make(args.quick)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peerd-hostile-") as workdir:
        bench = Bench(settings, Path(workdir))
        try:
            trio.run(main_async, settings, args.case, outcomes, bench)
        except BaseException as error:
            # trio may deliver Ctrl-C wrapped in an exception group; anything else is re-raised
            interrupted = isinstance(error, KeyboardInterrupt) or (
                isinstance(error, BaseExceptionGroup) and error.split(KeyboardInterrupt)[1] is None
            )
            if not interrupted:
                raise
            print("hostile: interrupted; cleaning up", file=sys.stderr)
        finally:
            bench.stop_all()
            reap_all()
    print_report(outcomes, bench.figures, settings, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
