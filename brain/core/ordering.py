"""Queue-order plugins: in which order pending jobs are offered GPUs.

An ordering returns the pending jobs sorted, and says whether a job that cannot be
placed blocks the ones behind it (strict FIFO) or lets them try (backfill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from brain.core.model import JobView


def job_sequence(job_id: str) -> tuple[int, str]:
    """Sort key for job ids: numeric ids in numeric order, others after, by text."""
    return (int(job_id), "") if job_id.isdigit() else (1 << 62, job_id)


def submission_key(job: JobView) -> tuple[float, tuple[int, str]]:
    return (job.submitted_at, job_sequence(job.job_id))


@dataclass(frozen=True, slots=True)
class Ordered:
    jobs: tuple[JobView, ...]
    # True: a job that cannot start holds back every job behind it.
    head_of_line_blocking: bool


Ordering = Callable[[Sequence[JobView], float], Ordered]


def fifo(pending: Sequence[JobView], now: float) -> Ordered:
    """First come, first served, strictly: nothing overtakes the head of the queue."""
    return Ordered(tuple(sorted(pending, key=submission_key)), head_of_line_blocking=True)


def priority(pending: Sequence[JobView], now: float) -> Ordered:
    """Higher priority first, FIFO within a priority; lower ones may backfill."""
    ordered = sorted(pending, key=lambda j: (-j.priority, *submission_key(j)))
    return Ordered(tuple(ordered), head_of_line_blocking=False)


ORDERINGS: Final[dict[str, Ordering]] = {"fifo": fifo, "priority": priority}
