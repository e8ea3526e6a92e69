"""Attempts and their failures without a server (brain/attempts.py): node events count
for the attempt that runs now only; failures are classified, retried or ended; critical
GPU faults drain and fail what runs there."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from brain.attempts import Attempts, launch_id
from brain.core.failures import DEFAULT_FAILURE_POLICY, Classification
from schemas.errors import ApiError
from schemas.events import CommandRejected, GpuFault, JobExited, JobStarted, LaunchFailed
from schemas.jobs import AttemptFailure, FailureClass, JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import NodeState
from schemas.state import Cause, CauseKind
from tests.parts import Clock, Shell
from tests.statelog import START_TS

POLICY = dataclasses.replace(DEFAULT_FAILURE_POLICY, infrastructure_retries=2)


@dataclass
class Joins:
    joining: set[tuple[str, str]] = field(default_factory=set)
    failed: list[tuple[str, str]] = field(default_factory=list)

    shedding: set[tuple[str, str]] = field(default_factory=set)
    shed_parts: list[tuple[str, str, str]] = field(default_factory=list)

    async def join_failed(self, job: JobRecord, node: str, why: str) -> bool:
        if (job.job_id, node) not in self.joining:
            return False
        self.failed.append((job.job_id, node))
        return True

    async def shed(self, job: JobRecord, node: str, why: str) -> bool:
        if (job.job_id, node) not in self.shedding:
            return False
        self.shed_parts.append((job.job_id, node, why))
        return True


def attempts(shell: Shell, joins: Joins | None = None) -> Attempts:
    return Attempts(
        lambda: shell.state, shell, joins or Joins(), policy=POLICY, clock=Clock(START_TS + 100)
    )


def two_node_job(shell: Shell, *, elastic: bool = False) -> JobRecord:
    """Job 1 running attempt 1 on GPUs 0,1 of n1 and n2, both started."""
    spec = JobSpec(name="wide", command=("train",), gpus=4, elastic=elastic)
    return shell.put_job(
        JobRecord(
            job_id="1",
            tenant="default",
            spec=spec,
            state=JobState.RUNNING,
            submitted_at=START_TS,
            started_at=START_TS + 1,
            attempt=1,
            grants=(
                NodeGrant(node="n1", gpus=(0, 1), pid=101),
                NodeGrant(node="n2", gpus=(0, 1), pid=102),
            ),
        )
    )


def cluster() -> Shell:
    shell = Shell()
    shell.add_node("n1")
    shell.add_node("n2")
    return shell


def exited(node: str = "n1", *, attempt: int = 1, **fields: object) -> JobExited:
    values: dict[str, object] = {"exit_code": 0, "runtime_s": 10.0, **fields}
    return JobExited(event_id="e", node=node, ts=0.0, job_id="1", attempt=attempt, **values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("job_id", "attempt", "node", "counts"),
    [
        pytest.param("1", 1, "n1", True, id="the attempt it runs, on its node"),
        pytest.param("1", 2, "n1", False, id="another attempt"),
        pytest.param("1", 1, "n3", False, id="a node it does not run on"),
        pytest.param("9", 1, "n1", False, id="an unknown job"),
    ],
)
async def test_an_event_counts_only_for_the_attempt_that_runs_now(
    job_id: str, attempt: int, node: str, counts: bool
) -> None:
    shell = cluster()
    shell.add_job(1, node="n1")
    before = shell.state.last_seq
    started = JobStarted(
        event_id="e",
        node=node,
        ts=0.0,
        job_id=job_id,
        attempt=attempt,
        pid=4242,
        gpus=(0,),
        log_path="/logs/1",
    )

    await attempts(shell).job_started(started)

    if counts:
        assert shell.state.jobs["1"].grants[0].pid == 4242
        assert shell.causes[-1].kind is CauseKind.STARTED
    else:
        assert shell.state.last_seq == before


@pytest.mark.parametrize(
    ("event", "state", "kind"),
    [
        pytest.param(exited(exit_code=0), JobState.SUCCEEDED, CauseKind.EXITED, id="exit 0"),
        pytest.param(
            exited(exit_code=None, signal=15, stopped=True),
            JobState.PENDING,
            CauseKind.EXITED,
            id="stopped by its node: runs again",
        ),
        pytest.param(
            exited(exit_code=1, log_tail=("Traceback (most recent call last):", "ValueError: x")),
            JobState.FAILED,
            CauseKind.FAILURE_CLASSIFIED,
            id="user error: not retried",
        ),
        pytest.param(
            exited(exit_code=None, signal=9),
            JobState.PENDING,
            CauseKind.RETRY_SCHEDULED,
            id="killed by the kernel: retried",
        ),
    ],
)
async def test_an_exit_ends_retries_or_requeues_the_job(
    event: JobExited, state: JobState, kind: CauseKind
) -> None:
    shell = cluster()
    shell.add_job(1, node="n1")

    await attempts(shell).job_exited(event)

    job = shell.state.jobs["1"]
    assert (job.state, shell.causes[-1].kind) == (state, kind)
    assert job.attempt == 1  # a requeue keeps the count; the next placement adds one
    if state is JobState.PENDING:
        assert job.grants == ()
    if state is JobState.FAILED:
        # The failure is said once in the cause, and once in the job's reason.
        assert shell.causes[-1].message.count("ValueError: x") == 1
        assert job.reason is not None and "ValueError: x" in job.reason


@pytest.mark.parametrize("sheds", [True, False], ids=["goes on without it", "cannot: requeued"])
async def test_an_elastic_part_its_node_stopped_is_shed_when_the_job_can_go_on(
    sheds: bool,
) -> None:
    """A worker host its node stopped (fenced through a partition shorter than the brain's
    wait, or the agent shut down): the job goes on without it rather than starting over."""
    shell = cluster()
    two_node_job(shell, elastic=True)
    joins = Joins(shedding={("1", "n2")} if sheds else set())

    await attempts(shell, joins).job_exited(exited("n2", exit_code=None, signal=9, stopped=True))

    job = shell.state.jobs["1"]
    if sheds:
        [(_, node, why)] = joins.shed_parts
        assert node == "n2" and why == "its part on node n2 was stopped by that node (signal 9)"
        assert job.state is JobState.RUNNING
    else:
        assert job.state is JobState.PENDING and job.attempt == 1


async def test_a_part_that_exits_0_waits_for_the_others() -> None:
    shell = cluster()
    two_node_job(shell)

    await attempts(shell).job_exited(exited("n2"))

    job = shell.state.jobs["1"]
    assert job.state is JobState.RUNNING and [g.exited for g in job.grants] == [False, True]
    await attempts(shell).job_exited(exited("n1"))
    assert shell.state.jobs["1"].state is JobState.SUCCEEDED and shell.stops == []


async def test_an_elastic_jobs_supervisor_exiting_0_ends_it_and_stops_its_worker_hosts() -> None:
    shell = cluster()
    two_node_job(shell, elastic=True)

    await attempts(shell).job_exited(exited("n1"))

    assert shell.state.jobs["1"].state is JobState.SUCCEEDED
    assert [(s.node, s.reason) for s in shell.stops] == [("n2", "the job's supervisor finished")]


@pytest.mark.parametrize(
    ("classification", "blamed"),
    [
        (Classification(FailureClass.INFRASTRUCTURE, "node n2 was lost"), ("n2",)),
        (
            Classification(FailureClass.INFRASTRUCTURE, "NCCL timeout", between_nodes=True),
            ("n1", "n2"),
        ),
        (
            Classification(FailureClass.INFRASTRUCTURE, "lost n1 and n2", on_nodes=("n1", "n2")),
            ("n1", "n2"),
        ),
    ],
)
async def test_a_failure_is_blamed_on_the_nodes_it_happened_on(
    classification: Classification, blamed: tuple[str, ...]
) -> None:
    shell = cluster()
    job = two_node_job(shell)

    await attempts(shell).fail_attempt(job, "n2", classification)

    after = shell.state.jobs["1"]
    assert after.failures[-1].nodes == ("n1", "n2")
    assert after.failures[-1].at_fault == blamed and after.avoid_nodes == blamed


async def test_a_failure_retries_elsewhere_until_the_limit_then_gives_up() -> None:
    shell = cluster()
    made = attempts(shell)
    infra = Classification(FailureClass.INFRASTRUCTURE, "node lost")
    outcomes = []
    for attempt in (1, 2, 3):
        so_far = shell.state.jobs["1"].failures if "1" in shell.state.jobs else ()
        job = two_node_job(shell).model_copy(update={"attempt": attempt, "failures": so_far})
        job = shell.put_job(job)
        shell.stops.clear()
        await made.fail_attempt(job, "n1", infra)
        after = shell.state.jobs["1"]
        outcomes.append((after.state, shell.causes[-1].kind, len(after.failures)))
        # What still ran is stopped (all of it on a retry; the rest when it ends).
        assert {s.node for s in shell.stops} == (
            {"n1", "n2"} if after.state is JobState.PENDING else {"n2"}
        )
    assert outcomes == [
        (JobState.PENDING, CauseKind.RETRY_SCHEDULED, 1),
        (JobState.PENDING, CauseKind.RETRY_SCHEDULED, 2),
        (JobState.UNSUCCESSFUL, CauseKind.RETRIES_EXHAUSTED, 3),
    ]
    assert all(
        f.failure_class is FailureClass.INFRASTRUCTURE for f in shell.state.jobs["1"].failures
    )


@pytest.mark.parametrize(
    ("retryable", "joining", "outcome"),
    [
        pytest.param(True, False, JobState.PENDING, id="not the job's fault: retried"),
        pytest.param(False, False, JobState.FAILED, id="the job's fault: failed"),
        pytest.param(False, True, JobState.RUNNING, id="a grow's worker host: the grow fails"),
    ],
)
async def test_a_failed_launch(retryable: bool, joining: bool, outcome: JobState) -> None:
    shell = cluster()
    shell.add_job(1, node="n1")
    joins = Joins({("1", "n1")} if joining else set())
    event = LaunchFailed(
        event_id="e",
        node="n1",
        ts=0.0,
        job_id="1",
        attempt=1,
        reason="no such program",
        retryable=retryable,
    )

    await attempts(shell, joins).launch_failed(event)

    assert shell.state.jobs["1"].state is outcome
    assert joins.failed == ([("1", "n1")] if joining else [])


@pytest.mark.parametrize(
    ("command_id", "requeued"),
    [
        (launch_id("1", 1, "n1"), True),
        (launch_id("1", 0, "n1"), False),  # an earlier attempt's launch
        ("stop-abc", False),
    ],
)
async def test_a_refused_launch_requeues_the_job(command_id: str, requeued: bool) -> None:
    shell = cluster()
    shell.add_job(1, node="n1")
    event = CommandRejected(
        event_id="e", node="n1", ts=0.0, command_id=command_id, job_id="1", reason="stale epoch"
    )

    await attempts(shell).command_rejected(event)

    job = shell.state.jobs["1"]
    assert (job.state is JobState.PENDING) is requeued
    if requeued:
        assert job.attempt == 1 and shell.causes[-1].kind is CauseKind.LAUNCH_FAILED


def fault(gpu: int, fault_kind: str = "xid", xid: int | None = None) -> GpuFault:
    return GpuFault(event_id="e", node="n1", ts=0.0, gpu=gpu, fault=fault_kind, xid=xid)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("event", "node_state", "drained_gpus", "failed"),
    [
        pytest.param(fault(1, xid=13), NodeState.READY, (), set(), id="application XID: nothing"),
        pytest.param(fault(1, xid=48), NodeState.READY, (1,), {"1"}, id="ECC on GPU 1: that GPU"),
        pytest.param(fault(5, "ecc_dbe"), NodeState.READY, (5,), set(), id="a GPU nobody holds"),
        pytest.param(fault(1, xid=79), NodeState.DRAINED, (), {"1", "2"}, id="off the bus: node"),
    ],
)
async def test_a_gpu_fault_drains_and_fails_what_runs_there(
    event: GpuFault, node_state: NodeState, drained_gpus: tuple[int, ...], failed: set[str]
) -> None:
    shell = cluster()
    shell.add_job(1, gpus=2, node="n1")  # GPUs 0, 1
    job = shell.add_job(2, gpus=1, node="n1")
    shell.put_job(job.model_copy(update={"grants": (NodeGrant(node="n1", gpus=(3,), pid=7),)}))

    await attempts(shell).gpu_fault(event)

    node = shell.state.nodes["n1"]
    assert node.state is node_state and tuple(d.index for d in node.drained_gpus) == drained_gpus
    retried = {j for j in ("1", "2") if shell.state.jobs[j].state is JobState.PENDING}
    assert retried == failed
    for job_id in failed:
        [failure] = shell.state.jobs[job_id].failures
        assert failure.failure_class is FailureClass.INFRASTRUCTURE


async def test_draining_a_gpu_twice_changes_nothing_and_an_unknown_gpu_is_refused() -> None:
    shell = cluster()
    made = attempts(shell)
    await made.drain_gpu(shell.state.nodes["n1"], 2, "operator")
    before = shell.state.last_seq

    await made.drain_gpu(shell.state.nodes["n1"], 2, "again")
    assert shell.state.last_seq == before

    with pytest.raises(ApiError) as refused:
        await made.drain_gpu(shell.state.nodes["n1"], 8, "no such GPU")
    assert refused.value.code == "not_found" and "GPU 8" in refused.value.message


async def test_requeue_keeps_the_attempt_count_and_stops_every_part() -> None:
    shell = cluster()
    job = two_node_job(shell)
    previous = AttemptFailure(
        attempt=1, failure_class=FailureClass.USER, reason="x", nodes=("n1",), at=0.0
    )
    job = shell.put_job(job.model_copy(update={"failures": (previous,)}))
    await attempts(shell).requeue(job, Cause(kind=CauseKind.PREEMPTED, job_id="1", message="room"))

    after = shell.state.jobs["1"]
    assert (after.state, after.attempt, after.grants, after.failures) == (
        JobState.PENDING,
        1,
        (),
        (previous,),
    )
    assert sorted(s.node for s in shell.stops) == ["n1", "n2"]


async def test_a_node_where_job_after_job_fails_is_drained_as_a_black_hole() -> None:
    """Three jobs fail on n1 for reasons not their own, minutes apart: n1 is drained,
    saying why; the failures of one incident, or on a node resumed since, do not count;
    and the rule drains no more than its share of the cluster."""
    shell = Shell()
    for name in ("n1", "n2", "n3"):
        shell.add_node(name)
    clock = Clock(START_TS)
    policy = dataclasses.replace(POLICY, black_hole_max_share=0.5)
    made = Attempts(lambda: shell.state, shell, Joins(), policy=policy, clock=clock)
    lost = Classification(FailureClass.INFRASTRUCTURE, "NCCL watchdog timeout")

    async def fail(number: int, node: str, at: float) -> None:
        clock.now = at
        job = shell.add_job(number, node=node)
        await made.fail_attempt(job, node, lost)

    # One incident of two jobs, then a second: not yet.
    await fail(1, "n1", START_TS + 10)
    await fail(2, "n1", START_TS + 20)
    await fail(3, "n1", START_TS + 600)
    assert shell.state.nodes["n1"].state is NodeState.READY
    await fail(4, "n1", START_TS + 1200)
    drained = shell.state.nodes["n1"]
    assert drained.state is NodeState.DRAINED
    assert drained.drain_reason == (
        "black hole: 3 infrastructure failures within 60 min, of jobs 1, 2, 3, 4; "
        "last: NCCL watchdog timeout"
    )
    assert shell.causes[-1].kind is CauseKind.NODE_DRAINED and shell.causes[-1].node == "n1"
    # n2 looks the same, but one node of three is this rule's most (half, rounded down).
    for number, at in ((5, 1300), (6, 1900), (7, 2500)):
        await fail(number, "n2", START_TS + at)
    assert shell.state.nodes["n2"].state is NodeState.READY
    # Resumed, n1's old failures are forgiven: one more does not drain it again.
    resumed = drained.model_copy(
        update={"state": NodeState.READY, "drain_reason": None, "resumed_at": START_TS + 2600}
    )
    await shell.node_changed(
        resumed, NodeState.DRAINED, Cause(kind=CauseKind.NODE_RESUMED, message="resumed")
    )
    await fail(8, "n1", START_TS + 2700)
    assert shell.state.nodes["n1"].state is NodeState.READY


async def test_a_job_past_its_time_limit_is_stopped_and_failed_not_retried() -> None:
    # Its run time over every attempt: 50 s before this run, which began at START_TS + 1.
    shell = Shell()
    shell.add_node("n1")
    clock = Clock(START_TS + 1)
    a = Attempts(lambda: shell.state, shell, Joins(), policy=POLICY, clock=clock)
    job = shell.add_job(1, node="n1")
    spec = job.spec.model_copy(update={"time_limit_s": 60.0})
    shell.put_job(job.model_copy(update={"spec": spec, "executed_seconds": 50.0}))
    shell.add_job(2, node="n1")  # no limit: never looked at
    assert shell.state.time_limited == {"1"}

    clock.now = START_TS + 1 + 9.5
    await a.check_time_limits()
    assert shell.state.jobs["1"].state is JobState.RUNNING and shell.stops == []

    clock.now = START_TS + 1 + 10.5
    await a.check_time_limits()
    ended = shell.state.jobs["1"]
    assert (ended.state, ended.reason) == (JobState.FAILED, "time limit 1:00 reached")
    (failure,) = ended.failures
    assert failure.failure_class is FailureClass.USER and failure.nodes == ("n1",)
    assert shell.causes[-1].kind is CauseKind.FAILURE_CLASSIFIED
    assert shell.causes[-1].message == "time limit 1:00 reached after 1:00 run; not retried"
    assert [(s.job_id, s.node, s.reason) for s in shell.stops] == [
        ("1", "n1", "time limit 1:00 reached")
    ]
    assert shell.state.time_limited == set()
    assert shell.state.jobs["2"].state is JobState.RUNNING


def limited_job(shell: Shell, clock: Clock) -> Attempts:
    """Job 1 running on n1 with a 60 s limit, 50 s of it run before this run began (at
    START_TS + 1); the clock at 10.5 s into the run: its limit is reached."""
    shell.add_node("n1")
    job = shell.add_job(1, node="n1")
    spec = job.spec.model_copy(update={"time_limit_s": 60.0})
    shell.put_job(job.model_copy(update={"spec": spec, "executed_seconds": 50.0}))
    clock.now = START_TS + 1 + 10.5
    return Attempts(lambda: shell.state, shell, Joins(), policy=POLICY, clock=clock)


async def test_a_job_requeued_past_its_time_limit_ends_instead_of_waiting_to_run_again() -> None:
    """Preempted (or its node lost) at its limit, before the tick that would stop it:
    queued again, it would be placed and run until the next tick."""
    shell, clock = Shell(), Clock(START_TS + 1)
    a = limited_job(shell, clock)
    await a.requeue(shell.state.jobs["1"], Cause(kind=CauseKind.PREEMPTED, message="room"))
    ended = shell.state.jobs["1"]
    assert (ended.state, ended.reason) == (JobState.FAILED, "time limit 1:00 reached")
    assert shell.causes[-1].message == "room; time limit 1:00 reached after 1:00 run; not retried"
    assert [(s.node, s.reason) for s in shell.stops] == [("n1", "time limit 1:00 reached")]

    # With time left (9.5 s run of 60), a requeue is a requeue.
    shell.put_job(shell.add_job(2, node="n1").model_copy(update={"spec": ended.spec}))
    await a.requeue(shell.state.jobs["2"], Cause(kind=CauseKind.PREEMPTED, message="room"))
    assert shell.state.jobs["2"].state is JobState.PENDING


async def test_a_failed_attempt_past_its_time_limit_is_not_retried() -> None:
    """A failure that would be retried, at the limit: the attempt's own failure is kept
    (its exit says why it ended), and the job ends."""
    shell, clock = Shell(), Clock(START_TS + 1)
    a = limited_job(shell, clock)
    why = Classification(FailureClass.INFRASTRUCTURE, "the node's GPU fell off the bus")
    await a.fail_attempt(shell.state.jobs["1"], "n1", why)
    ended = shell.state.jobs["1"]
    assert (ended.state, ended.reason) == (JobState.FAILED, "time limit 1:00 reached")
    (failure,) = ended.failures
    assert failure.failure_class is FailureClass.INFRASTRUCTURE
    assert shell.causes[-1].message.endswith("time limit 1:00 reached after 1:00 run; not retried")
    assert shell.stops == []  # nothing else of it runs: its one part failed on n1
