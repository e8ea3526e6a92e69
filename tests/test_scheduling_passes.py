"""What makes a scheduling pass due (brain/service.py): a change decide() would see,
not one it would not (a process that started where it was placed)."""

from __future__ import annotations

import pytest

from brain.service import _same_to_policy
from schemas.jobs import JobRecord, JobState, NodeGrant
from schemas.state import Cause, CauseKind
from tests.conftest import eventually
from tests.statelog import live_job_record


def running() -> JobRecord:
    return live_job_record(1, gpus=2, node="n1").job


def pending() -> JobRecord:
    return live_job_record(2, gpus=2).job


def with_grant(job: JobRecord, **update: object) -> JobRecord:
    grant = job.grants[0].model_copy(update=update)
    return job.model_copy(update={"grants": (grant,)})


@pytest.mark.parametrize(
    ("name", "old", "new", "same"),
    [
        ("its process started", running(), with_grant(running(), pid=4242, log_path="/l"), True),
        ("it moved GPUs", running(), with_grant(running(), gpus=(2, 3)), False),
        (
            "it grew onto another node",
            running(),
            running().model_copy(
                update={"grants": (*running().grants, NodeGrant(node="n2", gpus=(0,)))}
            ),
            False,
        ),
        ("it ended", running(), running().model_copy(update={"state": JobState.SUCCEEDED}), False),
        (
            "it was placed",
            pending(),
            pending().model_copy(update={"state": JobState.RUNNING}),
            False,
        ),
        # A waiting job's record changes with its reason (decide() reads it) or more.
        ("its reason changed", pending(), pending().model_copy(update={"reason": "x"}), False),
        (
            "its priority changed",
            running(),
            running().model_copy(
                update={"spec": running().spec.model_copy(update={"priority": 99})}
            ),
            False,
        ),
    ],
)
def test_a_change_is_news_for_policy_only_if_decide_would_see_it(
    name: str, old: JobRecord, new: JobRecord, same: bool
) -> None:
    assert _same_to_policy(old, new) is same, name


async def test_a_started_process_makes_no_pass_due(brain_factory, agent_factory) -> None:
    """On a real brain: a job's start is journaled without making state dirty."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    job = running()
    async with brain._unit():
        await brain._job_changed(job, None, _cause(job))
    assert brain._dirty  # a new job: news
    async with brain._unit():
        brain._dirty = False
        await brain._job_changed(with_grant(job, pid=4242), JobState.RUNNING, _cause(job))
        assert not brain._dirty
        await brain._job_changed(
            with_grant(job, pid=4242, gpus=(1,)), JobState.RUNNING, _cause(job)
        )
        assert brain._dirty


def _cause(job: JobRecord) -> Cause:
    return Cause(kind=CauseKind.STARTED, job_id=job.job_id, message="test")
