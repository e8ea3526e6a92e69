"""Preemption plugins: may a running job lose its GPUs to a better-ranked one?

A plugin gives each job a *hold*: within one quota standing, jobs with a smaller hold
rank first. `by-rank` gives everyone the same hold, so the queue order alone decides
and a better-ranked pending job preempts a worse-ranked running one (Tiresias).
`quota-only` puts running jobs ahead of pending ones of the same standing, so running
jobs are preempted only to give a queue back its guarantee (Run:ai reclaim).

Which running jobs become victims, and in which order, is fixed mechanism in `decide`:
the worst-ranked first, and only as many as a placement needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from brain.core.model import JobView

Preemption = Callable[[JobView], int]


def by_rank(job: JobView) -> int:
    return 0


def quota_only(job: JobView) -> int:
    return 0 if job.running else 1


PREEMPTIONS: Final[dict[str, Preemption]] = {"by-rank": by_rank, "quota-only": quota_only}

# Plugins that give every job the same hold, and that hold: the pipeline need not ask
# them job by job (a call per job, in rank order, is a cache miss per job at scale).
UNIFORM_HOLDS: Final[dict[Preemption, int]] = {by_rank: 0}
