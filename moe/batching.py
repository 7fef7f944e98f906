"""Which pending requests an expert computes together: a sans-I/O queue.

Requests that arrive while an expert is busy wait here; when it is free, the server takes the
oldest request and every later one of the same kind (forward or backward) while the batch stays
within ``max_batch_size`` samples, concatenates them and runs them as one batch. Batching is what
makes many small remote calls cost about as much as one large local one. No clock and no I/O
here: the server decides when to ask for a batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Job", "BatchQueue"]


@dataclass(eq=False)
class Job:
    """One request: ``kind`` is ``"forward"`` or ``"backward"``, ``size`` its number of samples."""

    kind: str
    size: int
    data: Any = None
    result: Any = None
    error: BaseException | None = None
    started: bool = field(default=False)


class BatchQueue:
    def __init__(self, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.max_batch_size = max_batch_size
        self._jobs: deque[Job] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> None:
        if not 1 <= job.size <= self.max_batch_size:
            raise ValueError(f"batch of {job.size} samples is outside 1..{self.max_batch_size} (max_batch_size)")
        self._jobs.append(job)

    def remove(self, job: Job) -> bool:
        """Withdraw a job not yet taken (its caller gave up); False if it was already taken."""
        try:
            self._jobs.remove(job)
        except ValueError:
            return False
        return True

    def next_batch(self) -> list[Job]:
        """The oldest job and the following jobs of its kind that fit; [] if nothing is pending."""
        if not self._jobs:
            return []
        kind = self._jobs[0].kind
        batch: list[Job] = []
        total = 0
        kept: deque[Job] = deque()
        while self._jobs:
            job = self._jobs.popleft()
            if job.kind == kind and total + job.size <= self.max_batch_size:
                batch.append(job)
                total += job.size
            else:
                kept.append(job)
        self._jobs = kept
        for job in batch:
            job.started = True
        return batch
