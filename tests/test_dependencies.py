"""Jobs that run after others (`JobSpec.after`, `alnair submit --after`): a job waits,
out of every decision, until each job it runs after has SUCCEEDED; it is cancelled when
one ends otherwise; a submission after a job that is not the tenant's, or that already
ended otherwise, is refused. The state's bookkeeping without a server, then a real
brain, agent and nats-server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import brain.state as state_module
from brain.state import BrainState
from schemas.api import ErrorReply, JobReply, SubmitRequest
from schemas.jobs import JobSpec, JobState
from tests.conftest import eventually
from tests.parts import Shell
from tests.test_cluster_e2e import submit


def _after(shell: Shell, number: int, *before: str) -> None:
    job = shell.add_job(number)  # PENDING
    spec = job.spec.model_copy(update={"after": before})
    shell.put_job(job.model_copy(update={"spec": spec}))


def _ended(shell: Shell, job_id: str, state: JobState) -> None:
    job = shell.state.jobs[job_id]
    shell.put_job(job.model_copy(update={"state": state, "grants": (), "finished_at": 1.0}))


def _pending_views(shell: Shell) -> list[str]:
    return [view.job_id for view in shell.state.snapshot().pending]


def test_a_job_waits_out_of_decisions_until_what_it_runs_after_succeeded() -> None:
    shell = Shell()
    shell.add_node("n1")
    shell.add_job(1, node="n1")
    shell.add_job(2, node="n1")
    _after(shell, 3, "1", "2")
    _after(shell, 4, "3")  # a chain
    assert shell.state.blocked == {"3": {"1", "2"}, "4": {"3"}}
    assert _pending_views(shell) == []
    assert shell.state.waits_by_kind() == {"after_jobs": 2}

    _ended(shell, "1", JobState.SUCCEEDED)
    assert shell.state.blocked["3"] == {"2"}
    _ended(shell, "2", JobState.SUCCEEDED)
    assert "3" not in shell.state.blocked and _pending_views(shell) == ["3"]
    assert shell.state.doomed == {}


def test_a_job_whose_job_to_run_after_fails_is_doomed_and_so_on_down_a_chain() -> None:
    shell = Shell()
    shell.add_node("n1")
    shell.add_job(1, node="n1")
    _after(shell, 2, "1")
    _after(shell, 3, "2")
    _ended(shell, "1", JobState.FAILED)
    assert shell.state.doomed == {"2": "job 1, which it was to run after, ended FAILED"}
    _ended(shell, "2", JobState.CANCELLED)  # as the brain's tick cancels it
    assert shell.state.doomed == {"3": "job 2, which it was to run after, ended CANCELLED"}
    _ended(shell, "3", JobState.CANCELLED)
    assert shell.state.doomed == {} and shell.state.blocked == {}


def test_a_finished_job_a_pending_one_waits_on_stays_in_memory_and_in_snapshots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finished jobs past the kept number leave memory, and one gone is taken for
    SUCCEEDED: had the job a pending one runs after failed and left before the tick
    cancelled its dependent, a brain restarted from a snapshot would have run it."""
    monkeypatch.setattr(state_module, "FINISHED_KEPT", 2)
    shell = Shell()
    shell.add_node("n1")
    shell.add_job(1, node="n1")
    _after(shell, 2, "1")
    _ended(shell, "1", JobState.FAILED)
    for number in range(3, 7):  # four more end after it
        shell.add_job(number, node="n1")
        _ended(shell, str(number), JobState.SUCCEEDED)
    assert "1" in shell.state.jobs and set(shell.state.finished) == {"6", "1"}
    again = BrainState.from_snapshot(shell.state.to_snapshot(taken_at=0.0, epoch=1))
    assert again.doomed == {"2": "job 1, which it was to run after, ended FAILED"}

    # Its dependent cancelled, it is let go with the next to end.
    job = shell.state.jobs["2"]
    shell.put_job(job.model_copy(update={"state": JobState.CANCELLED, "finished_at": 2.0}))
    shell.add_job(7, node="n1")
    _ended(shell, "7", JobState.SUCCEEDED)
    assert "1" not in shell.state.jobs and set(shell.state.finished) == {"2", "7"}


def test_a_job_after_any_waits_for_its_jobs_to_end_however_they_end() -> None:
    shell = Shell()
    shell.add_node("n1")
    shell.add_job(1, node="n1")
    shell.add_job(2, node="n1")
    job = shell.add_job(3)
    spec = job.spec.model_copy(update={"after": ("1",), "after_any": ("2",)})
    shell.put_job(job.model_copy(update={"spec": spec}))
    assert shell.state.blocked == {"3": {"1", "2"}}
    _ended(shell, "2", JobState.FAILED)  # ended: enough for after_any
    assert shell.state.blocked == {"3": {"1"}} and shell.state.doomed == {}
    _ended(shell, "1", JobState.SUCCEEDED)
    assert shell.state.blocked == {} and _pending_views(shell) == ["3"]


def test_a_job_is_in_after_or_after_any_not_both() -> None:
    with pytest.raises(ValidationError, match="after_any: job 2 is in after too"):
        JobSpec(command=("true",), gpus=1, after=("1", "2"), after_any=("2",))


async def test_jobs_run_after_others_and_are_cancelled_when_those_fail(
    brain_factory, agent_factory, tmp_path: Path
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)

    def job(code: str, *after: str) -> JobSpec:
        command = (sys.executable, "-c", code)
        return JobSpec(command=command, gpus=1, cwd=str(tmp_path), after=after)

    first = await submit(brain.api, job("import time; time.sleep(2)"))
    failing = await submit(brain.api, job("import time, sys; time.sleep(1); sys.exit(3)"))
    then = await submit(brain.api, job("pass", first))
    never = await submit(brain.api, job("pass", first, failing))
    cleanup = job("pass").model_copy(update={"after_any": (failing,)})
    regardless = await submit(brain.api, cleanup)
    assert brain.state.jobs[then].reason == f"waiting for job {first} to succeed"
    assert brain.state.jobs[never].reason == f"waiting for jobs {first}, {failing} to succeed"
    assert brain.state.jobs[regardless].reason == f"waiting for job {failing} to end"

    await eventually(lambda: brain.state.jobs[never].state is JobState.CANCELLED, timeout_s=30)
    assert brain.state.jobs[never].reason == (
        f"job {failing}, which it was to run after, ended FAILED"
    )
    assert brain.state.jobs[then].state is JobState.PENDING  # its first still runs
    await eventually(lambda: brain.state.jobs[then].state is JobState.SUCCEEDED, timeout_s=30)
    started = brain.state.jobs[then].started_at
    assert started is not None and started >= brain.state.jobs[first].finished_at
    # After any: it ran once the failing job had ended.
    await eventually(lambda: brain.state.jobs[regardless].state is JobState.SUCCEEDED)
    started = brain.state.jobs[regardless].started_at
    assert started is not None and started >= brain.state.jobs[failing].finished_at


@pytest.mark.parametrize(
    ("after", "tenant", "says"),
    [
        ("99", "default", "after: tenant default has no job 99"),
        ("1", "alice", "after: tenant alice has no job 1"),
        ("2", "default", "after: job 2 ended FAILED: this job could never start"),
        ("any:99", "default", "after_any: tenant default has no job 99"),
        ("any:2", "default", None),  # ended: nothing to wait for
    ],
)
async def test_a_submission_after_a_job_it_could_never_follow_is_refused(
    brain_factory, agent_factory, tmp_path: Path, after: str, tenant: str, says: str | None
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)
    spec = JobSpec(command=("sleep", "600"), gpus=1, cwd=str(tmp_path))
    await submit(brain.api, spec)  # job 1, running
    failing = await submit(brain.api, spec.model_copy(update={"command": ("false",)}))
    await eventually(lambda: brain.state.jobs[failing].state is JobState.FAILED, timeout_s=30)
    field, job_id = ("after_any", after[4:]) if after.startswith("any:") else ("after", after)
    request = SubmitRequest(spec=spec.model_copy(update={field: (job_id,)}))
    reply = await brain.api.handle(tenant, request)
    if says is None:
        assert isinstance(reply, JobReply) and reply.job.reason == "submitted"
        assert reply.job.job_id not in brain.state.blocked
    else:
        assert isinstance(reply, ErrorReply) and (reply.code, reply.error) == ("invalid", says)
