"""Admission by quota (Run:ai): where each job stands against its queue's guarantee.

Walking a queue's jobs in rank order, the jobs that fit in the queue's guaranteed
GPUs are *in quota* (a share of one GPU is charged its share: `charge`); the rest of a
`train` queue borrow idle GPUs *over quota* and are the first to be reclaimed; the rest
of a `build` queue are *held* (a fixed quota, never borrowed). Running `build` jobs are
*pinned*: never preempted.

This module decides standings only; the pipeline in `decide` turns them into ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum
from operator import attrgetter
from typing import Final

from brain.core.model import Demand, JobView, QueueQuota
from brain.core.sharing import GPU_MILLI as MILLI


class Standing(IntEnum):
    """Lower stands first: a job never loses GPUs to one that stands behind it."""

    PINNED = 0
    IN_QUOTA = 1
    OVER_QUOTA = 2
    HELD = 3


_DEMAND: Final = attrgetter("demand")


def charge(job: JobView) -> int:
    """What a job takes of its queue's guarantee, in thousandths of a GPU: a share of
    one GPU its share, any other job its GPUs."""
    demand = job.demand
    if demand is not None and demand.fractional:
        return demand.gpu_milli
    return job.gpus * MILLI


def smallest_ask(demands: Iterable[Demand | None]) -> int:
    """The least a job with one of `demands` takes of a guarantee, in thousandths: the
    smallest share among them, or a GPU where none is a share."""
    return min((d.gpu_milli for d in demands if d is not None and d.fractional), default=MILLI)


def _pinned_use(jobs: Iterable[JobView], builds: set[str]) -> dict[str, int]:
    """What running jobs of `build` queues use of their guarantees, by queue: they are
    pinned whatever their rank, so they use it before any pending job of their queue
    is considered."""
    used: dict[str, int] = {}
    if builds:
        for job in jobs:
            if job.grants and job.queue in builds:
                used[job.queue] = used.get(job.queue, 0) + charge(job)
    return used


def quota_of(queues: Iterable[QueueQuota]) -> dict[str, QueueQuota]:
    return {q.name: q for q in queues}


def standings(
    jobs_by_rank: Sequence[JobView], queues: dict[str, QueueQuota]
) -> dict[str, Standing]:
    """Each job's standing, by job id. `jobs_by_rank` is best-ranked first."""
    in_order = standings_in_order(jobs_by_rank, queues)
    return {job.job_id: s for job, s in zip(jobs_by_rank, in_order, strict=True)}


def standings_in_order(
    jobs_by_rank: Sequence[JobView],
    queues: dict[str, QueueQuota],
    *,
    unordered: Sequence[JobView] | None = None,
    smallest: int | None = None,
) -> list[Standing]:
    """Each job's standing, in the order of `jobs_by_rank` (best-ranked first): one walk,
    no lookup by job id. A job of a queue nobody configured is over quota.

    `unordered`: the same jobs in any order, for the walk that needs no order (what
    pinned jobs use), when the caller has them laid out in memory as they were built;
    `smallest`: the least any of them asks (`smallest_ask`), when the caller knows it."""
    if not queues:
        # The common case in a single-tenant cluster (and in Tiresias' traces).
        return [Standing.OVER_QUOTA] * len(jobs_by_rank)
    every = jobs_by_rank if unordered is None else unordered
    builds = {name for name, quota in queues.items() if quota.job_class == "build"}
    used = _pinned_use(every, builds)
    # Thousandths left of each guarantee. No job asks less than the smallest share (a
    # GPU, where none is shared), so once no queue has that left, no job further down
    # is within its quota: the rest of the walk (most of it, in a busy cluster) reads
    # only each job's queue and grants.
    if smallest is None:
        smallest = smallest_ask(set(map(_DEMAND, every)))
    room = {
        name: quota.guaranteed_gpus * MILLI - used.get(name, 0) for name, quota in queues.items()
    }
    open_queues = sum(1 for left in room.values() if left >= smallest)
    result: list[Standing] = []
    append = result.append
    walked = 0
    for job in jobs_by_rank:
        if not open_queues:
            break
        walked += 1
        quota = queues.get(job.queue)
        if quota is None:
            # No guarantee to be within.
            append(Standing.OVER_QUOTA)
        elif job.grants and quota.job_class == "build":
            append(Standing.PINNED)
        elif (ask := job.gpus * MILLI if job.demand is None else charge(job)) <= room[job.queue]:
            left = room[job.queue] = room[job.queue] - ask
            if left < smallest:
                open_queues -= 1
            append(Standing.IN_QUOTA)
        elif quota.job_class == "build":
            append(Standing.HELD)
        else:
            append(Standing.OVER_QUOTA)
    rest = jobs_by_rank[walked:]
    if not builds:
        result += [Standing.OVER_QUOTA] * len(rest)
    else:
        pinned, held, over = Standing.PINNED, Standing.HELD, Standing.OVER_QUOTA
        result += [
            (pinned if job.grants else held) if job.queue in builds else over for job in rest
        ]
    return result
