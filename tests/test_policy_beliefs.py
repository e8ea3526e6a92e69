"""Orders that weigh evidence: `progress-gittins` (a job's believed total, weighed by how
wrong finished jobs' beliefs were) and `gittins-size` (the service distribution of the
job's size class, and the exact Gittins index). Table-driven; no bus."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import (
    DEFAULT_ERROR_PRIOR,
    ORDERINGS,
    BeliefErrors,
    ClusterSnapshot,
    Grant,
    JobView,
    NodeView,
    Policy,
    ServiceDistribution,
    decide,
    ordering,
    reads,
)
from brain.core.distribution import ERROR_POINTS, ServiceByClass, gpu_class
from brain.core.ordering import OrderContext
from brain.sim import SimConfig, parse_cluster, simulate
from brain.sim.trace import TraceJob

# -- the distribution -----------------------------------------------------------------


@dataclass(frozen=True)
class RemainingCase:
    name: str
    samples: tuple[float, ...]
    scale: float
    done: float
    expected: float | None


REMAINING_CASES = [
    RemainingCase("one ratio, 1: exactly what is left (SRTF)", (1.0,), 100.0, 30.0, 70.0),
    RemainingCase("past every ratio seen: nothing to say", (1.0,), 100.0, 100.0, None),
    # Ratios 1 or 3 of a believed 10, 5 done: 5 or 25 left (15 expected); worth 5 + 5 for
    # a chance of 1/2 of finishing within 5: ranked as 10, not 15.
    RemainingCase("likely to finish soon: less than the mean", (1.0, 3.0), 10.0, 5.0, 10.0),
    # Past 1x its belief: only ratio 3 is left, 30 - 15.
    RemainingCase("conditioned on having overrun", (1.0, 3.0), 10.0, 15.0, 15.0),
    # A new job of 10, 20, 30 or 40: every look-ahead to the end gives 25, the mean.
    RemainingCase("a new job, even spread: its mean", (10.0, 20.0, 30.0, 40.0), 1.0, 0.0, 25.0),
]


@pytest.mark.parametrize("case", REMAINING_CASES, ids=[c.name for c in REMAINING_CASES])
def test_scaled_gittins_remaining(case: RemainingCase) -> None:
    distribution = ServiceDistribution.from_samples(list(case.samples))
    got = distribution.scaled_gittins_remaining(case.scale, case.done)
    assert got == (None if case.expected is None else pytest.approx(case.expected))


@pytest.mark.parametrize("case", REMAINING_CASES, ids=[c.name for c in REMAINING_CASES])
def test_remaining_indexer_says_the_same(case: RemainingCase) -> None:
    distribution = ServiceDistribution.from_samples(list(case.samples))
    got = distribution.remaining_indexer()(case.scale, case.done)
    assert got == (None if case.expected is None else pytest.approx(case.expected))


_SAMPLES = st.lists(st.floats(0.01, 1e6), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(
    samples=_SAMPLES,
    censored=st.lists(st.floats(0.01, 1e6), max_size=30),
    queries=st.lists(
        st.tuples(st.floats(0.001, 1e4), st.floats(0.0, 1.0), st.floats(0.0, 3.0)),
        min_size=1,
        max_size=20,
    ),
)
def test_remaining_indexer_is_scaled_gittins_remaining(
    samples: list[float], censored: list[float], queries: list[tuple[float, float, float]]
) -> None:
    """The look-ahead over the lower hull (`remaining_indexer`) against the definition
    (every look-ahead tried), on distributions with and without censored samples, asked
    for `done` below, at and above each sample's scaled value."""
    distribution = ServiceDistribution.from_samples(samples).with_censored(censored)
    remaining = distribution.remaining_indexer()
    values = distribution.values
    for scale, where, past in queries:
        done = values[int(where * (len(values) - 1))] * scale * past
        expected = distribution.scaled_gittins_remaining(scale, done)
        got = remaining(scale, done)
        if expected is None:
            assert got is None
        else:
            assert got == pytest.approx(expected, rel=1e-9, abs=1e-9 * scale * values[-1])


def test_exact_index_is_the_reciprocal_and_zero_past_the_samples() -> None:
    distribution = ServiceDistribution.from_samples([10.0, 20.0, 30.0, 40.0])
    assert distribution.gittins_index_exact(0.0) == pytest.approx(1 / 25)
    # At 25: 30 or 40, 5 or 15 left; look ahead 5: 1/2 finish, 5 used -> 1/10.
    assert distribution.gittins_index_exact(25.0) == pytest.approx(1 / 10)
    assert distribution.gittins_index_exact(45.0) == 0.0
    # Unlike a fixed quantum, it does not depend on the distribution's scale.
    scaled = ServiceDistribution.from_samples([1e5, 2e5, 3e5, 4e5])
    assert scaled.gittins_index_exact(0.0) == pytest.approx(1 / 25e4)
    assert scaled.gittins_index(0.0, 3250.0) == 0.0


def test_compressed_keeps_the_weight_and_the_mean() -> None:
    distribution = ServiceDistribution.from_samples([float(i) for i in range(1, 1001)])
    small = distribution.compressed(64)
    assert len(small.values) <= 64
    assert list(small.values) == sorted(small.values)
    assert small.cumulative_weight[-1] == pytest.approx(1000.0)
    assert small.cumulative_weighted_value[-1] == pytest.approx(500_500.0)
    assert distribution.compressed(2000) is distribution


def test_blended_shrinks_a_class_toward_the_pooled() -> None:
    own = ServiceDistribution.from_samples([100.0, 100.0])
    pooled = ServiceDistribution.from_samples([1.0, 10.0, 1000.0, 1000.0])
    blend = own.blended(pooled, 4.0)
    assert blend.values == (1.0, 10.0, 100.0, 100.0, 1000.0, 1000.0)
    assert blend.cumulative_weight[-1] == pytest.approx(6.0)
    assert own.blended(pooled, 0.0) is own


@pytest.mark.parametrize(
    ("gpus", "size_class"),
    [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16, 4), (24, 5), (32, 5)],
)
def test_gpu_class(gpus: int, size_class: int) -> None:
    assert gpu_class(gpus) == size_class


def test_service_by_class_looks_up_the_jobs_class() -> None:
    short = ServiceDistribution.from_samples([10.0])
    long = ServiceDistribution.from_samples([1e6])
    classes = ServiceByClass(((0, short), (2, long)))
    assert classes.of(1) is short
    assert classes.of(4) is long
    assert classes.of(8) is None


# -- the orders -----------------------------------------------------------------------


def test_the_orders_declare_what_they_read() -> None:
    assert reads("progress-gittins", "progress")
    assert reads("progress-gittins", "progress_error")
    assert not reads("progress-gittins", "declared_duration")
    assert reads("gittins-size", "distribution")
    assert reads("gittins-size", "class_distribution")
    assert not reads("gittins", "class_distribution")
    assert not reads("progress", "progress_error")


def job(job_id: str, gpus: int = 1, **fields: object) -> JobView:
    return replace(JobView(job_id, gpus, 0.0), **fields)  # type: ignore[arg-type]


def reporting(job_id: str, believed_s: float, done_s: float, **fields: object) -> JobView:
    """A job whose reports say it is `done_s` into a total it believes is `believed_s`."""
    return job(
        job_id,
        executed_seconds=done_s,
        progress_fraction=min(0.999, done_s / believed_s),
        progress_rate_per_s=1.0 / believed_s,
        **fields,
    )


WIDE = ServiceDistribution.from_samples([0.5, 2.0])
EXACT = ServiceDistribution.from_samples([1.0] * 20)


@dataclass(frozen=True)
class RankCase:
    name: str
    order: str
    jobs: tuple[JobView, ...]
    first: str
    errors: ServiceDistribution | None = None
    distribution: ServiceDistribution | None = None
    classes: ServiceByClass | None = None


# Pooled, half the jobs are short and half very long; by size class, 1-GPU jobs take
# 100 or 1,000 GPU-s, 4-GPU jobs a million.
MIXED = ServiceDistribution.from_samples([100.0] * 10 + [1e6] * 10)
BY_SIZE = ServiceByClass(
    (
        (0, ServiceDistribution.from_samples([100.0] * 5 + [1000.0] * 5)),
        (2, ServiceDistribution.from_samples([1e6] * 10)),
    )
)
SIZES = (job("big", 4), job("small", 1, attained_gpu_seconds=500.0))

RANK_CASES = [
    RankCase(
        "progress-gittins, exact beliefs: the least left first, as SRTF",
        "progress-gittins",
        (reporting("near", 1000, 900), reporting("mid", 1000, 400)),
        first="near",
        errors=EXACT,
    ),
    RankCase(
        "progress-gittins, beliefs off by 2x: 'nearly done' has shown it is the long kind",
        "progress-gittins",
        # `near` has run past half its belief: its total is twice it, 1,100 s to go;
        # `mid` may be at half, 100 s to go.
        (reporting("near", 1000, 900), reporting("mid", 1000, 400)),
        first="mid",
        errors=WIDE,
    ),
    RankCase(
        "progress, the same jobs: believes the reports",
        "progress",
        (reporting("near", 1000, 900), reporting("mid", 1000, 400)),
        first="near",
    ),
    RankCase(
        "progress-gittins without a learned distribution: the prior",
        "progress-gittins",
        (reporting("long", 10_000, 100), reporting("short", 100, 10)),
        first="short",
    ),
    RankCase(
        "progress-gittins: a job yet to report is probed first",
        "progress-gittins",
        (reporting("short", 100, 10), job("new", executed_seconds=0.0)),
        first="new",
        errors=EXACT,
    ),
    RankCase(
        "gittins-size: a new 4-GPU job is the long kind",
        "gittins-size",
        SIZES,
        first="small",
        distribution=MIXED,
        classes=BY_SIZE,
    ),
    RankCase(
        "gittins-size without classes: the pooled distribution",
        "gittins-size",
        SIZES,
        first="big",
        distribution=MIXED,
    ),
    RankCase(
        "gittins (pooled, a quantum): a job past the short samples is the long kind",
        "gittins",
        SIZES,
        first="big",
        distribution=MIXED,
        classes=BY_SIZE,
    ),
]


@pytest.mark.parametrize("case", RANK_CASES, ids=[c.name for c in RANK_CASES])
def test_rank(case: RankCase) -> None:
    context = OrderContext(
        now=1000.0,
        las_thresholds_gpu_s=(3250.0, 7200.0),
        gittins_quantum_gpu_s=3250.0,
        distribution=case.distribution or MIXED,
        error_distribution=case.errors,
        service_by_class=case.classes,
    )
    ordered = ORDERINGS[case.order](case.jobs, context)
    assert ordered.jobs[0].job_id == case.first


def test_decide_hands_the_order_what_the_snapshot_learned() -> None:
    # One GPU: `near` runs, `mid` waits; with beliefs known to be off by 2x, `mid`
    # (likely 100 s to go) preempts `near` (which has shown it needs 1,100 more).
    near = replace(reporting("near", 1000, 900), grants=(Grant("n0", (0,)),), started_at=100.0)
    snapshot = ClusterSnapshot(
        nodes=(NodeView("n0", (0,), frozenset(), "s0"),),
        pending=(reporting("mid", 1000, 400, pending_since=500.0),),
        running=(near,),
        error_distribution=WIDE,
    )
    decisions = decide(snapshot, 1000.0, Policy(order="progress-gittins"))
    assert {p.job_id for p in decisions.preemptions} == {"near"}
    assert {p.job_id for p in decisions.placements} == {"mid"}
    exact = replace(snapshot, error_distribution=EXACT)
    assert decide(exact, 1000.0, Policy(order="progress-gittins")).preemptions == ()


def test_belief_errors_learn_what_finished_jobs_were_off_by() -> None:
    errors = BeliefErrors(keep=3)
    assert errors.view is DEFAULT_ERROR_PRIOR and errors.learned == 0
    # Ran 200 s; its reports said a hundredth of the work a second: off by 2x.
    errors.learn(200.0, 0.01)
    assert errors.latest == (2.0,) and errors.learned == 1
    assert 2.0 in errors.view.values
    assert errors.view.cumulative_weight[-1] == pytest.approx(
        DEFAULT_ERROR_PRIOR.cumulative_weight[-1] + 1.0
    )
    # No run, or no rate: nothing learned.
    for executed_s, rate in ((0.0, 0.01), (200.0, 0.0), (200.0, math.inf)):
        errors.learn(executed_s, rate)
    assert errors.learned == 1
    # The latest `keep` to twice as many: past 6, built again from the latest 3.
    for ratio in (1.0, 3.0, 0.5, 1.5, 4.0):
        errors.learn(100.0, ratio / 100.0)
    assert errors.learned == 6
    errors.learn(100.0, 0.025)
    assert errors.latest == pytest.approx((1.5, 4.0, 2.5)) and errors.learned == 3
    assert len(errors.view.values) == len(DEFAULT_ERROR_PRIOR.values) + 3
    with pytest.raises(ValueError, match="keep must be at least 1"):
        BeliefErrors(keep=0)


def test_belief_errors_are_compressed_for_the_order() -> None:
    errors = BeliefErrors()
    for i in range(1, 1001):
        errors.learn(100.0, i / 1000.0)
    assert len(errors.view.values) <= ERROR_POINTS < errors.learned


def test_the_error_prior_is_centred_on_right() -> None:
    values = DEFAULT_ERROR_PRIOR.values
    assert values[0] == pytest.approx(0.25) and values[-1] == pytest.approx(4.0)
    assert DEFAULT_ERROR_PRIOR.scaled_gittins_remaining(100.0, 0.0) is not None


# -- in the simulator -----------------------------------------------------------------


def trace() -> tuple[TraceJob, ...]:
    # Short 1-GPU jobs and long 4-GPU ones, arriving together.
    short = [TraceJob(f"s{i}", 1, 50.0 * i, 100.0 + 10 * i) for i in range(12)]
    long = [TraceJob(f"l{i}", 4, 120.0 * i, 3000.0 + 100 * i) for i in range(4)]
    return (*short, *long)


@pytest.mark.parametrize(
    ("order", "error"),
    [("progress-gittins", 0.0), ("progress-gittins", 1.0), ("gittins-size", 0.0)],
)
def test_the_new_orders_replay_a_trace_to_the_end(order: str, error: float) -> None:
    config = SimConfig(Policy(order=order), parse_cluster("2x4"), progress_error=error)
    result = simulate(trace(), config)
    assert result.unfinished == ()


def test_progress_gittins_with_exact_beliefs_is_progress() -> None:
    # Exact beliefs: the learned ratios are all 1, and the order is SRTF on reports.
    config = SimConfig(Policy(order="progress"), parse_cluster("2x4"))
    plain = simulate(trace(), config)
    weighed = simulate(trace(), replace(config, policy=Policy(order="progress-gittins")))
    assert [o.finished_at for o in weighed.outcomes] == [o.finished_at for o in plain.outcomes]


def test_kept_indices_are_bounded_and_still_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound every kept distribution forgets its indices; asked again, each is
    computed again, the same."""
    monkeypatch.setattr(ordering, "_INDICES", {})
    monkeypatch.setattr(ordering, "_MEMO", ordering._MemoBudget(3))
    distribution = ServiceDistribution.from_samples([1.0, 2.0, 4.0, 8.0])
    kept = ordering.indices_of(distribution)
    asks = [(10.0, done) for done in (0.0, 5.0, 15.0, 30.0, 50.0)]
    first = [kept.scaled(scale, done) for scale, done in asks]
    assert kept.held() <= 3 and ordering._MEMO.held <= 3
    again = [kept.scaled(scale, done) for scale, done in asks]
    expected = [distribution.scaled_gittins_remaining(scale, done) for scale, done in asks]
    assert first == again
    assert again == [None if e is None else pytest.approx(e) for e in expected]
    assert ordering.indices_of(distribution) is kept
