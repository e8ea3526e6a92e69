"""Admission by quota (Run:ai): where each job stands against its queue's guarantee.

Walking a queue's jobs in rank order, the jobs that fit in the queue's guaranteed
GPUs are *in quota*; the rest of a `train` queue borrow idle GPUs *over quota* and are
the first to be reclaimed; the rest of a `build` queue are *held* (a fixed quota,
never borrowed). Running `build` jobs are *pinned*: never preempted.

This module decides standings only; the pipeline in `decide` turns them into ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum

from brain.core.model import JobView, QueueQuota


class Standing(IntEnum):
    """Lower stands first: a job never loses GPUs to one that stands behind it."""

    PINNED = 0
    IN_QUOTA = 1
    OVER_QUOTA = 2
    HELD = 3


# A queue nobody configured: no guarantee, may borrow, preemptible.
_UNCONFIGURED = QueueQuota(name="", guaranteed_gpus=0, job_class="train")


def quota_of(queues: Iterable[QueueQuota]) -> dict[str, QueueQuota]:
    return {q.name: q for q in queues}


def standings(
    jobs_by_rank: Sequence[JobView], queues: dict[str, QueueQuota]
) -> dict[str, Standing]:
    """Each job's standing, by job id. `jobs_by_rank` is best-ranked first."""
    if not queues:
        # The common case in a single-tenant cluster (and in Tiresias' traces).
        return dict.fromkeys((j.job_id for j in jobs_by_rank), Standing.OVER_QUOTA)
    used: dict[str, int] = {}
    result: dict[str, Standing] = {}
    # Running build jobs are pinned whatever their rank, so they use their queue's
    # guarantee before any pending job of that queue is considered.
    builds = {name for name, quota in queues.items() if quota.job_class == "build"}
    if builds:
        for job in jobs_by_rank:
            if job.grants and job.queue in builds:
                result[job.job_id] = Standing.PINNED
                used[job.queue] = used.get(job.queue, 0) + job.gpus
    for job in jobs_by_rank:
        if job.job_id in result:
            continue
        quota = queues.get(job.queue, _UNCONFIGURED)
        in_use = used.get(job.queue, 0)
        if in_use + job.gpus <= quota.guaranteed_gpus:
            used[job.queue] = in_use + job.gpus
            result[job.job_id] = Standing.IN_QUOTA
        elif quota.job_class == "build":
            result[job.job_id] = Standing.HELD
        else:
            result[job.job_id] = Standing.OVER_QUOTA
    return result
