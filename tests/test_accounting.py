"""What every job transition of the live brain journals besides the change itself
(brain/state.py, `accounted`): a run's service folded in as it ends, an elastic job's
size counted as it leaves it, the run's sizes gone with the run, when waiting began."""

from __future__ import annotations

import pytest

from brain.state import accounted, served
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant

START = 1_000.0
NOW = START + 100.0


def job(
    state: JobState = JobState.RUNNING,
    *,
    gpus: int = 2,
    milli: int | None = None,
    elastic: bool = False,
    **fields: object,
) -> JobRecord:
    spec = JobSpec(
        command=("train",),
        gpus=1 if milli is not None else gpus,
        gpu_milli=milli,
        elastic=elastic,
        max_gpus=8 if elastic else None,
    )
    running = state is JobState.RUNNING
    values: dict[str, object] = {
        "job_id": "1",
        "tenant": "t",
        "spec": spec,
        "state": state,
        "submitted_at": 0.0,
        "attempt": 1,
        "started_at": START if running else None,
        "grants": (NodeGrant(node="n1", gpus=tuple(range(gpus))),) if running else (),
        "attained_gpu_seconds": 50.0,
        "executed_seconds": 30.0,
        **fields,
    }
    return JobRecord.model_validate(values)


def ended(old: JobRecord, to: JobState) -> JobRecord:
    return old.model_copy(update={"state": to, "grants": (), "started_at": None})


@pytest.mark.parametrize(
    ("name", "old", "to", "attained", "executed"),
    [
        ("2 GPUs preempted after 100 s", job(), JobState.PENDING, 50.0 + 200.0, 130.0),
        ("a quarter of a GPU finished", job(gpus=1, milli=250), JobState.SUCCEEDED, 75.0, 130.0),
        ("8 GPUs failed", job(gpus=8), JobState.FAILED, 50.0 + 800.0, 130.0),
    ],
)
def test_a_run_that_ends_is_folded_into_the_jobs_service(
    name: str, old: JobRecord, to: JobState, attained: float, executed: float
) -> None:
    after = accounted(old, ended(old, to), NOW)
    assert (after.attained_gpu_seconds, after.executed_seconds) == (attained, executed), name
    assert after.attained_gpu_seconds == served(old, NOW)[0]  # what the snapshot saw


def test_an_elastic_job_counts_the_size_it_leaves_within_its_run() -> None:
    """4 GPUs since a resize at START + 40, then 2: the 60 s at 4 are counted now, and
    the run's time is counted when it ends."""
    old = job(gpus=4, elastic=True, resized_at=START + 40.0)
    smaller = old.model_copy(update={"grants": (NodeGrant(node="n1", gpus=(0, 1)),)})
    after = accounted(old, smaller, NOW)
    assert after.attained_gpu_seconds == 50.0 + 60.0 * 4
    assert after.resized_at == NOW and after.executed_seconds == 30.0
    later = accounted(after, ended(after, JobState.SUCCEEDED), NOW + 10.0)
    assert later.attained_gpu_seconds == 50.0 + 240.0 + 10.0 * 2
    assert later.executed_seconds == 30.0 + 110.0


def test_a_run_that_ends_takes_its_sizes_with_it() -> None:
    old = job(elastic=True, last_resize_at=START + 5.0, last_resize_s=3.0)
    after = accounted(old, ended(old, JobState.PENDING), NOW)
    assert (after.last_resize_at, after.last_resize_s, after.resize) == (None, None, None)


def test_waiting_begins_when_a_job_becomes_pending_and_not_again() -> None:
    new = job(JobState.PENDING)
    submitted = accounted(None, new, NOW)
    assert submitted.pending_since == NOW
    reasoned = submitted.model_copy(update={"reason": "needs 2 GPUs"})
    assert accounted(submitted, reasoned, NOW + 5.0).pending_since == NOW


def test_a_change_within_a_run_at_its_size_journals_only_itself() -> None:
    old = job()
    started = old.model_copy(update={"grants": (old.grants[0].model_copy(update={"pid": 42}),)})
    assert accounted(old, started, NOW) is started
    restarted = old.model_copy(update={"attempt": 2, "grants": (NodeGrant(node="n2", gpus=(0,)),)})
    # A new attempt is placed from PENDING, never from RUNNING: no resize is counted.
    assert accounted(old, restarted, NOW) is restarted
