"""Admission by quota (Run:ai): where each job stands against its queue's guarantee.

Walking a queue's jobs in rank order, the jobs that fit in the queue's guaranteed
GPUs are *in quota* (a share of one GPU is charged its share: `charge`); the rest of a
`train` queue borrow idle GPUs *over quota* and are the first to be reclaimed; the rest
of a `build` queue are *held* (a fixed quota, never borrowed). Running `build` jobs are
*pinned*: never preempted.

This module decides standings only; the pipeline in `decide` turns them into ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
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


def _pinned_use(
    jobs: Iterable[JobView], builds: AbstractSet[str]
) -> tuple[dict[str, int], frozenset[str]]:
    """What running jobs of `build` queues use of their guarantees, by queue: they are
    pinned whatever their rank, so they use it before any pending job of their queue
    is considered. And the `build` queues that have jobs: theirs are the only jobs
    whose standing after the walk is not over quota (`QuotaWalk.rest`)."""
    used: dict[str, int] = {}
    seen: set[str] = set()
    if builds:
        for job in jobs:
            if job.queue in builds:
                seen.add(job.queue)
                if job.grants:
                    used[job.queue] = used.get(job.queue, 0) + charge(job)
    return used, frozenset(seen)


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
    arrays: Mapping[str, int] | None = None,
) -> list[Standing]:
    """Each job's standing, in the order of `jobs_by_rank` (best-ranked first): one walk,
    no lookup by job id. A job of a queue nobody configured is over quota.

    `unordered`: the same jobs in any order, for the walk that needs no order (what
    pinned jobs use), when the caller has them laid out in memory as they were built;
    `smallest`: the least any of them asks (`smallest_ask`), when the caller knows it;
    `arrays`: how many jobs of each array run, when a job's array has a limit
    (`QuotaWalk`)."""
    walk = QuotaWalk(queues, jobs_by_rank if unordered is None else unordered, smallest, arrays)
    result = walk.standings(iter(jobs_by_rank))
    rest = walk.rest
    result += [rest(job) for job in jobs_by_rank[len(result) :]]
    return result


class QuotaWalk:
    """The walk behind `standings_in_order`, for a caller that partitions jobs by
    standing as it goes: `standings` reads jobs, best-ranked first, only as far as a
    guarantee has room left (the first few thousand of a busy cluster's jobs); `rest`
    is the standing of every job after those, which its queue and grants alone decide:
    over quota, but for the jobs of `build` queues (`of_builds`, the queues that have
    any).

    A waiting job of an array with a limit (`JobView.array_limit`) is charged only while
    fewer of its array's jobs run or were charged before it than the limit: past it, the
    cycle passes it over (it waits `array_limit`), and the guarantee it would have taken
    stays with its queue's other jobs. (Charged, it counts; walked but not charged, it
    does not: a job held to its fixed quota never runs, and one over quota is selected
    after every job within quota.)"""

    def __init__(
        self,
        queues: dict[str, QueueQuota],
        every: Sequence[JobView],
        smallest: int | None,
        arrays: Mapping[str, int] | None = None,
    ) -> None:
        """`every`: the jobs in any order (the walks that need none read them as they lie
        in memory); `smallest`: the least any of them asks (`smallest_ask`), if known;
        `arrays`: how many jobs of each array run, for a cycle with a job whose array
        has a limit (None: none has)."""
        self._queues = queues
        self._arrays = None if arrays is None else Counter(arrays)
        builds = frozenset(name for name, quota in queues.items() if quota.job_class == "build")
        self._used, self.of_builds = _pinned_use(every, builds)
        # No job asks less than the smallest share (a GPU, where none is shared), so once
        # no queue has that left, no job further down is within its quota.
        if smallest is None:
            smallest = smallest_ask(set(map(_DEMAND, every))) if queues else MILLI
        self._smallest = smallest
        # `rest` as a table: a queue's (standing while running, while waiting); a queue
        # not here is over quota either way. Public for a caller that partitions
        # thousands of jobs after the walk: a look-up each, not a call.
        self.rest_by_queue: dict[str, tuple[Standing, Standing]] = {
            name: (Standing.PINNED, Standing.HELD) for name in builds
        }

    def standings(self, jobs_by_rank: Iterator[JobView]) -> list[Standing]:
        """The standings of the jobs `jobs_by_rank` yields, as far as any guarantee has
        room: it stops reading there (or where they end)."""
        queues, used, smallest, arrays = self._queues, self._used, self._smallest, self._arrays
        if not queues:
            # The common case in a single-tenant cluster (and in Tiresias' traces).
            return []
        # Thousandths left of each guarantee.
        room = {
            name: quota.guaranteed_gpus * MILLI - used.get(name, 0)
            for name, quota in queues.items()
        }
        open_queues = sum(1 for left in room.values() if left >= smallest)
        result: list[Standing] = []
        append = result.append
        for job in jobs_by_rank if open_queues else ():
            quota = queues.get(job.queue)
            if quota is None:
                # No guarantee to be within.
                append(Standing.OVER_QUOTA)
                continue
            build = quota.job_class == "build"
            if job.grants and build:
                append(Standing.PINNED)
                continue
            if arrays is not None and not job.grants and at_array_limit(arrays, job):
                append(Standing.HELD if build else Standing.OVER_QUOTA)
                continue
            left = room[job.queue] - (job.gpus * MILLI if job.demand is None else charge(job))
            if left < 0:
                append(Standing.HELD if build else Standing.OVER_QUOTA)
                continue
            room[job.queue] = left
            append(Standing.IN_QUOTA)
            if arrays is not None and job.array is not None and not job.grants:
                arrays[job.array] += 1  # (its running jobs are counted already)
            if left < smallest:
                open_queues -= 1
                if not open_queues:
                    break
        return result

    def rest(self, job: JobView) -> Standing:
        """The standing of a job after the walk: a `build` job is pinned while it runs,
        held while it waits; any other is over quota."""
        return self.rest_by_queue.get(job.queue, _OVER_EITHER)[not job.grants]


_OVER_EITHER: Final = (Standing.OVER_QUOTA, Standing.OVER_QUOTA)


def at_array_limit(counts: Mapping[str, int], job: JobView) -> bool:
    """Do as many of its array's jobs as its limit allows count in `counts` (by array:
    those running, and those a walk has taken so far)? The one test of admission's walk
    (`QuotaWalk`) and selection's (brain/core/decide.py)."""
    limit, array = job.array_limit, job.array
    return limit is not None and array is not None and counts.get(array, 0) >= limit
