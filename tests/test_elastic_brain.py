"""Elastic jobs through the live brain: `resize` staged, committed on the supervisor's
`ResizeCompleted`, rolled back on a refusal or a timeout, continued by a new leader.

The first tests stand in for the node and the supervisor by publishing on the bus what
they would (heartbeats, `JobStarted`, `Progress`, `ResizeCompleted`): the brain's
refusals and its roll-back need no training job. The last runs the real thing: an
agent with four simulated GPUs, the supervisor and `horovodrun --gloo` on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from agents.agent import Agent
from brain import elastic
from brain.core import Policy
from brain.progress import MIN_REPORTS, WINDOW, ProgressTracker
from brain.service import Brain
from bus.client import Bus
from bus.server import EmbeddedNats
from schemas import subjects
from schemas.api import (
    OPERATOR_TENANT,
    CancelRequest,
    DrainRequest,
    ErrorReply,
    JobReply,
    ResizeRequest,
    SubmitRequest,
)
from schemas.base import decode
from schemas.commands import JOB_COMMAND, NODE_COMMAND, Launch, Regrant, Resize, Stop
from schemas.events import JobStarted, LaunchFailed, NodeEvent, ResizeCompleted
from schemas.jobs import (
    FailureClass,
    JobRecord,
    JobSpec,
    JobState,
    NodeGpus,
    NodeGrant,
    StagedResize,
)
from schemas.progress import Progress
from schemas.state import CauseKind, JobChanged, NodeEventRecorded, StateRecord
from schemas.telemetry import GpuInfo, Heartbeat
from tests.conftest import elastic_train_spec, eventually
from tests.httpkit import api_factory
from tests.statelog import live_job_record

REPO = Path(__file__).resolve().parent.parent
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
TENANT = "team"

__all__ = ["api_factory"]


@dataclass
class FakeNode:
    """A node as the brain sees it over the bus: heartbeats, events, and the commands
    it is sent (collected, not obeyed). No processes run."""

    bus: Bus
    name: str = "n1"
    gpus: int = 4
    node_commands: list[object] = field(default_factory=list)
    job_commands: list[Resize] = field(default_factory=list)
    _closing: bool = False
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def on_node_command(msg: Msg) -> None:
            self.node_commands.append(decode(msg.data, NODE_COMMAND))

        async def on_job_command(msg: Msg) -> None:
            self.job_commands.append(decode(msg.data, JOB_COMMAND))

        await self.bus.nc.subscribe(subjects.node(self.name, "cmd"), cb=on_node_command)
        await self.bus.nc.subscribe(subjects.ALL_JOB_COMMANDS, cb=on_job_command)
        self._task = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        inventory = tuple(
            GpuInfo(index=i, uuid=f"GPU-{self.name}-{i}", model="A100", memory_mib=40960)
            for i in range(self.gpus)
        )
        seq = 0
        while not self._closing:
            seq += 1
            beat = Heartbeat(
                node=self.name,
                ts=time.time(),
                seq=seq,
                instance="fake",
                hostname="fake",
                backend="sim",
                interval_s=0.2,
                gpus=inventory,
            )
            await self.bus.publish(subjects.node(self.name, "heartbeat"), beat)
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=2.0)

    async def event(self, event: NodeEvent) -> None:
        await self.bus.publish_durable(
            subjects.node(self.name, "event"), event, msg_id=event.event_id
        )

    async def started(self, job: JobRecord) -> None:
        await self.event(
            JobStarted(
                event_id=uuid.uuid4().hex,
                node=self.name,
                ts=time.time(),
                job_id=job.job_id,
                attempt=job.attempt,
                pid=4242,
                gpus=next(g.gpus for g in job.grants if g.node == self.name),
                log_path="/dev/null",
            )
        )

    async def progress(
        self, job_id: str, world_size: int, samples_per_s: float, attempt: int | None = None
    ) -> None:
        """As rank 0 reports a steady rate: the first step at a size (the world's warm-up,
        which the brain sets aside) and then enough for the brain to act on."""
        for _ in range(1 + MIN_REPORTS):
            await self._progress(job_id, world_size, samples_per_s, attempt)

    async def _progress(
        self, job_id: str, world_size: int, samples_per_s: float, attempt: int | None
    ) -> None:
        report = Progress(
            attempt=attempt,
            job_id=job_id,
            ts=time.time(),
            step=10,
            world_size=world_size,
            samples_per_s=samples_per_s,
            loss=0.5,
            slots=world_size,
            total_steps=100,
        )
        await self.bus.publish(subjects.job(job_id, "progress"), report)

    async def resized(
        self,
        command: Resize,
        *,
        ok: bool,
        from_size: int,
        reason: str = "",
        gpus: tuple[int, ...] = (),
    ) -> None:
        """The supervisor's answer, as it would publish it; `gpus`, those its workers
        hold (when they claimed one each)."""
        await self.event(
            ResizeCompleted(
                event_id=uuid.uuid4().hex,
                node=self.name,
                ts=time.time(),
                job_id=command.job_id,
                command_id=command.command_id,
                from_size=from_size,
                to_size=command.world_size,
                ok=ok,
                duration_s=1.5,
                released_gpus=max(0, from_size - command.world_size) if ok else 0,
                reason=reason,
                placement=(NodeGpus(node=self.name, gpus=gpus),) if gpus else (),
            )
        )

    def resize_for(self, command_id: str) -> Resize | None:
        return next((c for c in self.job_commands if c.command_id == command_id), None)

    def regrants(self, job_id: str) -> list[Regrant]:
        return [c for c in self.node_commands if isinstance(c, Regrant) and c.job_id == job_id]


@pytest.fixture
async def node(connect: Callable[[str], Awaitable[Bus]]) -> AsyncIterator[FakeNode]:
    fake = FakeNode(await connect("fake-node"))
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def submit(brain: Brain, spec: JobSpec, tenant: str = TENANT) -> str:
    reply = await brain.api.handle(tenant, SubmitRequest(spec=spec))
    assert isinstance(reply, JobReply), reply
    return reply.job.job_id


async def resize(
    brain: Brain, job_id: str, gpus: int, tenant: str = TENANT
) -> JobReply | ErrorReply:
    reply = await brain.api.handle(tenant, ResizeRequest(job_id=job_id, gpus=gpus))
    assert isinstance(reply, JobReply | ErrorReply)
    return reply


def refused(reply: JobReply | ErrorReply, code: str, words: str) -> None:
    assert isinstance(reply, ErrorReply), reply
    assert reply.code == code, reply
    assert words in reply.error, reply.error


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def sleeper(gpus: int, **elastic: int | bool) -> JobSpec:
    return JobSpec(command=("sleep", "600"), gpus=gpus, **elastic)  # type: ignore[arg-type]


async def elastic_heard_from(
    brain: Brain, node: FakeNode, gpus: int, most: int, rate: float
) -> JobRecord:
    """An elastic job (1..`most`, started at `gpus`) running on `node`, its supervisor
    heard from at `rate` samples/s."""
    job_id = await submit(brain, sleeper(gpus, elastic=True, min_gpus=1, max_gpus=most))
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state is JobState.RUNNING and j)
    await node.started(job)
    await node.progress(job_id, gpus, rate, attempt=job.attempt)
    await eventually(lambda: brain.progress.heard_from(job_id))
    return job


def held(brain: Brain, job_id: str) -> tuple[int, ...]:
    return brain.state.jobs[job_id].grants[0].gpus


def held_on(brain: Brain, job_id: str, node: str) -> tuple[int, ...]:
    return next(g.gpus for g in brain.state.jobs[job_id].grants if g.node == node)


def on(node: str, *gpus: int) -> tuple[NodeGpus, ...]:
    return (NodeGpus(node=node, gpus=gpus),)


def gpus_on(placement: tuple[NodeGpus, ...], node: str = "n1") -> set[int]:
    return {gpu for part in placement if part.node == node for gpu in part.gpus}


async def test_resize_refusals_roll_back_and_commit(brain_factory, node: FakeNode) -> None:
    brain = await brain_factory()
    await eventually(lambda: brain.state.nodes)
    rigid = await submit(brain, sleeper(1))
    job_id = await submit(brain, sleeper(2, elastic=True, min_gpus=1, max_gpus=3))
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state is JobState.RUNNING and j)
    await eventually(lambda: brain.state.jobs[rigid].state is JobState.RUNNING)

    refused(await resize(brain, rigid, 2), "invalid", "is not elastic: it runs on exactly 1 GPU ")
    refused(await resize(brain, job_id, 4), "invalid", "1..3")
    refused(await resize(brain, job_id, 3, tenant="other"), "not_found", "no job")
    refused(await resize(brain, job_id, 3), "conflict", "has not started yet")
    await node.started(job)
    await eventually(lambda: brain.state.jobs[job_id].grants[0].pid == 4242)
    refused(await resize(brain, job_id, 3), "conflict", "supervisor has not reported")
    await node.progress(job_id, 2, 100.0, attempt=job.attempt + 1)  # not this run's
    await asyncio.sleep(0.5)
    assert not brain.progress.heard_from(job_id)
    await node.progress(job_id, 2, 100.0, attempt=job.attempt)
    await eventually(lambda: brain.progress.heard_from(job_id))

    # Grow 2 -> 3: the added GPU is the job's at once, and its node is told.
    before = held(brain, job_id)
    reply = await resize(brain, job_id, 3)
    assert isinstance(reply, JobReply) and reply.job.resize is not None
    staged = reply.job.resize
    assert len(held(brain, job_id)) == 3 and set(before) < set(held(brain, job_id))
    assert brain._free_on("n1") == set()
    view = next(
        j
        for j in brain.state.snapshot(progress=brain.progress.current()).running
        if j.job_id == job_id
    )
    assert (view.min_gpus, view.max_gpus, view.resizing) == (1, 3, True)
    assert [(p.size, p.rate, p.rel_error) for p in view.throughput] == [(2, 100.0, 0.0)]
    assert view.progress_fraction == pytest.approx(0.1)
    refused(await resize(brain, job_id, 1), "conflict", "already resizing 2 -> 3")
    command = await eventually(lambda: node.resize_for(staged.command_id))
    assert (command.world_size, command.epoch) == (3, brain.epoch)
    assert command.placement == on("n1", *held(brain, job_id))  # the new worker's GPU
    await eventually(lambda: [r.gpus for r in node.regrants(job_id)] == [held(brain, job_id)])

    # The supervisor could not get there: rolled back, and told to go back to 2. It
    # may have moved part of the way (a worker on the added GPU), so the job holds that
    # GPU until the supervisor confirms it is back at 2; only then is it free.
    await node.resized(command, ok=False, from_size=2, reason="workers not stepping at 3")
    rolled = await eventually(lambda: (j := brain.state.jobs[job_id]).resize.reverting and j)
    assert len(rolled.grants[0].gpus) == 3 and brain._free_on("n1") == set()
    assert "rolled back" in (rolled.reason or "") and "not stepping" in (rolled.reason or "")
    revert = await eventually(lambda: node.resize_for(f"{staged.command_id}-revert"))
    assert (revert.world_size, revert.placement) == (2, on("n1", *before))
    refused(await resize(brain, job_id, 1), "conflict", "already resizing 3 -> 2")
    await node.resized(revert, ok=True, from_size=3, gpus=before)
    back = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
    assert back.grants[0].gpus == before
    assert brain._free_on("n1") == {3}
    await eventually(lambda: node.regrants(job_id)[-1].gpus == before)

    # Shrink 2 -> 1: the released GPU stays the job's until the supervisor says so.
    # The brain would keep the lowest GPU, but Horovod chose which worker to retire:
    # the GPU the surviving worker holds is the one the job keeps.
    reply = await resize(brain, job_id, 1)
    assert isinstance(reply, JobReply) and reply.job.resize is not None
    shrink = await eventually(lambda: node.resize_for(reply.job.resize.command_id))
    assert shrink.placement == on("n1", *before[:1])
    assert held(brain, job_id) == before and brain._free_on("n1") == {3}
    await node.resized(shrink, ok=True, from_size=2, gpus=before[1:])
    done = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
    assert done.gpu_count == 1 and done.grants[0].gpus == before[1:]
    assert done.resized_at is not None and f"GPUs n1:{before[0]} released" in (done.reason or "")
    assert brain._free_on("n1") == {before[0], 3}
    await eventually(lambda: node.regrants(job_id)[-1].gpus == before[1:])
    kinds = [r["kind"] for r in brain.history.job_events(job_id)]
    assert [k for k in kinds if k.startswith("resize") and k != "resize_completed"] == [
        CauseKind.RESIZE_STAGED.value,
        CauseKind.RESIZE_ROLLED_BACK.value,
        CauseKind.RESIZED.value,  # back at 2: the revert confirmed
        CauseKind.RESIZE_STAGED.value,
        CauseKind.RESIZED.value,
    ]
    # The same size again is no change at all.
    same = await resize(brain, job_id, 1)
    assert isinstance(same, JobReply) and same.job.resize is None


async def test_an_unanswered_grow_keeps_its_gpus_until_the_supervisor_is_back(
    brain_factory, node: FakeNode
) -> None:
    """A grow the supervisor never answers may have started workers on the added GPU:
    the brain holds it through the revert, and, the revert unanswered too, for good."""
    brain = await brain_factory(resize_timeout_s=1.0)
    await eventually(lambda: brain.state.nodes)
    job_id = (await elastic_heard_from(brain, node, 2, 3, 100.0)).job_id
    before = held(brain, job_id)
    reply = await resize(brain, job_id, 3)
    assert isinstance(reply, JobReply) and reply.job.resize is not None
    grown = held(brain, job_id)
    reverting = await eventually(
        lambda: (j := brain.state.jobs[job_id]).resize is not None and j.resize.reverting and j
    )
    assert held(brain, job_id) == grown and "no answer" in (reverting.reason or "")
    revert = await eventually(lambda: node.resize_for(f"{reply.job.resize.command_id}-revert"))
    assert (revert.world_size, revert.placement) == (2, on("n1", *before))
    given_up = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
    assert given_up.grants[0].gpus == grown
    assert "keeps GPUs" in (given_up.reason or "")
    assert not any(c.command_id.endswith("-revert-revert") for c in node.job_commands)


async def test_a_new_leader_continues_a_staged_resize(brain_factory, node: FakeNode) -> None:
    first = await brain_factory()
    await eventually(lambda: first.state.nodes)
    job = await elastic_heard_from(first, node, 2, 4, 50.0)
    job_id = job.job_id
    reply = await resize(first, job_id, 4)
    assert isinstance(reply, JobReply) and reply.job.resize is not None
    staged = reply.job.resize
    await eventually(lambda: node.resize_for(staged.command_id))
    await first.stop()

    # The successor reads the staged resize from the log, sends the command again
    # (same id: the supervisor drops a duplicate) and commits on the answer.
    second = await brain_factory(resize_timeout_s=1.0)
    assert second.state.jobs[job_id].resize == staged
    assert len(second.state.jobs[job_id].grants[0].gpus) == 4
    command = await eventually(lambda: node.resize_for(staged.command_id))
    await node.resized(command, ok=True, from_size=2)
    done = await eventually(lambda: (j := second.state.jobs[job_id]).resize is None and j)
    assert done.gpu_count == 4 and "resized 2 -> 4" in (done.reason or "")

    # A resize nobody answers is rolled back after the timeout.
    await node.progress(job_id, 4, 90.0)
    await eventually(lambda: second.progress.heard_from(job_id))
    reply = await resize(second, job_id, 2)
    assert isinstance(reply, JobReply) and reply.job.resize is not None
    late = await eventually(
        lambda: (j := second.state.jobs[job_id]).resize is None and j, timeout_s=10
    )
    assert late.gpu_count == 4 and "no answer from its supervisor" in (late.reason or "")


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(240)
async def test_elastic_horovod_job_resized_through_the_brain(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Agent]],
    tmp_path: Path,
) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=4)
    await eventually(lambda: brain.state.nodes)
    records: list[StateRecord] = []
    brain.record_observers.append(lambda record, seq: records.append(record))
    stop_file = tmp_path / "stop"
    job_id = await submit(brain, elastic_train_spec(2, stop_file, max_gpus=3))
    await eventually(lambda: brain.progress.world_size(job_id) == 2, timeout_s=90)

    def measured_at(size: int) -> bool:
        """A rate counts once a report after the warm-up step at that size came."""
        seen = brain.progress.current().get(job_id)
        return seen is not None and any(p.size == size for p in seen.throughput)

    running_at = 2
    for size in (3, 1):
        # Moving on before a rate is measured at this size would leave it unmeasured.
        await eventually(lambda at=running_at: measured_at(at), timeout_s=60)
        running_at = size
        reply = await resize(brain, job_id, size)
        assert isinstance(reply, JobReply) and reply.job.resize is not None, reply
        staged = reply.job.resize
        # Staged: a grow holds the added GPU at once; a shrink keeps its GPUs for now.
        union = gpus_on(staged.before) | gpus_on(staged.after)
        assert set(held(brain, job_id)) == union
        assert brain._free_on("n1") == set(range(4)) - union
        done = await eventually(
            lambda: (j := brain.state.jobs[job_id]).resize is None and j, timeout_s=90
        )
        assert done.gpu_count == size, done.reason
        assert (done.reason or "").startswith(f"resized {staged.from_size} -> {size}")
        # A grow keeps what it staged; a shrink keeps the GPU of the worker Horovod kept
        # (each worker claimed one), which need not be the brain's lowest-numbered pick.
        kept = set(done.grants[0].gpus)
        assert kept == gpus_on(staged.after) if size > staged.from_size else kept <= union
        assert brain._free_on("n1") == set(range(4)) - kept
        # The agent's books follow (which launches would collide with the job).
        await eventually(lambda: agent.launcher.find(job_id)[0].gpus == held(brain, job_id))
        await eventually(lambda s=size: brain.progress.world_size(job_id) == s, timeout_s=30)

    # Each commit came from the supervisor's acknowledgement, after the workers moved.
    answers = [
        r.event
        for r in records
        if isinstance(r, NodeEventRecorded) and isinstance(r.event, ResizeCompleted)
    ]
    assert [(a.ok, a.from_size, a.to_size, a.released_gpus) for a in answers] == [
        (True, 2, 3, 0),
        (True, 3, 1, 2),
    ]
    # The supervisor said which GPUs its workers held, and the brain committed those.
    assert [len(gpus_on(a.placement)) for a in answers] == [3, 1]
    sizes = [
        (r.cause.kind, r.job.gpu_count)
        for r in records
        if isinstance(r, JobChanged) and r.cause.kind.value.startswith("resize")
    ]
    assert sizes == [
        (CauseKind.RESIZE_STAGED, 3),
        (CauseKind.RESIZED, 3),
        (CauseKind.RESIZE_STAGED, 3),  # a shrink frees nothing until the ack
        (CauseKind.RESIZED, 1),
    ]
    # Measured at every size it ran at (the first step at each set aside as warm-up).
    await eventually(lambda: measured_at(1), timeout_s=60)
    throughput = brain.progress.current()[job_id].throughput
    assert [p.size for p in throughput] == [1, 2, 3] and all(p.rate > 0 for p in throughput)

    stop_file.touch()
    ended = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=60
    )
    assert ended.state is JobState.SUCCEEDED, ended.reason
    assert 0 < ended.attained_gpu_seconds <= 3 * ended.executed_seconds
    # Forgotten once the ending record is stored (observers hear a record after its
    # group's commit; state reads it as soon as it is staged).
    await eventually(lambda: job_id not in brain.progress.current())


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(300)
async def test_an_elastic_job_grows_onto_another_node_and_leaves_it_through_the_brain(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Agent]],
    connect: Callable[[str], Awaitable[Bus]],
    tmp_path: Path,
) -> None:
    """Two nodes of two GPUs. A job started on n1 at 2 is resized to 3: the brain
    launches its worker host on the other node through that node's agent, and
    horovodrun starts the new worker through it (no ssh). Then 4 (one more worker
    there), then 2: it leaves that node, whose worker host stays, idle, holding no GPU,
    and n1's workers keep stepping in the same processes. Then 3 again, back onto that
    node through the same worker host. It ends SUCCEEDED, and the worker host is
    stopped."""
    brain = await brain_factory()
    agents = {name: await agent_factory(name, gpus=2) for name in ("n1", "n2")}
    await eventually(lambda: len(brain.state.nodes) == 2)
    records: list[StateRecord] = []
    brain.record_observers.append(lambda record, seq: records.append(record))
    reports: list[Progress] = []

    async def on_progress(report: Progress, msg: Msg) -> None:
        reports.append(report)

    await (await connect("watch")).subscribe(subjects.ALL_JOB_PROGRESS, Progress, on_progress)

    def stepping_at(size: int) -> Progress | None:
        last = reports[-1] if reports else None
        return last if last and last.world_size == size and len(last.workers) == size else None

    stop_file = tmp_path / "stop"
    job_id = await submit(brain, elastic_train_spec(2, stop_file, max_gpus=4, name="wide"))
    start = await eventually(lambda: stepping_at(2), timeout_s=90)
    first = brain.state.jobs[job_id].grants[0].node
    second = next(n for n in agents if n != first)
    supervisor = agents[first].launcher.find(job_id)[0]

    for size, placed in ((3, {first: 2, second: 1}), (4, {first: 2, second: 2})):
        reply = await resize(brain, job_id, size)
        assert isinstance(reply, JobReply) and reply.job.resize is not None, reply
        done = await eventually(
            lambda: (j := brain.state.jobs[job_id]).resize is None and j, timeout_s=120
        )
        assert {g.node: len(g.gpus) for g in done.grants} == placed, done.reason
        assert (done.reason or "").startswith(f"resized {size - 1} -> {size}")
        await eventually(lambda s=size: brain.progress.world_size(job_id) == s, timeout_s=30)
    # The other node's part is the job's worker host, launched by its agent at the grow.
    host = agents[second].launcher.find(job_id)[0]
    assert command_line(host.pid)[-1] == "workloads.worker_host"
    # Each node's workers belong to its own launch there: the other node's carry their
    # worker host's launch token (hvdrun does not pass the supervisor's on), so its agent
    # charges and ends them, and the supervisor's agent does not.
    workers = {w.pid for w in (await eventually(lambda: stepping_at(4), timeout_s=30)).workers}
    theirs = host.owns(workers)
    assert len(theirs) == 2 and supervisor.owns(workers) == workers - theirs
    assert agents[second].launcher.find(job_id)[0].gpus == held_on(brain, job_id, second)
    assert agents[first].launcher.find(job_id) == [supervisor]

    reply = await resize(brain, job_id, 2)
    assert isinstance(reply, JobReply) and reply.job.resize is not None, reply
    done = await eventually(
        lambda: (j := brain.state.jobs[job_id]).resize is None and j, timeout_s=120
    )
    assert done.placement == (NodeGpus(node=first, gpus=(0, 1)),), done.reason
    assert brain._free_on(second) == {0, 1}
    # The worker host stays, idle, holding no GPU in its agent's books either; the job
    # goes on on n1 with the workers it began with.
    await eventually(lambda: agents[second].launcher.find(job_id)[0].gpus == ())
    assert not host.exited.is_set()
    latest = await eventually(lambda: stepping_at(2), timeout_s=30)
    assert {w.pid for w in latest.workers} == {w.pid for w in start.workers}
    # A grow back onto that node goes through the same worker host: no new launch.
    reply = await resize(brain, job_id, 3)
    assert isinstance(reply, JobReply) and reply.job.resize is not None, reply
    done = await eventually(
        lambda: (j := brain.state.jobs[job_id]).resize is None and j, timeout_s=120
    )
    assert {g.node: len(g.gpus) for g in done.grants} == {first: 2, second: 1}, done.reason
    assert agents[second].launcher.find(job_id) == [host]
    await eventually(lambda: stepping_at(3), timeout_s=30)

    def answers() -> list[tuple[bool, int, int]]:
        return [
            (r.event.ok, r.event.from_size, r.event.to_size)
            for r in records
            if isinstance(r, NodeEventRecorded) and isinstance(r.event, ResizeCompleted)
        ]

    await eventually(lambda: len(answers()) == 4)
    assert answers() == [(True, 2, 3), (True, 3, 4), (True, 4, 2), (True, 2, 3)]

    stop_file.touch()
    ended = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=90
    )
    assert ended.state is JobState.SUCCEEDED, ended.reason
    await eventually(lambda: host.exited.is_set(), timeout_s=30)


async def test_cli_submit_elastic_resize_and_show(
    brain_factory, node: FakeNode, nats_server, tmp_path: Path
) -> None:
    from tests.test_cli import alnair

    brain = await brain_factory()
    await eventually(lambda: brain.state.nodes)
    env = {"PATH": "/usr/bin:/bin", "ALNAIR_HOME": str(tmp_path / "home"), "HOME": str(tmp_path)}
    where = ("--nats", nats_server.url, "--tenant", TENANT)
    code, out, err = await alnair(
        "submit", *where, "--elastic", "--min-gpus", "1", "--max-gpus", "3", "--gpus", "2",
        "--json", "--", "sleep", "600", env=env,
    )  # fmt: skip
    assert code == 0, err
    submitted = JobRecord.model_validate_json(out)
    assert (submitted.spec.elastic, submitted.spec.gpu_range) == (True, (1, 3))
    job_id = submitted.job_id
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state is JobState.RUNNING and j)
    await node.started(job)
    await node.progress(job_id, 2, 10.0)
    await eventually(lambda: brain.progress.heard_from(job_id))

    code, _, err = await alnair("resize", *where, job_id, "5", env=env)
    assert code == 1 and "1..3 GPUs; 5 is outside that range" in err
    code, out, err = await alnair("resize", *where, job_id, "3", env=env)
    assert code == 0 and "resize 2 -> 3 GPUs staged" in out, err
    code, out, err = await alnair("job", *where, job_id, env=env)
    assert code == 0, err
    shown = json.loads(out)["elastic"]
    assert (shown["size"], shown["min_gpus"], shown["max_gpus"]) == (2, 1, 3)
    assert shown["resize"]["to_gpus"] == 3
    command = await eventually(lambda: node.job_commands and node.job_commands[-1])
    await node.resized(command, ok=True, from_size=2)
    await eventually(lambda: brain.state.jobs[job_id].resize is None)
    code, out, err = await alnair("jobs", *where, env=env)
    assert code == 0 and "3[1..3] pin=3" in out, err
    code, out, err = await alnair("why", *where, job_id, env=env)
    assert code == 0 and "pinned at 3 by `alnair resize`" in out, err
    code, out, err = await alnair("resize", *where, job_id, "auto", env=env)
    assert code == 0 and "not pinned" in out, err
    code, out, err = await alnair("job", *where, job_id, env=env)
    assert code == 0 and json.loads(out)["elastic"]["pinned_gpus"] is None, err
    code, _, err = await alnair("resize", *where, job_id, "two", env=env)
    assert code != 0 and "neither a number of GPUs (1 to 4,096) nor 'auto'" in err


# -- the pure parts: brain/elastic.py and brain/progress.py ------------------------------


def running_elastic(gpus: tuple[int, ...], *, low: int = 1, high: int = 4) -> JobRecord:
    return JobRecord(
        job_id="7",
        tenant=TENANT,
        spec=JobSpec(command=("train",), gpus=len(gpus), elastic=True, min_gpus=low, max_gpus=high),
        state=JobState.RUNNING,
        attempt=1,
        submitted_at=0.0,
        started_at=1.0,
        grants=(NodeGrant(node="n1", gpus=gpus, pid=99),),
    )


@pytest.mark.parametrize(
    ("target", "free", "code", "words"),
    [
        (on("n1", 0, 1, 2), {"n1": {2, 3}}, None, ""),
        (on("n1", 0), {}, None, ""),
        # A grow onto another node (the job's worker host starts there).
        ((*on("n1", 0, 1), *on("n2", 5)), {"n2": {5}}, None, ""),
        (on("n2", 0, 1, 2), {"n2": {0, 1, 2}}, "invalid", "supervisor runs on node n1"),
        (on("n1", 0, 2, 3), {"n1": {2, 3}}, "invalid", "keeps some or all"),
        # Shrinking one node while growing onto another moves a worker: refused.
        ((*on("n1", 0), *on("n2", 5)), {"n2": {5}}, "invalid", "and adds others (a grow)"),
        (on("n1", 0, 1, 2), {"n1": {3}}, "conflict", "GPUs [2] of node n1 are not free"),
        ((*on("n1", 0, 1), *on("n3", 0)), {"n3": {0}}, "conflict", "ended on node(s) n3"),
        (on("n1", 0, 1, 2, 3, 4), {"n1": {2, 3, 4}}, "invalid", "1..4 GPUs; 5 is outside"),
    ],
)
def test_check_resize(
    target: tuple[NodeGpus, ...], free: dict[str, set[int]], code: str | None, words: str
) -> None:
    job = running_elastic((0, 1)).model_copy(update={"failed_nodes": ("n3",)})
    found = elastic.check_resize(job, target, free, supervisor_ready=True)
    if code is None:
        assert found is None
    else:
        assert found is not None and found.code == code and words in found.reason, found


def test_stage_commit_and_roll_back_hold_every_gpu_of_both_sizes() -> None:
    job = running_elastic((0, 1))
    target = elastic.choose_target(job, 3, free={"n1": {3, 2}})
    assert target == on("n1", 0, 1, 2)
    grow = elastic.stage(job, target, command_id="c1", now=5.0, cause="test")
    assert grow.grants[0].gpus == (0, 1, 2) and grow.grants[0].pid == 99
    assert grow.resize is not None and grow.resize.grow
    assert elastic.current_placement(grow) == on("n1", 0, 1)
    assert elastic.roll_back(grow, "no").grants[0].gpus == (0, 1)
    grown = elastic.commit(grow, "yes")
    assert grown.grants[0].gpus == (0, 1, 2) and grown.resize is None
    shrink = elastic.stage(grown, on("n1", 0), command_id="c2", now=6.0, cause="t")
    assert shrink.grants[0].gpus == (0, 1, 2)  # kept until the supervisor says so
    assert elastic.commit(shrink, "yes").grants[0].gpus == (0,)
    # What the supervisor says its workers hold wins, when it fits the resize.
    assert elastic.commit(shrink, "yes", held=on("n1", 2)).grants[0].gpus == (2,)
    assert elastic.commit(shrink, "yes", held=on("n1", 1, 2)).grants[0].gpus == (0,)  # size
    assert elastic.commit(shrink, "yes", held=on("n1", 5)).grants[0].gpus == (0,)  # not ours
    assert elastic.commit(shrink, "yes", held=on("n2", 2)).grants[0].gpus == (0,)  # elsewhere
    command = elastic.resize_command(shrink, epoch=3, issued_at=7.0)
    assert (command.command_id, command.world_size, command.epoch) == ("c2", 1, 3)
    # A shrink the supervisor may have begun: the old size staged again, holding both
    # sizes; committed, back where it was; rolled back in turn, it keeps them all.
    revert = elastic.stage_revert(shrink, "back", now=8.0)
    assert revert.resize is not None and revert.resize.reverting
    assert (revert.resize.command_id, revert.grants[0].gpus) == ("c2-revert", (0, 1, 2))
    assert elastic.resize_command(revert, epoch=3, issued_at=8.0).world_size == 3
    assert elastic.commit(revert, "ok").grants[0].gpus == (0, 1, 2)
    assert elastic.roll_back(revert, "unanswered").grants[0].gpus == (0, 1, 2)
    # A grow's revert: committed, the added GPU is free again; unanswered, it is kept.
    back = elastic.stage_revert(grow, "back", now=8.0)
    assert elastic.commit(back, "ok").grants[0].gpus == (0, 1)
    assert elastic.roll_back(back, "unanswered").grants[0].gpus == (0, 1, 2)
    assert isinstance(elastic.choose_target(grown, 4, free={}), elastic.ResizeRefused)


def test_a_resize_across_nodes_adds_grants_and_leaves_them_idle() -> None:
    job = running_elastic((0, 1))
    # A grow fills the job's own node first, then the node with most free GPUs.
    target = elastic.choose_target(job, 4, free={"n1": {2}, "n2": {0}, "n3": {1, 3}})
    assert target == (*on("n1", 0, 1, 2), *on("n3", 1))
    grow = elastic.stage(job, target, command_id="c1", now=5.0, cause="t")
    # The new node's grant is not launched yet; the first node's keeps its process.
    assert [(g.node, g.gpus, g.pid) for g in grow.grants] == [
        ("n1", (0, 1, 2), 99),
        ("n3", (1,), None),
    ]
    assert elastic.resize_command(grow, epoch=1, issued_at=5.0).placement == target
    assert elastic.joining(grow) == {"n3"}  # its worker host is being launched
    # Rolled back, the new node keeps its grant with no GPU (its worker host, once
    # started, idles); where the worker host could not start, the part goes, and the
    # job does not grow there again in this attempt.
    undone = elastic.roll_back(grow, "no")
    assert [(g.node, g.gpus) for g in undone.grants] == [("n1", (0, 1)), ("n3", ())]
    assert undone.placement == on("n1", 0, 1)
    failed = elastic.drop_node(undone, "n3")
    assert failed.nodes == ("n1",) and failed.failed_nodes == ("n3",)
    refusal = elastic.check_target(failed, target, {"n1": {2}, "n3": {1}})
    assert refusal is not None and "could not start or has ended" in refusal.reason
    grown = elastic.commit(grow, "yes").model_copy(
        update={"grants": (grow.grants[0], grow.grants[1].model_copy(update={"pid": 7}))}
    )
    # A shrink leaves the node where the job holds fewest first, never its first one.
    assert elastic.choose_target(grown, 3, free={}) == on("n1", 0, 1, 2)
    assert elastic.choose_target(grown, 1, free={}) == on("n1", 0)
    shrink = elastic.stage(grown, on("n1", 0, 1), command_id="c2", now=6.0, cause="t")
    assert shrink.nodes == ("n1", "n3")  # held until the supervisor says so
    reported = (*on("n1", 1), *on("n3", 1))  # not the target's nodes: the target is kept
    done = elastic.commit(shrink, "yes", held=reported)
    # It leaves n3 holding no GPU there; its worker host stays, so a grow back needs no
    # launch, and goes there before any other node.
    assert done.placement == on("n1", 0, 1) and done.failed_nodes == ()
    assert [(g.node, g.gpus, g.pid) for g in done.grants][1] == ("n3", (), 7)
    back = elastic.choose_target(done, 3, free={"n2": {0, 1}, "n3": {1}})
    assert back == (*on("n1", 0, 1), *on("n3", 1))
    assert elastic.check_resize(done, back, {"n3": {1}}, supervisor_ready=True) is None
    regrow = elastic.stage(done, back, command_id="c3", now=7.0, cause="t")
    assert elastic.joining(regrow) == set()  # no launch: it runs there already
    # An idle worker host that ended bars its node, but the job still resizes; a job
    # that no longer runs bars nothing (its next attempt starts afresh).
    ended = done.model_copy(
        update={"grants": (done.grants[0], done.grants[1].model_copy(update={"exited": True}))}
    )
    assert ended.barred_nodes == {"n3"}
    assert elastic.check_resizable(ended, 1, supervisor_ready=True) is None
    assert ended.model_copy(update={"state": JobState.PENDING}).barred_nodes == frozenset()
    assert elastic.commit(shrink, "yes", held=on("n1", 1, 2)).placement == on("n1", 1, 2)
    assert shrink.resize is not None
    assert elastic.describe(shrink.resize) == "4 -> 2 GPUs (n1:0,1,2, n3:1 -> n1:0,1)"
    # Journals from before resizes across nodes said one node's GPUs.
    old = {"command_id": "c", "node": "n1", "from_gpus": [0], "to_gpus": [0, 1]}
    staged = StagedResize.model_validate({**old, "staged_at": 1.0, "cause": "x"})
    assert (staged.before, staged.after) == (on("n1", 0), on("n1", 0, 1))


def test_progress_tracker_learns_throughput_per_size() -> None:
    tracker = ProgressTracker()

    def report(step: int, size: int, rate: float, ts: float) -> Progress:
        return Progress(
            job_id="7",
            ts=ts,
            step=step,
            world_size=size,
            samples_per_s=rate,
            loss=0.1,
            slots=size,
            total_steps=1000,
        )

    # The first step at a size is the world's warm-up: set aside, but news.
    assert tracker.observe(report(10, 2, 5.0, 1.0))
    assert tracker.current()["7"].throughput == ()
    assert tracker.observe(report(20, 2, 100.0, 2.0))  # the first rate at size 2: news
    assert not tracker.observe(report(30, 2, 200.0, 3.0))
    (two,) = tracker.current()["7"].throughput
    assert (two.size, two.rate, two.settled) == (2, 150.0, False)  # too few to know the error
    assert tracker.observe(report(40, 2, 150.0, 4.0))  # the third: its error known, news
    (two,) = tracker.current()["7"].throughput
    assert (two.rate, two.at) == (150.0, 4.0)
    assert two.rel_error == pytest.approx(50.0 / math.sqrt(3) / 150.0)
    tracker.observe(report(50, 3, 10.0, 5.0))  # warm-up at 3
    assert tracker.observe(report(60, 3, 240.0, 6.0))
    seen = tracker.current()["7"]
    assert [(p.size, p.rate) for p in seen.throughput] == [(2, 150.0), (3, 240.0)]
    assert seen.progress_fraction == pytest.approx(0.06)
    assert tracker.heard_from("7") and tracker.world_size("7") == 3
    # A window of the latest reports: old ones age out.
    for i in range(2 * WINDOW):
        tracker.observe(report(70 + i, 3, 300.0, 7.0 + i))
    (_, three) = tracker.current()["7"].throughput
    assert (three.rate, three.rel_error) == (300.0, 0.0)


def test_progress_tracker_prefers_goodput_from_a_job_that_adapts_its_batch() -> None:
    tracker = ProgressTracker()
    base = {"job_id": "8", "step": 1, "loss": 0.1, "slots": 2}
    for ts in (1.0, 2.0):
        tracker.observe(Progress(ts=ts, world_size=2, samples_per_s=900.0, goodput=300.0, **base))
    for ts in (3.0, 4.0):
        tracker.observe(Progress(ts=ts, world_size=4, samples_per_s=2000.0, **base))
    # Goodput where reported (a bigger batch's samples are worth less), else samples/s.
    seen = tracker.current()["8"].throughput
    assert [(p.size, p.rate) for p in seen] == [(2, 300.0), (4, 2000.0)]


def test_progress_tracker_learns_how_far_a_succeeded_jobs_reports_were_off() -> None:
    """A job that succeeded after reporting its rate of progress ran some multiple of
    the total that rate implied: what `progress-gittins` weighs the next beliefs by. A
    failed or cancelled run, or one that never reported a rate, teaches nothing."""
    tracker = ProgressTracker()

    def reported(job_id: str, *, steps_a_second: int) -> None:
        for ts in (1.0, 2.0):
            tracker.observe(
                Progress(
                    job_id=job_id,
                    ts=ts,
                    step=int(ts) * steps_a_second,
                    world_size=1,
                    samples_per_s=10.0,
                    loss=0.1,
                    slots=1,
                    total_steps=1000,
                )
            )

    def ended(job_id: str, state: JobState, executed_s: float) -> JobChanged:
        record = live_job_record(int(job_id), gpus=1, node="n1")
        job = record.job.model_copy(update={"state": state, "executed_seconds": executed_s})
        return record.model_copy(update={"job": job})

    reported("1", steps_a_second=10)  # 1/100 of its work a second: 100 s in all
    tracker.on_record(ended("1", JobState.SUCCEEDED, 250.0), 1)
    assert tracker.errors.latest == pytest.approx((2.5,))
    reported("2", steps_a_second=10)
    tracker.on_record(ended("2", JobState.FAILED, 50.0), 2)
    tracker.on_record(ended("3", JobState.SUCCEEDED, 50.0), 3)  # never reported
    assert tracker.errors.learned == 1 and tracker.current() == {}


@contextlib.asynccontextmanager
async def growing_across(
    brain_factory: Callable[..., Awaitable[Brain]], connect: Callable[[str], Awaitable[Bus]]
) -> AsyncIterator[tuple[Brain, FakeNode, FakeNode, JobRecord]]:
    """Two nodes of two GPUs played on the bus, and an elastic job (2 of 1..4) that
    fills one: the policy stages its grow onto the other. Yields the brain, the job's
    first node, the other, and the job as placed."""
    from brain.core import Policy

    nodes = [FakeNode(await connect(f"fake-{name}"), name, gpus=2) for name in ("n1", "n2")]
    for fake in nodes:
        await fake.start()
    try:
        brain = await brain_factory(policy=Policy(elasticity="marginal-gain"))
        await eventually(lambda: len(brain.state.nodes) == 2)
        job_id = await submit(brain, sleeper(2, elastic=True, min_gpus=1, max_gpus=4))
        job = await eventually(
            lambda: (j := brain.state.jobs[job_id]).state is JobState.RUNNING and j
        )
        first, second = sorted(nodes, key=lambda f: f.name != job.nodes[0])
        await first.started(job)
        await first.progress(job_id, 2, 100.0, attempt=job.attempt)
        await eventually(lambda: brain.state.jobs[job_id].resize, timeout_s=10)
        yield brain, first, second, job
    finally:
        for fake in nodes:
            await fake.stop()


async def test_the_policy_grows_a_job_that_fills_its_node_onto_another(
    brain_factory, connect: Callable[[str], Awaitable[Bus]]
) -> None:
    """Nodes of two GPUs; an elastic job fills one. With nothing waiting the policy
    grows it onto the other: the brain launches the job's worker host there (with the
    attempt's secret), then tells the supervisor the placement per node. Cancelled, both
    parts are stopped."""
    async with growing_across(brain_factory, connect) as (brain, first, second, job):
        job_id = job.job_id
        staged = brain.state.jobs[job_id].resize
        assert staged is not None
        assert {p.node: len(p.gpus) for p in staged.after} == {first.name: 2, second.name: 2}
        assert staged.after[0].node == first.name == staged.node
        launch = await eventually(
            lambda: next((c for c in second.node_commands if isinstance(c, Launch)), None)
        )
        assert launch.command[-1] == "workloads.worker_host" and launch.node_rank == 1
        assert launch.gpus == (0, 1) and launch.env.get("ALNAIR_EXEC_SECRET")
        command = await eventually(lambda: first.resize_for(staged.command_id))
        assert (command.world_size, command.placement) == (4, staged.after)
        await second.started(brain.state.jobs[job_id])
        await eventually(lambda: all(g.pid for g in brain.state.jobs[job_id].grants))
        await first.resized(command, ok=True, from_size=2)
        done = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
        assert done.gpu_count == 4 and done.nodes == (first.name, second.name)

        assert isinstance(await brain.api.handle(TENANT, CancelRequest(job_id=job_id)), JobReply)
        for fake in (first, second):
            await eventually(
                lambda f=fake: any(
                    isinstance(c, Stop) and c.job_id == job_id for c in f.node_commands
                )
            )


async def test_a_grow_whose_worker_host_cannot_start_is_rolled_back_not_the_job(
    brain_factory, connect: Callable[[str], Awaitable[Bus]]
) -> None:
    async with growing_across(brain_factory, connect) as (brain, first, second, job):
        job_id = job.job_id
        await second.event(
            LaunchFailed(
                event_id=uuid.uuid4().hex,
                node=second.name,
                ts=time.time(),
                job_id=job_id,
                attempt=job.attempt,
                reason="no such directory",
            )
        )
        back = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
        assert back.state is JobState.RUNNING and back.nodes == (first.name,)
        assert back.failed_nodes == (second.name,) and "did not start" in (back.reason or "")
        assert back.barred_nodes == {second.name}
        await eventually(
            lambda: any(isinstance(c, Stop) and c.job_id == job_id for c in second.node_commands)
        )
        # It does not try that node again in this attempt.
        await asyncio.sleep(1.0)
        assert brain.state.jobs[job_id].resize is None


async def test_the_policy_grows_an_elastic_job_through_the_same_path(
    brain_factory, node: FakeNode
) -> None:
    from brain.core import Policy

    brain = await brain_factory(policy=Policy(elasticity="marginal-gain"))
    await eventually(lambda: brain.state.nodes)
    rigid = await submit(brain, sleeper(2))
    await eventually(lambda: brain.state.jobs[rigid].state is JobState.RUNNING)
    job = await elastic_heard_from(brain, node, 2, 3, 100.0)
    job_id = job.job_id
    assert job.gpu_count == 2
    # GPUs go idle and a job may use them: the elasticity stage's Resize is staged by
    # the shell (checked against the live state), commanded, and committed on the ack.
    assert isinstance(await brain.api.handle(TENANT, CancelRequest(job_id=rigid)), JobReply)
    staged = await eventually(lambda: brain.state.jobs[job_id].resize)
    assert staged.to_size == 3 and staged.node == "n1"
    command = await eventually(lambda: node.resize_for(staged.command_id))
    await node.resized(command, ok=True, from_size=2)
    done = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
    assert done.gpu_count == 3


async def test_a_job_shrunk_for_a_newcomer_keeps_running_until_its_shrink_commits(
    brain_factory, node: FakeNode
) -> None:
    from brain.core import Policy

    brain = await brain_factory(policy=Policy(order="priority", elasticity="marginal-gain"))
    await eventually(lambda: brain.state.nodes)
    job_id = (await elastic_heard_from(brain, node, 4, 4, 100.0)).job_id
    # A better-ranked job needs one GPU: the elastic job is shrunk for it, in place.
    newcomer = await submit(brain, JobSpec(command=("sleep", "600"), gpus=1, priority=5))
    staged = await eventually(lambda: brain.state.jobs[job_id].resize)
    assert staged.to_size == 3
    # While its supervisor has not answered, passes come and go (the newcomer's
    # placement on the GPU not yet released is refused, and decided again): the job is
    # not preempted and restarted, which is what shrinking in place is for.
    await eventually(lambda: "0 free" in (brain.state.jobs[newcomer].reason or ""))
    still = brain.state.jobs[job_id]
    assert (still.state, still.attempt, still.resize) == (JobState.RUNNING, 1, staged)
    command = await eventually(lambda: node.resize_for(staged.command_id))
    await node.resized(command, ok=True, from_size=4)
    await eventually(lambda: brain.state.jobs[newcomer].state is JobState.RUNNING)
    done = brain.state.jobs[job_id]
    assert (done.state, done.attempt, done.gpu_count) == (JobState.RUNNING, 1, 3)


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(240)
async def test_a_horovod_job_shrinks_in_place_for_a_better_ranked_newcomer(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Agent]],
    tmp_path: Path,
) -> None:
    """The whole path with real horovodrun, across two nodes: the newcomer outranks the
    elastic job, which gives it a GPU by shrinking in place, not by a preemption and a
    restart. (The pass between staging and commit that once preempted it is pinned by
    the fake-supervisor test above: here the real one answers too fast to hit it.)"""
    from brain.core import Policy

    brain = await brain_factory(policy=Policy(order="priority", elasticity="marginal-gain"))
    await agent_factory("n1", gpus=2)
    await agent_factory("n2", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 2)
    records: list[StateRecord] = []
    brain.record_observers.append(lambda record, seq: records.append(record))
    stop_file = tmp_path / "stop"
    job_id = await submit(brain, elastic_train_spec(4, stop_file, max_gpus=4))
    await eventually(lambda: brain.progress.world_size(job_id) == 4, timeout_s=90)

    newcomer = await submit(brain, JobSpec(command=("sleep", "600"), gpus=1))
    await eventually(lambda: brain.state.jobs[newcomer].state is JobState.RUNNING, timeout_s=90)
    shrunk = brain.state.jobs[job_id]
    assert (shrunk.state, shrunk.attempt, shrunk.gpu_count) == (JobState.RUNNING, 1, 3)
    await eventually(lambda: brain.progress.world_size(job_id) == 3, timeout_s=30)
    changes = [
        r.cause.kind for r in records if isinstance(r, JobChanged) and r.job.job_id == job_id
    ]
    assert CauseKind.PREEMPTED not in changes
    assert changes.index(CauseKind.RESIZE_STAGED) < changes.index(CauseKind.RESIZED)

    stop_file.touch()
    ended = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=60
    )
    assert (ended.state, ended.attempt) == (JobState.SUCCEEDED, 1), ended.reason


async def test_an_elastic_job_shrinks_off_a_gpu_an_operator_drains_and_runs_on(
    brain_factory, node: FakeNode
) -> None:
    from brain.core import Policy

    brain = await brain_factory(policy=Policy(elasticity="marginal-gain"))
    await eventually(lambda: brain.state.nodes)
    job_id = (await elastic_heard_from(brain, node, 4, 4, 100.0)).job_id
    await brain.api.handle(
        OPERATOR_TENANT, DrainRequest(node="n1", gpu=3, reason="fan"), operator=True
    )
    staged = await eventually(lambda: brain.state.jobs[job_id].resize)
    assert staged.to_size == 3 and gpus_on(staged.after) == {0, 1, 2}
    assert "off n1:3, no longer schedulable" in (brain.state.jobs[job_id].reason or "")
    command = await eventually(lambda: node.resize_for(staged.command_id))
    await node.resized(command, ok=True, from_size=4)
    done = await eventually(lambda: (j := brain.state.jobs[job_id]).resize is None and j)
    assert (done.state, done.attempt, held(brain, job_id)) == (JobState.RUNNING, 1, (0, 1, 2))
    # Not grown back onto the drained GPU, nor preempted, in the passes that follow.
    await asyncio.sleep(1.0)
    after = brain.state.jobs[job_id]
    assert (after.resize, after.attempt, held(brain, job_id)) == (None, 1, (0, 1, 2))


async def test_http_resize_route(brain_factory, api_factory, node: FakeNode) -> None:
    brain = await brain_factory()
    api = await api_factory(brain)
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(brain, sleeper(1), tenant="alice")
    status, body = await api.call("POST", f"/v1/jobs/{job_id}/resize", "alice", json={"gpus": 2})
    assert status == 400 and "is not elastic" in body["error"], body
    status, body = await api.call("POST", f"/v1/jobs/{job_id}/resize", "bob", json={"gpus": 2})
    assert status == 404, body
    status, body = await api.call("POST", f"/v1/jobs/{job_id}/resize", "alice", json={"gpus": "2"})
    assert status == 400 and "gpus" in body["error"], body
    elastic_id = await submit(brain, sleeper(1, elastic=True, max_gpus=2), tenant="alice")
    await eventually(lambda: brain.state.jobs[elastic_id].state is JobState.RUNNING)
    # An operator may resize any tenant's job; this one has not started yet.
    status, body = await api.call(
        "POST", f"/v1/jobs/{elastic_id}/resize", "operator", json={"gpus": 2}
    )
    assert status == 409 and "has not started yet" in body["error"], body
    # Started and heard from: resizing pins it; the job record says so; "auto" lifts it.
    job = brain.state.jobs[elastic_id]
    await node.started(job)
    await node.progress(elastic_id, 1, 10.0, attempt=job.attempt)
    await eventually(lambda: brain.progress.heard_from(elastic_id))
    path = f"/v1/jobs/{elastic_id}"
    status, body = await api.call("POST", f"{path}/resize", "alice", json={"gpus": 1})
    assert status == 200 and body["job"]["pinned_gpus"] == 1, body
    status, body = await api.call("GET", path, "alice")
    assert status == 200 and body["job"]["pinned_gpus"] == 1, body
    status, body = await api.call("POST", f"{path}/resize", "alice", json={"gpus": "auto"})
    assert status == 200 and body["job"]["pinned_gpus"] is None, body
    status, body = await api.call("POST", f"{path}/resize", "alice", json={"gpus": "most"})
    assert status == 400 and "gpus" in body["error"], body


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(120)
async def test_a_failing_elastic_job_says_which_worker_failed_and_why(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Agent]],
    tmp_path: Path,
) -> None:
    """horovodrun's own error ends the log; the supervisor's last line names the first
    worker exception, and that is the reason the job's owner reads."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    spec = JobSpec(
        command=(sys.executable, "-c", "raise ValueError('lr must be > 0')"),
        gpus=2,
        elastic=True,
        min_gpus=1,
        max_gpus=2,
        cwd=str(REPO),
        env={"TMPDIR": str(tmp_path)},
    )
    job_id = await submit(brain, spec)
    job = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=90
    )
    assert job.state is JobState.FAILED
    (failure,) = job.failures
    assert failure.failure_class is FailureClass.USER
    assert "first error: worker" in failure.reason
    assert "ValueError: lr must be > 0" in failure.reason


def _when(records: list[tuple[float, StateRecord]], kind: CauseKind) -> list[float]:
    return [at for at, r in records if isinstance(r, JobChanged) and r.cause.kind is kind]


def _policy_resizes(records: list[tuple[float, StateRecord]], job_id: str) -> list[float]:
    """When the policy (not an operator) staged a resize of the job."""
    return [
        at
        for at, r in records
        if isinstance(r, JobChanged)
        and r.job.job_id == job_id
        and r.cause.kind is CauseKind.RESIZE_STAGED
        and "asked by" not in r.cause.message
    ]


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(480)
async def test_an_elastic_job_settles_and_an_operator_pin_holds(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Agent]],
    nats_server: EmbeddedNats,
    tmp_path: Path,
) -> None:
    """The first elastic user's run, on an idle node under `make up`'s policy (marginal
    gain, resizes at every cycle): `--gpus 2 --min-gpus 1 --max-gpus 3` of the example
    once flapped 17 times in 65 s. It settles: at most 2 policy resizes in the 90 s
    after its first commit. `alnair resize JOB 1 --wait` exits 0 once committed and the
    size holds for 60 s with no policy resize; `resize JOB auto` hands it back."""
    from tests.test_cli import alnair

    brain = await brain_factory(policy=Policy(order="fifo", elasticity="marginal-gain"))
    await agent_factory("n1", gpus=4)
    await eventually(lambda: brain.state.nodes)
    records: list[tuple[float, StateRecord]] = []
    brain.record_observers.append(lambda record, seq: records.append((time.monotonic(), record)))
    stop_file = tmp_path / "stop"
    job_id = await submit(brain, elastic_train_spec(2, stop_file, max_gpus=3))
    await eventually(lambda: brain.progress.world_size(job_id) == 2, timeout_s=90)

    # The policy may probe another size (a resize) and come back (a second): no more.
    # The window opens at the first commit (or after a minute without one).
    with contextlib.suppress(AssertionError):
        await eventually(lambda: _when(records, CauseKind.RESIZED), timeout_s=60, interval_s=1)
    committed = _when(records, CauseKind.RESIZED)
    window_start = committed[0] if committed else time.monotonic()
    await asyncio.sleep(max(0.0, window_start + 90 - time.monotonic()))
    late = [at for at in _policy_resizes(records, job_id) if window_start <= at < window_start + 90]
    assert len(late) <= 2, [r.cause.message for _, r in records if isinstance(r, JobChanged)]
    await eventually(lambda: brain.state.jobs[job_id].resize is None, timeout_s=90)

    # An operator's size holds, through the CLI a user would type.
    env = {"PATH": "/usr/bin:/bin", "ALNAIR_HOME": str(tmp_path / "home"), "HOME": str(tmp_path)}
    where = ("--nats", nats_server.url, "--tenant", TENANT)
    code, out, err = await alnair("resize", *where, job_id, "1", "--wait", env=env)
    assert code == 0, (out, err)
    job = brain.state.jobs[job_id]
    assert (job.gpu_count, job.pinned_gpus) == (1, 1), job.reason
    pinned_at = time.monotonic()
    await asyncio.sleep(60)
    assert brain.state.jobs[job_id].gpu_count == 1
    assert [at for at in _policy_resizes(records, job_id) if at >= pinned_at] == []

    code, out, err = await alnair("resize", *where, job_id, "auto", env=env)
    assert code == 0 and "not pinned" in out, err
    assert _when(records, CauseKind.RESIZE_UNPINNED)
    assert brain.state.jobs[job_id].pinned_gpus is None

    stop_file.touch()
    ended = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=90
    )
    assert ended.state is JobState.SUCCEEDED, ended.reason
