"""A task factory for interrupt tests: says it is loading, then loads forever (as a big model or
data set would), so a test can interrupt ``peerd join`` in the middle of loading its task."""

from __future__ import annotations

import sys
import time

LOADING = "interrupt_tasks: loading"


def loading_forever(shard, device):
    print(LOADING, file=sys.stderr, flush=True)
    time.sleep(3600)
