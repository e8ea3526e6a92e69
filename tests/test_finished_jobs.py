"""Finished jobs leave the brain's memory: it grows with live jobs, not with history.

The latest FINISHED_KEPT finished jobs stay in memory; older ones are answered from
the sqlite history; their idempotency keys still find them; counts still include
them; and which ones left follows from the log alone, so a brain started from a
snapshot holds the same ones as one that replayed everything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from brain.core.model import Ask
from brain.service import Brain
from brain.state import FINISHED_KEPT, BrainState
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    STATUS_RESULT,
    CancelRequest,
    ErrorReply,
    GetJobRequest,
    JobReply,
    StatusRequest,
    SubmitRequest,
)
from schemas.jobs import JobSpec, JobState
from tests.statelog import append_records, finished_job_records

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
