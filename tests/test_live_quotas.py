"""Queue quotas in the live brain, and `why`: a real nats-server, a brain configured
with a queues file, a simulated-GPU agent running real processes."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from brain.queues import load_queues
from brain.service import Brain
from bus.server import EmbeddedNats
from cli.main import main
from schemas.api import ErrorReply, JobReply, SubmitRequest, WhyReply, WhyRequest
from schemas.jobs import JobSpec, JobState
from schemas.state import CauseKind
from tests.conftest import eventually
from tests.httpkit import Api, api_factory

__all__ = ["api_factory"]

QUEUES = """\
queues:
  - name: interactive
    guaranteed_gpus: 1
    class: build
  - name: prod
    guaranteed_gpus: 2
  - name: research
    guaranteed_gpus: 1
"""
SLEEP = (sys.executable, "-c", "import time; time.sleep(600)")


async def submit(brain: Brain, queue: str, gpus: int, tenant: str = "alice") -> str:
    spec = JobSpec(name=f"{queue}-job", command=SLEEP, gpus=gpus, queue=queue)
    reply = await brain.api.handle(tenant, SubmitRequest(spec=spec))
    assert isinstance(reply, JobReply), reply
    return reply.job.job_id


async def why(brain: Brain, job_id: str, tenant: str = "alice") -> WhyReply:
    reply = await brain.api.handle(tenant, WhyRequest(job_id=job_id, limit=100))
    assert isinstance(reply, WhyReply), reply
    return reply


async def test_an_owner_reclaims_its_guarantee_from_a_borrower_and_build_jobs_stay(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    nats_server: EmbeddedNats,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    queues_file = tmp_path / "queues.yaml"
    queues_file.write_text(QUEUES)
    brain = await brain_factory(queues=load_queues(queues_file))
    agent = await agent_factory("n1", gpus=4)
    await eventually(lambda: brain.state.nodes)

    def running(job_id: str) -> bool:
        return brain.state.jobs[job_id].state is JobState.RUNNING and bool(
            agent.launcher.find(job_id)
        )

    # An interactive (build) job within its fixed quota, then a research job that
    # borrows every GPU left, beyond research's guarantee of 1.
    build = await submit(brain, "interactive", gpus=1)
    await eventually(lambda: running(build))
    borrower = await submit(brain, "research", gpus=3)
    await eventually(lambda: running(borrower))

    # prod's guarantee is owed: the borrower, not the build job, gives its GPUs back.
    owner = await submit(brain, "prod", gpus=2)
    await eventually(lambda: running(owner), timeout_s=30)
    assert brain.state.jobs[borrower].state is JobState.PENDING
    assert brain.state.jobs[build].state is JobState.RUNNING
    assert brain.state.jobs[build].attempt == 1

    preempted = [d for d in (await why(brain, borrower)).decisions if d.cause.preemption]
    assert len(preempted) == 1
    cause = preempted[0].cause
    assert cause.kind is CauseKind.PREEMPTED and preempted[0].state is JobState.PENDING
    assert cause.preemption is not None
    assert cause.preemption.reason == "quota_reclaim"
    assert (cause.preemption.owner_queue, cause.preemption.victim_queue) == ("prod", "research")
    assert cause.preemption.for_job == owner
    assert "quota reclaim: queue prod needs its guaranteed GPUs" in cause.message
    placed = [d for d in (await why(brain, owner)).decisions if d.cause.kind is CauseKind.PLACED]
    assert placed and "within queue prod's guarantee" in placed[-1].cause.message
    assert placed[-1].grants[0].node == "n1" and len(placed[-1].grants[0].gpus) == 2

    # A second build job waits at its queue's fixed quota rather than borrow the idle GPU.
    held = await submit(brain, "interactive", gpus=1)
    await eventually(lambda: "fixed quota" in (brain.state.jobs[held].reason or ""))
    build_history = (await why(brain, build)).decisions
    assert not any(d.cause.kind is CauseKind.PREEMPTED for d in build_history)
    assert brain.state.jobs[held].state is JobState.PENDING

    # `alnair why`, over NATS, shows the reclaim; another tenant is told nothing.
    args = ["why", borrower, "--nats", nats_server.url, "--tenant", "alice"]
    assert await asyncio.to_thread(main, args) == 0
    out = capsys.readouterr().out
    assert f"job {borrower} (research-job), queue research, 3 GPUs: PENDING" in out
    assert "RUNNING->PENDING" in out and "preempted" in out
    assert "quota reclaim: queue prod needs its guaranteed GPUs" in out
    assert "PENDING->RUNNING" in out and "placed on n1[" in out
    args = ["why", borrower, "--nats", nats_server.url, "--tenant", "bob"]
    assert await asyncio.to_thread(main, args) == 1
    assert f"no job {borrower} for tenant bob" in capsys.readouterr().err

    # The same over HTTP: the owner, an operator, not another tenant.
    api = await api_factory(brain)
    status, body = await api.call("GET", f"/v1/jobs/{borrower}/why?limit=2")
    assert status == 200 and body["truncated"] is True and len(body["decisions"]) == 2
    status, body = await api.call("GET", f"/v1/jobs/{borrower}/why", who="operator")
    assert status == 200
    assert any(d["cause"].get("preemption") for d in body["decisions"])
    status, body = await api.call("GET", f"/v1/jobs/{borrower}/why", who="bob")
    assert status == 404 and body["code"] == "not_found"
    status, body = await api.call("GET", f"/v1/jobs/{borrower}/why?limit=0")
    assert status == 400 and "limit" in body["error"]

    # `alnair queues`: each queue's guarantee beside what it holds and asks, for any
    # tenant (totals, no other tenant's jobs); the same over HTTP.
    args = ["queues", "--nats", nats_server.url, "--tenant", "bob"]
    assert await asyncio.to_thread(main, args) == 0
    assert capsys.readouterr().out.splitlines() == [
        "QUEUE        CLASS  GUARANTEED  RUNNING(JOBS/GPUS)  BORROWED  PENDING(JOBS/GPUS)",
        "interactive  build  1           1/1                 0         1/1",
        "prod         train  2           1/2                 0         0/0",
        "research     train  1           0/0                 0         1/3",
    ]
    status, body = await api.call("GET", "/v1/queues", who="bob")
    assert status == 200 and body["strict"] is False
    assert [(q["name"], q["running_gpus"], q["pending_gpus"]) for q in body["queues"]] == [
        ("interactive", 1, 1),
        ("prod", 2, 0),
        ("research", 0, 3),
    ]

    # `alnair jobs --queue`, and `?queue=` over HTTP: the jobs of one queue, or several.
    args = ["jobs", "--queue", "interactive", "--nats", nats_server.url, "--tenant", "alice"]
    assert await asyncio.to_thread(main, [*args, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(j["job_id"] for j in listed) == sorted([build, held])
    status, body = await api.call("GET", "/v1/jobs?queue=prod&queue=research")
    assert status == 200
    assert sorted(j["job_id"] for j in body["jobs"]) == sorted([owner, borrower])
    status, body = await api.call("GET", "/v1/jobs?queue=no%20such")
    assert status == 400 and "queues" in body["error"]


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"gpus": 2}, "a job asking 2 GPUs there could never run"),
        # An elastic job that could run at its minimum is taken.
        ({"gpus": 2, "elastic": True, "min_gpus": 1, "max_gpus": 2}, None),
        ({"gpus": 1}, None),
    ],
)
async def test_a_build_job_beyond_its_queues_fixed_quota_is_refused_at_submit(
    brain_factory: Callable[..., Awaitable[Brain]],
    tmp_path: Path,
    fields: dict[str, object],
    refused: str | None,
) -> None:
    queues_file = tmp_path / "queues.yaml"
    queues_file.write_text(QUEUES)
    brain = await brain_factory(queues=load_queues(queues_file))
    spec = JobSpec.model_validate({"command": SLEEP, "queue": "interactive", **fields})
    reply = await brain.api.handle("alice", SubmitRequest(spec=spec))
    if refused is None:
        assert isinstance(reply, JobReply), reply
        return
    assert isinstance(reply, ErrorReply) and reply.code == "invalid"
    assert reply.error == (
        "queue interactive is a build queue guaranteed 1 GPU, and build jobs do not "
        f"borrow: {refused}"
    )
    assert not brain.state.jobs


@pytest.mark.parametrize(("strict", "queue"), [(True, "prdo"), (True, "default"), (False, "prdo")])
async def test_a_brain_with_strict_queues_refuses_a_queue_it_does_not_list(
    brain_factory: Callable[..., Awaitable[Brain]], tmp_path: Path, strict: bool, queue: str
) -> None:
    queues_file = tmp_path / "queues.yaml"
    queues_file.write_text(QUEUES)
    brain = await brain_factory(queues=load_queues(queues_file), strict_queues=strict)
    prod = await submit(brain, "prod", gpus=1)
    spec = JobSpec(command=SLEEP, gpus=1, queue=queue)
    reply = await brain.api.handle("alice", SubmitRequest(spec=spec))
    if not strict:
        assert isinstance(reply, JobReply), reply  # a train queue with no guarantee
        return
    assert isinstance(reply, ErrorReply) and reply.code == "invalid"
    assert reply.error == (
        f"no queue {queue}; the queues are interactive, prod, research (submit --queue NAME)"
    )
    assert list(brain.state.jobs) == [prod]  # what was accepted stays


async def test_why_is_for_the_jobs_owner(
    brain_factory: Callable[..., Awaitable[Brain]],
) -> None:
    brain = await brain_factory()
    job_id = await submit(brain, "default", gpus=1)
    reply = await why(brain, job_id)
    assert [d.cause.kind for d in reply.decisions][:1] == [CauseKind.SUBMITTED]
    assert reply.decisions[0].previous is None and not reply.truncated
    refused = await brain.api.handle("bob", WhyRequest(job_id=job_id))
    assert isinstance(refused, ErrorReply) and refused.code == "not_found"
    missing = await brain.api.handle("alice", WhyRequest(job_id="404"))
    assert isinstance(missing, ErrorReply) and missing.code == "not_found"
    seen = await brain.api.handle("operator", WhyRequest(job_id=job_id), operator=True)
    assert isinstance(seen, WhyReply) and seen.job.job_id == job_id
