"""Brain + agents against a real nats-server, running real processes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from brain.api import ApiServer
from brain.census import CensusCache, gpu_census
from brain.core.decide import Policy
from brain.leader import BRAINS_FRESH_S
from cli.client import call
from schemas.api import (
    OPERATOR_TENANT,
    STATUS_RESULT,
    BrainInfo,
    CancelRequest,
    DrainRequest,
    ErrorReply,
    GpuCensus,
    JobReply,
    StatusReply,
    StatusRequest,
    SubmitRequest,
)
from schemas.jobs import JobSpec, JobState
from tests.conftest import eventually


async def submit(api: ApiServer, spec: JobSpec, tenant: str = "default") -> str:
    reply = await api.handle(tenant, SubmitRequest(spec=spec))
    assert isinstance(reply, JobReply), reply
    return reply.job.job_id


async def test_two_gpu_job_runs_and_succeeds(brain_factory, agent_factory) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=4)
    await agent_factory("n2", gpus=4)
    await eventually(lambda: len(brain.state.nodes) == 2)

    job_id = await submit(
        brain.api,
        JobSpec(
            command=(
                sys.executable,
                "-c",
                "import os; print(42, os.environ['CUDA_VISIBLE_DEVICES'])",
            ),
            gpus=2,
        ),
    )
    job = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state is JobState.SUCCEEDED and j
    )
    assert job.attempt == 1
    assert job.exit_code == 0
    (grant,) = job.grants
    assert len(grant.gpus) == 2
    assert grant.log_path is not None
    assert Path(grant.log_path).read_text().split() == ["42", ",".join(map(str, grant.gpus))]


async def test_failing_command_ends_failed_with_exit_code(brain_factory, agent_factory) -> None:
    brain = await brain_factory()
    await agent_factory("n1")
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(
        brain.api,
        JobSpec(command=(sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"), gpus=1),
    )
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.FAILED
    assert job.exit_code == 3
    assert job.reason is not None and "boom" in job.reason


async def test_cancel_stops_running_process(brain_factory, agent_factory) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1")
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(
        brain.api, JobSpec(command=(sys.executable, "-c", "import time; time.sleep(600)"), gpus=1)
    )
    await eventually(lambda: agent.launcher.find(job_id))
    (process,) = agent.launcher.find(job_id)
    reply = await brain.api.handle("default", CancelRequest(job_id=job_id))
    assert isinstance(reply, JobReply) and reply.job.state is JobState.CANCELLED
    await eventually(lambda: process.exited.is_set())
    assert process.process.returncode is not None and process.process.returncode < 0
    # Asked again (a retry whose answer was lost): the same cancelled job.
    again = await brain.api.handle("default", CancelRequest(job_id=job_id))
    assert isinstance(again, JobReply) and again.job.state is JobState.CANCELLED


async def test_lost_node_job_runs_on_other_node(brain_factory, agent_factory) -> None:
    brain = await brain_factory(node_timeout_s=1.0)
    first = await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)
    job_id = await submit(
        brain.api, JobSpec(command=(sys.executable, "-c", "import time; time.sleep(600)"), gpus=2)
    )
    await eventually(lambda: first.launcher.find(job_id))
    second = await agent_factory("n2", gpus=2)
    orphans = await first.crash()
    agent_factory.orphans.extend(orphans)
    await eventually(lambda: second.launcher.find(job_id), timeout_s=30)
    job = brain.state.jobs[job_id]
    assert job.state is JobState.RUNNING
    assert job.nodes == ("n2",)
    assert job.attempt == 2


async def test_status_leaves_out_a_dead_leaders_announcement(brain_factory, connect) -> None:
    leader = await brain_factory()
    standby = await brain_factory(lead=False)
    # What a leader killed outright leaves in the bucket until its TTL.
    dead = BrainInfo(brain_id="0dead0", host="gone", pid=1, since=0.0, leader=True)
    await leader.lease.announce(dead)
    client = await connect("client")

    async def listed() -> list[tuple[str, bool]]:
        reply = await call(client, "default", "status", StatusRequest(), STATUS_RESULT)
        return [(b.brain_id, b.leader) for b in reply.brains]

    async def standby_listed() -> bool:
        return (standby.instance, False) in await listed()

    await eventually(standby_listed)
    assert await listed() == [(leader.instance, True), (standby.instance, False)]


async def test_status_counts_every_gpu_by_what_it_is_doing(brain_factory, agent_factory) -> None:
    """The census `alnair status` and the dashboard show: each GPU in exactly one of
    busy, shared, free, drained and on lost nodes, and READY nodes' GPUs by utilisation."""
    brain = await brain_factory(policy=Policy(share_placement="best-fit"))
    await agent_factory("n1", gpus=2)
    n2 = await agent_factory("n2", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 2)
    sleeper = (sys.executable, "-c", "import time; time.sleep(600)")
    whole = await submit(brain.api, JobSpec(command=sleeper, gpus=1))
    share = await submit(brain.api, JobSpec(command=sleeper, gpus=1, gpu_milli=500))
    await eventually(
        lambda: all(brain.state.jobs[j].state is JobState.RUNNING for j in (whole, share))
    )
    free_node = next(n for n in ("n1", "n2") if n not in brain.state.allocated())
    drain = DrainRequest(node=free_node, gpu=1)
    reply = await brain.api.handle(OPERATOR_TENANT, drain, operator=True)
    assert not isinstance(reply, ErrorReply), reply

    reply = await brain.api.handle("default", StatusRequest())
    assert isinstance(reply, StatusReply) and reply.census is not None

    async def census() -> GpuCensus:  # as the API counts it, without its 5 s cache
        return await CensusCache().get(brain.state, brain.telemetry)

    counted = await census()
    assert counted == gpu_census(brain.state, brain.telemetry)
    assert (counted.busy, counted.shared, counted.free, counted.drained) == (1, 1, 1, 1)
    assert counted.unavailable == 0
    assert counted.nodes_by_state == {"READY": 2, "LOST": 0, "DRAINED": 0}
    await eventually(lambda: len(brain.telemetry) == 2)
    counted = await census()
    assert sum(counted.utilisation) + counted.unreported == 4

    await n2.stop(stop_jobs=False)  # gone silent: LOST after the node timeout
    await eventually(lambda: brain.state.nodes["n2"].state.value == "LOST", timeout_s=30)
    counted = await census()
    assert counted.unavailable == 2
    assert counted.busy + counted.shared + counted.free + counted.drained == 2
    assert counted.nodes_by_state["LOST"] == 1


async def test_status_does_not_wait_on_the_brains_bucket(brain_factory, monkeypatch) -> None:
    """`status` lists the brains as last read: a read of the bucket that does not end
    (its stream leader moving, a flood ahead of its answer) holds no request up, and the
    list is read again in the background once it is a second old."""
    brain = await brain_factory()
    first = await brain.api.handle("default", StatusRequest())
    assert isinstance(first, StatusReply) and [b.leader for b in first.brains] == [True]
    release = asyncio.Event()
    reads: list[bool] = []
    real = brain.lease._read_brains

    async def stuck() -> list[BrainInfo]:
        reads.append(True)
        await release.wait()
        return await real()

    monkeypatch.setattr(brain.lease, "_read_brains", stuck)
    await asyncio.sleep(BRAINS_FRESH_S)  # stale: the next status starts a read
    for _ in range(3):
        reply = await asyncio.wait_for(brain.api.handle("default", StatusRequest()), 10)
        assert isinstance(reply, StatusReply) and reply.brains == first.brains
    assert reads == [True]  # one read at a time
    release.set()
    await eventually(lambda: brain.lease._reading is None)
