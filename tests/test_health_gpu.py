"""GPU health: faults injected into simulated GPUs through NATS drain what the XID
catalogue says; operators drain and resume by hand; the NVML watcher turns events and
queries into one report per fault; NVML without a driver is handled."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import TypeAdapter

from agents.health import FaultReport, NvmlHealthWatcher, check_injection, watch_nvml
from brain.core.failures import FailurePolicy
from cli.format import nodes_table
from schemas import subjects
from schemas.api import DrainRequest, ListNodesRequest, NodeReply, NodesReply, ResumeRequest
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
    listed = await brain.api.handle("default", ListNodesRequest())
    assert isinstance(listed, NodesReply) and "XID 79" in nodes_table(listed.nodes)


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


class ScriptedDriver:
    """pynvml's health functions over scripted GPUs: what a driver would answer, for a
    machine without one. Constants and error types are pynvml's own, so the watcher
    runs its real code paths (a GPU machine runs them against the driver itself)."""

    def __init__(self, pynvml: Any, gpus: int) -> None:
        self._real = pynvml
        self.NVMLError = pynvml.NVMLError
        self.handles = [f"GPU-{i:04d}" for i in range(gpus)]
        self.events: list[tuple[int, int, int]] = []
        self.lost: set[int] = set()
        self.retired_pending: set[int] = set()
        self.remap_failed: set[int] = set()
        self.registered: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # constants: nvmlEventType*, NVML_ERROR_*
        return getattr(self._real, name)

    def _error(self, code: int) -> Exception:
        return self._real.NVMLError(code)

    def nvmlInit(self) -> None:
        pass

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlDeviceGetSupportedEventTypes(self, handle: str) -> int:
        return int(
            self._real.nvmlEventTypeXidCriticalError | self._real.nvmlEventTypeDoubleBitEccError
        )

    def nvmlDeviceRegisterEvents(self, handle: str, types: int, event_set: str) -> None:
        self.registered[handle] = types

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        with self._lock:
            event = self.events.pop(0) if self.events else None
        if event is None:
            time.sleep(min(timeout_ms, 10) / 1000)
            raise self._error(self._real.NVML_ERROR_TIMEOUT)
        gpu, kind, data = event
        return SimpleNamespace(device=self.handles[gpu], eventType=kind, eventData=data)

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        if self.handles.index(handle) in self.lost:
            raise self._error(self._real.NVML_ERROR_GPU_IS_LOST)
        return handle

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> int:
        return int(self.handles.index(handle) in self.retired_pending)

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        return (0, 0, 0, int(self.handles.index(handle) in self.remap_failed))

    def push(self, gpu: int, kind: int, data: int = 0) -> None:
        with self._lock:
            self.events.append((gpu, kind, data))


def test_nvml_watcher_reports_each_fault_once_from_events_and_queries() -> None:
    pynvml = pytest.importorskip("pynvml")
    driver = ScriptedDriver(pynvml, gpus=2)
    reports: list[FaultReport] = []
    watcher = NvmlHealthWatcher(driver, driver.handles, reports.append, poll_s=0.02, wait_ms=5)
    assert watcher.start() is None
    try:
        wanted = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        assert driver.registered == {h: wanted for h in driver.handles}
        driver.push(1, pynvml.nvmlEventTypeXidCriticalError, 79)
        driver.push(0, pynvml.nvmlEventTypeDoubleBitEccError)
        driver.retired_pending.add(0)
        driver.remap_failed.add(1)
        wait_for(lambda: len(reports) >= 4)
        driver.lost.add(1)
        wait_for(lambda: any(r.fault == "lost" for r in reports))
        time.sleep(0.1)  # several more polls: persisting faults are not reported again
    finally:
        watcher.stop()
    assert sorted((r.gpu, r.fault, r.xid) for r in reports) == [
        (0, "ecc_dbe", None),
        (0, "retired_pages", None),
        (1, "lost", None),
        (1, "row_remap_failure", None),
        (1, "xid", 79),
    ]


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
