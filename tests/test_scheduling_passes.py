"""What makes a scheduling pass due on a real brain (brain/service.py, brain/scheduler.py):
a change decide() would see, not one it would not (a process that started where it was
placed)."""

from __future__ import annotations

import asyncio

import pytest

from brain import scheduler as scheduling
from brain.core import Wait
from brain.service import _same_to_policy
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.state import Cause, CauseKind
from tests.conftest import eventually
from tests.statelog import live_job_record
from tests.test_cluster_e2e import submit


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
    assert brain.scheduler.dirty  # a new job: news
    async with brain._unit():
        brain.scheduler.dirty = False
        await brain._job_changed(with_grant(job, pid=4242), JobState.RUNNING, _cause(job))
        assert not brain.scheduler.dirty
        await brain._job_changed(
            with_grant(job, pid=4242, gpus=(1,)), JobState.RUNNING, _cause(job)
        )
        assert brain.scheduler.dirty


def _cause(job: JobRecord) -> Cause:
    return Cause(kind=CauseKind.STARTED, job_id=job.job_id, message="test")


async def test_passes_say_why_new_jobs_wait_at_once_and_every_job_once_per_interval(
    brain_factory, agent_factory, monkeypatch
) -> None:
    """A pass within EXPLAIN_WAITS_EVERY_S of the last that explained every waiting job
    asks why only the jobs that became pending since wait: a new job is told at once,
    the others' reasons wait for the interval, which the pass owes; once it is due,
    the tick makes state dirty and a pass explains them all."""
    monkeypatch.setattr(scheduling, "EXPLAIN_WAITS_EVERY_S", 3600.0)  # "not yet", for now
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    waits_per_pass: list[list[str]] = []
    brain.decision_observers.append(
        lambda decisions: waits_per_pass.append(
            [a.job_id for a in decisions.actions if isinstance(a, Wait)]
        )
    )
    await submit(brain.api, JobSpec(command=("sleep", "60"), gpus=2))  # holds both
    queued = JobSpec(command=("true",), gpus=2)
    first = await submit(brain.api, queued)
    await eventually(lambda: "needs 2 GPUs" in (brain.state.jobs[first].reason or ""))
    explained = len(waits_per_pass)  # every pass from here on is within the interval

    second = await submit(brain.api, queued)
    # Behind the first (fifo blocks the head of the line), said by the next pass...
    await eventually(lambda: "queued behind" in (brain.state.jobs[second].reason or ""))
    # ... which asked about the new job alone, and owes the rest.
    scheduler = brain.scheduler
    await eventually(
        lambda: scheduler.waits_owed and not scheduler.dirty and brain._inbox.queue.empty()
    )
    assert [second] in waits_per_pass[explained:]
    assert all(first not in waits for waits in waits_per_pass[explained:])

    brain.scheduler.waits_due = brain.monotonic()  # the interval has passed
    await eventually(lambda: any(sorted(w) == sorted([first, second]) for w in waits_per_pass))
    await eventually(lambda: not brain.scheduler.waits_owed)


async def test_nothing_waiting_owes_no_explanation(brain_factory, agent_factory) -> None:
    """Once nothing waits, no explanation is owed: an idle cluster makes no passes
    (before, an owed explanation with no job left waiting made one at every tick)."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    passes = [0]
    brain.decision_observers.append(lambda _: passes.__setitem__(0, passes[0] + 1))
    # Jobs waited, then left.
    brain.scheduler.waits_owed, brain.scheduler.waits_due = True, brain.monotonic()
    await eventually(lambda: not brain.scheduler.waits_owed)
    settled = passes[0]
    for _ in range(5):  # ticks run meanwhile: still no pass
        await asyncio.sleep(brain.config.tick_s)
    assert passes[0] == settled
