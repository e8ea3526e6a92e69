"""Fakes behind brain/writer.py's protocols, for the brain's parts tested without NATS.

`Shell` stages each change as the brain would (a record applied to a real `BrainState`
at the next sequence) and keeps what it was asked to send; its units of work hold its
writer lock and are counted; `Clock` is a settable time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from brain.state import BrainState
from schemas.commands import NodeCommand
from schemas.events import NodeEvent
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeRecord, NodeState
from schemas.state import (
    BlacklistChanged,
    BlacklistEntry,
    Cause,
    CauseKind,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
)
from schemas.telemetry import Heartbeat, RunningJob
from tests.statelog import START_TS, fake_gpus, fake_instance, live_job_record, node_record


@dataclass
class Clock:
    now: float = START_TS

    def __call__(self) -> float:
        return self.now


@dataclass
class Stop:
    job_id: str
    node: str
    reason: str
    attempt: int | None


@dataclass
class Shell:
    state: BrainState = field(default_factory=BrainState)
    epoch: int = 1
    clock: Clock = field(default_factory=Clock)
    causes: list[Cause] = field(default_factory=list)
    commands: list[tuple[str, NodeCommand]] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    launches: list[str] = field(default_factory=list)
    records: int = 0
    writer: asyncio.Lock = field(default_factory=asyncio.Lock)
    units: int = 0
    # What building a launch raises (the cluster key out of reach), if anything.
    launch_error: Exception | None = None

    @contextlib.asynccontextmanager
    async def unit(self) -> AsyncIterator[None]:
        async with self.writer:
            self.units += 1
            yield

    def apply(self, record: StateRecord) -> None:
        self.state.apply(record, self.state.last_seq + 1)

    def _next_id(self) -> str:
        self.records += 1
        return f"test-{self.records}"

    async def job_changed(self, job: JobRecord, previous: JobState | None, cause: Cause) -> None:
        self.apply(
            JobChanged(
                record_id=self._next_id(),
                ts=self.clock(),
                epoch=self.epoch,
                job=job,
                previous=previous,
                cause=cause,
            )
        )
        self.causes.append(cause)

    async def node_changed(
        self, node: NodeRecord, previous: NodeState | None, cause: Cause
    ) -> None:
        self.apply(
            NodeChanged(
                record_id=self._next_id(),
                ts=self.clock(),
                epoch=self.epoch,
                node=node,
                previous=previous,
                cause=cause,
            )
        )
        self.causes.append(cause)

    async def blacklist_changed(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None:
        self.apply(
            BlacklistChanged(
                record_id=self._next_id(),
                ts=self.clock(),
                epoch=self.epoch,
                entries=tuple(entries.values()),
                cause=cause,
            )
        )
        self.causes.append(cause)

    async def command(self, node: str, command: NodeCommand) -> None:
        self.commands.append((node, command))

    async def stop(self, job_id: str, node: str, reason: str, attempt: int | None) -> None:
        self.stops.append(Stop(job_id, node, reason, attempt))

    async def stop_parts(
        self, job: JobRecord, reason: str, *, except_node: str | None = None
    ) -> None:
        for grant in job.grants:
            if grant.node != except_node and not grant.exited:
                await self.stop(job.job_id, grant.node, reason, job.attempt)

    async def launch_ready(self, job: JobRecord) -> None:
        if self.launch_error is not None:
            raise self.launch_error

    async def send_launches(self, job: JobRecord) -> None:
        self.launches += [g.node for g in job.grants if g.pid is None and not g.exited]

    # -- building state ----------------------------------------------------------------

    def add_node(self, name: str, gpus: int = 8) -> NodeRecord:
        self.apply(node_record(name, gpus))
        return self.state.nodes[name]

    def add_job(self, number: int, *, gpus: int = 1, node: str | None = None) -> JobRecord:
        """Job `number`, RUNNING attempt 1 on GPUs 0..gpus-1 of `node` (or PENDING)."""
        self.apply(live_job_record(number, gpus=gpus, node=node))
        return self.state.jobs[str(number)]

    def record_event(self, event: NodeEvent) -> None:
        """The event's own record, as the brain journals it after its effects."""
        self.apply(
            NodeEventRecorded(
                record_id=self._next_id(), ts=self.clock(), epoch=self.epoch, event=event
            )
        )

    def put_job(self, job: JobRecord) -> JobRecord:
        """Set a job as given (any state), as if journaled."""
        self.apply(
            JobChanged(
                record_id=self._next_id(),
                ts=self.clock(),
                epoch=self.epoch,
                job=job,
                previous=None,
                cause=Cause(kind=CauseKind.SUBMITTED, message="test", job_id=job.job_id),
            )
        )
        return self.state.jobs[job.job_id]


def heartbeat(node: str, *running: tuple[str, int], instance: str | None = None) -> Heartbeat:
    """A heartbeat from `node` reporting (job, attempt) processes."""
    return Heartbeat(
        node=node,
        ts=START_TS,
        seq=1,
        instance=instance or fake_instance(node),
        hostname=node,
        backend="sim",
        interval_s=1.0,
        gpus=fake_gpus(node, 8),
        running=tuple(
            RunningJob(job_id=job_id, attempt=attempt, pid=1000 + i, gpus=(0,))
            for i, (job_id, attempt) in enumerate(running)
        ),
        fence_s=3.0,
    )
