"""GPU health: faults injected into simulated GPUs through NATS drain what the XID
catalogue says; operators drain and resume by hand; NVML without a driver is handled."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from agents.health import NvmlHealthWatcher, check_injection, watch_nvml
from brain.core.failures import FailurePolicy
from cli.format import nodes_table
from schemas import subjects
from schemas.api import DrainRequest, NodeReply, ResumeRequest
from schemas.commands import InjectFault, InjectFaultReply
from schemas.jobs import FailureClass, JobSpec, JobState
from schemas.nodes import NodeState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit
from tests.test_failures_e2e import python

REPLY: TypeAdapter[InjectFaultReply] = TypeAdapter(InjectFaultReply)
SLEEP = python("import time; time.sleep(600)")


async def inject(bus, node: str, **fault) -> InjectFaultReply:  # type: ignore[no-untyped-def]
    return await bus.request(subjects.node(node, "inject"), InjectFault(**fault), REPLY)


async def test_xid_79_drains_the_node_and_its_job_runs_elsewhere(
    brain_factory, agent_factory, connect
) -> None:
    brain = await brain_factory(failures=FailurePolicy(backoff_base_s=0.1))
    first = await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(brain.api, JobSpec(command=SLEEP, gpus=2))
    (stale,) = await eventually(lambda: first.launcher.find(job_id))
    second = await agent_factory("n2", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 2)
    reply = await inject(await connect("cli"), "n1", gpu=1, fault="xid", xid=79)
    assert reply.ok, reply.detail
    await eventually(lambda: second.launcher.find(job_id), timeout_s=30)
    node = brain.state.nodes["n1"]
    assert node.state is NodeState.DRAINED
    assert node.drain_reason is not None and "XID 79" in node.drain_reason
    job = brain.state.jobs[job_id]
    assert (job.state, job.nodes, job.attempt) == (JobState.RUNNING, ("n2",), 2)
    assert job.failures[0].failure_class is FailureClass.INFRASTRUCTURE
    await eventually(lambda: stale.exited.is_set())
    assert "XID 79" in nodes_table(brain.api._nodes())


async def test_xid_13_drains_nothing(brain_factory, agent_factory, connect) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(brain.api, JobSpec(command=SLEEP, gpus=1))
    await eventually(lambda: agent.launcher.find(job_id))
    reply = await inject(await connect("cli"), "n1", gpu=0, fault="xid", xid=13)
    assert reply.ok, reply.detail
    await eventually(
        lambda: any(row["kind"] == "gpu_fault" for row in brain.history.db.table("events").rows)
    )
    node = brain.state.nodes["n1"]
    assert node.state is NodeState.READY and not node.drained_gpus
    job = brain.state.jobs[job_id]
    assert (job.state, job.attempt, job.failures) == (JobState.RUNNING, 1, ())


async def test_critical_xid_drains_one_gpu_and_operator_resumes(
    brain_factory, agent_factory, connect
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    assert (await inject(await connect("cli"), "n1", gpu=1, fault="ecc_dbe")).ok
    await eventually(lambda: brain.state.nodes["n1"].drained_gpus)
    assert brain.state.snapshot().nodes[0].gpus == (0,)
    drained = await brain.api.handle(
        "operator", DrainRequest(node="n1", gpu=0, reason="fan noise"), operator=True
    )
    assert isinstance(drained, NodeReply)
    assert [d.index for d in drained.node.record.drained_gpus] == [1, 0]
    assert brain.state.snapshot().nodes[0].gpus == ()
    resumed = await brain.api.handle("operator", ResumeRequest(node="n1"), operator=True)
    assert isinstance(resumed, NodeReply) and not resumed.node.record.drained_gpus
    assert brain.state.snapshot().nodes[0].gpus == (0, 1)


def test_injection_refused_for_real_gpus() -> None:
    fault = InjectFault(gpu=0, fault="xid", xid=79)
    refusal = check_injection(fault, "nvml", 8)
    assert refusal is not None and "real GPUs" in refusal
    assert check_injection(fault, "sim", 8) is None
    assert check_injection(InjectFault(gpu=9, fault="lost"), "sim", 8) is not None


def test_nvml_watcher_without_a_driver_is_a_value_not_a_crash() -> None:
    pynvml = pytest.importorskip("pynvml")
    reports: list[object] = []
    watcher = NvmlHealthWatcher(pynvml, [], reports.append)
    reason = watcher.start()
    if reason is None:  # a machine with a driver: the watcher runs; stop it
        watcher.stop()
        pytest.skip("NVML is usable here")
    assert "NVML" in reason
    watcher.stop()
    assert reports == []
    assert watch_nvml(object(), reports.append) == (None, "not an NVML backend")
