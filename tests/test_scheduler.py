"""The scheduling pass without a server (brain/scheduler.py): decisions applied only
where they still hold on state as it is by then, waits noted once per kind, and what
makes the next pass due."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain import scheduler as scheduling
from brain.attempts import Attempts
from brain.core import (
    DEFAULT_POLICY,
    DEFAULT_SERVICE_PRIOR,
    AtFixedQuota,
    BandCrossed,
    Decisions,
    Grant,
    Grown,
    NoFit,
    Outranked,
    Place,
    Placed,
    Policy,
    Preempt,
    QueuedBehind,
    QueueQuota,
    RankedOut,
    Resize,
    ServiceDistribution,
    SetServiceLevel,
    Wait,
    decide,
)
from brain.core.failures import DEFAULT_FAILURE_POLICY
from brain.progress import ObservedProgress
from brain.scheduler import Scheduler, still_holds
from brain.state import accounted
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import NodeState
from schemas.state import Cause, CauseKind
from tests.parts import Clock, Shell
from tests.statelog import START_TS

NOW = START_TS + 100.0


@dataclass(frozen=True)
class Settings:
    policy: Policy = DEFAULT_POLICY
    queues: tuple[QueueQuota, ...] = ()
    service_prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR


@dataclass
class Resizes:
    applied: list[tuple[str, Resize]] = field(default_factory=list)

    async def apply_resize(self, job: JobRecord, action: Resize) -> None:
        self.applied.append((job.job_id, action))


@dataclass
class Monotonic:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def part(
    shell: Shell,
    policy: Policy = DEFAULT_POLICY,
    resizes: Resizes | None = None,
    decided: Callable[[Decisions], None] = lambda decisions: None,
    *,
    progress: Mapping[str, ObservedProgress] | None = None,
    errors: ServiceDistribution | None = None,
) -> tuple[Scheduler, Monotonic]:
    monotonic = Monotonic()
    attempts = Attempts(
        lambda: shell.state, shell, _NoJoins(), policy=DEFAULT_FAILURE_POLICY, clock=shell.clock
    )
    scheduler = Scheduler(
        lambda: shell.state,
        shell,
        attempts,
        resizes or Resizes(),
        Settings(policy=policy),
        clock=shell.clock,
        monotonic=monotonic,
        progress=lambda: progress or {},
        errors=lambda: errors,
        decided=decided,
    )
    return scheduler, monotonic


class _NoJoins:
    async def join_failed(self, job: JobRecord, node: str, why: str) -> bool:
        return False

    async def shed(self, job: JobRecord, node: str, why: str) -> bool:
        return False


def cluster(*nodes: str, gpus: int = 4) -> Shell:
    shell = Shell(clock=Clock(NOW))
    for node in nodes:
        shell.add_node(node, gpus)
    return shell


def kinds(shell: Shell) -> list[CauseKind]:
    return [cause.kind for cause in shell.causes]


async def test_a_pass_places_a_waiting_job_and_sends_its_launches() -> None:
    shell = cluster("n1")
    shell.add_job(1, gpus=2)
    scheduler, _ = part(shell)
    shell.causes.clear()
    await scheduler.run_pass()
    job = shell.state.jobs["1"]
    assert job.state is JobState.RUNNING and job.attempt == 1
    assert [(g.node, len(g.gpus)) for g in job.grants] == [("n1", 2)]
    assert job.started_at == NOW
    assert kinds(shell) == [CauseKind.PLACED]
    assert shell.causes[0].message == job.reason and "placed on n1" in job.reason
    assert shell.launches == ["n1"]
    assert not scheduler.dirty and shell.units == 1  # nothing waits: no second unit


async def test_a_launch_that_cannot_be_built_leaves_its_job_waiting_and_a_pass_due() -> None:
    """The cluster key out of reach (a JetStream cluster electing the bucket's leader):
    the placement is not stored, so no job runs on nodes never told to start it; the
    pass is tried again after a back-off though nothing else changes."""
    shell = cluster("n1")
    shell.add_job(1, gpus=2)
    scheduler, _ = part(shell)
    shell.causes.clear()
    shell.launch_error = TimeoutError()
    with pytest.raises(TimeoutError):
        await scheduler.run_pass()
    scheduler.failed()
    assert shell.state.jobs["1"].state is JobState.PENDING
    assert shell.causes == [] and shell.launches == []
    scheduler.dirty = False
    scheduler.due()
    assert not scheduler.dirty  # not yet: the back-off
    shell.clock.now += scheduling.RETRY_FAILED_PASS_S
    scheduler.due()
    assert scheduler.dirty
    shell.launch_error = None
    await scheduler.run_pass()
    assert shell.state.jobs["1"].state is JobState.RUNNING and shell.launches == ["n1"]


async def test_a_placement_whose_gpus_were_taken_meanwhile_is_decided_again() -> None:
    """decide() may run in a thread while the inbox goes on: a job that took the GPUs
    in between keeps them, and the next pass decides again."""
    shell = cluster("n1", gpus=2)
    shell.add_job(1, gpus=2)
    scheduler, _ = part(shell)
    decisions = decide(shell.state.snapshot(now=NOW), NOW)
    assert decisions.placements
    shell.add_job(2, gpus=2, node="n1")  # placed by a pass before this one applied
    scheduler.dirty = False
    shell.causes.clear()
    async with shell.unit():
        waits = await scheduler.apply(decisions)
    assert waits == []
    assert shell.state.jobs["1"].state is JobState.PENDING
    assert shell.causes == [] and shell.launches == []
    assert scheduler.dirty


async def test_a_placement_on_a_node_lost_meanwhile_is_decided_again() -> None:
    shell = cluster("n1")
    shell.add_job(1, gpus=2)
    scheduler, _ = part(shell)
    decisions = decide(shell.state.snapshot(now=NOW), NOW)
    await lose(shell, "n1")
    scheduler.dirty = False
    async with shell.unit():
        await scheduler.apply(decisions)
    assert shell.state.jobs["1"].state is JobState.PENDING
    assert scheduler.dirty


async def lose(shell: Shell, node: str) -> None:
    lost = shell.state.nodes[node].model_copy(update={"state": NodeState.LOST})
    cause = Cause(kind=CauseKind.NODE_LOST, node=node, message="silent")
    await shell.node_changed(lost, NodeState.READY, cause)


def _outranking(shell: Shell) -> Preempt:
    """Job 1 runs on n1's two GPUs; job 2 waits and outranks it."""
    shell.add_job(1, gpus=2, node="n1")
    shell.add_job(2, gpus=2)
    return Preempt("1", (Grant("n1", (0, 1)),), Outranked("2", "las", "band 1", "band 0"))


@pytest.mark.parametrize(
    ("name", "meanwhile", "requeued"),
    [
        ("it still holds", None, True),
        ("the job it was for was cancelled", ("2", JobState.CANCELLED), False),
        ("the victim ended", ("1", JobState.SUCCEEDED), False),
    ],
)
async def test_a_preemption_is_applied_only_while_it_holds(
    name: str, meanwhile: tuple[str, JobState] | None, requeued: bool
) -> None:
    shell = cluster("n1", gpus=2)
    preempt = _outranking(shell)
    scheduler, _ = part(shell)
    if meanwhile is not None:
        job_id, to = meanwhile
        shell.put_job(shell.state.jobs[job_id].model_copy(update={"state": to}))
    scheduler.dirty = False
    async with shell.unit():
        await scheduler.apply(decide_nothing_but(preempt))
    victim = shell.state.jobs["1"]
    assert (victim.state is JobState.PENDING) is requeued, name
    assert scheduler.dirty is not requeued  # a moved state: decide again
    if requeued:
        assert victim.attempt == 1 and victim.grants == ()
        cause = shell.causes[-1]
        assert cause.kind is CauseKind.PREEMPTED and cause.preemption is not None
        assert cause.preemption.reason == "outranked" and cause.preemption.for_job == "2"
        assert [(s.job_id, s.node) for s in shell.stops] == [("1", "n1")]


async def test_a_victim_on_a_lost_node_is_never_preempted() -> None:
    """Its stop could not arrive; it would run twice. Its node's loss frees it."""
    shell = cluster("n1", gpus=2)
    preempt = _outranking(shell)
    scheduler, _ = part(shell)
    await lose(shell, "n1")
    async with shell.unit():
        await scheduler.apply(decide_nothing_but(preempt))
    assert shell.state.jobs["1"].state is JobState.RUNNING
    assert shell.stops == []


def decide_nothing_but(*actions: Preempt | Resize | SetServiceLevel | Place) -> Decisions:
    return Decisions(actions=actions)


async def test_a_band_change_is_journaled_only_when_it_changes_the_record() -> None:
    shell = cluster("n1")
    shell.add_job(1, gpus=2, node="n1")
    scheduler, _ = part(shell)
    moved = SetServiceLevel("1", 1, NOW, BandCrossed(3_250.0, 3_250.0, 0, 1))
    shell.causes.clear()
    async with shell.unit():
        await scheduler.apply(decide_nothing_but(moved))
        await scheduler.apply(decide_nothing_but(moved))  # already there: nothing
    job = shell.state.jobs["1"]
    assert (job.service_level, job.service_level_since) == (1, NOW)
    assert kinds(shell) == [CauseKind.SERVICE_LEVEL]
    assert shell.causes[0].message == "attained 3250 GPU-s >= 3250: band 0 -> 1"


@dataclass
class GrowingResizes(Resizes):
    """Applies a resize to state at once, as the real part stages a grow's GPUs."""

    shell: Shell = field(default_factory=Shell)

    async def apply_resize(self, job: JobRecord, action: Resize) -> None:
        await super().apply_resize(job, action)
        grants = tuple(NodeGrant(node=g.node, gpus=g.gpus) for g in action.grants)
        self.shell.put_job(job.model_copy(update={"grants": grants}))


async def test_placements_after_a_resize_read_the_free_gpus_it_left() -> None:
    shell = cluster("n1", gpus=4)
    shell.add_job(1, gpus=2, node="n1")
    shell.add_job(2, gpus=1)
    shell.add_job(3, gpus=1)
    resizes = GrowingResizes(shell=shell)
    scheduler, _ = part(shell, resizes=resizes)
    grow = Resize("1", (Grant("n1", (0, 1, 2)),), Grown(2, 3, 0.4, 2, 4, "concave prior"))
    decided = decide_nothing_but(
        Place("2", (Grant("n1", (3,)),), Placed((Grant("n1", (3,)),), ("fifo",))),
        grow,
        # Decided before the grow:
        Place("3", (Grant("n1", (2,)),), Placed((Grant("n1", (2,)),), ("fifo",))),
    )
    scheduler.dirty = False
    async with shell.unit():
        await scheduler.apply(decided)
    assert resizes.applied == [("1", grow)]
    assert shell.state.jobs["2"].state is JobState.RUNNING
    assert shell.state.jobs["3"].state is JobState.PENDING  # GPU 2 is job 1's now
    assert scheduler.dirty


async def test_a_waiting_reason_is_journaled_once_per_kind() -> None:
    """A new kind of wait is a record, with its kind; the same kind with other figures
    is shown, not journaled (else every change of free capacity writes one per pending
    job); a reason of another change clears the kind, so the next wait is journaled."""
    shell = cluster("n1")
    shell.add_job(1, gpus=8)
    scheduler, _ = part(shell)
    shell.causes.clear()
    async with shell.unit():
        await scheduler.note_waits([Wait("1", RankedOut(8, False, 4, "fifo"))])
    assert kinds(shell) == [CauseKind.WAITING]
    job = shell.state.jobs["1"]
    assert job.reason == "needs 8 GPUs; 4 left after higher-ranked jobs (fifo)"
    assert job.wait_kind == "ranked_out"
    async with shell.unit():
        await scheduler.note_waits([Wait("1", RankedOut(8, False, 3, "fifo"))])
        await scheduler.note_waits([Wait("1", RankedOut(8, False, 3, "fifo"))])
    assert kinds(shell) == [CauseKind.WAITING]  # not journaled again
    assert shell.state.jobs["1"] is job
    said = "needs 8 GPUs; 3 left after higher-ranked jobs (fifo)"
    assert shell.state.reason_of(job) == said
    assert shell.state.shown(job).reason == said
    async with shell.unit():
        await scheduler.note_waits([Wait("1", QueuedBehind("fifo"))])
    assert kinds(shell) == [CauseKind.WAITING, CauseKind.WAITING]
    assert shell.state.jobs["1"].wait_kind == "queued_behind"
    # As the brain journals them (`accounted`): a change that gives another reason
    # takes the kind away with the wait's; a wait of another kind brings its own.
    old = shell.state.jobs["1"]
    retried = accounted(old, old.model_copy(update={"reason": "retry scheduled"}), 1.0)
    assert retried.wait_kind is None
    waits = old.model_copy(update={"reason": "shares on ...", "wait_kind": "making_room"})
    assert accounted(old, waits, 1.0).wait_kind == "making_room"
    placed = old.model_copy(update={"state": JobState.RUNNING})
    assert accounted(old, placed, 1.0).wait_kind is None


class _Journaling(Shell):
    """`Shell` that journals every change through `accounted`, as brain/service.py does."""

    async def job_changed(self, job: JobRecord, previous: JobState | None, cause: Cause) -> None:
        old = self.state.jobs.get(job.job_id)
        await super().job_changed(accounted(old, job, self.clock()), previous, cause)


_WAITS = st.one_of(
    st.builds(
        RankedOut,
        st.integers(1, 8),
        st.booleans(),
        st.integers(0, 8),
        st.sampled_from(["fifo", "las band 0, las"]),
        st.integers(0, 2),
    ),
    st.builds(QueuedBehind, st.sampled_from(["fifo", "starvation guard"])),
    st.builds(AtFixedQuota, st.just("build")),
    st.builds(NoFit, st.sampled_from("ab"), st.sampled_from(["scattered", "too_few_free"])),
)
# Another change of a pending job: a reason of its own (a retry's, an operator's), or
# the one it has.
_OTHER = st.sampled_from(["retry scheduled", "requeued by an operator", None])
_STEPS = st.lists(st.one_of(_WAITS, _OTHER), max_size=12)


@settings(max_examples=200, deadline=None)
@given(_STEPS)
def test_a_records_wait_kind_is_the_kind_of_its_reason(steps: list[object]) -> None:
    """Whatever the sequence of waits and other changes: a record keeps a wait kind
    exactly while its reason is the text of the last wait journaled, of that kind; a
    wait of the kind the record keeps is not journaled, and is what callers are shown."""

    async def run() -> None:
        shell = _Journaling(clock=Clock(NOW))
        shell.add_node("n1", 4)
        shell.add_job(1, gpus=8)
        scheduler, _ = part(shell)
        journaled: tuple[str, str] | None = None  # (kind, text) of the last wait journaled
        for step in steps:
            job = shell.state.jobs["1"]
            before = len(shell.causes)
            if isinstance(step, RankedOut | QueuedBehind | AtFixedQuota | NoFit):
                async with shell.unit():
                    await scheduler.note_waits([Wait("1", step)])
                if step.kind == job.wait_kind:
                    assert len(shell.causes) == before  # the same kind: shown only
                else:
                    assert kinds(shell)[before:] == [CauseKind.WAITING]
                    journaled = (step.kind, step.describe())
                assert shell.state.reason_of(shell.state.jobs["1"]) == step.describe()
            else:
                reason = job.reason if step is None else step
                async with shell.unit():
                    await shell.job_changed(
                        job.model_copy(update={"reason": reason}),
                        JobState.PENDING,
                        Cause(kind=CauseKind.RETRY_SCHEDULED, job_id="1", message=str(reason)),
                    )
            # Both ways: a kind while its wait's text is the reason, and only then
            # (else a wait of that kind would be journaled again, or not at all).
            job = shell.state.jobs["1"]
            still = journaled is not None and job.reason == journaled[1]
            assert job.wait_kind == (journaled[0] if journaled and still else None)

    asyncio.run(run())


async def test_a_pass_explains_every_wait_once_per_interval_and_owes_the_rest() -> None:
    shell = cluster("n1")
    shell.add_job(1, gpus=8)
    seen: list[list[str]] = []
    scheduler, monotonic = part(
        shell, decided=lambda d: seen.append([a.job_id for a in d.actions if isinstance(a, Wait)])
    )
    await scheduler.run_pass()
    assert seen == [["1"]] and not scheduler.waits_owed
    shell.add_job(2, gpus=8)
    scheduler.became_pending("2")
    monotonic.now += 1.0
    await scheduler.run_pass()
    assert seen[-1] == ["2"]  # only the job new since the last pass
    scheduler.due()
    assert scheduler.waits_owed and not scheduler.dirty
    monotonic.now += scheduling.EXPLAIN_WAITS_EVERY_S
    scheduler.due()
    assert scheduler.dirty  # owed and due: the tick makes state dirty
    await scheduler.run_pass()
    assert sorted(seen[-1]) == ["1", "2"] and not scheduler.waits_owed


async def test_decide_asks_to_be_called_again_when_a_back_off_ends() -> None:
    shell = cluster("n1")
    job = shell.add_job(1, gpus=2)
    shell.put_job(job.model_copy(update={"not_before": NOW + 30.0}))
    scheduler, _ = part(shell)
    await scheduler.run_pass()
    assert shell.state.jobs["1"].state is JobState.PENDING
    scheduler.due()
    assert scheduler.wake_at == NOW + 30.0 and not scheduler.dirty
    shell.clock.now = NOW + 30.0
    scheduler.due()
    assert scheduler.dirty and scheduler.wake_at is None
    await scheduler.run_pass()
    assert shell.state.jobs["1"].state is JobState.RUNNING


async def test_a_slow_decide_runs_in_a_thread_to_the_same_effect() -> None:
    shell = cluster("n1")
    shell.add_job(1, gpus=2)
    scheduler, _ = part(shell)
    scheduler.last_decide_s = scheduling.DECIDE_IN_THREAD_AFTER_S * 2
    await scheduler.run_pass()
    assert shell.state.jobs["1"].state is JobState.RUNNING
    assert scheduler.last_decide_s < scheduling.DECIDE_IN_THREAD_AFTER_S * 2


@pytest.mark.parametrize("in_thread", [False, True])
async def test_the_collector_sleeps_through_a_pass_and_wakes_after_it(in_thread: bool) -> None:
    """A pass's decisions are applied and freed with the cyclic collector paused, so
    it never walks them; it runs again after the pass, and after one that failed."""
    assert gc.isenabled()
    shell = cluster("n1")
    shell.add_job(1, gpus=2)
    during: list[bool] = []
    scheduler, _ = part(shell, decided=lambda decisions: during.append(gc.isenabled()))
    if in_thread:
        scheduler.last_decide_s = scheduling.DECIDE_IN_THREAD_AFTER_S * 2
    await scheduler.run_pass()
    assert during == [False] and gc.isenabled()
    assert shell.state.jobs["1"].state is JobState.RUNNING

    def fails(decisions: Decisions) -> None:
        raise RuntimeError("an observer failed")

    scheduler, _ = part(shell, decided=fails)
    with pytest.raises(RuntimeError, match="an observer failed"):
        await scheduler.run_pass()
    assert gc.isenabled()


@pytest.mark.parametrize(
    ("ratios", "preempted"),
    [
        # Finished jobs ran half or twice what their reports implied: job 1, 900 s into
        # the 1,000 it believes, has shown it needs 2,000 (1,100 to go); job 2, 400 s
        # in, is likely done at 500. It goes first.
        ((0.5, 2.0), True),
        # They ran what they implied: job 1 has 100 s to go, job 2 600.
        ((1.0,) * 20, False),
    ],
)
async def test_a_pass_weighs_beliefs_by_what_finished_jobs_were_off_by(
    ratios: tuple[float, ...], preempted: bool
) -> None:
    """Under `progress-gittins` the pass hands decide() the errors the brain learned
    from finished jobs' reports (brain/progress.py), not the prior."""
    shell = cluster("n1", gpus=1)
    shell.add_job(1, node="n1")
    shell.add_job(2)
    believed = 1 / 1000.0
    scheduler, _ = part(
        shell,
        Policy(order="progress-gittins"),
        progress={
            "1": ObservedProgress(progress_fraction=0.9, progress_rate_per_s=believed),
            "2": ObservedProgress(progress_fraction=0.4, progress_rate_per_s=believed),
        },
        errors=ServiceDistribution.from_samples(ratios),
    )
    await scheduler.run_pass()
    assert (shell.state.jobs["1"].state is JobState.PENDING) is preempted
    assert (shell.state.jobs["2"].state is JobState.RUNNING) is preempted


async def test_a_submission_made_while_a_pass_plans_makes_the_next_one_prompt() -> None:
    shell = cluster("n1")
    scheduler, _ = part(shell)
    scheduler.submitted.set()
    await scheduler.run_pass()  # planned with it: nothing more is owed to it
    assert not scheduler.submitted.is_set()


def test_a_preemption_decided_on_a_moved_state_does_not_hold() -> None:
    """A Preempt is applied only if its victim still holds the GPUs it was decided on
    and the job it makes room for still waits."""

    def job(job_id: str, state: JobState, gpus: tuple[int, ...] = ()) -> JobRecord:
        grants = (NodeGrant(node="n1", gpus=gpus, pid=9),) if gpus else ()
        spec = JobSpec(command=("train",), gpus=max(1, len(gpus)))
        return JobRecord(
            job_id=job_id, tenant="t", spec=spec, state=state, submitted_at=0.0, grants=grants
        )

    victim = job("1", JobState.RUNNING, (0, 1))
    waiting = job("2", JobState.PENDING)
    preempt = Preempt("1", (Grant("n1", (0, 1)),), Outranked("2", "las", "band 1", "band 0"))
    assert still_holds(preempt, victim, {"1": victim, "2": waiting})
    # The job it was for was cancelled meanwhile.
    cancelled = waiting.model_copy(update={"state": JobState.CANCELLED})
    assert not still_holds(preempt, victim, {"1": victim, "2": cancelled})
    # The victim was resized (or restarted) meanwhile: other GPUs than decided on.
    moved = job("1", JobState.RUNNING, (0,))
    assert not still_holds(preempt, moved, {"1": moved, "2": waiting})
    ended = victim.model_copy(update={"state": JobState.SUCCEEDED})
    assert not still_holds(preempt, ended, {"1": ended, "2": waiting})
