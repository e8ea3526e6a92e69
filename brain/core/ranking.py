"""Jobs in rank order, and a ranking kept from one cycle to the next.

`rank_order` sorts a cycle's `Ranked` jobs by (rank, submission, job id): the order
every later stage of `decide` walks.

`Ranking` keeps that order between cycles for a caller that decides again and again
on a state that changes little (the live brain: a pass at every submission, over a
queue of thousands). For a queue order whose ranks depend on each job's view alone
(`QueueOrder.view_only`), a job whose view is the very object it was last cycle keeps
its rank and its place; only new views are ranked, and merged in. The views are
immutable records, so the same object is the same job as it was; the ranking holds
each view it knows, so that no other object can take its identity meanwhile.

What `decide` returns is the same with a `Ranking` or without one (a property test
holds it to that); only the work differs: at 10,000 pending jobs and one new one,
ranking and sorting the queue again was about 40 % of a cycle.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from operator import itemgetter
from typing import Final

from brain.core.model import JobView
from brain.core.ordering import OrderContext, Ordered, QueueOrder, Ranked, job_sequence

_RANK: Final = itemgetter(1)  # Ranked.rank


def _submission_then_id(item: Ranked) -> tuple[float, tuple[int, str]]:
    job = item.job
    return (job.submitted_at, job_sequence(job.job_id))


def _rank_key(item: Ranked) -> tuple[tuple[float, ...], float, tuple[int, str]]:
    """The whole sort key of `rank_order`, for a look-up in an order already sorted."""
    job = item.job
    return (item.rank, job.submitted_at, job_sequence(job.job_id))


def rank_order(ranked: Sequence[Ranked]) -> list[Ranked]:
    """By (rank, submission, job id), as two stable sorts: by submission (ties broken by
    id only when two jobs share a submission time), then by rank alone. Sorting by one
    float, then by short rank tuples over nearly sorted data, costs a third of one sort
    by the whole (rank, submission, id) tuple."""
    submitted = [item.job.submitted_at for item in ranked]
    if len(set(submitted)) == len(submitted):
        # Sorting positions by a list of floats reads each job once, not once per key.
        order = [ranked[i] for i in sorted(range(len(ranked)), key=submitted.__getitem__)]
    else:
        order = sorted(ranked, key=_submission_then_id)
    order.sort(key=_RANK)
    return order


# More changed views than this share of those kept: sorting everything again costs
# less than finding each one's place.
_RESORT_SHARE: Final = 0.125


class Ranking:
    """One cycle's jobs in rank order, kept for the next (see the module's docstring).

    Not thread-safe, and meant for one caller: a cycle reads and replaces it."""

    __slots__ = ("_by_id", "_by_rank", "_order")

    def __init__(self) -> None:
        self._order: str | None = None
        # id(view) -> its Ranked, which holds the view (so the id stays its own).
        self._by_id: dict[int, Ranked] = {}
        self._by_rank: list[Ranked] = []

    def rank(
        self, order: QueueOrder, jobs: Sequence[JobView], context: OrderContext
    ) -> tuple[Ordered, list[Ranked]]:
        """`order(jobs, context)` and `rank_order` of its ranks, ranking only the views
        this ranking has not seen. The `Ordered` covers the jobs ranked this cycle (its
        flags are the order's own); the list is every job's, in rank order."""
        if not order.view_only:
            ordered = order(jobs, context)
            self._forget()
            return ordered, rank_order(ordered.ranked)
        if order.name != self._order:
            self._forget()
            self._order = order.name
        known = self._by_id
        current = set(map(id, jobs))
        gone = known.keys() - current
        fresh = [job for job in jobs if id(job) not in known]
        ordered = order(fresh, context)
        added = rank_order(ordered.ranked)
        kept = self._by_rank
        if len(gone) + len(added) > _RESORT_SHARE * len(kept):
            by_rank = rank_order([*(r for r in kept if id(r.job) in current), *added])
        else:
            by_rank = list(kept)
            for key in gone:
                _remove(by_rank, known[key])
            for item in added:
                bisect.insort(by_rank, item, key=_rank_key)
        for key in gone:
            del known[key]
        for item in added:
            known[id(item.job)] = item
        self._by_rank = by_rank
        return ordered, list(by_rank)

    def _forget(self) -> None:
        self._order = None
        self._by_id.clear()
        self._by_rank = []


def _remove(by_rank: list[Ranked], item: Ranked) -> None:
    """Take `item` out of an order sorted by `_rank_key` (ids are unique, so its key
    is too: the first position with that key is its own)."""
    at = bisect.bisect_left(by_rank, _rank_key(item), key=_rank_key)
    if by_rank[at] is not item:
        raise AssertionError(f"job {item.job.job_id} is not where its rank puts it")
    del by_rank[at]
