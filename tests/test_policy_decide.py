"""Table-driven tests of the policy core: snapshot builders -> decide -> decisions."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from brain.core import (
    BandCrossed,
    ClusterSnapshot,
    Decisions,
    Grant,
    InvalidPolicy,
    JobView,
    NodeView,
    Outranked,
    Place,
    Policy,
    Preempt,
    QueueQuota,
    QuotaReclaim,
    ServiceDistribution,
    SetServiceLevel,
    UnknownPlugin,
    Wait,
    decide,
)
from brain.core.model import Demand

# -- builders -------------------------------------------------------------------------


def node(name: str, gpus: int = 4, busy: tuple[int, ...] = (), switch: str = "s0") -> NodeView:
    all_gpus = tuple(range(gpus))
    return NodeView(name, all_gpus, frozenset(g for g in all_gpus if g not in busy), switch)


def pending(job_id: str, gpus: int = 1, at: float = 0.0, **fields: object) -> JobView:
    return replace(JobView(job_id, gpus, at), **fields)  # type: ignore[arg-type]


def running(
    job_id: str, on: str, gpus: tuple[int, ...], at: float = 0.0, **fields: object
) -> JobView:
    view = JobView(job_id, len(gpus), at, grants=(Grant(on, gpus),), started_at=at)
    return replace(view, **fields)  # type: ignore[arg-type]


def cluster(
    *nodes: NodeView,
    pending_jobs: tuple[JobView, ...] = (),
    running_jobs: tuple[JobView, ...] = (),
    queues: tuple[QueueQuota, ...] = (),
    distribution: ServiceDistribution | None = None,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        nodes, pending_jobs, running_jobs, queues, service_distribution=distribution
    )


def placed(decisions: Decisions) -> dict[str, tuple[Grant, ...]]:
    return {p.job_id: p.grants for p in decisions.placements}


def preempted(decisions: Decisions) -> set[str]:
    return {p.job_id for p in decisions.preemptions}


def waiting(decisions: Decisions) -> dict[str, str]:
    return {w.job_id: w.reason for w in decisions.waits}


# -- queue order ----------------------------------------------------------------------


@dataclass(frozen=True)
class OrderCase:
    name: str
    policy: Policy
    snapshot: ClusterSnapshot
    now: float
    placed: set[str]
    preempted: set[str]


# A full cluster, two jobs running in band 2, one new job waiting: "old-huge" entered
# the band first, was preempted, and resumed at 800; "steady" has run there since 100.
BAND_TWO_RUNNERS = cluster(
    node("n0", busy=(0, 1, 2, 3)),
    node("n1", busy=(0, 1, 2, 3)),
    pending_jobs=(pending("new", 4, at=900),),
    running_jobs=(
        running(
            "old-huge",
            "n0",
            (0, 1, 2, 3),
            at=800,
            attained_gpu_seconds=90_000,
            service_level=2,
            service_level_since=10,
            submitted_at=0,
        ),
        running(
            "steady",
            "n1",
            (0, 1, 2, 3),
            at=100,
            attained_gpu_seconds=8_000,
            service_level=2,
            service_level_since=50,
            submitted_at=5,
        ),
    ),
)

# Two jobs waiting in band 2: "preempted" entered it first (and has more service) but
# was preempted after "patient" began waiting.
BAND_TWO_WAITERS = cluster(
    node("n0"),
    pending_jobs=(
        pending(
            "preempted",
            4,
            at=0,
            attained_gpu_seconds=90_000,
            service_level=2,
            service_level_since=10,
            pending_since=700,
        ),
        pending(
            "patient",
            4,
            at=5,
            attained_gpu_seconds=8_000,
            service_level=2,
            service_level_since=50,
            pending_since=60,
        ),
    ),
)


# Every finished job used at most 1,000 GPU-s: a job in band 2 is past every sample,
# and its Gittins index is 0, the same for all of them.
SHORT_JOBS = ServiceDistribution.from_samples([100.0, 400.0, 1000.0])

ORDER_CASES = [
    OrderCase(
        "fifo: the head blocks the queue (Tiresias' fifo is head-of-line blocking)",
        Policy(order="fifo"),
        cluster(
            node("n0", busy=(0, 1)),
            pending_jobs=(pending("1", 4, at=1), pending("2", 1, at=2)),
            running_jobs=(running("0", "n0", (0, 1)),),
        ),
        now=10,
        placed=set(),
        preempted=set(),
    ),
    OrderCase(
        "priority: a higher priority preempts a lower one",
        Policy(order="priority"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("hi", 4, at=5, priority=10),),
            running_jobs=(running("lo", "n0", (0, 1, 2, 3), priority=0),),
        ),
        now=10,
        placed={"hi"},
        preempted={"lo"},
    ),
    OrderCase(
        "priority: equals never churn; the running job keeps its GPUs",
        Policy(order="priority"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("early", 4, at=0),),
            running_jobs=(running("late", "n0", (0, 1, 2, 3), at=5),),
        ),
        now=10,
        placed=set(),
        preempted=set(),
    ),
    OrderCase(
        "las: a new job (band 0) preempts one past the first threshold",
        Policy(order="las"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("new", 4, at=100),),
            running_jobs=(
                running(
                    "old",
                    "n0",
                    (0, 1, 2, 3),
                    attained_gpu_seconds=4000,
                    service_level=1,
                    service_level_since=50,
                ),
            ),
        ),
        now=100,
        placed={"new"},
        preempted={"old"},
    ),
    OrderCase(
        "las: within band 0 a running job keeps its GPUs (FIFO within a band)",
        Policy(order="las"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("new", 4, at=100),),
            running_jobs=(running("old", "n0", (0, 1, 2, 3), attained_gpu_seconds=400),),
        ),
        now=100,
        placed=set(),
        preempted=set(),
    ),
    OrderCase(
        "las: a job just demoted into a band with less service than its waiting jobs keeps running",
        Policy(order="las"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(
                pending(
                    "waiting", 4, attained_gpu_seconds=3300, service_level=1, service_level_since=10
                ),
            ),
            running_jobs=(running("demoted", "n0", (0, 1, 2, 3), attained_gpu_seconds=3250.0),),
        ),
        now=500,
        placed=set(),
        preempted=set(),
    ),
    OrderCase(
        "las-tiresias: a job demoted into a band queues behind the band's waiting jobs",
        Policy(order="las-tiresias"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(
                pending(
                    "waiting", 4, attained_gpu_seconds=3300, service_level=1, service_level_since=10
                ),
            ),
            running_jobs=(running("demoted", "n0", (0, 1, 2, 3), attained_gpu_seconds=3250.0),),
        ),
        now=500,
        placed={"waiting"},
        preempted={"demoted"},
    ),
    OrderCase(
        "las: in a band, the job that started running there last yields first, "
        "however early it entered the band",
        Policy(order="las"),
        BAND_TWO_RUNNERS,
        now=1000,
        placed={"new"},
        preempted={"old-huge"},
    ),
    OrderCase(
        "las: among a band's waiting jobs, the least attained service first",
        Policy(order="las"),
        BAND_TWO_WAITERS,
        now=1000,
        placed={"patient"},
        preempted=set(),
    ),
    OrderCase(
        "gittins: equal indices (past every sample) in a band, the job that started "
        "running there last yields first, not the one submitted last",
        Policy(order="gittins"),
        replace(BAND_TWO_RUNNERS, service_distribution=SHORT_JOBS),
        now=1000,
        placed={"new"},
        preempted={"old-huge"},
    ),
    OrderCase(
        "gittins: equal indices among a band's waiting jobs, the least attained service first",
        Policy(order="gittins"),
        replace(BAND_TWO_WAITERS, service_distribution=SHORT_JOBS),
        now=1000,
        placed={"patient"},
        preempted=set(),
    ),
    OrderCase(
        "las-tiresias: Tiresias' lists put the job preempted last first among waiting",
        Policy(order="las-tiresias"),
        BAND_TWO_WAITERS,
        now=1000,
        placed={"preempted"},
        preempted=set(),
    ),
    OrderCase(
        "las-tiresias: in a band, the job that started running there last yields first",
        Policy(order="las-tiresias"),
        BAND_TWO_RUNNERS,
        now=1000,
        placed={"new"},
        preempted={"old-huge"},
    ),
    OrderCase(
        "srtf: the shortest declared remaining GPU-time runs",
        Policy(order="srtf"),
        cluster(
            node("n0", busy=(0, 1)),
            pending_jobs=(pending("short", 2, declared_duration_s=10),),
            running_jobs=(running("long", "n0", (0, 1), declared_duration_s=1000),),
        ),
        now=1,
        placed={"short"},
        preempted=set(),
    ),
    OrderCase(
        "srtf: when GPUs are short, the longer remaining job is preempted",
        Policy(order="srtf"),
        cluster(
            node("n0", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("short", 4, declared_duration_s=10),),
            running_jobs=(running("long", "n0", (0, 1, 2, 3), declared_duration_s=1000),),
        ),
        now=1,
        placed={"short"},
        preempted={"long"},
    ),
    OrderCase(
        "progress: a job not yet probed runs before one observed to be long",
        Policy(order="progress"),
        cluster(
            node("n0", gpus=1, busy=(0,)),
            pending_jobs=(pending("new", 1, at=50),),
            running_jobs=(
                running("long", "n0", (0,), executed_seconds=100, progress_fraction=0.01),
            ),
        ),
        now=100,
        placed={"new"},
        preempted={"long"},
    ),
    OrderCase(
        "progress: among probed jobs, the smaller estimated remainder first",
        Policy(order="progress"),
        cluster(
            node("n0", gpus=1, busy=(0,)),
            pending_jobs=(pending("nearly-done", 1, executed_seconds=100, progress_fraction=0.9),),
            running_jobs=(
                running("long", "n0", (0,), executed_seconds=100, progress_fraction=0.1),
            ),
        ),
        now=100,
        placed={"nearly-done"},
        preempted={"long"},
    ),
    OrderCase(
        "progress: a job that has overrun its believed total is no longer 'nearly done'",
        Policy(order="progress"),
        cluster(
            node("n0", gpus=1, busy=(0,)),
            # Believes 1,000 s in all (rate 0.001/s), has run 3,000 and says 0.999.
            pending_jobs=(
                pending(
                    "overran",
                    1,
                    executed_seconds=3000,
                    progress_fraction=0.999,
                    progress_rate_per_s=0.001,
                ),
            ),
            # 500 s left by its reports, and on time.
            running_jobs=(
                running(
                    "on-time",
                    "n0",
                    (0,),
                    executed_seconds=500,
                    progress_fraction=0.5,
                    progress_rate_per_s=0.001,
                ),
            ),
        ),
        now=100,
        placed=set(),
        preempted=set(),
    ),
]


@pytest.mark.parametrize("case", ORDER_CASES, ids=[c.name for c in ORDER_CASES])
def test_queue_order(case: OrderCase) -> None:
    decisions = decide(case.snapshot, case.now, case.policy)
    assert set(placed(decisions)) == case.placed
    assert preempted(decisions) == case.preempted


def test_fifo_skips_a_job_larger_than_the_cluster() -> None:
    snapshot = cluster(node("n0"), pending_jobs=(pending("huge", 8, at=0), pending("ok", 2, at=1)))
    decisions = decide(snapshot, 5, Policy(order="fifo"))
    assert set(placed(decisions)) == {"ok"}
    assert "the cluster has 4 schedulable" in waiting(decisions)["huge"]


def test_fifo_never_preempts_and_names_the_blocking_job() -> None:
    snapshot = cluster(
        node("n0", busy=(0, 1, 2)),
        pending_jobs=(pending("head", 2, at=0), pending("next", 1, at=1)),
        running_jobs=(running("r", "n0", (0, 1, 2)),),
    )
    decisions = decide(snapshot, 5, Policy(order="fifo"))
    assert preempted(decisions) == set()
    assert waiting(decisions)["next"] == "queued behind an earlier job that does not fit yet (fifo)"
    # fifo's rank says nothing more than its name: it is named once.
    assert waiting(decisions)["head"] == "needs 2 GPUs; 1 left after higher-ranked jobs (fifo)"


def test_a_wait_counts_one_gpu_in_the_singular() -> None:
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        pending_jobs=(pending("one", 1, at=1),),
        running_jobs=(running("r", "n0", (0, 1, 2, 3)),),
    )
    reason = waiting(decide(snapshot, 5, Policy(order="fifo")))["one"]
    assert reason == "needs 1 GPU; 0 left after higher-ranked jobs (fifo)"


def test_las_reports_band_changes_and_when_to_wake() -> None:
    job = running("j", "n0", (0, 1), attained_gpu_seconds=3250.0)
    snapshot = cluster(node("n0", busy=(0, 1)), running_jobs=(job,))
    decisions = decide(snapshot, 1000, Policy(order="las"))
    assert decisions.level_changes == (
        SetServiceLevel("j", 1, 1000, BandCrossed(3250.0, 3250.0, 0, 1)),
    )
    # Next threshold: 7200 GPU-s, at 2 GPUs: (7200 - 3250) / 2 seconds from now.
    assert decisions.wake_at == pytest.approx(1000 + 3950 / 2)


@dataclass(frozen=True)
class WakeCase:
    name: str
    order: str
    attained_gpu_seconds: float
    gpus: int
    # When the job placed at `now` = 100 crosses its band's threshold; None: never.
    wake_at: float | None
    # A share of one GPU, in thousandths (`gpus` 1): it accrues its share a second.
    milli: int | None = None


WAKE_CASES = [
    WakeCase("las: a new 2-GPU job crosses 3250 GPU-s after 1625 s", "las", 0.0, 2, 1725.0),
    WakeCase("las: a resumed job crosses 7200 from 5000 on 4 GPUs", "las", 5000.0, 4, 650.0),
    WakeCase("las: a job in the last band never crosses", "las", 9000.0, 4, None),
    WakeCase("gittins: bands too", "gittins", 0.0, 1, 3350.0),
    WakeCase("las-tiresias: a 1-GPU job, the same wake", "las-tiresias", 3000.0, 1, 350.0),
    # Tiresias: floor((3250 - 1500 wall seconds) / 2) = 875 s, not (3250 - 3000) / 2.
    WakeCase("las-tiresias: a resumed 2-GPU job, looked at late", "las-tiresias", 3000.0, 2, 975.0),
    WakeCase("fifo: no bands, no wake", "fifo", 0.0, 1, None),
    WakeCase("las: a 0.25 share crosses 3250 GPU-s after 13000 s", "las", 0.0, 1, 13100.0, 250),
]


@pytest.mark.parametrize("case", WAKE_CASES, ids=[c.name for c in WAKE_CASES])
def test_a_job_started_in_this_decision_is_woken_for_its_band_crossing(case: WakeCase) -> None:
    level = 0 if case.attained_gpu_seconds < 3250 else 1 if case.attained_gpu_seconds < 7200 else 2
    job = pending(
        "j",
        case.gpus,
        at=0,
        attained_gpu_seconds=case.attained_gpu_seconds,
        executed_seconds=case.attained_gpu_seconds / case.gpus,
        service_level=level,
        demand=None if case.milli is None else Demand(gpu_milli=case.milli),
    )
    decisions = decide(cluster(node("n0"), pending_jobs=(job,)), 100, Policy(order=case.order))
    assert set(placed(decisions)) == {"j"}
    assert decisions.wake_at == (None if case.wake_at is None else pytest.approx(case.wake_at))


def test_las_stays_quiet_when_the_band_is_recorded() -> None:
    job = running(
        "j", "n0", (0,), attained_gpu_seconds=5000, service_level=1, service_level_since=3
    )
    decisions = decide(cluster(node("n0", busy=(0,)), running_jobs=(job,)), 10, Policy("las"))
    assert decisions.level_changes == ()


def test_gittins_prefers_the_job_likelier_to_finish_soon() -> None:
    # Half the jobs use 100 GPU-s, half 100,000: a job at 50 is likely to finish soon,
    # one at 200 is surely long.
    distribution = ServiceDistribution.from_samples([100.0] * 10 + [100_000.0] * 10)
    snapshot = cluster(
        node("n0", gpus=1, busy=(0,)),
        pending_jobs=(pending("young", 1, attained_gpu_seconds=50, at=5),),
        running_jobs=(running("old", "n0", (0,), attained_gpu_seconds=200),),
        distribution=distribution,
    )
    decisions = decide(
        snapshot, 10, Policy(order="gittins", las_thresholds_gpu_s=(), gittins_quantum_gpu_s=100)
    )
    assert set(placed(decisions)) == {"young"}
    assert preempted(decisions) == {"old"}


def test_kaplan_meier_counts_unfinished_jobs_as_longer() -> None:
    finished = ServiceDistribution.from_samples([1.0, 2.0, 3.0, 4.0])
    # Two jobs have run 2.5 without finishing. By hand: at 1, 6 at risk, 1 ends (mass
    # 1/6); at 2, 5 at risk (1/6); at 3, 2 at risk: half of the 4/6 left (2/6); at 4
    # the rest (2/6). Weights scale to the 6 jobs seen.
    estimate = finished.with_censored([2.5, 2.5])
    assert estimate.values == (1.0, 2.0, 3.0, 4.0)
    assert estimate.cumulative_weight == pytest.approx((1.0, 2.0, 4.0, 6.0))
    assert estimate.cumulative_weighted_value[-1] == pytest.approx(1 + 2 + 6 + 8)
    assert finished.with_censored([]) is finished
    assert finished.with_censored([0.0]) is finished
    # A job past every sample: the mass left goes to where it has got to.
    beyond = finished.with_censored([10.0])
    assert beyond.values == (1.0, 2.0, 3.0, 4.0, 10.0)
    assert beyond.cumulative_weight == pytest.approx((1.0, 2.0, 3.0, 4.0, 5.0))
    # Unfinished jobs make long jobs likelier than finished jobs alone say: a new job
    # is less likely to finish within 2 (1/3, not 1/2) and uses more of the quantum.
    assert finished.gittins_index(0.0, 2.0) == pytest.approx(0.5 / 1.75)
    assert estimate.gittins_index(0.0, 2.0) == pytest.approx((1 / 3) / (11 / 6))


def test_tiresias_index_is_zero_at_the_largest_sample() -> None:
    distribution = ServiceDistribution.from_samples([10.0, 20.0, 30.0, 40.0])
    assert distribution.gittins_index_tiresias(40.0, 10.0) == 0.0
    assert distribution.gittins_index_tiresias(25.0, 10.0) > 0.0


def test_gittins_index_follows_the_distribution() -> None:
    distribution = ServiceDistribution.from_samples([10.0, 20.0, 30.0, 40.0])
    # From 0 with a quantum of 10: 1 in 4 finish, expected use 10 -> 1/40.
    assert distribution.gittins_index(0, 10) == pytest.approx(0.25 / 10)
    assert distribution.gittins_index(45, 10) == 0.0
    learned = distribution.with_sample(15.0)
    assert learned.observed == 1
    assert learned.values == (10.0, 15.0, 20.0, 30.0, 40.0)
    assert learned.cumulative_weight[-1] == pytest.approx(5.0)


# -- placement ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlaceCase:
    name: str
    nodes: tuple[NodeView, ...]
    job: JobView
    policy: Policy
    now: float
    expect_nodes: set[str] | None  # None: must wait


PLACE_CASES = [
    PlaceCase(
        "one node when it fits: best fit, the fullest that fits",
        (node("a"), node("b", busy=(0, 1))),
        pending("j", 2),
        Policy(),
        0,
        {"b"},
    ),
    PlaceCase(
        "fewest nodes under one switch",
        (
            node("a", busy=(0,), switch="s0"),
            node("b", busy=(0,), switch="s1"),
            node("c", switch="s1"),
            node("d", switch="s1"),
        ),
        pending("j", 8),
        Policy(),
        0,
        {"c", "d"},
    ),
    PlaceCase(
        "before the back-off, a scattered placement is refused",
        (node("a", busy=(0, 1), switch="s0"), node("b", busy=(0, 1), switch="s1")),
        pending("j", 4),
        Policy(relax_locality_after_s=600),
        100,
        None,
    ),
    PlaceCase(
        "after the back-off, the job may spread (Philly)",
        (node("a", busy=(0, 1), switch="s0"), node("b", busy=(0, 1), switch="s1")),
        pending("j", 4),
        Policy(relax_locality_after_s=600),
        700,
        {"a", "b"},
    ),
    PlaceCase(
        "a network-sensitive job never spreads",
        (node("a", busy=(0, 1), switch="s0"), node("b", busy=(0, 1), switch="s1")),
        pending("j", 4, network_sensitive=True),
        Policy(),
        10_000,
        None,
    ),
]


@pytest.mark.parametrize("case", PLACE_CASES, ids=[c.name for c in PLACE_CASES])
def test_placement(case: PlaceCase) -> None:
    decisions = decide(cluster(*case.nodes, pending_jobs=(case.job,)), case.now, case.policy)
    grants = placed(decisions).get(case.job.job_id)
    if case.expect_nodes is None:
        assert grants is None
        assert "under one switch" in waiting(decisions)[case.job.job_id]
    else:
        assert grants is not None
        assert {g.node for g in grants} == case.expect_nodes
        assert sum(len(g.gpus) for g in grants) == case.job.gpus


def test_locality_wait_asks_to_be_woken_at_the_back_off() -> None:
    nodes = (node("a", busy=(0, 1), switch="s0"), node("b", busy=(0, 1), switch="s1"))
    decisions = decide(
        cluster(*nodes, pending_jobs=(pending("j", 4, at=50),)),
        100,
        Policy(relax_locality_after_s=600),
    )
    assert decisions.wake_at == 650


# -- quotas and preemption ------------------------------------------------------------


def test_quota_reclaim_preempts_the_over_quota_borrower() -> None:
    queues = (QueueQuota("a", 4), QueueQuota("b", 4))
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        node("n1", busy=(0, 1, 2, 3)),
        pending_jobs=(pending("a2", 4, at=50, queue="a"),),
        running_jobs=(
            running("b1", "n0", (0, 1, 2, 3), queue="b"),
            running("b2", "n1", (0, 1, 2, 3), at=5, queue="b"),
        ),
        queues=queues,
    )
    decisions = decide(snapshot, 100, Policy(order="fifo"))
    assert set(placed(decisions)) == {"a2"}
    (preemption,) = decisions.preemptions
    assert preemption.job_id == "b2"
    assert preemption.cause == QuotaReclaim(owner_queue="a", for_job="a2", victim_queue="b")
    assert "quota reclaim" in preemption.reason
    # Preemptions come first, so a shell applying in order frees GPUs before placing.
    assert isinstance(decisions.actions[0], Preempt)


def test_quota_only_preemption_leaves_in_quota_jobs_alone() -> None:
    queues = (QueueQuota("a", 4),)
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        pending_jobs=(pending("new", 4, at=50, queue="a"),),
        running_jobs=(
            running(
                "old", "n0", (0, 1, 2, 3), queue="a", attained_gpu_seconds=1e6, service_level=2
            ),
        ),
        queues=queues,
    )
    assert preempted(decide(snapshot, 100, Policy(order="las", preemption="by-rank"))) == {"old"}
    assert preempted(decide(snapshot, 100, Policy(order="las", preemption="quota-only"))) == set()


def test_build_jobs_are_never_preempted_and_never_borrow() -> None:
    queues = (QueueQuota("dev", 4, "build"),)
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        node("n1"),
        pending_jobs=(pending("dev2", 1, at=1, queue="dev"), pending("vip", 4, priority=99)),
        running_jobs=(running("dev1", "n0", (0, 1, 2, 3), queue="dev"),),
        queues=queues,
    )
    decisions = decide(snapshot, 10, Policy(order="priority"))
    assert preempted(decisions) == set()
    assert set(placed(decisions)) == {"vip"}
    assert "fixed quota" in waiting(decisions)["dev2"]


@pytest.mark.parametrize("order", ["fifo", "priority", "las", "gittins"])
def test_an_array_runs_no_more_than_its_limit_and_holds_no_one_back(order: str) -> None:
    """sbatch's %N: with one of its jobs running, an array limited to 2 starts one more;
    the rest wait, saying so, take no GPUs from the budget and block no one (not even
    under fifo's head of line): the job behind them starts, and no running job of the
    array is preempted for one of its own."""
    sweep = {"array": "alice/sweep", "array_limit": 2}
    snapshot = cluster(
        node("n0", gpus=4, busy=(0,)),
        node("n1", gpus=4),
        running_jobs=(running("1", "n0", (0,), **sweep),),
        pending_jobs=(
            *(pending(str(n), 1, at=float(n), **sweep) for n in range(2, 6)),
            pending("6", 4, at=6.0),
            pending("7", 1, at=7.0, array="bob/sweep", array_limit=2),
        ),
    )
    decisions = decide(snapshot, 10.0, Policy(order=order))
    assert set(placed(decisions)) == {"2", "6", "7"}
    assert preempted(decisions) == set()
    said = "2 of its array's jobs run, as many as it allows at once"
    assert waiting(decisions) == {"3": said, "4": said, "5": said}
    assert {w.cause.kind for w in decisions.waits} == {"array_limit"}


def test_a_job_its_array_holds_back_takes_no_guarantee_from_its_queue() -> None:
    """LAS ranks the array's new job first, but its array runs its one: were it charged
    to its queue's guarantee, the queue's other running job would stand over quota, and
    a borrowing job of another queue would preempt it."""
    sweep = {"array": "a/sweep", "array_limit": 1}
    served = {"queue": "q", "attained_gpu_seconds": 20_000.0, "service_level": 2}
    snapshot = cluster(
        node("n0", gpus=2, busy=(0, 1)),
        running_jobs=(
            running("1", "n0", (0,), **served, **sweep),
            running("2", "n0", (1,), **served),
        ),
        pending_jobs=(pending("3", 1, at=5.0, queue="q", **sweep), pending("4", 1, at=6.0)),
        queues=(QueueQuota("q", 2, "train"),),
    )
    decisions = decide(snapshot, 10.0, Policy(order="las"))
    assert preempted(decisions) == set()
    assert placed(decisions) == {}
    assert {w.job_id: w.cause.kind for w in decisions.waits} == {
        "3": "array_limit",
        "4": "ranked_out",
    }


def test_admission_counts_an_arrays_jobs_as_selection_does() -> None:
    """Its one running job counted once (not again when admission walks it), and a job
    of the array held to its own queue's fixed quota not at all: the array, limited to 2,
    runs one, so job 4 has room in its array and in its queue's guarantee, and starts."""
    sweep = {"array": "a/sweep", "array_limit": 2}
    snapshot = cluster(
        node("n0", gpus=2, busy=(0, 1)),
        node("n1", gpus=1),
        running_jobs=(
            running("1", "n0", (0,), queue="b", **sweep),
            running("2", "n0", (1,), queue="full"),
        ),
        pending_jobs=(
            pending("3", 1, at=1.0, queue="full", **sweep),
            pending("4", 1, at=2.0, queue="c", **sweep),
        ),
        queues=(
            QueueQuota("b", 1, "train"),
            QueueQuota("full", 1, "build"),
            QueueQuota("c", 1, "build"),
        ),
    )
    decisions = decide(snapshot, 10.0, Policy())
    assert set(placed(decisions)) == {"4"}
    # Held by its queue, and (job 4 selected) by its array now too: the array says it.
    assert {w.job_id: w.cause.kind for w in decisions.waits} == {"3": "array_limit"}


def test_a_job_of_an_array_without_a_limit_is_not_counted() -> None:
    snapshot = cluster(
        node("n0", gpus=4),
        pending_jobs=tuple(pending(str(n), 1, at=float(n), array="a/x") for n in range(1, 5)),
    )
    assert set(placed(decide(snapshot, 10.0, Policy()))) == {"1", "2", "3", "4"}


def test_outranked_cause_names_the_winner() -> None:
    snapshot = cluster(
        node("n0", gpus=1, busy=(0,)),
        pending_jobs=(pending("hi", 1, priority=5),),
        running_jobs=(running("lo", "n0", (0,)),),
    )
    (preemption,) = decide(snapshot, 1, Policy(order="priority")).preemptions
    assert preemption.cause == Outranked("hi", "priority", "priority 0", "priority 5")


def test_a_victim_whose_gpus_are_not_needed_keeps_running() -> None:
    # The pending job fits on the free node; nobody has to go.
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        node("n1"),
        pending_jobs=(pending("hi", 4, priority=5),),
        running_jobs=(running("lo", "n0", (0, 1, 2, 3)),),
    )
    decisions = decide(snapshot, 1, Policy(order="priority"))
    assert set(placed(decisions)) == {"hi"}
    assert preempted(decisions) == set()


@dataclass(frozen=True)
class DrainedCase:
    name: str
    policy: Policy
    snapshot: ClusterSnapshot
    placed: dict[str, tuple[Grant, ...]]
    preempted: set[str]


# Jobs still running on GPUs no longer schedulable (an operator drained them, or they
# faulted): they hold nothing of the capacity there is, and a preempted one gives back
# only its schedulable GPUs.
DRAINED_CASES = [
    DrainedCase(
        "a job on a drained node takes nothing from the free GPUs of the others",
        Policy(order="fifo"),
        cluster(
            node("n1"),
            pending_jobs=(pending("late", 4, at=1.0),),
            running_jobs=(running("early", "n2", (0, 1, 2, 3)),),
        ),
        placed={"late": (Grant("n1", (0, 1, 2, 3)),)},
        preempted=set(),
    ),
    DrainedCase(
        "a share on a drained node is no reason to preempt an earlier job under fifo",
        Policy(order="fifo"),
        cluster(
            node("n1", busy=(0, 1, 2, 3)),
            pending_jobs=(pending("late", 3, at=2.0),),
            running_jobs=(
                running("early", "n1", (0, 1, 2, 3)),
                running("share", "n2", (0,), at=1.0, demand=Demand(gpu_milli=250)),
            ),
        ),
        placed={},
        preempted=set(),
    ),
    DrainedCase(
        "a preempted job's drained GPU is not given to the job that outranks it",
        Policy(order="priority"),
        cluster(
            NodeView("n1", (0, 1, 2), frozenset(), "s0"),  # GPU 3 drained
            node("n2", busy=(0, 1, 2)),
            pending_jobs=(pending("hi", 4, priority=5),),
            running_jobs=(
                running("lo", "n1", (0, 1, 2, 3)),
                running("top", "n2", (0, 1, 2), priority=9),
            ),
        ),
        placed={"hi": (Grant("n1", (0, 1, 2)), Grant("n2", (3,)))},
        preempted={"lo"},
    ),
    DrainedCase(
        "a victim whose schedulable GPUs nobody took keeps running",
        Policy(order="priority"),
        cluster(
            NodeView("n1", (0, 1, 2), frozenset(), "s0"),  # GPU 3 drained
            node("n2", busy=(0,)),
            pending_jobs=(pending("hi", 3, priority=5),),
            running_jobs=(
                running("lo", "n1", (0, 1, 2, 3)),
                running("top", "n2", (0,), priority=9),
            ),
        ),
        placed={"hi": (Grant("n2", (1, 2, 3)),)},
        preempted=set(),
    ),
]


@pytest.mark.parametrize("case", DRAINED_CASES, ids=[c.name for c in DRAINED_CASES])
def test_jobs_on_drained_gpus(case: DrainedCase) -> None:
    decisions = decide(case.snapshot, 10.0, case.policy)
    assert placed(decisions) == case.placed
    assert preempted(decisions) == case.preempted


def test_starvation_guard_puts_a_long_waiter_first() -> None:
    snapshot = cluster(
        node("n0", busy=(0, 1, 2, 3)),
        pending_jobs=(
            pending("starved", 4, attained_gpu_seconds=1e6, service_level=2, pending_since=0),
        ),
        running_jobs=(running("young", "n0", (0, 1, 2, 3), attained_gpu_seconds=10),),
    )
    policy = Policy(order="las", starvation_guard_s=3600)
    early = decide(snapshot, 1000, policy)
    assert placed(early) == {}
    assert early.wake_at is not None and early.wake_at <= 3600
    late = decide(snapshot, 3600, policy)
    assert set(placed(late)) == {"starved"}
    assert "starvation guard" in late.placements[0].reason
    # The victim is told the guard put the starved job ahead: by las alone, a job in
    # band 2 is behind one in band 0.
    (preemption,) = late.preemptions
    assert preemption.cause == Outranked(
        "starved", "las", "las band 0", "las band 2 (starvation guard)"
    )


# -- policy configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        (Policy(order="nope"), UnknownPlugin),
        (Policy(placement="nope"), UnknownPlugin),
        (Policy(preemption="nope"), UnknownPlugin),
        (Policy(las_thresholds_gpu_s=(10.0, 5.0)), InvalidPolicy),
        (Policy(gittins_quantum_gpu_s=0), InvalidPolicy),
        (Policy(starvation_guard_s=-1), InvalidPolicy),
    ],
)
def test_bad_policies_are_rejected(policy: Policy, error: type[Exception]) -> None:
    with pytest.raises(error):
        policy.validate()


def test_decide_rejects_an_unknown_plugin() -> None:
    with pytest.raises(
        UnknownPlugin,
        match="known: fifo, gittins, gittins-size, gittins-tiresias, las, las-tiresias, priority",
    ):
        decide(cluster(node("n0")), 0, Policy(order="nope"))


def test_every_place_and_wait_says_why() -> None:
    snapshot = cluster(
        node("n0", busy=(0, 1, 2)),
        pending_jobs=(pending("a", 1), pending("b", 2, at=1)),
        running_jobs=(running("r", "n0", (0, 1, 2)),),
    )
    for action in decide(snapshot, 3, Policy(order="las")).actions:
        if isinstance(action, Place):
            assert action.reason.startswith("placed on n0[3]")
        elif isinstance(action, Wait):
            assert "needs 2 GPUs" in action.reason


# -- decide(..., waits=False) ------------------------------------------------------------


@pytest.mark.parametrize("order", ["fifo", "priority", "las", "gittins", "srtf", "progress"])
@pytest.mark.parametrize("guard", [None, 600.0])
def test_leaving_out_waits_changes_nothing_else(order: str, guard: float | None) -> None:
    """The simulator's cycles leave out `Wait`s; every other action, in order, and the
    wake time are what a caller reading waits gets."""
    from bench.decide_scale import NOW, Size, build_snapshot

    policy = Policy(order=order, starvation_guard_s=guard, relax_locality_after_s=120.0)
    for seed in range(3):
        snapshot = build_snapshot(Size("s", 40, 150, 300), seed=seed)
        # A job backing off after a failure waits too (the retry stage's `Wait`).
        late = replace(snapshot.pending[0], not_before=NOW + 30.0)
        snapshot = replace(snapshot, pending=(late, *snapshot.pending[1:]))
        full = decide(snapshot, NOW, policy)
        quiet = decide(snapshot, NOW, policy, waits=False)
        assert any(isinstance(a, Wait) for a in full.actions)
        assert quiet.actions == tuple(a for a in full.actions if not isinstance(a, Wait))
        assert quiet.wake_at == full.wake_at
        # Asked of some jobs (the live brain asks of those newly pending), the `Wait`s
        # of those jobs, and nothing else, come back: the retry stage's, the
        # selection's and a placement's that found no GPUs alike.
        waits = [a for a in full.actions if isinstance(a, Wait)]
        assert waits[0].job_id == late.job_id  # the retry stage's comes first
        asked = {w.job_id for w in waits[::2]} | {"gone"}
        some = decide(snapshot, NOW, policy, waits=False, explain=asked)
        assert some.actions == tuple(
            a for a in full.actions if not isinstance(a, Wait) or a.job_id in asked
        )


def test_a_gang_larger_than_its_queues_guarantee_yields_to_one_within_it() -> None:
    # Queue a is guaranteed 2 GPUs: its running 3-GPU job never fits in them, so the
    # queue's next 2-GPU job stands within the guarantee and takes it back.
    snapshot = cluster(
        node("n0", busy=(0, 1, 2)),
        pending_jobs=(pending("a2", 2, at=50, queue="a"),),
        running_jobs=(running("a1", "n0", (0, 1, 2), queue="a"),),
        queues=(QueueQuota("a", 2),),
    )
    (preemption,) = decide(snapshot, 100, Policy(order="fifo")).preemptions
    assert preemption.reason == (
        "quota reclaim: queue a needs its guaranteed GPUs for job a2; "
        "this job of the same queue was beyond the guarantee"
    )
