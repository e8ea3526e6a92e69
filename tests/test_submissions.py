"""Submissions and cancellations without a server (brain/submissions.py): a job that
could never run is refused with what was wrong and leaves no record; a known key is
answered with its job; a cancellation ends the job and stops its parts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from brain.core import QueueQuota
from brain.core.failures import DEFAULT_FAILURE_POLICY, FailurePolicy
from brain.submissions import Submissions
from schemas.api import SubmitRequest
from schemas.errors import ApiError
from schemas.jobs import MAX_SPEC_BYTES, JobRecord, JobSpec, JobState
from schemas.state import CauseKind
from tests.parts import Clock, Shell
from tests.statelog import START_TS

NOW = START_TS + 50.0


@dataclass(frozen=True)
class Settings:
    tenants: frozenset[str] | None = None
    queues: tuple[QueueQuota, ...] = ()
    strict_queues: bool = False
    failures: FailurePolicy = DEFAULT_FAILURE_POLICY


@dataclass
class Part:
    shell: Shell
    submissions: Submissions
    prompted: list[None] = field(default_factory=list)


def part(settings: Settings | None = None) -> Part:
    shell = Shell(clock=Clock(NOW))
    shell.add_node("n1", 8)
    shell.add_node("n2", 4)
    prompted: list[None] = []

    async def job_record(job_id: str) -> JobRecord | None:
        return shell.state.jobs.get(job_id)

    submissions = Submissions(
        lambda: shell.state,
        shell,
        settings or Settings(),
        clock=shell.clock,
        job_record=job_record,
        submitted=lambda: prompted.append(None),
    )
    return Part(shell, submissions, prompted)


def request(key: str | None = None, **spec: object) -> SubmitRequest:
    fields: dict[str, object] = {"command": ("train",), "gpus": 2, **spec}
    return SubmitRequest(spec=JobSpec.model_validate(fields), idempotency_key=key)


async def test_an_admitted_job_is_journaled_pending_and_its_pass_is_prompt() -> None:
    p = part()
    job = await p.submissions.submit("team", request())
    assert p.shell.state.jobs[job.job_id] == job
    assert job.state is JobState.PENDING and job.tenant == "team"
    assert (job.submitted_at, job.reason) == (NOW, "submitted")
    assert [c.kind for c in p.shell.causes] == [CauseKind.SUBMITTED]
    assert "tenant team" in p.shell.causes[0].message
    assert len(p.prompted) == 1
    second = await p.submissions.submit("team", request())
    assert int(second.job_id) == int(job.job_id) + 1


async def test_a_known_key_is_answered_with_its_job_and_makes_nothing() -> None:
    p = part()
    first = await p.submissions.submit("team", request("k-1"))
    again = await p.submissions.submit("team", request("k-1", gpus=4))
    assert again == first
    assert len(p.shell.state.jobs) == 1 and len(p.shell.causes) == 1
    other = await p.submissions.submit("other", request("k-1"))  # keys are per tenant
    assert other.job_id != first.job_id


async def test_a_key_whose_job_left_memory_never_makes_a_second_one() -> None:
    """A finished job gone from memory is answered from the history; when the history
    cannot give its record (a read that failed), the caller is told to try again, and
    no job is made for a key that already has one."""
    p = part()
    p.shell.state.keys_away[("team", "k-old")] = "7"
    jobs_before = dict(p.shell.state.jobs)
    with pytest.raises(ApiError) as refused:
        await p.submissions.submit("team", request("k-old"))
    assert refused.value.code == "unavailable" and "(7)" in str(refused.value)
    assert p.shell.state.jobs == jobs_before and p.shell.causes == [] and p.prompted == []


@pytest.mark.parametrize(
    ("name", "settings", "tenant", "spec", "code", "says"),
    [
        (
            "more GPUs than the cluster registered",
            Settings(),
            "team",
            {"gpus": 13},
            "invalid",
            "the cluster has 12 (2 nodes, at most 8 on one node)",
        ),
        (
            "a tenant not in the map",
            Settings(tenants=frozenset({"team"})),
            "stranger",
            {},
            "forbidden",
            "tenant stranger has no Unix user",
        ),
        (
            "a queue not listed, under strict queues",
            Settings(queues=(QueueQuota("research", 4, "train"),), strict_queues=True),
            "team",
            {"queue": "nowhere"},
            "invalid",
            "no queue nowhere; the queues are research",
        ),
        (
            "more than a build queue's guarantee",
            Settings(queues=(QueueQuota("ci", 2, "build"),)),
            "team",
            {"queue": "ci", "gpus": 4},
            "invalid",
            "could never run",
        ),
        (
            "a GPU type no node has",
            Settings(),
            "team",
            {"gpu_types": ("A100",)},
            "invalid",
            "no node could ever run this job",
        ),
        (
            "a spec too large for the log",
            Settings(),
            "team",
            {"env": {"BLOB": "x" * MAX_SPEC_BYTES}},
            "invalid",
            f"over the {MAX_SPEC_BYTES} a job may take",
        ),
    ],
)
async def test_a_job_that_could_never_run_is_refused_with_what_was_wrong(
    name: str, settings: Settings, tenant: str, spec: dict[str, object], code: str, says: str
) -> None:
    p = part(settings)
    listed = {"queue": settings.queues[0].name} if settings.strict_queues else {}
    kept = await p.submissions.submit("team", request(**listed)) if tenant == "team" else None
    with pytest.raises(ApiError) as refused:
        await p.submissions.submit(tenant, request(**spec))
    assert refused.value.code == code, name
    assert says in refused.value.message, refused.value.message
    # Nothing is lost of what was accepted, and nothing is added.
    assert list(p.shell.state.jobs.values()) == ([kept] if kept else [])


async def test_a_cancellation_ends_the_job_and_stops_its_parts() -> None:
    p = part()
    running = p.shell.add_job(7, gpus=2, node="n1")
    cancelled = await p.submissions.cancel("default", "7")
    assert cancelled.state is JobState.CANCELLED and cancelled.finished_at == NOW
    assert p.shell.state.jobs["7"].state is JobState.CANCELLED
    assert [(s.job_id, s.node, s.attempt) for s in p.shell.stops] == [("7", "n1", running.attempt)]
    # Asked again (a retry whose answer was lost): the same job, and nothing more done.
    again = await p.submissions.cancel("default", "7")
    assert again == p.shell.state.jobs["7"] and len(p.shell.stops) == 1
    assert [c.kind for c in p.shell.causes] == [CauseKind.CANCELLED]
    finished = p.shell.add_job(8, gpus=1, node="n1")
    p.shell.state.jobs["8"] = finished.model_copy(update={"state": JobState.SUCCEEDED})
    with pytest.raises(ApiError) as ended:
        await p.submissions.cancel("default", "8")
    assert ended.value.code == "conflict" and "already ended SUCCEEDED" in ended.value.message


async def test_only_its_tenant_may_cancel_a_job() -> None:
    p = part()
    p.shell.add_job(7, gpus=2, node="n1")
    with pytest.raises(ApiError) as refused:
        await p.submissions.cancel("other", "7")
    assert refused.value.code == "not_found"
    assert p.shell.state.jobs["7"].state is JobState.RUNNING and p.shell.stops == []


async def test_an_operator_may_cancel_any_tenants_job_and_says_so() -> None:
    p = part()
    running = p.shell.add_job(7, gpus=2, node="n1")
    assert running.tenant != "operator"  # another tenant's job
    cancelled = await p.submissions.cancel("operator", "7", operator=True)
    assert cancelled.state is JobState.CANCELLED and cancelled.tenant == running.tenant
    assert cancelled.reason == "cancelled by an operator"
    assert [c.message for c in p.shell.causes] == ["cancelled by an operator"]
    assert [(s.job_id, s.node) for s in p.shell.stops] == [("7", "n1")]
    # A retry answers with the job as cancelled, and does nothing more.
    assert await p.submissions.cancel("operator", "7", operator=True) == p.shell.state.jobs["7"]
    assert len(p.shell.stops) == 1 and len(p.shell.causes) == 1
