"""A synthetic STATE log appended straight to the stream: many finished jobs, quickly.

For tests and bench/brain_scale.py that need a brain restarted over a long history
without running thousands of jobs through one. Each job gets the three entries a real
run journals at least (submitted, started, succeeded), each carrying the whole record,
as the brain writes them. Append before any brain leads: these appends are not fenced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from bus.client import Bus
from schemas import subjects
from schemas.base import encode
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.state import Cause, CauseKind, JobChanged

START_TS = 1_700_000_000.0


def finished_job_records(
    count: int, *, first: int = 1, nodes: int = 100, epoch: int = 1
) -> Iterator[JobChanged]:
    """Entries for jobs `first`..`first + count - 1`, phase by phase (all submitted, then
    all started, then all finished), so no job's entries are near each other in the log."""
    for phase in (JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED):
        for number in range(first, first + count):
            yield _entry(number, phase, nodes=nodes, epoch=epoch)


def _entry(number: int, phase: JobState, *, nodes: int, epoch: int) -> JobChanged:
    job_id = str(number)
    submitted = START_TS + number
    record = JobRecord(
        job_id=job_id,
        tenant="default",
        spec=JobSpec(name=f"train-{number}", command=("python", "train.py", "--epochs=3"), gpus=2),
        state=JobState.PENDING,
        submitted_at=submitted,
        pending_since=submitted,
        idempotency_key=f"key-{number}",
    )
    previous: JobState | None = None
    cause = Cause(kind=CauseKind.SUBMITTED, message="submitted", job_id=job_id)
    if phase is not JobState.PENDING:
        grant = NodeGrant(
            node=f"n{number % nodes}", gpus=(0, 1), pid=10_000 + number, log_path=f"/x/{job_id}"
        )
        record = record.model_copy(
            update={"state": JobState.RUNNING, "attempt": 1, "started_at": submitted + 1.0}
        )
        record = record.model_copy(update={"grants": (grant,), "pending_since": None})
        previous = JobState.PENDING
        cause = Cause(kind=CauseKind.STARTED, message="started", job_id=job_id)
    if phase is JobState.SUCCEEDED:
        exited = record.grants[0].model_copy(update={"exited": True, "exit_code": 0})
        record = record.model_copy(
            update={
                "state": JobState.SUCCEEDED,
                "finished_at": submitted + 61.0,
                "grants": (exited,),
                "exit_code": 0,
                "reason": "exited with code 0",
                "attained_gpu_seconds": 120.0,
                "executed_seconds": 60.0,
            }
        )
        previous = JobState.RUNNING
        cause = Cause(kind=CauseKind.EXITED, message="exited with code 0", job_id=job_id)
    return JobChanged(
        record_id=f"synthetic-{job_id}-{phase.value}",
        ts=submitted,
        epoch=epoch,
        job=record,
        previous=previous,
        cause=cause,
    )


async def append_records(
    bus: Bus, records: Sequence[JobChanged] | Iterator[JobChanged], *, window: int = 256
) -> int:
    """Append `records` in order, `window` publishes in flight at a time; returns the
    log's last sequence."""
    await bus.ensure_streams()
    last = 0
    batch: list[JobChanged] = []

    async def flush() -> None:
        nonlocal last
        acks = await asyncio.gather(
            *(bus.js.publish(subjects.state_job(r.job.job_id), encode(r)) for r in batch)
        )
        last = max([last, *(int(a.seq) for a in acks)])
        batch.clear()

    for record in records:
        batch.append(record)
        if len(batch) >= window:
            await flush()
    if batch:
        await flush()
    return last
