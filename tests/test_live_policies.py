"""The live brain runs the core's policies with the inputs they need: attained
service, LAS bands, and preemption applied to real processes."""

from __future__ import annotations

import sys

from brain.core import Policy
from schemas.api import JobReply, SubmitRequest
from schemas.jobs import JobSpec, JobState
from schemas.state import CauseKind
from tests.conftest import eventually


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
    assert brain.preemptions >= 1
