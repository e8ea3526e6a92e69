"""Finished jobs leave the brain's memory: it grows with live jobs, not with history.

The latest FINISHED_KEPT finished jobs stay in memory; older ones are answered from
the sqlite history; their idempotency keys still find them; counts still include
them; and which ones left follows from the log alone, so a brain started from a
snapshot holds the same ones as one that replayed everything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from brain.core.failures import NodeFailure
from brain.core.model import Ask
from brain.service import Brain, BrainConfig, InvalidBrainConfig
from brain.state import FINISHED_KEPT, BrainState
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    JOBS_RESULT,
    OPERATOR_TENANT,
    STATUS_RESULT,
    CancelRequest,
    ErrorReply,
    GetJobRequest,
    JobReply,
    JobsReply,
    ListJobsRequest,
    StatusRequest,
    SubmitRequest,
)
from schemas.jobs import AttemptFailure, FailureClass, JobSpec, JobState
from schemas.state import Cause, CauseKind, JobChanged
from tests.conftest import eventually
from tests.statelog import append_records, finished_job_records, live_job_record

JOBS = FINISHED_KEPT + 300


def folded(count: int, *, first: int = 1, into: BrainState | None = None) -> BrainState:
    state = into or BrainState()
    for record in finished_job_records(count, first=first):
        state.apply(record, state.last_seq + 1)
    return state


def test_only_the_latest_finished_jobs_stay_in_memory() -> None:
    state = folded(JOBS)
    assert len(state.jobs) == FINISHED_KEPT
    assert "1" not in state.jobs and str(JOBS) in state.jobs
    assert next(iter(state.finished)) == str(JOBS - FINISHED_KEPT + 1)
    assert state.counts_by_state()[JobState.SUCCEEDED] == JOBS
    assert state.job_away_for_key("default", "key-1") == "1"
    assert state.job_for_key("default", f"key-{JOBS}") == state.jobs[str(JOBS)]
    assert state.next_job_id() == str(JOBS + 1)
    # What the Gittins order learns from is not cut by it.
    assert len(state.service_samples) == JOBS


def test_a_brain_from_a_snapshot_holds_what_a_full_replay_holds() -> None:
    replayed = folded(JOBS)
    restored = BrainState.from_snapshot(replayed.to_snapshot(taken_at=1.0, epoch=1))
    for state in (replayed, restored):
        folded(50, first=JOBS + 1, into=state)
    assert restored.jobs == replayed.jobs
    assert list(restored.finished) == list(replayed.finished)
    assert restored.counts_by_state() == replayed.counts_by_state()
    assert restored.keys_away == replayed.keys_away
    assert list(restored.service_samples) == list(replayed.service_samples)
    assert restored.snapshot().recent_asks == replayed.snapshot().recent_asks


def failed_on(node: str, number: int, at: float) -> JobChanged:
    """Job `number` failed for good by an infrastructure failure blamed on `node`."""
    running = live_job_record(number, gpus=1, node=node)
    failure = AttemptFailure(
        attempt=1,
        failure_class=FailureClass.INFRASTRUCTURE,
        reason="NCCL watchdog timeout",
        nodes=(node,),
        at_fault=(node,),
        at=at,
    )
    job = running.job.model_copy(
        update={"state": JobState.FAILED, "finished_at": at, "failures": (failure,)}
    )
    cause = Cause(kind=CauseKind.EXITED, message="failed", job_id=job.job_id)
    return running.model_copy(
        update={
            "record_id": f"failed-{number}",
            "job": job,
            "previous": JobState.RUNNING,
            "cause": cause,
        }
    )


def test_failures_blamed_on_a_node_outlive_their_jobs_across_a_snapshot() -> None:
    # Two jobs failed on n7, then enough others finished that both left memory: the
    # black-hole rule must still count them on a brain loaded from a snapshot.
    replayed = BrainState()
    for number, at in ((1, 100.0), (2, 500.0)):
        replayed.apply(live_job_record(number, gpus=1, node="n7"), replayed.last_seq + 1)
        replayed.apply(failed_on("n7", number, at), replayed.last_seq + 1)
    folded(JOBS, first=3, into=replayed)
    assert "1" not in replayed.jobs and "2" not in replayed.jobs
    snapshot = replayed.to_snapshot(taken_at=1.0, epoch=1)

    restored = BrainState.from_snapshot(snapshot)
    assert (
        list(restored.node_failures["n7"])
        == list(replayed.node_failures["n7"])
        == [
            NodeFailure(100.0, "1", "NCCL watchdog timeout"),
            NodeFailure(500.0, "2", "NCCL watchdog timeout"),
        ]
    )
    # A snapshot from before they were kept has only its jobs to go by.
    older = BrainState.from_snapshot(snapshot.model_copy(update={"node_failures": None}))
    assert "n7" not in older.node_failures


def test_the_recent_workload_is_what_the_finished_jobs_in_memory_asked() -> None:
    """Sharing placement weighs fragment against what jobs ask (brain/core/shares.py):
    the finished jobs still in memory count, those gone from it do not."""
    state = folded(JOBS)
    assert state.snapshot().recent_asks == ((Ask(2), FINISHED_KEPT),)
    assert folded(3).snapshot().recent_asks == ((Ask(2), 3),)
    assert BrainState().snapshot().recent_asks == ()


async def ask(brain: Brain, verb: str, request: object, reply: object) -> object:
    return await brain.bus.request(subjects.api("default", verb), request, reply)  # type: ignore[arg-type]


async def test_a_finished_job_gone_from_memory_is_still_answered(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    await append_records(await connect("setup"), finished_job_records(JOBS))
    brain = await brain_factory()
    assert "1" not in brain.state.jobs

    got = await ask(brain, "job", GetJobRequest(job_id="1"), JOB_RESULT)
    assert isinstance(got, JobReply) and got.job.state is JobState.SUCCEEDED, got
    # A submission retried with its key long after is answered with its job.
    again = SubmitRequest(
        spec=JobSpec(name="train-1", command=("python", "train.py"), gpus=2),
        idempotency_key="key-1",
    )
    retried = await ask(brain, "submit", again, JOB_RESULT)
    assert isinstance(retried, JobReply) and retried.job.job_id == "1", retried
    cancelled = await ask(brain, "cancel", CancelRequest(job_id="1"), JOB_RESULT)
    assert isinstance(cancelled, ErrorReply) and cancelled.code == "conflict", cancelled
    status = await ask(brain, "status", StatusRequest(), STATUS_RESULT)
    assert status.jobs_by_state[JobState.SUCCEEDED.value] == JOBS  # type: ignore[attr-defined]


async def listed(brain: Brain, request: ListJobsRequest, tenant: str = "default") -> JobsReply:
    reply = await brain.bus.request(subjects.api(tenant, "jobs"), request, JOBS_RESULT)
    assert isinstance(reply, JobsReply), reply
    return reply


async def every_job(brain: Brain, request: ListJobsRequest) -> list[str]:
    """Page by page, newest first, as `alnair jobs` does: the ids, oldest first."""
    ids: list[str] = []
    while True:
        reply = await listed(brain, request)
        ids[:0] = [job.job_id for job in reply.jobs]
        if reply.next_before is None:
            return ids
        assert reply.jobs and reply.next_before == reply.jobs[0].job_id
        request = request.model_copy(update={"before": reply.next_before})


async def test_listings_go_on_into_the_finished_jobs_gone_from_memory(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    """Job 1 still waits; jobs 2..JOBS+1 finished, the oldest of them gone from memory:
    a listing merges both in job order, page by page, and filters both alike."""
    setup = await connect("setup")
    await append_records(setup, [live_job_record(1, gpus=1)])
    await append_records(setup, finished_job_records(JOBS, first=2))
    brain = await brain_factory()
    gone = JOBS - FINISHED_KEPT
    assert "1" in brain.state.jobs and "2" not in brain.state.jobs

    everything = await every_job(brain, ListJobsRequest(limit=100_000))
    assert everything == [str(n) for n in range(1, JOBS + 2)]
    # Around where memory's finished jobs begin: the newest 5 below it, from both.
    first_kept = gone + 2
    reply = await listed(brain, ListJobsRequest(limit=5, before=str(first_kept + 2)))
    assert [j.job_id for j in reply.jobs] == [str(n) for n in range(first_kept - 3, first_kept + 2)]
    assert reply.next_before == str(first_kept - 3)
    assert all(j.state is JobState.SUCCEEDED for j in reply.jobs)
    assert reply.jobs[0].spec.name == f"train-{first_kept - 3}"  # the whole record
    # Below the oldest finished job: the waiting one, and nothing older.
    reply = await listed(brain, ListJobsRequest(before="3"))
    assert [j.job_id for j in reply.jobs] == ["1", "2"] and reply.next_before is None
    # States and queues filter the history as they filter memory.
    succeeded = await every_job(brain, ListJobsRequest(states=(JobState.SUCCEEDED,)))
    assert succeeded == [str(n) for n in range(2, JOBS + 2)]
    pending = await listed(brain, ListJobsRequest(states=(JobState.PENDING,)))
    assert [j.job_id for j in pending.jobs] == ["1"] and pending.next_before is None
    elsewhere = await listed(brain, ListJobsRequest(queues=("elsewhere",)))
    assert elsewhere.jobs == () and elsewhere.next_before is None
    # A tenant sees only its own, an operator every tenant's.
    other = await listed(brain, ListJobsRequest(before="100"), tenant="bob")
    assert other.jobs == () and other.next_before is None
    ops = await listed(brain, ListJobsRequest(limit=3, before="100"), tenant=OPERATOR_TENANT)
    assert [j.job_id for j in ops.jobs] == ["97", "98", "99"]


async def test_an_array_is_listed_from_memory_and_from_the_history_alike(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    """Every tenth job is of array "sweep": a listing by array finds those gone from
    memory (the history's) and those still in it, and no other job."""

    def of_sweep(record: JobChanged) -> JobChanged:
        if int(record.job.job_id) % 10:
            return record
        spec = record.job.spec.model_copy(update={"array": "sweep"})
        return record.model_copy(update={"job": record.job.model_copy(update={"spec": spec})})

    await append_records(await connect("setup"), map(of_sweep, finished_job_records(JOBS)))
    brain = await brain_factory()
    assert "10" not in brain.state.jobs and str(JOBS) in brain.state.jobs
    sweep = await every_job(brain, ListJobsRequest(arrays=("sweep",), limit=7))
    assert sweep == [str(n) for n in range(10, JOBS + 1, 10)]
    reply = await listed(brain, ListJobsRequest(arrays=("other",)))
    assert reply.jobs == () and reply.next_before is None


async def test_a_page_reads_at_most_so_many_jobs_from_the_history(
    brain_factory: Callable[..., Awaitable[Brain]], connect, monkeypatch
) -> None:
    monkeypatch.setattr("brain.api.HISTORY_PAGE", 7)
    await append_records(await connect("setup"), finished_job_records(JOBS))
    brain = await brain_factory()
    below = str(JOBS - FINISHED_KEPT + 5)  # four in memory, then the history
    reply = await listed(brain, ListJobsRequest(limit=100, before=below))
    assert len(reply.jobs) == 4 + 7 and reply.next_before == reply.jobs[0].job_id
    assert await every_job(brain, ListJobsRequest(limit=100_000)) == [
        str(n) for n in range(1, JOBS + 1)
    ]


async def test_a_brain_forgets_history_older_than_it_keeps(brain_factory, connect) -> None:
    """`--history-keep-days`: a brain started over jobs that ended long ago (the
    synthetic log's are from 2023) fills its history from the log, then forgets them;
    the log, and so the state, still hold what they held."""
    bus = await connect("setup")
    await append_records(bus, finished_job_records(5))  # 15 entries
    brain = await brain_factory(history_keep_days=1.0)

    async def forgotten() -> bool:
        return brain.history.floor() == 15 and await brain.history.read_last_job("3") is None

    await eventually(forgotten)
    assert brain.history.last_seq() == 15
    assert brain.state.jobs["3"].state is JobState.SUCCEEDED
    with pytest.raises(InvalidBrainConfig, match=r"history_keep_days \(--history-keep-days\)"):
        BrainConfig(history_keep_days=0.0)
