"""Properties the policy core must keep for every snapshot, checked with hypothesis."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from brain.core import (
    ORDERINGS,
    PREEMPTIONS,
    ClusterSnapshot,
    Decisions,
    Grant,
    JobView,
    NodeView,
    Outranked,
    Policy,
    QueueQuota,
    QuotaReclaim,
    decide,
)

QUEUE_NAMES = ("a", "b", "c")


@dataclass(frozen=True)
class World:
    snapshot: ClusterSnapshot
    now: float


# Job arrays the worlds' jobs may belong to, with their limits (None: no limit).
ARRAY_LIMITS: dict[str | None, int | None] = {"a/x": 1, "b/y": 2, "c/z": None}


@st.composite
def worlds(draw: st.DrawFn, *, with_quotas: bool = True, always_quotas: bool = False) -> World:
    """A small cluster with running and pending jobs; configured queues in half the
    worlds (`with_quotas`), or in every one (`always_quotas`)."""
    node_count = draw(st.integers(1, 4))
    nodes: list[NodeView] = []
    busy: dict[str, set[int]] = {}
    for i in range(node_count):
        name = f"n{i}"
        nodes.append(
            NodeView(name, tuple(range(draw(st.integers(1, 4)))), frozenset(), f"s{i % 2}")
        )
        busy[name] = set()
    now = draw(st.floats(0, 100_000))
    job_ids = iter(range(1000))

    def job_fields() -> dict[str, object]:
        array = draw(st.sampled_from((None, *ARRAY_LIMITS)))
        return {
            "array": array,
            "array_limit": ARRAY_LIMITS.get(array),
            "submitted_at": draw(st.floats(0, now)),
            "queue": draw(st.sampled_from(QUEUE_NAMES)),
            "priority": draw(st.integers(0, 3)),
            "attained_gpu_seconds": draw(st.floats(0, 50_000)),
            "declared_duration_s": draw(st.none() | st.floats(1, 10_000)),
            "progress_fraction": draw(st.none() | st.floats(0.01, 0.99)),
            "executed_seconds": draw(st.floats(0, 10_000)),
        }

    running: list[JobView] = []
    for _ in range(draw(st.integers(0, 5))):
        node = draw(st.sampled_from(nodes))
        free = [g for g in node.gpus if g not in busy[node.name]]
        if not free:
            continue
        take = draw(st.integers(1, len(free)))
        gpus = tuple(free[:take])
        busy[node.name].update(gpus)
        fields = job_fields()
        running.append(
            JobView(
                str(next(job_ids)), take, grants=(Grant(node.name, gpus),), started_at=now, **fields
            )
        )  # type: ignore[arg-type]
    pending = [
        JobView(str(next(job_ids)), draw(st.integers(1, 6)), pending_since=None, **job_fields())  # type: ignore[arg-type]
        for _ in range(draw(st.integers(0, 6)))
    ]
    # Drained since the jobs started (an operator's drain, a GPU fault): those GPUs, or
    # the whole node, are no longer schedulable, while the jobs on them run on.
    drained: set[tuple[str, int]] = set()
    if draw(st.booleans()):
        drained = set(draw(st.sets(st.sampled_from([(n.name, g) for n in nodes for g in n.gpus]))))
    nodes = [
        NodeView(
            n.name,
            gpus := tuple(g for g in n.gpus if (n.name, g) not in drained),
            frozenset(set(gpus) - busy[n.name]),
            n.switch,
        )
        for n in nodes
    ]
    # A node drained or lost whole is not in the snapshot at all.
    nodes = [n for n in nodes if n.gpus]
    queues: tuple[QueueQuota, ...] = ()
    if always_quotas or (with_quotas and draw(st.booleans())):
        capacity = sum(len(n.gpus) for n in nodes)
        left = capacity
        made = []
        for name in QUEUE_NAMES:
            share = draw(st.integers(0, left))
            left -= share
            made.append(QueueQuota(name, share, draw(st.sampled_from(("build", "train")))))
        queues = tuple(made)
    return World(ClusterSnapshot(tuple(nodes), tuple(pending), tuple(running), queues), now)


policies = st.builds(
    Policy,
    order=st.sampled_from(sorted(ORDERINGS)),
    preemption=st.sampled_from(sorted(PREEMPTIONS)),
    starvation_guard_s=st.none() | st.floats(1, 50_000),
)
# Built with a guard rather than filtered out of `policies`: filtering half the draws
# failed Hypothesis' filter_too_much health check on some seeds.
guarded_policies = st.builds(
    Policy,
    order=st.sampled_from(sorted(ORDERINGS)),
    preemption=st.sampled_from(sorted(PREEMPTIONS)),
    starvation_guard_s=st.floats(1, 50_000),
)


@settings(max_examples=150, deadline=None)
@given(worlds(), policies)
def test_an_array_never_starts_past_its_limit(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    for array, limit in ARRAY_LIMITS.items():
        if limit is None:
            continue
        running = sum(1 for j in world.snapshot.running if j.array == array)
        members = {j.job_id for j in world.snapshot.pending if j.array == array}
        started = sum(1 for p in decisions.placements if p.job_id in members)
        assert started <= max(0, limit - running)


def final_allocation(world: World, decisions: Decisions) -> dict[str, set[tuple[str, int]]]:
    """Who holds which GPU once the decisions are applied in order."""
    held = {
        j.job_id: {(g.node, gpu) for g in j.grants for gpu in g.gpus}
        for j in world.snapshot.running
    }
    for preemption in decisions.preemptions:
        del held[preemption.job_id]
    for place in decisions.placements:
        held[place.job_id] = {(g.node, gpu) for g in place.grants for gpu in g.gpus}
    return held


@settings(max_examples=150, deadline=None)
@given(worlds(), policies)
def test_no_gpu_is_granted_to_two_jobs(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    schedulable = {(n.name, g) for n in world.snapshot.nodes for g in n.gpus}
    seen: set[tuple[str, int]] = set()
    for gpus in final_allocation(world, decisions).values():
        assert not gpus & seen
        seen |= gpus
    # Never a drained or faulty GPU, even one a preempted job gave back.
    for place in decisions.placements:
        assert {(g.node, gpu) for g in place.grants for gpu in g.gpus} <= schedulable


@settings(max_examples=150, deadline=None)
@given(worlds(), policies)
def test_gangs_are_all_or_nothing(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    size = {j.job_id: j.gpus for j in world.snapshot.pending}
    for place in decisions.placements:
        granted = [(g.node, gpu) for g in place.grants for gpu in g.gpus]
        assert len(granted) == len(set(granted)) == size[place.job_id]
    # Every pending job is either placed or told why it waits, exactly once.
    answered = [p.job_id for p in decisions.placements] + [w.job_id for w in decisions.waits]
    assert sorted(answered) == sorted(size)
    # Only running jobs are preempted, each once.
    victims = [p.job_id for p in decisions.preemptions]
    assert len(victims) == len(set(victims))
    assert set(victims) <= {j.job_id for j in world.snapshot.running}


# One world in twenty preempts: more examples than the others, for a few dozen that do.
@settings(max_examples=600, deadline=None)
@given(worlds(), policies)
def test_a_preemption_names_the_first_job_placed_on_its_gpus(world: World, policy: Policy) -> None:
    """A victim's cause names the first placement, in rank order, that took one of its
    GPUs (the cycle's first placement if none did: it was released for that one)."""
    decisions = decide(world.snapshot, world.now, policy)
    placed = [
        (place.job_id, {(g.node, gpu) for g in place.grants for gpu in g.gpus})
        for place in decisions.placements
    ]
    for preemption in decisions.preemptions:
        cause = preemption.cause
        named = cause.by_job if isinstance(cause, Outranked) else cause.for_job
        assert isinstance(cause, Outranked | QuotaReclaim)
        gpus = {(g.node, gpu) for g in preemption.grants for gpu in g.gpus}
        takers = [job_id for job_id, taken in placed if taken & gpus]
        assert placed
        assert named == (takers[0] if takers else placed[0][0])


# Worlds with queues only: drawn so, not filtered, which left two draws in three out and
# failed Hypothesis' filter_too_much health check about once in seven runs.
@settings(max_examples=150, deadline=None)
@given(worlds(always_quotas=True), policies)
def test_a_guaranteed_quota_is_always_reachable(world: World, policy: Policy) -> None:
    snapshot = world.snapshot
    assume(snapshot.queues)
    # A build queue's running jobs are never preempted; a state where they exceed its
    # guarantee (the quota was lowered under them) is outside the promise.
    for quota in snapshot.queues:
        if quota.job_class == "build":
            used = sum(j.gpus for j in snapshot.running if j.queue == quota.name)
            assume(used <= quota.guaranteed_gpus)
    decisions = decide(snapshot, world.now, policy)
    running_after = set(final_allocation(world, decisions))
    jobs = (*snapshot.running, *snapshot.pending)
    # But for the jobs of an array that runs as many as it allows, before the decisions
    # or after them: a job preempted in a cycle gives its array's turn back in the next.
    before = Counter(j.array for j in snapshot.running)
    after = Counter(j.array for j in jobs if j.job_id in running_after)
    for quota in snapshot.queues:
        mine = [j for j in jobs if j.queue == quota.name]
        if sum(j.gpus for j in mine) <= quota.guaranteed_gpus:
            for job in mine:
                if job.job_id not in running_after:
                    assert job.array_limit is not None, quota
                    assert max(before[job.array], after[job.array]) >= job.array_limit, quota


# Most worlds have no job waiting past a guard drawn apart from them (about 58 % are
# left out): the filtering is understood, and the health check that counts it is off.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(worlds(with_quotas=False), guarded_policies)
def test_no_job_starves_beyond_the_guard(world: World, policy: Policy) -> None:
    guard = policy.starvation_guard_s
    assert guard is not None
    capacity = sum(len(n.gpus) for n in world.snapshot.nodes)
    running = Counter(j.array for j in world.snapshot.running)
    # Not a job whose array runs as many jobs as it allows: that one waits its turn.
    starving = [
        j
        for j in world.snapshot.pending
        if world.now - j.waiting_since() >= guard
        and j.gpus <= capacity
        and (j.array_limit is None or running[j.array] < j.array_limit)
    ]
    assume(starving)
    longest_wait = min(j.waiting_since() for j in starving)
    first = {j.job_id for j in starving if j.waiting_since() == longest_wait}
    decisions = decide(world.snapshot, world.now, policy)
    started = {p.job_id for p in decisions.placements}
    if policy.preemption == "by-rank":
        # It may preempt anyone: it starts now.
        assert started & first
    else:
        # Running jobs keep their GPUs, but nothing may overtake it for freed ones.
        assert started & first or not started


@settings(max_examples=100, deadline=None)
@given(worlds(), policies, st.randoms(use_true_random=False))
def test_decide_is_deterministic(world: World, policy: Policy, shuffler: object) -> None:
    first = decide(world.snapshot, world.now, policy)
    assert decide(world.snapshot, world.now, policy) == first
    # The order in which the shell lists jobs and nodes must not matter either.
    snapshot = world.snapshot
    pending, running, nodes = list(snapshot.pending), list(snapshot.running), list(snapshot.nodes)
    for items in (pending, running, nodes):
        shuffler.shuffle(items)  # type: ignore[attr-defined]
    shuffled = ClusterSnapshot(tuple(nodes), tuple(pending), tuple(running), snapshot.queues)
    assert decide(shuffled, world.now, policy) == first
