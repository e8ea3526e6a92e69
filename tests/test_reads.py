"""API reads on a real brain answer from state as stored. A unit of work applies its
records to state as it stages them and stores them as one group at its end: a read made
while a unit is under way (its group being appended, say) waits for it, so it never
reports what a failed append would take back (brain/service.py, `settled`)."""

from __future__ import annotations

import asyncio

from schemas.api import (
    ErrorReply,
    GetJobRequest,
    JobReply,
    JobsReply,
    ListJobsRequest,
    StatusReply,
    StatusRequest,
)
from schemas.jobs import JobState
from schemas.state import Cause, CauseKind
from tests.statelog import live_job_record


async def test_a_read_waits_for_the_unit_under_way(brain_factory) -> None:
    brain = await brain_factory()
    job = live_job_record(1, gpus=1).job
    async with brain._unit():
        await brain._job_changed(
            job, None, Cause(kind=CauseKind.SUBMITTED, job_id="1", message="submitted")
        )
    stored = brain.state.last_seq
    cancelled = job.model_copy(update={"state": JobState.CANCELLED})
    async with brain._unit():
        await brain._job_changed(
            cancelled,
            JobState.PENDING,
            Cause(kind=CauseKind.CANCELLED, job_id="1", message="cancelled"),
        )
        # Applied to state, not stored yet.
        assert brain.state.jobs["1"].state is JobState.CANCELLED
        reads = [
            asyncio.create_task(brain.api.handle("default", request))
            for request in (GetJobRequest(job_id="1"), ListJobsRequest(), StatusRequest())
        ]
        await asyncio.sleep(0.3)
        assert not any(read.done() for read in reads)
        assert brain.state.last_seq > stored
    one, listing, status = [await read for read in reads]
    # Answered once the group was stored, with what it stored.
    assert isinstance(one, JobReply) and one.job.state is JobState.CANCELLED
    assert isinstance(listing, JobsReply) and [j.state for j in listing.jobs] == [
        JobState.CANCELLED
    ]
    assert isinstance(status, StatusReply) and status.jobs_by_state["CANCELLED"] == 1
    # With no unit under way a read does not wait.
    assert isinstance(await brain.api.handle("default", GetJobRequest(job_id="1")), JobReply)


async def test_a_read_is_refused_while_state_is_ahead_of_the_log(brain_factory) -> None:
    """A group the log did not take (the journal tainted) until the brain, stepping
    down, reads state again: no read reports what the log does not have."""
    brain = await brain_factory()
    brain.journal.tainted = True
    try:
        refused = await brain.api.handle("default", StatusRequest())
    finally:
        brain.journal.tainted = False
    assert isinstance(refused, ErrorReply) and refused.code == "unavailable"
    assert isinstance(await brain.api.handle("default", StatusRequest()), StatusReply)
