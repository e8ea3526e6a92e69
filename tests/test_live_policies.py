"""The live brain runs the core's policies with the inputs they need: attained
service, LAS bands, and preemption applied to real processes."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agents.agent import Agent
from brain.core import ClusterSnapshot, Policy
from brain.service import Brain
from brain.state import BrainState
from bus.client import Bus
from cli import why as why_cli
from schemas import subjects
from schemas.api import JobReply, SubmitRequest, WhyReply, WhyRequest
from schemas.jobs import JobSpec, JobState
from schemas.progress import Progress
from schemas.state import CauseKind
from tests.conftest import eventually


async def started(brain: Brain, agent: Agent, spec: JobSpec) -> str:
    """Submit `spec` and wait until `agent` runs it; returns its job id."""
    submitted = await brain.api.handle("default", SubmitRequest(spec=spec))
    assert isinstance(submitted, JobReply)
    job_id = submitted.job.job_id
    await eventually(lambda: agent.launcher.find(job_id))
    return job_id


async def test_finished_job_carries_its_attained_service(brain_factory, agent_factory) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    reply = await brain.api.handle(
        "default",
        SubmitRequest(
            spec=JobSpec(command=(sys.executable, "-c", "import time; time.sleep(0.5)"), gpus=2)
        ),
    )
    assert isinstance(reply, JobReply)
    job = await eventually(
        lambda: (j := brain.state.jobs[reply.job.job_id]).state is JobState.SUCCEEDED and j
    )
    assert job.executed_seconds >= 0.5
    assert job.attained_gpu_seconds >= 2 * 0.5
    assert job.attained_gpu_seconds == 2 * job.executed_seconds


async def test_why_counts_the_service_of_the_run_in_progress(brain_factory, agent_factory) -> None:
    # The record counts only runs that ended; `alnair why` of a running job read
    # "0.0 GPU-s over 0.0 s run" however long it had run.
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    sleeper = JobSpec(command=(sys.executable, "-c", "import time; time.sleep(600)"), gpus=2)
    job_id = await started(brain, agent, sleeper)

    async def why() -> WhyReply:
        reply = await brain.api.handle("default", WhyRequest(job_id=job_id))
        assert isinstance(reply, WhyReply)
        return reply

    async def served() -> WhyReply | None:
        reply = await why()
        return reply if (reply.executed_seconds or 0.0) >= 0.5 else None

    reply = await eventually(served)
    assert reply.job.state is JobState.RUNNING
    assert reply.job.executed_seconds == 0.0  # the record: nothing ended yet
    assert reply.attained_gpu_seconds == 2 * reply.executed_seconds
    (service,) = (line for line in why_cli.render(reply).splitlines() if "service:" in line)
    assert service.startswith(f"  service:  {reply.attained_gpu_seconds:.1f} GPU-s over ")
    assert not service.startswith("  service:  0.0 ")
    assert reply.order == brain.config.policy.order


async def test_las_demotes_a_long_job_and_preempts_it_for_a_newcomer(
    brain_factory, agent_factory
) -> None:
    # One GPU; the first band ends after 1 GPU-second of service.
    brain = await brain_factory(policy=Policy(order="las", las_thresholds_gpu_s=(1.0,)))
    agent = await agent_factory("n1", gpus=1)
    await eventually(lambda: brain.state.nodes)
    sleeper = JobSpec(
        name="long", command=(sys.executable, "-c", "import time; time.sleep(600)"), gpus=1
    )
    long = await brain.api.handle("default", SubmitRequest(spec=sleeper))
    assert isinstance(long, JobReply)
    long_id = long.job.job_id
    await eventually(lambda: agent.launcher.find(long_id))
    await eventually(lambda: brain.state.jobs[long_id].service_level == 1, timeout_s=30)

    short = await brain.api.handle(
        "default", SubmitRequest(spec=JobSpec(name="short", command=("true",), gpus=1))
    )
    assert isinstance(short, JobReply)
    await eventually(
        lambda: brain.state.jobs[short.job.job_id].state is JobState.SUCCEEDED, timeout_s=30
    )
    rows = brain.history.job_events(long_id)
    assert any(r["kind"] == CauseKind.PREEMPTED.value for r in rows), rows
    # The preempted job kept its service and runs again once the newcomer is done.
    await eventually(lambda: brain.state.jobs[long_id].attempt == 2, timeout_s=30)
    assert brain.state.jobs[long_id].attained_gpu_seconds >= 1.0


async def test_srtf_preempts_for_a_job_that_declares_less_work(
    brain_factory, agent_factory
) -> None:
    brain = await brain_factory(policy=Policy(order="srtf"))
    agent = await agent_factory("n1", gpus=1)
    await eventually(lambda: brain.state.nodes)
    long = await brain.api.handle(
        "default",
        SubmitRequest(
            spec=JobSpec(
                name="long",
                command=(sys.executable, "-c", "import time; time.sleep(600)"),
                gpus=1,
                declared_duration_s=600,
            )
        ),
    )
    assert isinstance(long, JobReply)
    long_id = long.job.job_id
    await eventually(lambda: agent.launcher.find(long_id))
    short = await brain.api.handle(
        "default",
        SubmitRequest(spec=JobSpec(name="short", command=("true",), gpus=1, declared_duration_s=1)),
    )
    assert isinstance(short, JobReply)
    await eventually(
        lambda: brain.state.jobs[short.job.job_id].state is JobState.SUCCEEDED, timeout_s=30
    )
    reply = await brain.api.handle("default", WhyRequest(job_id=long_id))
    assert isinstance(reply, WhyReply)
    preemptions = [d.cause.preemption for d in reply.decisions if d.cause.preemption]
    assert preemptions and preemptions[0].reason == "outranked"
    assert (preemptions[0].for_job, preemptions[0].order) == (short.job.job_id, "srtf")
    # The long job runs again once the short one is done.
    await eventually(lambda: brain.state.jobs[long_id].attempt == 2, timeout_s=30)


async def test_gittins_learns_finished_jobs_service_and_a_standby_rebuilds_it(
    brain_factory, agent_factory, monkeypatch
) -> None:
    # What `decide` is given: the learned distribution of every snapshot taken.
    observed: list[int | None] = []
    take = BrainState.snapshot

    def spy(self: BrainState, **kwargs: Any) -> ClusterSnapshot:
        snapshot = take(self, **kwargs)
        learned = snapshot.service_distribution
        observed.append(None if learned is None else learned.observed)
        return snapshot

    monkeypatch.setattr(BrainState, "snapshot", spy)
    brain = await brain_factory(policy=Policy(order="gittins"))
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    ids = []
    for gpus in (1, 2, 1):
        reply = await brain.api.handle(
            "default", SubmitRequest(spec=JobSpec(command=("true",), gpus=gpus))
        )
        assert isinstance(reply, JobReply)
        ids.append(reply.job.job_id)
    await eventually(
        lambda: all(brain.state.jobs[i].state is JobState.SUCCEEDED for i in ids), timeout_s=30
    )
    service = [brain.state.jobs[i].attained_gpu_seconds for i in ids]
    assert sorted(brain.state.service_samples) == sorted(service)
    await eventually(lambda: observed[-1] == 3)
    assert None not in observed
    learned = brain.state.snapshot().service_distribution
    assert learned is not None and learned.observed == 3
    # A standby folds the same log into the same distribution.
    standby = await brain_factory(lead=False, policy=Policy(order="gittins"))
    await eventually(lambda: standby.state.last_seq == brain.state.last_seq)
    assert list(standby.state.service_samples) == list(brain.state.service_samples)
    rebuilt = standby.state.snapshot().service_distribution
    assert rebuilt is not None and rebuilt.values == learned.values


async def test_the_brain_learns_how_far_succeeded_jobs_progress_reports_were_off(
    brain_factory, agent_factory, connect: Callable[[str], Awaitable[Bus]]
) -> None:
    """As the simulator does: a job that succeeds after reporting its rate of progress
    teaches how far such reports are off, which `progress-gittins` reads."""
    brain = await brain_factory(policy=Policy(order="progress-gittins"))
    agent = await agent_factory("n1", gpus=1)
    supervisor = await connect("supervisor")
    await eventually(lambda: brain.state.nodes)
    spec = JobSpec(command=(sys.executable, "-c", "import time; time.sleep(1.5)"), gpus=1)
    job_id = await started(brain, agent, spec)
    # Its reports: a hundredth of its work a second, so 100 s in all.
    for step, ts in ((10, 1.0), (20, 2.0)):
        report = Progress(
            job_id=job_id,
            ts=ts,
            step=step,
            world_size=1,
            samples_per_s=10.0,
            loss=0.1,
            slots=1,
            total_steps=1000,
        )
        await supervisor.publish(subjects.job(job_id, "progress"), report)
    await eventually(lambda: brain.progress.current().get(job_id))
    job = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state is JobState.SUCCEEDED and j
    )
    assert brain.progress.errors.latest == pytest.approx((job.executed_seconds / 100.0,))
    assert job.executed_seconds >= 1.5
