"""A ranking kept from one cycle to the next (brain/core/ranking.py) changes what a
cycle costs, never what it decides."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.decide_scale import NOW, Size, build_snapshot
from brain.core import ORDERINGS, ClusterSnapshot, JobView, Policy, Ranking, decide
from brain.core.ordering import Ranked
from brain.core.ranking import rank_order


def _next(snapshot: ClusterSnapshot, rng: random.Random, serial: int) -> ClusterSnapshot:
    """What a live brain's next pass might see: some pending jobs placed or cancelled,
    some new, some changed (a new view of the same job), running jobs started from
    the queue and ended; every other view the very object it was."""
    pending = list(snapshot.pending)
    running = list(snapshot.running)
    for _ in range(rng.randint(0, 3)):
        if pending:
            pending.pop(rng.randrange(len(pending)))
    for i in range(rng.randint(0, 4)):
        gpus = rng.choice((1, 1, 2, 4, 8))
        submitted = NOW - rng.choice((0.0, 10.0, rng.uniform(0.0, 7_200.0)))  # some tie
        pending.append(JobView(f"new{serial}-{i}", gpus, submitted, priority=rng.randint(0, 3)))
    for _ in range(rng.randint(0, 3)):
        if pending:
            at = rng.randrange(len(pending))
            pending[at] = replace(pending[at], priority=rng.randint(0, 3))
    for _ in range(rng.randint(0, 2)):
        if running:
            running.pop(rng.randrange(len(running)))
    if rng.random() < 0.3:
        # A pass that re-read every view (a new object for each: all of them "new").
        pending = [replace(job) for job in pending]
    return replace(snapshot, pending=tuple(pending), running=tuple(running))


@pytest.mark.parametrize("order", sorted(ORDERINGS))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_kept_ranking_decides_as_a_fresh_one(order: str, seed: int) -> None:
    rng = random.Random(seed)
    snapshot = build_snapshot(Size("s", 12, 40, 80), seed=rng.randrange(1_000))
    policy = Policy(order=order)
    ranking = Ranking()
    for serial in range(6):
        for waits in (False, True):
            fresh = decide(snapshot, NOW, policy, waits=waits)
            kept = decide(snapshot, NOW, policy, waits=waits, ranking=ranking)
            assert kept.actions == fresh.actions
            assert kept.wake_at == fresh.wake_at
        snapshot = _next(snapshot, rng, serial)


def test_orders_that_read_more_than_a_view_are_ranked_afresh() -> None:
    """An order whose ranks read the clock or the context (las: service; gittins: the
    learned distribution) ranks every job at every cycle, ranking or not."""
    assert {name for name, order in ORDERINGS.items() if order.view_only} == {"fifo", "priority"}
    snapshot = build_snapshot(Size("s", 12, 40, 80))
    ranking = Ranking()
    for now in (NOW, NOW + 600.0):
        policy = Policy(order="las")
        kept = decide(snapshot, now, policy, ranking=ranking)
        assert kept == decide(snapshot, now, policy)


def test_rank_order_is_by_rank_then_submission_then_id() -> None:
    jobs = [
        JobView("10", 1, 5.0),
        JobView("9", 1, 5.0),  # same submission: by id, numerically
        JobView("x", 1, 1.0),
        JobView("2", 1, 9.0),
    ]
    ranked = [
        Ranked(jobs[0], (1.0,), ""),
        Ranked(jobs[1], (1.0,), ""),
        Ranked(jobs[2], (1.0,), ""),
        Ranked(jobs[3], (0.0,), ""),
    ]
    assert [r.job.job_id for r in rank_order(ranked)] == ["2", "x", "9", "10"]
