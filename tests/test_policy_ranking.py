"""A ranking kept from one cycle to the next (brain/core/ranking.py), and a ledger
(brain/core/placement.py), change what a cycle costs, never what it decides."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.decide_scale import NOW, Size, build_snapshot
from brain.core import (
    DEFAULT_SERVICE_PRIOR,
    ORDERINGS,
    ClusterSnapshot,
    Grant,
    JobView,
    KeptLedger,
    Policy,
    Ranking,
    decide,
)
from brain.core.ordering import OrderContext, Ranked
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


def _nodes_changed(snapshot: ClusterSnapshot, rng: random.Random) -> ClusterSnapshot:
    """Some node views rebuilt for the next pass: the same, or with a GPU fewer free."""
    nodes = list(snapshot.nodes)
    for _ in range(rng.randint(0, 4)):
        at = rng.randrange(len(nodes))
        free = nodes[at].free
        if free and rng.random() < 0.5:
            free = free - {min(free)}
        nodes[at] = replace(nodes[at], free=free)
    return replace(snapshot, nodes=tuple(nodes))


@pytest.mark.parametrize("order", sorted(ORDERINGS))
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_kept_ranking_and_ledger_decide_as_fresh_ones(order: str, seed: int) -> None:
    """As the live brain decides: a `Ranking` and a `KeptLedger` (brain/core/placement.py)
    kept from pass to pass, over snapshots whose jobs and nodes change."""
    rng = random.Random(seed)
    snapshot = build_snapshot(Size("s", 12, 40, 80), seed=rng.randrange(1_000))
    policy = Policy(order=order)
    ranking, ledger = Ranking(), KeptLedger()
    for serial in range(6):
        for waits in (False, True):
            fresh = decide(snapshot, NOW, policy, waits=waits)
            kept = decide(snapshot, NOW, policy, waits=waits, ranking=ranking, ledger=ledger)
            assert kept.actions == fresh.actions
            assert kept.wake_at == fresh.wake_at
        snapshot = _nodes_changed(_next(snapshot, rng, serial), rng)
    assert ledger.reused > 0


def test_orders_that_read_more_than_a_view_are_ranked_afresh() -> None:
    """An order whose ranks read the clock or the context (las: a job's place in its
    band depends on whether it entered the band before now) ranks every job at every
    cycle, ranking or not: the same views, a later clock, a different order."""
    assert {name for name, order in ORDERINGS.items() if order.view_only} == {"fifo", "priority"}
    grant = (Grant("n0", (0,)),)
    # Entered band 0 at NOW: at NOW it stands with the waiting jobs, by service; later,
    # with the running ones, ahead of every waiting job of the band.
    demoted = JobView(
        "1",
        1,
        0.0,
        grants=grant,
        started_at=0.0,
        attained_gpu_seconds=50.0,
        service_level_since=NOW,
    )
    waiting = JobView("2", 1, 1.0, attained_gpu_seconds=10.0)
    jobs = (demoted, waiting)
    order = ORDERINGS["las"]
    ranking = Ranking()
    orders = []
    for now in (NOW, NOW + 600.0):
        context = OrderContext(now, Policy().las_thresholds_gpu_s, 3250.0, DEFAULT_SERVICE_PRIOR)
        _, by_rank = ranking.rank(order, jobs, context)
        assert by_rank == rank_order(order(jobs, context).ranked)
        orders.append([r.job.job_id for r in by_rank])
    assert orders == [["2", "1"], ["1", "2"]]


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
