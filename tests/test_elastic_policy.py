"""The elasticity stage of the policy core: table-driven cases and hypothesis properties.

Pure: snapshot builders -> `decide` -> decisions; no bus, no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import (
    ClusterSnapshot,
    Decisions,
    Evacuated,
    Grant,
    InvalidPolicy,
    JobView,
    Measured,
    NodeView,
    Place,
    Policy,
    Preempt,
    Resize,
    UnknownPlugin,
    decide,
)
from brain.core.elastic import (
    ELASTICITIES,
    RIGID,
    ElasticStage,
    estimate_throughput,
    is_resize_round,
    next_resize_round,
    prior_speedup,
)
from brain.core.placement import FreeGpus

ELASTIC = Policy(order="las", elasticity="marginal-gain")
ONE_NODE = replace(ELASTIC, elastic_may_spread=False)  # --elastic-one-node

# -- builders -------------------------------------------------------------------------


def node(name: str, gpus: int = 4, busy: tuple[int, ...] = ()) -> NodeView:
    all_gpus = tuple(range(gpus))
    return NodeView(name, all_gpus, frozenset(g for g in all_gpus if g not in busy))


def pending(job_id: str, gpus: int, at: float = 0.0, **fields: object) -> JobView:
    return replace(JobView(job_id, gpus, at), **fields)  # type: ignore[arg-type]


def elastic(
    job_id: str,
    asked: int,
    least: int,
    most: int,
    *,
    on: tuple[Grant, ...] = (),
    throughput: tuple[tuple[int, float], ...] = (),
    attained: float = 0.0,
    at: float = 0.0,
    **fields: object,
) -> JobView:
    view = JobView(
        job_id,
        asked,
        at,
        grants=on,
        started_at=at if on else None,
        min_gpus=least,
        max_gpus=most,
        # Exact rates, as the simulator reports them.
        throughput=tuple(Measured(size, rate) for size, rate in throughput),
        attained_gpu_seconds=attained,
    )
    return replace(view, **fields)  # type: ignore[arg-type]


def on(name: str, *gpus: int) -> tuple[Grant, ...]:
    return (Grant(name, gpus),)


def snapshot(
    *nodes: NodeView, pending_jobs: tuple[JobView, ...] = (), running: tuple[JobView, ...] = ()
) -> ClusterSnapshot:
    return ClusterSnapshot(nodes, pending_jobs, running)


def sizes(decisions: Decisions) -> dict[str, int]:
    """Final GPU counts of every job placed or resized."""
    out = {p.job_id: sum(len(g.gpus) for g in p.grants) for p in decisions.placements}
    out.update({r.job_id: r.size for r in decisions.resizes})
    return out


# -- the throughput estimate ----------------------------------------------------------


def test_estimate_uses_observations_then_interpolates_then_the_prior() -> None:
    job = elastic("1", 4, 1, 16, throughput=((2, 100.0), (4, 180.0)))
    assert estimate_throughput(job, 4) == 180.0
    assert estimate_throughput(job, 3) == pytest.approx(140.0)
    # Below every observation: the prior's shape, through the smallest observation.
    assert estimate_throughput(job, 1) == pytest.approx(100.0 * prior_speedup(1) / prior_speedup(2))
    # Above: the prior, but never steeper than the last observed slope (40/GPU).
    assert estimate_throughput(job, 6) == pytest.approx(
        min(180.0 * prior_speedup(6) / prior_speedup(4), 260.0)
    )
    # Nothing observed: the prior alone.
    assert estimate_throughput(elastic("2", 4, 1, 8), 8) == prior_speedup(8)


def test_an_observed_slowdown_predicts_no_gain() -> None:
    job = elastic("1", 4, 1, 8, throughput=((4, 100.0), (5, 70.0)))
    assert estimate_throughput(job, 6) < estimate_throughput(job, 5) < 100.0


def test_prior_is_concave() -> None:
    gains = [prior_speedup(n + 1) - prior_speedup(n) for n in range(1, 64)]
    assert all(g > 0 for g in gains)
    assert gains == sorted(gains, reverse=True)


# -- configuration --------------------------------------------------------------------


def test_none_and_a_cycle_without_elastic_jobs_get_the_identity_stage() -> None:
    """Elasticity is one plugin among the others: `decide` drives whatever stage it
    starts, and "none" (or a snapshot with no elastic job) starts the identity."""
    elastic_world = snapshot(node("n0"), pending_jobs=(elastic("1", 2, 1, 4),))
    rigid_world = snapshot(node("n0"), pending_jobs=(pending("1", 2),))
    settings = {
        "may_spread": True,
        "min_gain": 0.25,
        "now": 0.0,
        "resize_interval_s": 0.0,
        "payback": 4.0,
        "reprobe_s": 1800.0,
    }
    assert ELASTICITIES["none"].start(elastic_world, **settings) is RIGID
    assert ELASTICITIES["marginal-gain"].start(rigid_world, **settings) is RIGID
    stage = ELASTICITIES["marginal-gain"].start(elastic_world, **settings)
    assert isinstance(stage, ElasticStage) and stage.resizes
    assert not ELASTICITIES["none"].sizes_jobs and ELASTICITIES["linear"].sizes_jobs
    # The identity takes and places every job at what it asked, and changes nothing.
    job = elastic("1", 2, 1, 4)
    assert (RIGID.need(job), RIGID.size(job), RIGID.resizes) == (2, 2, False)
    assert RIGID.views(elastic_world) is elastic_world
    assert RIGID.finish(FreeGpus(elastic_world.nodes), [], set()) == ([], [], [])


def test_unknown_elasticity_and_bad_gain_are_rejected() -> None:
    with pytest.raises(UnknownPlugin, match="unknown elasticity policy 'greedy'"):
        Policy(elasticity="greedy").validate()
    with pytest.raises(InvalidPolicy, match="minimum gain"):
        Policy(elasticity="marginal-gain", elastic_min_gain=1.5).validate()
    assert set(ELASTICITIES) >= {"none", "marginal-gain"}
    assert Policy(elasticity="marginal-gain").describe().endswith("elasticity=marginal-gain")
    assert "elasticity" not in Policy().describe()
    with pytest.raises(InvalidPolicy, match="resize interval"):
        Policy(elasticity="marginal-gain", elastic_resize_interval_s=-1.0).validate()


# -- table-driven cases ---------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    policy: Policy
    snapshot: ClusterSnapshot
    # Final sizes of the jobs placed or resized; jobs absent here were neither.
    sizes: dict[str, int]
    preempted: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    # A word every Resize (or elastic Place) cause for that job must contain.
    cause: dict[str, str] | None = None


CASES = [
    Case(
        "none: an elastic job is rigid at the size it asked for",
        Policy(order="las"),
        snapshot(node("n0", busy=(0, 1)), pending_jobs=(elastic("1", 4, 1, 8),)),
        sizes={},
        waiting=frozenset({"1"}),
    ),
    Case(
        "admitted with what is free, down to its minimum",
        ELASTIC,
        snapshot(node("n0", busy=(0, 1)), pending_jobs=(elastic("1", 4, 1, 8),)),
        sizes={"1": 2},
        cause={"1": "less than the 4 asked for"},
    ),
    Case(
        "a new job starts at what it asked for, not past it (nothing measured yet)",
        ELASTIC,
        snapshot(node("n0", gpus=8), pending_jobs=(elastic("1", 2, 1, 8),)),
        sizes={"1": 2},
    ),
    Case(
        "a job measured before grows past its ask, at most twice the largest measured",
        ELASTIC,
        snapshot(
            node("n0", gpus=8), pending_jobs=(elastic("1", 2, 1, 8, throughput=((2, 10.0),)),)
        ),
        sizes={"1": 4},
        cause={"1": "idle"},
    ),
    Case(
        "below its minimum it waits",
        ELASTIC,
        snapshot(node("n0", busy=(0, 1, 2)), pending_jobs=(elastic("1", 4, 2, 8),)),
        sizes={},
        waiting=frozenset({"1"}),
    ),
    Case(
        "the idle GPU goes to the job with the higher marginal gain",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=(0, 1, 2, 3, 4, 5, 6)),
            running=(
                elastic("1", 3, 1, 8, on=on("n0", 0, 1, 2), throughput=((2, 60.0), (3, 70.0))),
                elastic("2", 4, 1, 8, on=on("n0", 3, 4, 5, 6), throughput=((4, 100.0),)),
            ),
        ),
        sizes={"2": 5},
        cause={"2": "grown from 4 to 5"},
    ),
    Case(
        "GPUs above minimums are shared by marginal gain, ties to less attained service",
        ELASTIC,
        snapshot(
            node("n0", gpus=9, busy=(0, 1, 2, 3)),
            running=(
                # Entered band 2 first (FIFO would favour it) but has had 5x the service.
                elastic(
                    "1",
                    6,
                    1,
                    8,
                    on=on("n0", 0, 1),
                    throughput=((2, 10.0),),
                    attained=1e5,
                    service_level=2,
                    service_level_since=0.0,
                ),
                elastic(
                    "2",
                    6,
                    1,
                    8,
                    on=on("n0", 2, 3),
                    throughput=((2, 10.0),),
                    attained=2e4,
                    service_level=2,
                    service_level_since=50.0,
                ),
            ),
        ),
        # Equal gains: they alternate, and the odd GPU goes to the better-ranked one.
        sizes={"1": 4, "2": 5},
        cause={"2": "grown from 2 to 5"},
    ),
    Case(
        "the job that scales better gets the GPUs above minimums, not the better-ranked",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=(0, 1, 2, 3)),
            running=(
                # Better ranked (less service) but its second GPU added 30%.
                elastic("1", 6, 1, 8, on=on("n0", 0, 1), throughput=((1, 10.0), (2, 13.0))),
                elastic(
                    "2",
                    6,
                    1,
                    8,
                    on=on("n0", 2, 3),
                    throughput=((1, 10.0), (2, 20.0)),
                    attained=1e5,
                ),
            ),
        ),
        # By rank, job 1 would take all four idle GPUs (its ask).
        sizes={"1": 3, "2": 5},
        cause={"2": "grown from 2 to 5"},
    ),
    Case(
        "a priority is an entitlement: the higher one reaches its ask first",
        replace(ELASTIC, order="priority"),
        snapshot(
            node("n0", gpus=8, busy=(0, 1, 2, 3)),
            running=(
                elastic("1", 6, 1, 8, on=on("n0", 0, 1), throughput=((1, 10.0), (2, 20.0))),
                elastic(
                    "2", 6, 1, 8, on=on("n0", 2, 3), throughput=((1, 10.0), (2, 13.0)), priority=5
                ),
            ),
        ),
        sizes={"2": 6},
        cause={"2": "grown from 2 to 6"},
    ),
    Case(
        "a GPU that adds too little is left idle",
        replace(ELASTIC, elastic_min_gain=0.9),
        snapshot(
            node("n0", busy=(0, 1)),
            running=(elastic("1", 2, 1, 4, on=on("n0", 0, 1), throughput=((2, 100.0),)),),
        ),
        sizes={},
    ),
    Case(
        "shrink above its ask to make room, instead of preempting",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=tuple(range(8))),
            pending_jobs=(pending("2", 4, at=10.0),),
            running=(
                elastic(
                    "1", 4, 2, 8, on=on("n0", *range(8)), throughput=((8, 200.0),), attained=1e5
                ),
            ),
        ),
        sizes={"1": 4, "2": 4},
        cause={"1": "for job 2"},
    ),
    Case(
        "a better-ranked job is shrunk toward its minimum, never below it",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=tuple(range(8))),
            pending_jobs=(pending("2", 4, at=10.0, attained_gpu_seconds=1e6),),
            running=(elastic("1", 8, 6, 8, on=on("n0", *range(8)), attained=10.0),),
        ),
        sizes={},
        waiting=frozenset({"2"}),
    ),
    Case(
        "a worse-ranked job that cannot shrink far enough is preempted",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=tuple(range(8))),
            pending_jobs=(pending("2", 4, at=10.0),),
            running=(elastic("1", 8, 6, 8, on=on("n0", *range(8)), attained=1e6),),
        ),
        sizes={"2": 4},
        preempted=frozenset({"1"}),
    ),
    Case(
        "the job with the lowest marginal loss gives first",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=tuple(range(8))),
            pending_jobs=(pending("3", 1, at=10.0),),
            running=(
                # Scales well: losing a GPU costs it a quarter.
                elastic("1", 2, 1, 8, on=on("n0", 0, 1, 2, 3), throughput=((3, 75.0), (4, 100.0))),
                # Barely scales: losing a GPU costs it 2%.
                elastic("2", 2, 1, 8, on=on("n0", 4, 5, 6, 7), throughput=((3, 98.0), (4, 100.0))),
            ),
        ),
        sizes={"2": 3, "3": 1},
        cause={"2": "for job 3"},
    ),
    Case(
        "measured: the last GPU added too little, so it goes back",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=(0, 1, 2, 3, 4)),
            running=(
                elastic(
                    "1", 4, 1, 8, on=on("n0", 0, 1, 2, 3, 4), throughput=((4, 100.0), (5, 80.0))
                ),
            ),
        ),
        sizes={"1": 4},
        cause={"1": "did not earn their keep"},
    ),
    Case(
        "a job whose resize is staged keeps its size",
        ELASTIC,
        snapshot(
            node("n0", gpus=8, busy=(0, 1)),
            running=(
                elastic("1", 2, 1, 8, on=on("n0", 0, 1), throughput=((2, 9.0),), resizing=True),
            ),
        ),
        sizes={},
    ),
    Case(
        "one node: an elastic job grows on its own node only",
        ONE_NODE,
        snapshot(
            node("n0", busy=(0, 1, 2, 3)),
            node("n1"),
            running=(elastic("1", 4, 1, 8, on=on("n0", 0, 1, 2, 3), throughput=((4, 10.0),)),),
        ),
        sizes={},
    ),
    Case(
        "a job that fills its node may span another",
        ELASTIC,
        snapshot(
            node("n0", busy=(0, 1, 2, 3)),
            node("n1"),
            running=(elastic("1", 4, 1, 8, on=on("n0", 0, 1, 2, 3), throughput=((4, 10.0),)),),
        ),
        sizes={"1": 8},
    ),
    Case(
        "a pending elastic job that fits a node needs its minimum on one node",
        ELASTIC,
        snapshot(
            node("n0", busy=(0, 1)), node("n1", busy=(0, 1)), pending_jobs=(elastic("1", 3, 3, 4),)
        ),
        sizes={},
        waiting=frozenset({"1"}),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_elastic_cases(case: Case) -> None:
    decisions = decide(case.snapshot, 100.0, case.policy)
    assert sizes(decisions) == case.sizes
    assert {p.job_id for p in decisions.preemptions} == case.preempted
    assert {w.job_id for w in decisions.waits} == case.waiting
    for job_id, word in (case.cause or {}).items():
        causes = [r.reason for r in decisions.resizes if r.job_id == job_id]
        causes += [p.reason for p in decisions.placements if p.job_id == job_id]
        assert causes and all(word in c for c in causes), causes


def test_the_wait_reason_of_an_elastic_job_names_its_minimum() -> None:
    world = snapshot(
        node("n0", busy=(0, 1, 2, 3)),
        pending_jobs=(elastic("1", 4, 2, 8),),
        running=(pending("9", 4, grants=on("n0", 0, 1, 2, 3), started_at=0.0),),
    )
    (wait,) = decide(world, 100.0, ELASTIC).waits
    assert "at least 2 GPUs" in wait.reason


def test_shrinks_come_before_placements_and_grows_after() -> None:
    world = snapshot(
        node("n0", gpus=8, busy=tuple(range(8))),
        node("n1", gpus=2, busy=(0,)),
        pending_jobs=(pending("2", 4, at=10.0),),
        running=(
            elastic("1", 4, 2, 8, on=on("n0", *range(8)), throughput=((8, 9.0),), attained=1e5),
            elastic("3", 1, 1, 2, on=on("n1", 0), throughput=((1, 5.0),), attained=1e5),
        ),
    )
    # Job 2 waits for one node (no locality relaxation): it takes four of job 1's.
    actions = decide(world, 100.0, replace(ELASTIC, relax_locality_after_s=1e9)).actions
    kinds = [
        type(a.cause).__name__ if isinstance(a, Resize) else a.reason.split()[0]
        for a in actions
        if isinstance(a, Place | Resize)
    ]
    assert kinds == ["ShrunkFor", "placed", "Grown"]


def test_none_decides_exactly_as_if_the_jobs_were_rigid() -> None:
    jobs = (elastic("1", 2, 1, 8), elastic("2", 4, 2, 6, at=5.0))
    rigid = tuple(replace(j, min_gpus=None, max_gpus=None) for j in jobs)
    nodes = (node("n0", busy=(0,)), node("n1"))
    policy = Policy(order="las")
    assert decide(snapshot(*nodes, pending_jobs=jobs), 9.0, policy) == decide(
        snapshot(*nodes, pending_jobs=rigid), 9.0, policy
    )


@pytest.mark.parametrize("order", ["fifo", "priority", "las"])
def test_an_elasticity_stage_without_elastic_jobs_is_the_identity(order: str) -> None:
    """Rigid jobs only: an elasticity stage decides exactly as "none" does. (It would
    otherwise order them by service within a rank class, and the live brain could
    not reuse running jobs' views for an order that reads no service.)"""
    running = (
        replace(pending("1", 2, 0.0), grants=on("n0", 0, 1), attained_gpu_seconds=9e5),
        replace(pending("2", 2, 1.0), grants=on("n0", 2, 3), attained_gpu_seconds=10.0),
    )
    waiting = (pending("3", 4, 2.0, attained_gpu_seconds=5e5), pending("4", 4, 3.0))
    world = snapshot(node("n0"), node("n1"), pending_jobs=waiting, running=running)
    assert decide(world, 9.0, replace(ELASTIC, order=order)) == decide(
        world, 9.0, Policy(order=order)
    )


# -- the resize interval (rounds) ---------------------------------------------------

ROUNDS = replace(ELASTIC, elastic_resize_interval_s=60.0)


def test_resize_rounds() -> None:
    assert is_resize_round(120.0, 60.0) and is_resize_round(120.5, 60.0)
    assert not is_resize_round(130.0, 60.0)
    assert is_resize_round(130.0, 0.0)
    assert next_resize_round(130.0, 60.0) == 180.0
    assert next_resize_round(120.0, 60.0) == 180.0


def _growable() -> ClusterSnapshot:
    # Job 1 runs on 2 of 4 GPUs, measured scaling well: it would grow into the rest.
    running = elastic("1", 2, 1, 4, on=on("n0", 0, 1), throughput=((2, 100.0),))
    return snapshot(node("n0", busy=(0, 1)), running=(running,))


def test_between_rounds_running_jobs_keep_their_size_and_the_brain_wakes_at_the_next() -> None:
    between = decide(_growable(), 130.0, ROUNDS)
    assert sizes(between) == {}
    assert between.wake_at == 180.0
    assert sizes(decide(_growable(), 180.0, ROUNDS)) == {"1": 4}
    # Without an interval: at every cycle, as before.
    assert sizes(decide(_growable(), 130.0, ELASTIC)) == {"1": 4}


def test_between_rounds_new_jobs_are_placed_and_reclaims_still_happen() -> None:
    big = elastic("1", 2, 1, 4, on=on("n0", 0, 1, 2, 3), throughput=((4, 100.0),))
    world = snapshot(
        node("n0", busy=(0, 1, 2, 3)), running=(big,), pending_jobs=(pending("2", 2, at=120.0),)
    )
    decisions = decide(world, 130.0, ROUNDS)
    assert sizes(decisions) == {"1": 2, "2": 2}
    # A job placed between rounds may take idle GPUs at once (no resize to pay).
    fresh = snapshot(node("n0"), pending_jobs=(elastic("3", 2, 1, 4, throughput=((2, 10.0),)),))
    assert sizes(decide(fresh, 130.0, ROUNDS)) == {"3": 4}


# -- properties -----------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    snapshot: ClusterSnapshot
    now: float


@st.composite
def worlds(draw: st.DrawFn) -> World:
    nodes = [
        NodeView(f"n{i}", tuple(range(draw(st.integers(1, 8)))), frozenset())
        for i in range(draw(st.integers(1, 4)))
    ]
    busy: dict[str, set[int]] = {n.name: set() for n in nodes}
    now = draw(st.floats(0, 100_000))
    ids = iter(range(1000))

    def curve(most: int) -> tuple[tuple[int, float], ...]:
        observed = draw(st.lists(st.integers(1, most), unique=True, max_size=3))
        return tuple(sorted((n, draw(st.floats(1, 1000))) for n in observed))

    def range_of(asked: int) -> tuple[int, int]:
        least = draw(st.integers(1, asked))
        return least, draw(st.integers(asked, asked + 6))

    running: list[JobView] = []
    for _ in range(draw(st.integers(0, 6))):
        grants: list[Grant] = []
        for n in draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2, unique=True)):
            free = [g for g in n.gpus if g not in busy[n.name]]
            if free:
                take = tuple(free[: draw(st.integers(1, len(free)))])
                busy[n.name].update(take)
                grants.append(Grant(n.name, take))
        if not grants:
            continue
        held = sum(len(g.gpus) for g in grants)
        service = draw(st.floats(0, 50_000))
        if draw(st.booleans()):
            asked = draw(st.integers(1, held + 2))
            least, most = range_of(asked)
            least, most = min(least, held), max(most, held)
            job = elastic(
                str(next(ids)),
                asked,
                least,
                most,
                on=tuple(grants),
                throughput=curve(most),
                attained=service,
                at=draw(st.floats(0, now)),
                resizing=draw(st.booleans()) and draw(st.booleans()),
            )
        else:
            job = JobView(
                str(next(ids)),
                held,
                draw(st.floats(0, now)),
                grants=tuple(grants),
                started_at=now,
                attained_gpu_seconds=service,
            )
        running.append(job)
    waiting: list[JobView] = []
    for _ in range(draw(st.integers(0, 6))):
        asked = draw(st.integers(1, 8))
        at = draw(st.floats(0, now))
        if draw(st.booleans()):
            least, most = range_of(asked)
            waiting.append(elastic(str(next(ids)), asked, least, most, at=at))
        else:
            waiting.append(pending(str(next(ids)), asked, at=at))
    views = tuple(NodeView(n.name, n.gpus, frozenset(set(n.gpus) - busy[n.name])) for n in nodes)
    return World(ClusterSnapshot(views, tuple(waiting), tuple(running)), now)


policies = st.builds(
    Policy,
    order=st.sampled_from(["las", "fifo", "priority", "gittins"]),
    preemption=st.sampled_from(["by-rank", "quota-only"]),
    elasticity=st.sampled_from(sorted(ELASTICITIES)),
    elastic_may_spread=st.booleans(),
    elastic_min_gain=st.sampled_from([0.0, 0.25, 0.9]),
    elastic_resize_interval_s=st.sampled_from([0.0, 60.0]),
)


def held_after(world: World, decisions: Decisions) -> dict[str, list[tuple[str, int]]]:
    """Who holds which GPU once the decisions are applied in order (Preempt, Resize,
    Place: a GPU listed twice anywhere shows up as a duplicate)."""
    held = {
        j.job_id: [(g.node, gpu) for g in j.grants for gpu in g.gpus]
        for j in world.snapshot.running
    }
    for action in decisions.actions:
        if isinstance(action, Preempt):
            del held[action.job_id]
        elif isinstance(action, Place | Resize):
            held[action.job_id] = [(g.node, gpu) for g in action.grants for gpu in g.gpus]
    return held


@settings(max_examples=300, deadline=None)
@given(worlds(), policies)
def test_no_gpu_is_granted_twice_resizes_included(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    schedulable = {(n.name, g) for n in world.snapshot.nodes for g in n.gpus}
    seen: set[tuple[str, int]] = set()
    for gpus in held_after(world, decisions).values():
        assert len(gpus) == len(set(gpus))
        assert not set(gpus) & seen
        assert set(gpus) <= schedulable
        seen |= set(gpus)


@st.composite
def drained_worlds(draw: st.DrawFn) -> World:
    """`worlds`, then some GPUs drained (by an operator, or a fault) under the jobs that
    run on them: gone from their nodes' views, and a node with none left gone whole."""
    world = draw(worlds())
    gpus = [(n.name, g) for n in world.snapshot.nodes for g in n.gpus]
    drained = draw(st.sets(st.sampled_from(gpus))) if gpus else set()
    views = []
    for n in world.snapshot.nodes:
        left = tuple(g for g in n.gpus if (n.name, g) not in drained)
        if left:
            views.append(NodeView(n.name, left, frozenset(n.free & set(left)), n.switch))
    return World(replace(world.snapshot, nodes=tuple(views)), world.now)


@pytest.mark.parametrize("order", ["las", "priority"])
def test_a_job_mid_resize_is_not_preempted_for_the_job_it_shrinks_for(order: str) -> None:
    # The pass after a shrink for job 4 was staged: the elastic job still holds every
    # GPU of both sizes until its supervisor commits, and job 4 (ahead of it in every
    # order here: less service, a higher priority) waits for the GPU it frees. Before,
    # this pass preempted the elastic job and restarted it: the very restart an in-place
    # shrink is for avoiding.
    shrinking = elastic("3", 4, 1, 4, on=(Grant("n1", (0, 1)), Grant("n2", (0, 1))), attained=171.0)
    snapshot = ClusterSnapshot(
        (NodeView("n1", (0, 1), frozenset()), NodeView("n2", (0, 1), frozenset())),
        (pending("4", 1, at=30.0, priority=5),),
        (replace(shrinking, resizing=True),),
    )
    decisions = decide(snapshot, 35.0, Policy(order=order, elasticity="marginal-gain"))
    assert decisions.preemptions == ()
    assert [w.job_id for w in decisions.waits] == ["4"]


@pytest.mark.parametrize("elasticity", ["linear", "marginal-gain"])
def test_a_reclaim_takes_a_gpu_the_winner_can_use_not_a_drained_one(elasticity: str) -> None:
    # The elastic job runs on n0, drained whole since, and on n1; the new job outranks
    # it under las. Only its GPU on n1 is of use to anyone.
    shrinking = elastic("1", 3, 1, 3, on=(Grant("n0", (0, 1)), Grant("n1", (0,))), attained=1e6)
    snapshot = ClusterSnapshot(
        (NodeView("n1", (0,), frozenset()),), (pending("2", 1, at=1.0),), (shrinking,)
    )
    decisions = decide(snapshot, 10.0, Policy(order="las", elasticity=elasticity))
    assert [(p.job_id, p.grants) for p in decisions.placements] == [("2", (Grant("n1", (0,)),))]
    (shrink,) = [a for a in decisions.actions if isinstance(a, Resize)]
    assert shrink.job_id == "1" and shrink.grants == (Grant("n0", (0, 1)),)


SPANNING = (Grant("n1", (0, 1)), Grant("n2", (0, 1)))


@pytest.mark.parametrize(
    ("views", "least", "kept", "left"),
    [
        pytest.param(
            (NodeView("n1", (0, 1), frozenset()),),
            1,
            {"n1": (0, 1)},
            "n2:0, n2:1",
            id="a node drained whole",
        ),
        pytest.param(
            (NodeView("n1", (0, 1), frozenset()), NodeView("n2", (0,), frozenset())),
            1,
            {"n1": (0, 1), "n2": (0,)},
            "n2:1",
            id="one faulty GPU",
        ),
        pytest.param(
            (NodeView("n2", (0, 1), frozenset()),),
            1,
            {"n1": (1,), "n2": (0, 1)},
            "n1:0",
            id="its first node: the last GPU there stays, for its supervisor",
        ),
        pytest.param(
            (NodeView("n1", (0, 1), frozenset()),),
            3,
            {"n1": (0, 1), "n2": (1,)},
            "n2:0",
            id="never below its minimum",
        ),
    ],
)
def test_an_elastic_job_leaves_gpus_drained_under_it_in_place(
    views: tuple[NodeView, ...], least: int, kept: dict[str, tuple[int, ...]], left: str
) -> None:
    # A rigid job runs on where its GPUs were drained until it ends; an elastic one can
    # shrink off them without a restart, so a drained node empties sooner.
    job = elastic(
        "1", 4, least, 4, on=SPANNING, throughput=((2, 20.0), (3, 30.0), (4, 40.0)), attained=1e3
    )
    decisions = decide(
        snapshot(*views, running=(job,)), 50.0, Policy(order="las", elasticity="marginal-gain")
    )
    (resize,) = decisions.resizes
    assert {g.node: g.gpus for g in resize.grants} == kept and not resize.retreat
    size = sum(len(gpus) for gpus in kept.values())
    assert isinstance(resize.cause, Evacuated)
    assert resize.reason == (
        f"shrunk from 4 to {size} GPUs off {left}, no longer schedulable (drained, faulty "
        "or gone): it runs on in place"
    )
    assert not decisions.preemptions and not decisions.placements


def test_a_pinned_elastic_job_keeps_its_drained_gpus() -> None:
    # The operator's pin holds: what it runs on is theirs to change.
    job = elastic("1", 4, 1, 4, on=SPANNING, throughput=((4, 40.0),), pinned_gpus=4)
    views = (NodeView("n1", (0, 1), frozenset()),)
    decisions = decide(
        snapshot(*views, running=(job,)), 50.0, Policy(order="las", elasticity="marginal-gain")
    )
    assert decisions.resizes == ()


@settings(max_examples=300, deadline=None)
@given(drained_worlds(), policies)
def test_no_drained_gpu_is_granted_resizes_included(world: World, policy: Policy) -> None:
    # Jobs keep the drained GPUs they run on (or give them up), but no job gains one.
    decisions = decide(world.snapshot, world.now, policy)
    schedulable = {(n.name, g) for n in world.snapshot.nodes for g in n.gpus}
    before = held_after(world, Decisions(()))
    seen: set[tuple[str, int]] = set()
    for job_id, gpus in held_after(world, decisions).items():
        assert set(gpus) - set(before.get(job_id, ())) <= schedulable
        assert not set(gpus) & seen
        seen |= set(gpus)


@settings(max_examples=300, deadline=None)
@given(worlds(), policies)
def test_sizes_stay_within_min_and_max(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    jobs = {j.job_id: j for j in (*world.snapshot.running, *world.snapshot.pending)}
    for place in decisions.placements:
        job = jobs[place.job_id]
        size = sum(len(g.gpus) for g in place.grants)
        if policy.elasticity == "none" or not job.elastic:
            assert size == job.gpus
        else:
            assert job.min_gpus is not None and job.max_gpus is not None
            assert job.min_gpus <= size <= job.max_gpus
    resized = [r.job_id for r in decisions.resizes]
    assert len(resized) == len(set(resized))
    preempted = {p.job_id for p in decisions.preemptions}
    for resize in decisions.resizes:
        job = jobs[resize.job_id]
        assert policy.elasticity != "none"
        assert job.running and job.elastic and not job.resizing
        assert resize.job_id not in preempted
        assert job.min_gpus is not None and job.max_gpus is not None
        assert job.min_gpus <= resize.size <= max(job.max_gpus, job.held_gpus)
        assert resize.size != job.held_gpus or resize.grants != job.grants
        assert resize.reason
    # Every pending job is placed or told why it waits, exactly once.
    answered = [p.job_id for p in decisions.placements] + [w.job_id for w in decisions.waits]
    assert sorted(answered) == sorted(j.job_id for j in world.snapshot.pending)


@settings(max_examples=200, deadline=None)
@given(
    worlds(),
    # Built so rather than filtered out of `policies` (Hypothesis' filter_too_much).
    st.builds(
        Policy,
        order=st.sampled_from(["las", "fifo", "priority", "gittins"]),
        preemption=st.sampled_from(["by-rank", "quota-only"]),
        elasticity=st.sampled_from(sorted(set(ELASTICITIES) - {"none"})),
        elastic_may_spread=st.just(False),
        elastic_min_gain=st.sampled_from([0.0, 0.25, 0.9]),
        elastic_resize_interval_s=st.sampled_from([0.0, 60.0]),
    ),
)
def test_live_brain_keeps_elastic_jobs_on_one_node(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    jobs = {j.job_id: j for j in (*world.snapshot.running, *world.snapshot.pending)}
    grants = [(p.job_id, p.grants) for p in decisions.placements]
    grants += [(r.job_id, r.grants) for r in decisions.resizes]
    for job_id, granted in grants:
        job = jobs[job_id]
        if not job.elastic:
            continue
        nodes = {g.node for g in granted}
        # A job already on several nodes (from before) may stay there; no new node.
        assert len(nodes) == 1 or nodes <= {g.node for g in job.grants}


@settings(max_examples=150, deadline=None)
@given(worlds(), policies, st.randoms(use_true_random=False))
def test_elastic_decisions_are_deterministic(
    world: World, policy: Policy, shuffler: random.Random
) -> None:
    first = decide(world.snapshot, world.now, policy)
    assert decide(world.snapshot, world.now, policy) == first
    # The order in which the shell lists jobs and nodes must not matter either.
    waiting, running = list(world.snapshot.pending), list(world.snapshot.running)
    nodes = list(world.snapshot.nodes)
    shuffler.shuffle(waiting)
    shuffler.shuffle(running)
    shuffler.shuffle(nodes)
    shuffled = ClusterSnapshot(tuple(nodes), tuple(waiting), tuple(running))
    assert decide(shuffled, world.now, policy) == first


def test_a_shrink_across_nodes_gives_back_a_whole_other_node_before_the_first_ones() -> None:
    """Seen live: a job at 2+2 GPUs on n0 (its first node) and n1 shrank to n0:0 and
    n1:0 (a GPU off n0, the tie's first name, then n0's last stays), still on two
    nodes. Giving back on the first node frees no node: n1 goes, whole."""
    job = elastic(
        "1", 2, 1, 8, on=(Grant("n0", (0, 1)), Grant("n1", (0, 1))), throughput=((4, 100.0),)
    )
    world = snapshot(
        node("n0", busy=(0, 1, 2, 3)),
        node("n1", busy=(0, 1, 2, 3)),
        pending_jobs=(pending("2", 2, at=10.0),),
        running=(job,),
    )
    decisions = decide(world, 100.0, ELASTIC)
    (shrink,) = decisions.resizes
    assert shrink.grants == (Grant("n0", (0, 1)),), shrink
    (placed,) = decisions.placements
    assert placed.grants == (Grant("n1", (0, 1)),), placed


def test_a_shrink_across_nodes_never_leaves_the_first_node() -> None:
    """The supervisor runs on a job's first node: a shrink keeps a GPU there, though
    giving back from the node where the job holds fewest would otherwise come first."""
    job = elastic(
        "1", 1, 1, 8, on=(Grant("n1", (3,)), Grant("n0", (0, 1))), throughput=((3, 100.0),)
    )
    world = snapshot(
        node("n0", busy=(0, 1, 2, 3)),
        node("n1", busy=(0, 1, 2, 3)),
        pending_jobs=(pending("2", 1, at=10.0),),
        running=(job,),
    )
    decisions = decide(world, 100.0, ELASTIC)
    (shrink,) = decisions.resizes
    assert [g.node for g in shrink.grants][:1] == ["n1"], shrink
