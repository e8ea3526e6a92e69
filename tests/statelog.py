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
from schemas.nodes import NodeRecord, NodeState
from schemas.state import Cause, CauseKind, JobChanged, NodeChanged
from schemas.telemetry import GpuInfo

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


def fake_instance(node: str) -> str:
    """The agent instance a synthetic node's record names (its heartbeats must too)."""
    return f"fake-{node}"


def fake_gpus(node: str, gpus: int) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_mib=81_559)
        for i in range(gpus)
    )


def node_record(node: str, gpus: int, *, epoch: int = 1) -> NodeChanged:
    """A READY node, as its first heartbeat would have journaled it."""
    return NodeChanged(
        record_id=f"synthetic-node-{node}",
        ts=START_TS,
        epoch=epoch,
        node=NodeRecord(
            name=node,
            state=NodeState.READY,
            hostname=node,
            backend="sim",
            instance=fake_instance(node),
            gpus=fake_gpus(node, gpus),
            joined_at=START_TS,
        ),
        previous=None,
        cause=Cause(kind=CauseKind.NODE_JOINED, node=node, message=f"joined with {gpus} GPUs"),
    )


def live_job_record(
    number: int, *, gpus: int, node: str | None = None, priority: int = 0, epoch: int = 1
) -> JobChanged:
    """Job `number` asking `gpus` GPUs: PENDING, or RUNNING on GPUs 0..gpus-1 of `node`
    (pid 10000 + number), as a brain that placed it and heard it start would record."""
    job_id = str(number)
    record = JobRecord(
        job_id=job_id,
        tenant="default",
        spec=JobSpec(
            name=f"live-{number}", command=("sleep", "infinity"), gpus=gpus, priority=priority
        ),
        state=JobState.PENDING,
        submitted_at=START_TS,
        pending_since=START_TS,
    )
    cause = Cause(kind=CauseKind.SUBMITTED, message="submitted", job_id=job_id)
    if node is not None:
        grant = NodeGrant(node=node, gpus=tuple(range(gpus)), pid=10_000 + number)
        update = {"state": JobState.RUNNING, "attempt": 1, "started_at": START_TS + 1.0}
        record = record.model_copy(update={**update, "grants": (grant,), "pending_since": None})
        cause = Cause(kind=CauseKind.STARTED, message="started", job_id=job_id, node=node)
    return JobChanged(
        record_id=f"synthetic-live-{job_id}",
        ts=START_TS,
        epoch=epoch,
        job=record,
        previous=None,
        cause=cause,
    )


def _subject(record: JobChanged | NodeChanged) -> str:
    if isinstance(record, NodeChanged):
        return subjects.state_node(record.node.name)
    return subjects.state_job(record.job.job_id)


async def append_records(
    bus: Bus,
    records: Sequence[JobChanged | NodeChanged] | Iterator[JobChanged | NodeChanged],
    *,
    window: int = 256,
) -> int:
    """Append `records` in order, `window` publishes in flight at a time; returns the
    log's last sequence."""
    await bus.ensure_streams()
    last = 0
    batch: list[JobChanged | NodeChanged] = []

    async def flush() -> None:
        nonlocal last
        acks = await asyncio.gather(*(bus.js.publish(_subject(r), encode(r)) for r in batch))
        last = max([last, *(int(a.seq) for a in acks)])
        batch.clear()

    for record in records:
        batch.append(record)
        if len(batch) >= window:
            await flush()
    if batch:
        await flush()
    return last
