"""The brain's asyncio shell: fold events into state, decide, command, journal.

Every input (a heartbeat, a node event, an API call, a tick) goes through one inbox
and is handled to completion before the next, so state has a single writer. Each
change is appended to the STATE stream first and applied to memory once JetStream has
stored it (write-ahead), so what any client was told is in the log. Decisions come from
the pure `decide()`; this module only turns them into records and commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nats.js.errors
from nats.aio.msg import Msg

from brain.core import DEFAULT_POLICY, Place, Policy, Wait, decide
from brain.history import History
from brain.state import BrainState
from bus.client import Bus
from schemas import subjects
from schemas.commands import Launch, NodeCommand, Stop
from schemas.errors import ApiError, InvalidMessage
from schemas.events import (
    NODE_EVENT,
    CommandRejected,
    JobExited,
    JobStarted,
    LaunchFailed,
    NodeEvent,
)
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import NodeRecord, NodeState
from schemas.state import (
    STATE_RECORD,
    Cause,
    CauseKind,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
)
from schemas.telemetry import Heartbeat, TelemetryBatch

log = logging.getLogger(__name__)

EPOCH_BUCKET: Final = "alnair_brain"
EPOCH_KEY: Final = "epoch"
# Do not repeat a reconciliation stop for the same process more often than this.
RESTOP_AFTER_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class BrainConfig:
    policy: Policy = DEFAULT_POLICY
    # A node silent this long is LOST and its jobs are taken back.
    node_timeout_s: float = 5.0
    tick_s: float = 0.5
    # A launch not confirmed by the node within this long is given up and requeued.
    launch_ttl_s: float = 60.0
    stop_grace_s: float = 10.0
    history_path: Path | None = None


@dataclass
class _Item:
    """One unit of work for the inbox; `done` resolves when it has been handled."""

    kind: str
    payload: object = None
    tenant: str = ""
    done: asyncio.Future[object] | None = None


@dataclass
class _Liveness:
    last_seen: float
    instance: str
    running: set[tuple[str, int]] = field(default_factory=set)


class Brain:
    def __init__(
        self,
        bus: Bus,
        config: BrainConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.config = config or BrainConfig()
        self.config.policy.validate()
        self.clock = clock
        self.monotonic = monotonic
        self.state = BrainState()
        self.history = History(self.config.history_path)
        self.epoch = 0
        self.instance = uuid.uuid4().hex[:12]
        self.started_at = clock()
        self.host = socket.gethostname()
        self.telemetry: dict[str, TelemetryBatch] = {}
        self._liveness: dict[str, _Liveness] = {}
        self._stops_sent: dict[tuple[str, str, int], float] = {}
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._dirty = True
        self._record_counter = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.decisions_made = 0
        # Read-only observers (metrics, profiles, the HTTP event stream). They run in
        # the brain's loop and must not block or raise; they never change state.
        self.telemetry_observers: list[Callable[[TelemetryBatch], None]] = []
        self.record_observers: list[Callable[[StateRecord, int], None]] = []

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.bus.ensure_streams()
        self.epoch = await claim_epoch(self.bus)
        await self._replay()
        from brain.api import ApiServer  # the API serves this brain; import late

        self.api = ApiServer(self)
        now = self.monotonic()
        for node in self.state.nodes.values():
            # Liveness is not in the log: every known node gets a fresh grace period.
            self._liveness[node.name] = _Liveness(last_seen=now, instance=node.instance)
        await self.bus.subscribe(subjects.ALL_HEARTBEATS, Heartbeat, self._on_heartbeat)
        await self.bus.subscribe(subjects.ALL_TELEMETRY, TelemetryBatch, self._on_telemetry)
        await self.api.serve()
        await self.bus.consume(
            subjects.STREAM_EVENTS, "brain", subjects.ALL_NODE_EVENTS, NODE_EVENT, self._on_event
        )
        self._loop_task = self.bus.spawn(self._run(), name="brain-loop")
        self._ticker = self.bus.spawn(self._tick_forever(), name="brain-tick")
        log.info(
            "brain %s up: epoch %d, %d jobs and %d nodes from the log (seq %d), policy %s",
            self.instance,
            self.epoch,
            len(self.state.jobs),
            len(self.state.nodes),
            self.state.last_seq,
            self.config.policy.describe(),
        )

    async def stop(self) -> None:
        for task in (self._ticker, self._loop_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.history.close()

    async def _replay(self) -> None:
        history_seq = self.history.last_seq()
        async for item, seq, subject in self.bus.read(subjects.STREAM_STATE, STATE_RECORD):
            if isinstance(item, InvalidMessage):
                log.error("STATE entry %d on %s is unreadable: %s", seq, subject, item.reason)
                continue
            self.state.apply(item, seq)
            if seq > history_seq:
                self.history.record(item, seq)

    # -- inbound ---------------------------------------------------------------------

    async def _on_heartbeat(self, beat: Heartbeat, msg: Msg) -> None:
        if not await self._from_own_node(beat.node, msg):
            return
        await self._inbox.put(_Item("heartbeat", beat))

    async def _on_telemetry(self, batch: TelemetryBatch, msg: Msg) -> None:
        if await self._from_own_node(batch.node, msg):
            self.telemetry[batch.node] = batch
            self._notify(self.telemetry_observers, batch)

    async def _on_event(self, event: NodeEvent, msg: Msg) -> None:
        if not await self._from_own_node(event.node, msg):
            return
        await self.submit_item(_Item("event", event))

    async def _from_own_node(self, node: str, msg: Msg) -> bool:
        """A node speaks only for itself: the payload's node must be the subject's."""
        token = msg.subject.split(".")[2] if msg.subject.count(".") >= 3 else ""
        if token != node:
            await self.bus.dead_letter(
                msg.subject, msg.data, f"payload names node {node!r} but the subject is {token!r}"
            )
            return False
        return True

    async def submit_item(self, item: _Item) -> object:
        item.done = asyncio.get_running_loop().create_future()
        await self._inbox.put(item)
        return await item.done

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            await self._inbox.put(_Item("tick"))

    async def _run(self) -> None:
        while True:
            item = await self._inbox.get()
            try:
                result = await self._handle(item)
            except ApiError as error:
                if item.done is not None and not item.done.done():
                    item.done.set_exception(error)
            except Exception as error:
                log.exception("brain failed handling %s", item.kind)
                if item.done is not None and not item.done.done():
                    item.done.set_exception(error)
            else:
                if item.done is not None and not item.done.done():
                    item.done.set_result(result)
            if self._dirty and self._inbox.empty():
                try:
                    await self._schedule()
                except Exception:
                    log.exception("scheduling cycle failed")

    async def _handle(self, item: _Item) -> object:
        if item.kind == "heartbeat":
            assert isinstance(item.payload, Heartbeat)
            await self._heartbeat(item.payload)
        elif item.kind == "event":
            await self._event(item.payload)  # type: ignore[arg-type]
        elif item.kind == "tick":
            await self._check_nodes()
            await self._check_launches()
        elif item.kind == "submit":
            assert isinstance(item.payload, JobSpec)
            return await self._submit(item.tenant, item.payload)
        elif item.kind == "cancel":
            assert isinstance(item.payload, str)
            return await self._cancel(item.tenant, item.payload)
        return None

    # -- journal ---------------------------------------------------------------------

    def _record_id(self) -> str:
        self._record_counter += 1
        return f"{self.instance}-{self._record_counter}"

    async def _append(self, record: StateRecord, subject: str) -> None:
        seq = await self.bus.publish_durable(subject, record, msg_id=record.record_id)
        self.state.apply(record, seq)
        try:
            self.history.record(record, seq)
        except Exception:
            log.exception("history write failed for seq %d; the log has it", seq)
        self._notify(self.record_observers, record, seq)

    async def _job_changed(self, job: JobRecord, previous: JobState | None, cause: Cause) -> None:
        record = JobChanged(
            record_id=self._record_id(),
            ts=self.clock(),
            epoch=self.epoch,
            job=job,
            previous=previous,
            cause=cause,
        )
        await self._append(record, subjects.state_job(job.job_id))
        self._dirty = True

    async def _node_changed(
        self, node: NodeRecord, previous: NodeState | None, cause: Cause
    ) -> None:
        record = NodeChanged(
            record_id=self._record_id(),
            ts=self.clock(),
            epoch=self.epoch,
            node=node,
            previous=previous,
            cause=cause,
        )
        await self._append(record, subjects.state_node(node.name))
        self._dirty = True

    async def _event_recorded(self, event: NodeEvent) -> None:
        record = NodeEventRecorded(
            record_id=f"event-{event.event_id}", ts=self.clock(), epoch=self.epoch, event=event
        )
        await self._append(record, subjects.state_node(event.node))

    # -- commands --------------------------------------------------------------------

    async def _command(self, node: str, command: NodeCommand) -> None:
        await self.bus.publish_durable(
            subjects.node(node, "cmd"), command, msg_id=command.command_id
        )

    async def _stop(self, job_id: str, node: str, reason: str, attempt: int | None) -> None:
        command = Stop(
            command_id=f"stop-{uuid.uuid4().hex}",
            epoch=self.epoch,
            issued_at=self.clock(),
            job_id=job_id,
            attempt=attempt,
            reason=reason,
            grace_s=self.config.stop_grace_s,
        )
        self._stops_sent[(node, job_id, attempt or 0)] = self.monotonic()
        await self._command(node, command)

    async def _stop_parts(
        self, job: JobRecord, reason: str, *, except_node: str | None = None
    ) -> None:
        for grant in job.grants:
            if grant.node != except_node and not grant.exited:
                await self._stop(job.job_id, grant.node, reason, job.attempt)

    # -- API operations (called from the inbox) ----------------------------------------

    async def _submit(self, tenant: str, spec: JobSpec) -> JobRecord:
        capacity = self.state.capacity()
        if self.state.nodes and spec.gpus > capacity:
            raise ApiError(
                "invalid",
                f"job asks for {spec.gpus} GPUs but the cluster has {capacity} "
                f"({len(self.state.nodes)} nodes, at most {self.state.largest_node()} on one node)",
            )
        job = JobRecord(
            job_id=self.state.next_job_id(),
            tenant=tenant,
            spec=spec,
            state=JobState.PENDING,
            submitted_at=self.clock(),
            reason="submitted",
        )
        await self._job_changed(
            job,
            None,
            Cause(
                kind=CauseKind.SUBMITTED, message=f"submitted by tenant {tenant}", job_id=job.job_id
            ),
        )
        return job

    async def _cancel(self, tenant: str, job_id: str) -> JobRecord:
        job = self.state.jobs.get(job_id)
        if job is None or job.tenant != tenant:
            raise ApiError("not_found", f"no job {job_id} for tenant {tenant}")
        if job.state.terminal:
            raise ApiError("conflict", f"job {job_id} already ended {job.state.value}")
        cancelled = job.model_copy(
            update={
                "state": JobState.CANCELLED,
                "finished_at": self.clock(),
                "reason": "cancelled by its owner",
            }
        )
        await self._job_changed(
            cancelled,
            job.state,
            Cause(kind=CauseKind.CANCELLED, message=f"cancelled by tenant {tenant}", job_id=job_id),
        )
        await self._stop_parts(job, "cancelled")
        return cancelled

    # -- nodes -----------------------------------------------------------------------

    async def _heartbeat(self, beat: Heartbeat) -> None:
        now = self.monotonic()
        live = self._liveness.get(beat.node)
        if live is None:
            live = self._liveness[beat.node] = _Liveness(last_seen=now, instance=beat.instance)
        live.last_seen = now
        live.instance = beat.instance
        live.running = {(r.job_id, r.attempt) for r in beat.running}
        known = self.state.nodes.get(beat.node)
        fresh = NodeRecord(
            name=beat.node,
            state=NodeState.READY,
            hostname=beat.hostname,
            backend=beat.backend,
            instance=beat.instance,
            gpus=beat.gpus,
            joined_at=known.joined_at if known is not None else self.clock(),
        )
        if known is None:
            await self._node_changed(
                fresh,
                None,
                Cause(
                    kind=CauseKind.NODE_JOINED,
                    node=beat.node,
                    message=f"joined with {len(beat.gpus)} GPUs ({beat.backend})",
                ),
            )
        elif known.state is NodeState.LOST:
            await self._node_changed(
                fresh,
                known.state,
                Cause(kind=CauseKind.NODE_RETURNED, node=beat.node, message="heartbeats resumed"),
            )
        elif fresh != known:
            await self._node_changed(
                fresh,
                known.state,
                Cause(
                    kind=CauseKind.NODE_UPDATED,
                    node=beat.node,
                    message="inventory or agent instance changed",
                ),
            )
        await self._reconcile(beat)

    async def _reconcile(self, beat: Heartbeat) -> None:
        """Stop what a node runs that the brain did not give it (any more)."""
        now = self.monotonic()
        for running in beat.running:
            job = self.state.jobs.get(running.job_id)
            if (
                job is not None
                and job.state is JobState.RUNNING
                and job.attempt == running.attempt
                and beat.node in job.nodes
            ):
                continue
            key = (beat.node, running.job_id, running.attempt)
            if now - self._stops_sent.get(key, -RESTOP_AFTER_S) < RESTOP_AFTER_S:
                continue
            log.warning(
                "node %s runs job %s attempt %d that it does not hold; stopping it",
                beat.node,
                running.job_id,
                running.attempt,
            )
            await self._stop(
                running.job_id,
                beat.node,
                "stale: the brain no longer runs this attempt here",
                running.attempt,
            )

    async def _check_nodes(self) -> None:
        now = self.monotonic()
        for name, node in list(self.state.nodes.items()):
            live = self._liveness.get(name)
            if node.state is not NodeState.READY or live is None:
                continue
            silent = now - live.last_seen
            if silent <= self.config.node_timeout_s:
                continue
            await self._node_changed(
                node.model_copy(update={"state": NodeState.LOST}),
                node.state,
                Cause(
                    kind=CauseKind.NODE_LOST,
                    node=name,
                    message=f"no heartbeat for {silent:.1f}s "
                    f"(limit {self.config.node_timeout_s:g}s)",
                ),
            )
            for job in self.state.running_on(name):
                await self._requeue(
                    job,
                    Cause(
                        kind=CauseKind.NODE_LOST,
                        node=name,
                        job_id=job.job_id,
                        message=f"node {name} was lost",
                    ),
                )

    async def _check_launches(self) -> None:
        """Requeue a job whose launch a node never confirmed nor refused."""
        now = self.clock()
        for job in self.state.jobs_in(JobState.RUNNING):
            if job.started_at is None or now - job.started_at < self.config.launch_ttl_s + 5:
                continue
            for grant in job.grants:
                if grant.pid is not None or grant.exited:
                    continue
                live = self._liveness.get(grant.node)
                if live is not None and (job.job_id, job.attempt) in live.running:
                    continue
                await self._requeue(
                    job,
                    Cause(
                        kind=CauseKind.LAUNCH_FAILED,
                        node=grant.node,
                        job_id=job.job_id,
                        message=f"node {grant.node} never confirmed the launch",
                    ),
                )
                break

    async def _requeue(self, job: JobRecord, cause: Cause) -> None:
        """Back to PENDING, keeping its attempt count; stop whatever still runs."""
        pending = job.model_copy(
            update={
                "state": JobState.PENDING,
                "grants": (),
                "started_at": None,
                "reason": cause.message,
            }
        )
        await self._job_changed(pending, job.state, cause)
        await self._stop_parts(job, f"requeued: {cause.message}")

    # -- node events -----------------------------------------------------------------

    async def _event(self, event: NodeEvent) -> None:
        await self._event_recorded(event)
        if isinstance(event, JobStarted):
            await self._job_started(event)
        elif isinstance(event, JobExited):
            await self._job_exited(event)
        elif isinstance(event, LaunchFailed):
            await self._launch_failed(event)
        elif isinstance(event, CommandRejected):
            await self._command_rejected(event)
        self._dirty = True

    def _current(self, job_id: str, attempt: int, node: str) -> JobRecord | None:
        """The job, if `attempt` on `node` is what it runs now; else the event is stale."""
        job = self.state.jobs.get(job_id)
        if job is None or job.state is not JobState.RUNNING or job.attempt != attempt:
            return None
        return job if node in job.nodes else None

    @staticmethod
    def _with_grant(job: JobRecord, node: str, **update: object) -> JobRecord:
        grants = tuple(g.model_copy(update=update) if g.node == node else g for g in job.grants)
        return job.model_copy(update={"grants": grants})

    async def _job_started(self, event: JobStarted) -> None:
        job = self._current(event.job_id, event.attempt, event.node)
        if job is None:
            return
        started = self._with_grant(job, event.node, pid=event.pid, log_path=event.log_path)
        await self._job_changed(
            started,
            job.state,
            Cause(
                kind=CauseKind.STARTED,
                node=event.node,
                job_id=job.job_id,
                message=f"process {event.pid} started on {event.node}",
            ),
        )

    async def _job_exited(self, event: JobExited) -> None:
        job = self._current(event.job_id, event.attempt, event.node)
        if job is None:
            return
        updated = self._with_grant(
            job, event.node, exited=True, exit_code=event.exit_code, signal=event.signal
        )
        how = f"exit code {event.exit_code}" if event.signal is None else f"signal {event.signal}"
        if event.stopped:
            # Stopped by its node, not by this brain (the agent shut down): not the
            # job's fault, so it runs again.
            await self._requeue(
                updated,
                Cause(
                    kind=CauseKind.EXITED,
                    node=event.node,
                    job_id=job.job_id,
                    message=f"stopped by node {event.node} ({how})",
                ),
            )
            return
        if event.exit_code == 0:
            if all(g.exited for g in updated.grants):
                done = updated.model_copy(
                    update={
                        "state": JobState.SUCCEEDED,
                        "finished_at": self.clock(),
                        "exit_code": 0,
                        "reason": "exited 0",
                    }
                )
                await self._job_changed(
                    done,
                    job.state,
                    Cause(
                        kind=CauseKind.EXITED,
                        node=event.node,
                        job_id=job.job_id,
                        message=f"exited 0 after {event.runtime_s:.1f}s",
                    ),
                )
            else:
                await self._job_changed(
                    updated,
                    job.state,
                    Cause(
                        kind=CauseKind.EXITED,
                        node=event.node,
                        job_id=job.job_id,
                        message=f"part on {event.node} exited 0; waiting for the others",
                    ),
                )
            return
        last_line = next((line for line in reversed(event.log_tail) if line.strip()), "")
        reason = f"{how} on {event.node}" + (f": {last_line.strip()}" if last_line else "")
        failed = updated.model_copy(
            update={
                "state": JobState.FAILED,
                "finished_at": self.clock(),
                "exit_code": event.exit_code,
                "signal": event.signal,
                "reason": reason,
            }
        )
        await self._job_changed(
            failed,
            job.state,
            Cause(kind=CauseKind.EXITED, node=event.node, job_id=job.job_id, message=reason),
        )
        await self._stop_parts(updated, f"another part failed: {reason}", except_node=event.node)

    async def _launch_failed(self, event: LaunchFailed) -> None:
        job = self._current(event.job_id, event.attempt, event.node)
        if job is None:
            return
        updated = self._with_grant(job, event.node, exited=True)
        cause = Cause(
            kind=CauseKind.LAUNCH_FAILED,
            node=event.node,
            job_id=job.job_id,
            message=f"launch failed on {event.node}: {event.reason}",
        )
        if event.retryable:
            await self._requeue(updated, cause)
            return
        failed = updated.model_copy(
            update={"state": JobState.FAILED, "finished_at": self.clock(), "reason": cause.message}
        )
        await self._job_changed(failed, job.state, cause)
        await self._stop_parts(updated, "another part failed to launch", except_node=event.node)

    async def _command_rejected(self, event: CommandRejected) -> None:
        log.warning("node %s rejected %s: %s", event.node, event.command_id, event.reason)
        if event.job_id is None or not event.command_id.startswith("launch-"):
            return
        job = self.state.jobs.get(event.job_id)
        if job is None or job.state is not JobState.RUNNING:
            return
        if event.command_id == _launch_id(job.job_id, job.attempt, event.node):
            await self._requeue(
                job,
                Cause(
                    kind=CauseKind.LAUNCH_FAILED,
                    node=event.node,
                    job_id=job.job_id,
                    message=f"node {event.node} refused the launch: {event.reason}",
                ),
            )

    # -- scheduling ------------------------------------------------------------------

    async def _schedule(self) -> None:
        self._dirty = False
        decisions = decide(self.state.snapshot(), self.clock(), self.config.policy)
        self.decisions_made += 1
        for action in decisions.actions:
            job = self.state.jobs.get(action.job_id)
            if job is None or job.state is not JobState.PENDING:
                continue
            if isinstance(action, Place):
                await self._place(job, action)
            elif isinstance(action, Wait) and action.reason != job.reason:
                await self._job_changed(
                    job.model_copy(update={"reason": action.reason}),
                    job.state,
                    Cause(kind=CauseKind.WAITING, job_id=job.job_id, message=action.reason),
                )

    async def _place(self, job: JobRecord, action: Place) -> None:
        now = self.clock()
        attempt = job.attempt + 1
        grants = tuple(NodeGrant(node=g.node, gpus=g.gpus) for g in action.grants)
        running = job.model_copy(
            update={
                "state": JobState.RUNNING,
                "attempt": attempt,
                "grants": grants,
                "started_at": now,
                "finished_at": None,
                "exit_code": None,
                "signal": None,
                "reason": action.cause,
            }
        )
        await self._job_changed(
            running,
            job.state,
            Cause(kind=CauseKind.PLACED, job_id=job.job_id, message=action.cause),
        )
        nodes = tuple(g.node for g in grants)
        for rank, grant in enumerate(grants):
            await self._command(
                grant.node,
                Launch(
                    command_id=_launch_id(job.job_id, attempt, grant.node),
                    epoch=self.epoch,
                    issued_at=now,
                    job_id=job.job_id,
                    attempt=attempt,
                    gpus=grant.gpus,
                    command=job.spec.command,
                    env=job.spec.env,
                    cwd=job.spec.cwd,
                    expires_at=now + self.config.launch_ttl_s,
                    node_rank=rank,
                    nodes=nodes,
                ),
            )

    @staticmethod
    def _notify(observers: list[Callable[..., None]], *args: object) -> None:
        for observer in observers:
            try:
                observer(*args)
            except Exception:
                log.exception("observer %r failed", observer)

    # -- views -----------------------------------------------------------------------

    def last_seen_ago(self, node: str) -> float | None:
        live = self._liveness.get(node)
        return None if live is None else max(0.0, self.monotonic() - live.last_seen)

    @property
    def pid(self) -> int:
        return os.getpid()


def _launch_id(job_id: str, attempt: int, node: str) -> str:
    return f"launch-{job_id}-{attempt}-{node}"


async def claim_epoch(bus: Bus) -> int:
    """Take the next brain epoch: a compare-and-set increment in a KV bucket.

    Commands carry it, and agents refuse an older one, so a brain that was replaced
    cannot act after its successor has.
    """
    try:
        kv = await bus.js.key_value(EPOCH_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        kv = await bus.js.create_key_value(bucket=EPOCH_BUCKET, history=1)
    while True:
        try:
            entry = await kv.get(EPOCH_KEY)
        except nats.js.errors.KeyNotFoundError:
            try:
                await kv.create(EPOCH_KEY, b"1")
                return 1
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
        current = int((entry.value or b"0").decode())
        try:
            await kv.update(EPOCH_KEY, str(current + 1).encode(), last=entry.revision)
            return current + 1
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
