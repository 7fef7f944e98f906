"""NAT traversal in the network lab: how often and how fast hole punching gets two peers behind
port-preserving NATs directly connected, and what a relayed connection costs.

    python benchmarks/nat.py --quick      # within 180 s: 20 punches, 32 MiB streams
    python benchmarks/nat.py --tries 50 --megabytes 128

Hosts (``tests/support/netlab.py``): one public host running ``peerd join`` (the relay, relaying by
default), and two private hosts behind their own port-preserving NAT routers (nft masquerade),
every link shaped to ``--rate`` Mbit/s. ``tests/support/lab_punch_peer.py`` runs on each private host:
for each try, a fresh peer behind NAT B reserves a slot on the relay, a fresh peer behind NAT A
dials its relayed address and punches (``peer/holepunch.py``); fresh ports per try, as a closed
connection's 4-tuple lingers in TIME_WAIT.

Figures (last line, one JSON object):
  punch_success         tries that ended directly connected ÷ tries (target 1.0).
  punch_s               median seconds from the start of punching (the relayed connection is
                        up) to the direct connection (target ≤ 2); punch_s_max the slowest.
  relayed_stream_ratio  throughput of one encrypted RPC stream through the relay ÷ the same
                        stream over the punched direct connection, the same peers and links
                        (target ≥ 0.7; on shaped links both are bound by the link).
  relay_cpu_s_per_gb    the relay process's CPU seconds (user + system, from /proc) per GB it
                        forwarded while the relayed stream ran.
Without root, ``ip``, ``tc`` or ``nft`` it prints one line saying what is missing and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer import LOCAL_DIFFICULTY  # noqa: E402

os.environ.setdefault("PEERD_NODE_ID_DIFFICULTY", str(LOCAL_DIFFICULTY))  # as tests/conftest.py

from tests.support.netlab import PEER_PORT, Lab, lab_unavailable, remove_leftovers  # noqa: E402

RUN_ID = "bench-nat"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log_tail(path: Path, lines: int = 6) -> str:
    """The last lines of a helper's log: what a failed run's JSON says about why."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def read_json(process, timeout: float, log: Path) -> dict[str, Any]:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"{log.stem} gave no answer within {timeout} s: {log_tail(log)}")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{log.stem} exited ({process.wait()}): {log_tail(log)}")
    return json.loads(line)


def tell(process, line: str) -> None:
    process.stdin.write(line.encode() + b"\n")
    process.stdin.flush()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def run(workdir: Path, tries: int, megabytes: int, rate: float | None) -> dict[str, Any]:
    with Lab(workdir, tag="nat") as lab:
        hub = lab.add_host("relay", rate_mbit=rate)
        behind = [lab.add_nat_host(f"p{index}", rate_mbit=rate) for index in range(2)]
        [relay_peer] = lab.start_swarm([hub], run_id=RUN_ID)
        relay = f"{hub.address}:{PEER_PORT}/{relay_peer.status()['peer_id']}"
        common = ["--relay", relay, "--run-id", RUN_ID]
        target = lab.spawn(
            behind[0],
            ["tests/support/lab_punch_peer.py", "target", "--host", behind[0].address, "--tries", str(tries), *common],
            workdir / "target.log",
        )
        dialer = lab.spawn(
            behind[1],
            [
                "tests/support/lab_punch_peer.py",
                "dialer",
                "--host",
                behind[1].address,
                "--megabytes",
                str(megabytes),
                *common,
            ],
            workdir / "dialer.log",
        )
        records = []
        relay_cpu = None
        for index in range(tries):
            offered = read_json(target, 60, workdir / "target.log")
            before = cpu_seconds(relay_peer.process.pid)
            tell(dialer, offered["address"])
            record = read_json(dialer, 120, workdir / "dialer.log")
            if index == 0:
                relay_cpu = cpu_seconds(relay_peer.process.pid) - before
            record["direct_to_nat"] = (record.get("remote") or "").split(":")[0] == behind[0].router.address
            records.append(record)
            print(
                f"try {index:3d}: punched={record['punched']!s:5} punch_s={record.get('punch_s')} "
                f"remote={record.get('remote')} {record.get('error') or ''}",
                flush=True,
            )
            tell(target, "next")
        target.stdin.close()
        dialer.stdin.close()
    first = records[0]
    punched = [r for r in records if r["punched"] and r["direct_to_nat"]]
    times = [r["punch_s"] for r in punched]
    relayed, direct = first.get("relayed_mb_s"), first.get("direct_mb_s")
    return {
        "punch_success": round(len(punched) / tries, 3),
        "punch_s": round(statistics.median(times), 3) if times else None,
        "punch_s_max": round(max(times), 3) if times else None,
        "relayed_stream_ratio": round(relayed / direct, 3) if relayed and direct else None,
        "relayed_mb_s": relayed,
        "direct_mb_s": direct,
        # the relayed stream's bytes crossed the relay once (plus a little RPC framing)
        "relay_cpu_s_per_gb": round(relay_cpu / (megabytes / 1024), 2) if relay_cpu is not None else None,
        "relay_cpu_s": round(relay_cpu, 3) if relay_cpu is not None else None,
        "tries": tries,
        "megabytes": megabytes,
        "rate_mbit": rate,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="within 180 s: 20 tries, 32 MiB streams")
    parser.add_argument("--tries", type=int, default=None, help="punches (default 20 quick, 50 otherwise)")
    parser.add_argument("--megabytes", type=int, default=None, help="MiB per throughput stream (32 / 128)")
    parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every link (0: unshaped)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args(argv)
    reason = lab_unavailable(nat=True)
    if reason is not None:
        print(f"nat benchmark cannot run: {reason}")
        return 2
    tries = args.tries or (20 if args.quick else 50)
    megabytes = args.megabytes or (32 if args.quick else 128)
    rate = args.rate or None
    remove_leftovers()
    workdir = Path(tempfile.mkdtemp(prefix="peerd-nat-"))
    started = time.monotonic()
    try:
        summary = run(workdir, tries, megabytes, rate)
        error = None
    except Exception as failure:  # the table and JSON still come, saying what failed
        summary, error = {"punch_success": None, "punch_s": None, "relayed_stream_ratio": None}, repr(failure)
    summary.update(quick=args.quick, error=error, wall_s=round(time.monotonic() - started, 1))
    print()
    print(f"{'figure':24} value")
    for key, value in summary.items():
        print(f"{key:24} {value}")
    if error or args.keep:
        print(f"logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
