"""The brain's asyncio shell: fold events into state, decide, command, journal.

Every input that may change state (a heartbeat with news, a node event, an API call,
a tick) goes through one inbox and is handled to completion before the next; heartbeats
and telemetry stop in brain/ingest.py, which passes on only their news. State has one
writer at a time: the inbox loop, or a scheduling pass applying its decisions (passes
are coalesced and run decide() off the request path). Each change is appended to the
STATE stream first and applied to memory once JetStream has stored it (write-ahead), so
what any client was told is in the log. Decisions come from the pure `decide()`; this
module only turns them into records and commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from brain import elastic, secrets
from brain import queues as queue_config
from brain.api import ApiServer
from brain.core import (
    DEFAULT_POLICY,
    DEFAULT_SERVICE_PRIOR,
    DISTRIBUTION_AWARE,
    Decisions,
    MemoryPressure,
    Place,
    Policy,
    Preempt,
    QueueQuota,
    QuotaReclaim,
    Resize,
    ServiceDistribution,
    SetServiceLevel,
    Wait,
    decide,
)
from brain.core.failures import (
    DEFAULT_FAILURE_POLICY,
    AttemptEnd,
    Classification,
    FailurePolicy,
    GiveUp,
    classify,
    decide_retry,
    fault_action,
)
from brain.core.ordering import job_sequence
from brain.core.shares import never_fits
from brain.credentials import JobCredentials, load_signer
from brain.hearing import Hearing
from brain.history import History
from brain.inbox import ApiCall, EventArrived, HeartbeatNews, Item, Tick, WriteRequest
from brain.ingest import (
    SHED_TELEMETRY_INBOX,
    SHED_TELEMETRY_LAG_S,
    TELEMETRY_PENDING_BYTES,
    TELEMETRY_PENDING_MSGS,
    NodeIngest,
)
from brain.journal import Journal
from brain.leader import Lease
from brain.profiles import Profiler, ProfileStore, profiles_path
from brain.progress import ProgressTracker
from brain.replica import Replica
from brain.state import BrainState, current_size_s, job_demand
from brain.tenants import check_tenant, job_event_refusal
from bus.client import Bus, Consumer
from schemas import subjects
from schemas.api import (
    BlacklistRequest,
    BrainInfo,
    CancelRequest,
    DrainRequest,
    ResizeRequest,
    ResumeRequest,
    SubmitRequest,
)
from schemas.commands import Launch, NodeCommand, Regrant, Stop
from schemas.errors import ApiError, HandBack
from schemas.events import (
    NODE_EVENT,
    CommandRejected,
    GpuFault,
    InputError,
    JobExited,
    JobStarted,
    LaunchFailed,
    NodeEvent,
    ResizeCompleted,
)
from schemas.jobs import (
    AttemptFailure,
    FailureClass,
    JobRecord,
    JobState,
    NodeGpus,
    NodeGrant,
    describe_placement,
    job_limits,
    placement_size,
)
from schemas.nodes import DrainedGpu, NodeRecord, NodeState
from schemas.progress import Progress
from schemas.state import (
    BlacklistChanged,
    BlacklistEntry,
    Cause,
    CauseKind,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    Preemption,
    StateRecord,
)
from schemas.telemetry import GpuShares, Heartbeat, TelemetryBatch
from schemas.workers import EXEC_SECRET_ENV

log = logging.getLogger(__name__)

# Do not repeat a reconciliation stop for the same process more often than this.
RESTOP_AFTER_S: Final = 10.0
# A pass waits for the inbox to empty (one pass for all the changes queued), but no
# longer than this: a steady stream of requests must not starve scheduling.
PASS_WAITS_FOR_INBOX_S: Final = 0.05
# A decide() that took longer than this last time runs in a worker thread, so the loop
# (heartbeats, the API, the lease) goes on beside it; a shorter one runs in the loop,
# where it does not make every wake-up of the loop wait for the GIL.
DECIDE_IN_THREAD_AFTER_S: Final = 0.05
# Inbox items handled as one unit, their records stored as one group: enough to carry
# a burst of submissions in a few round trips, few enough that the first caller in a
# group is not kept waiting long for the last.
GROUP_MAX: Final = 256


@dataclass(frozen=True, slots=True)
class BrainConfig:
    policy: Policy = DEFAULT_POLICY
    # A node silent this long is LOST: nothing new is placed on it.
    node_timeout_s: float = 5.0
    # Its jobs run elsewhere only this much later, once its agent has surely stopped
    # them (agents/fence.py; the arithmetic is in docs/operations.md, "Partitions").
    fence_margin_s: float = 5.0
    # How long a job submitted with on_disconnect "keep" may run on unheard: its agent
    # fences it after this, and the brain runs it elsewhere after this plus the margin.
    keep_disconnected_s: float = 300.0
    tick_s: float = 0.5
    # A launch not confirmed by the node within this long is given up and requeued.
    launch_ttl_s: float = 60.0
    stop_grace_s: float = 10.0
    history_path: Path | None = None
    # The leader lease expires this long after its last renewal: the failover time.
    lease_ttl_s: float = 5.0
    # Write a snapshot after this many log entries, to bound a restart's replay.
    snapshot_every: int = 1000
    # Where this brain's HTTP API listens, if anywhere (shown by `alnair status`).
    http_address: str | None = None
    # Failure classes, retries and back-off, input blacklisting, pre-run.
    failures: FailurePolicy = DEFAULT_FAILURE_POLICY
    # An elastic resize its supervisor has not answered within this long is rolled
    # back (the supervisor gives up on its own after 120 s and says so).
    resize_timeout_s: float = 300.0
    # Queue quotas (`alnair brain --queues FILE`); a queue not listed has no guarantee.
    queues: tuple[QueueQuota, ...] = ()
    # What the Gittins order believes of job service before any job has finished; the
    # finished jobs' service (from the log) is learned on top of it.
    service_prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR
    # The tenants of the tenant map (`--tenant-users`): others are refused at submit.
    # None: no map, every tenant may submit (its jobs run as the agent's user).
    tenants: frozenset[str] | None = None
    # The account seed that signs jobs' NATS users (auth callout, brain/credentials.py);
    # None: jobs get no token, and use their node's job identity if it gives them one.
    callout_seed: Path | None = None


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
        self.history = History(self.config.history_path)
        self.replica = Replica(bus, self.history)
        self.lease = Lease(bus, ttl_s=self.config.lease_ttl_s)
        # 0 while standing by; the lease revision it was taken at while leading.
        self.epoch = 0
        self.leading = asyncio.Event()
        self.instance = uuid.uuid4().hex[:12]
        self.started_at = clock()
        self.host = socket.gethostname()
        # Heartbeats and telemetry arrive on a connection of their own (`ingest_bus`,
        # opened at start) and stop in `ingest`; only their news reaches the inbox.
        self.ingest = NodeIngest(node_timeout_s=self.config.node_timeout_s)
        self.hearing = Hearing(monotonic)
        self.ingest_bus: Bus = bus
        self._stops_sent: dict[tuple[str, str, int], float] = {}
        # (job, attempt, node) -> when its node's agent came back as a new instance
        # without it: the process went with the old agent (`_check_vanished`).
        self._vanishing: dict[tuple[str, int, str], float] = {}
        self._inbox: asyncio.Queue[Item] = asyncio.Queue()
        # State and the log have one writer at a time: an inbox item being handled, or
        # a scheduling pass applying its decisions (decide() itself runs outside it).
        self._writer = asyncio.Lock()
        # State changed since the last pass began: one more pass is due.
        self._dirty = True
        self._pass_wanted = asyncio.Event()
        # Set while the inbox loop waits for an item with none queued.
        self._inbox_idle = asyncio.Event()
        self._last_decide_s = 0.0
        # How late the last tick woke up: how far behind the event loop runs.
        self._loop_lag_s = 0.0
        # When the last decide() asked to be called again, even if nothing happens.
        self._wake_at: float | None = None
        self._exec_key = b""  # the cluster's key for worker starts (brain/secrets.py)
        self.credentials = (
            JobCredentials(load_signer(self.config.callout_seed), self._cluster_key, self._running)
            if self.config.callout_seed is not None
            else None
        )
        self._record_counter = 0
        self._leader_tasks: list[asyncio.Task[None]] = []
        self._leader_subs: list[Subscription] = []
        self._events: Consumer | None = None
        self._election: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._taking_over = False
        self._stepping_down = False
        # Loops end on this flag, not on cancellation alone: nats-py turns a
        # cancellation into ConnectionClosedError once the connection is closed.
        self._closing = False
        self.preemptions = 0
        # Read-only observers (metrics, profiles, the HTTP event stream). They run in
        # the brain's loop and must not block or raise; they never change state.
        self.telemetry_observers: list[Callable[[TelemetryBatch], None]] = []
        self.record_observers: list[Callable[[StateRecord, int], None]] = []
        self.decision_observers: list[Callable[[Decisions], None]] = []
        # Running jobs' utilisation profiles, from telemetry; the snapshot carries them.
        self.profiles = Profiler(
            lambda: self.state.jobs_in(JobState.RUNNING),
            store=ProfileStore(profiles_path(self.config.history_path)),
            clock=clock,
        )
        self.telemetry_observers.append(self.profiles.observe)
        self.record_observers.append(self.profiles.on_record)
        # Elastic jobs' throughput per world size, from their supervisors' reports.
        self.progress = ProgressTracker()
        self.record_observers.append(self.progress.on_record)
        # Records staged by the writer, stored as one group per unit of work.
        self.journal = Journal(bus, self.history, lambda: self.state, self.record_observers)

    @property
    def state(self) -> BrainState:
        return self.replica.state

    @property
    def telemetry(self) -> dict[str, TelemetryBatch]:
        """Each node's latest telemetry batch."""
        return self.ingest.latest_telemetry

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Come up as a standby with the log's state; the election makes it lead."""

        self.api = ApiServer(self)
        await self.bus.ensure_streams()
        # A telemetry flood may make the server cut this connection; the lease, the
        # log, commands, events and the API live on `bus` and do not go with it.
        self.ingest_bus = await self.bus.sibling(f"{self.bus.component}:ingest")
        await self.lease.open()
        await self.replica.load()
        self.replica.follow()
        self._election = self.bus.spawn(self._elect_forever(), name="brain-election")
        log.info(
            "brain %s up: %d jobs and %d nodes at seq %d; policy %s; queues %s",
            self.instance,
            len(self.state.jobs),
            len(self.state.nodes),
            self.state.last_seq,
            self.config.policy.describe(),
            queue_config.describe(self.config.queues),
        )

    async def stop(self) -> None:
        self._closing = True
        if self._election is not None:
            self._election.cancel()
            await asyncio.wait({self._election}, timeout=3.0)
        await self._stop_leading("brain shutting down")
        await self.lease.release()
        await self.replica.stop_following()
        if self.ingest_bus is not self.bus:
            await self.ingest_bus.close()
        self.history.close()
        self.profiles.close()

    def info(self) -> BrainInfo:
        return BrainInfo(
            brain_id=self.instance,
            host=self.host,
            pid=os.getpid(),
            since=self.started_at,
            http=self.config.http_address,
            leader=self.leading.is_set(),
        )

    async def _elect_forever(self) -> None:
        while not self._closing:
            try:
                idle = not (self._taking_over or self._stepping_down)
                if not self.leading.is_set() and idle:
                    epoch = await self.lease.try_acquire(self.info())
                    if epoch is not None:
                        # Renew from now on, however long taking over lasts.
                        self._renewer = self.bus.spawn(self._renew_forever(), name="lease")
                        self._taking_over = True
                        try:
                            await self._lead(epoch)
                        except Exception:
                            if not self.leading.is_set():
                                # Not leading after all: let the lease go, or nobody
                                # would lead while this brain's renewer kept it.
                                await self._let_lease_go()
                            raise
                        finally:
                            self._taking_over = False
                await self.lease.announce(self.info())
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("election round failed: %r", error)
            await asyncio.sleep(self.config.lease_ttl_s / 10)

    async def _renew_forever(self) -> None:
        renewed_at = self.monotonic()
        while self.lease.epoch is not None and not self._closing:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            try:
                if not await self.lease.renew(self.info()):
                    await self._stop_leading("the lease was lost")
                    return
                renewed_at = self.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("lease renewal failed: %r", error)
                if self.monotonic() - renewed_at > self.config.lease_ttl_s:
                    # Unrenewed past its TTL the lease is surely gone: stop acting now.
                    self.lease.epoch = self.lease.revision = None
                    await self._stop_leading("could not renew the lease")
                    return

    async def _let_lease_go(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()
        await self.lease.release()

    async def _lead(self, epoch: int) -> None:
        await self.replica.stop_following()
        if self.journal.tainted:
            # The last tenure's state ran ahead of the log and could not be read again
            # then (cut off from NATS, say): it must be before this one begins.
            await self.replica.reload()
            self.journal.tainted = False
        caught_up = await self.replica.catch_up()
        self.epoch = epoch
        now = self.monotonic()
        self.ingest.reset()
        for node in self.state.nodes.values():
            # Liveness is not in the log: every known node gets a fresh grace period.
            self.ingest.expect(node.name, node.instance, now)
        ingest = self.ingest_bus
        self._leader_subs = [
            await ingest.subscribe(subjects.ALL_HEARTBEATS, Heartbeat, self._on_heartbeat),
            await ingest.subscribe(
                subjects.ALL_TELEMETRY,
                TelemetryBatch,
                self._on_telemetry,
                # Shed telemetry, never heartbeats, when the brain falls behind.
                pending_msgs_limit=TELEMETRY_PENDING_MSGS,
                pending_bytes_limit=TELEMETRY_PENDING_BYTES,
                accept=self._takes_telemetry,
            ),
            await self.bus.subscribe(subjects.ALL_JOB_PROGRESS, Progress, self._on_progress),
            await self.api.serve(),
        ]
        if self.credentials is not None:  # the leader admits jobs: it knows which run
            self._leader_subs.append(await self.credentials.serve(self.bus))
        # Named apart from the node-events-only consumer ("brain") of earlier versions,
        # whose filter cannot change: a brain upgraded in place reads the EVENTS stream
        # again from its start, harmlessly (each effect checks the attempt).
        self._events = await self.bus.consume(
            subjects.STREAM_EVENTS, "brain-events", subjects.ALL_EVENTS, NODE_EVENT, self._on_event
        )
        self._leader_tasks = [
            self.bus.spawn(self._run(), name="brain-loop"),
            self.bus.spawn(self._schedule_forever(), name="brain-scheduler"),
            self.bus.spawn(self._tick_forever(), name="brain-tick"),
            self.bus.spawn(
                self.hearing.watch(self.ingest_bus, every_s=self.config.tick_s),
                name="brain-hearing",
            ),
        ]
        self._dirty = True
        self._pass_wanted.set()
        self.leading.set()
        if self.lease.epoch != epoch:
            # The renewer gave the lease up while this takeover waited on the bus.
            await self._stop_leading("the lease was lost while taking over")
            return
        async with self._unit():
            await self._resend_unconfirmed_launches()
            await self._resend_staged_resizes()
        log.info(
            "brain %s leads with epoch %d (caught up %d entries, seq %d)",
            self.instance,
            epoch,
            caught_up,
            self.state.last_seq,
        )

    async def _resend_unconfirmed_launches(self) -> None:
        """A brain may have died between journaling a placement and commanding it.

        Re-sending is safe: the command id is the same, so JetStream drops it if it
        was stored, and agents ignore a launch they have already run.
        """
        for job in self.state.jobs_in(JobState.RUNNING):
            if not self.leading.is_set():
                return  # stepped down meanwhile: the next leader re-sends them
            if any(g.pid is None and not g.exited for g in job.grants):
                await self._send_launches(job)

    async def _stop_leading(self, reason: str) -> None:
        if not self.leading.is_set():
            if self._renewer is not None and self._renewer is not asyncio.current_task():
                self._renewer.cancel()
            self._renewer = None
            return
        log.warning("brain %s stops leading: %s", self.instance, reason)
        self.leading.clear()
        # Take this tenure's parts before the first await, and hold the election off
        # until they are let go: otherwise a tenure begun meanwhile (the lease came
        # back) would have its own parts torn down and keep this one's loop at epoch 0.
        self._stepping_down = True
        self.epoch = 0
        current = asyncio.current_task()
        subs, events = self._leader_subs, self._events
        others = [t for t in (*self._leader_tasks, self._renewer) if t and t is not current]
        self._leader_subs, self._leader_tasks, self._renewer, self._events = [], [], None, None
        try:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            if events is not None:
                await events.stop()
            for task in others:
                task.cancel()
            if others:
                await asyncio.wait(others, timeout=3.0)
            while not self._inbox.empty():
                item = self._inbox.get_nowait()
                if item.done is not None and not item.done.done():
                    error = ApiError("unavailable", f"brain stepped down: {reason}")
                    item.done.set_exception(error)
            self.journal.discard()  # staged by a unit cut short: never stored
            if self.journal.tainted:
                # State ran ahead of the log (a group not stored): read it all again.
                try:
                    await self.replica.reload()
                    self.journal.tainted = False
                except Exception as error:  # cut off from NATS, say: before leading again
                    log.warning("reading state again failed (%r); retried before leading", error)
        finally:
            self._stepping_down = False
        if not self.journal.tainted:  # else its state is read again before it leads
            self.replica.follow()

    async def _maybe_snapshot(self) -> None:
        if self.state.last_seq - self.replica.snapshot_seq < self.config.snapshot_every:
            return
        # Stored in the background (encoded in a thread), one at a time: the loop goes on.
        self.replica.write_snapshot_soon(taken_at=self.clock(), epoch=self.epoch)

    # -- inbound ---------------------------------------------------------------------

    async def _on_heartbeat(self, beat: Heartbeat, msg: Msg) -> None:
        if not await self._from_own_node(beat.node, msg):
            return
        news = self.ingest.heartbeat(beat, self.monotonic(), msg.data)
        if news is not None:
            # Only news reaches the inbox: a heartbeat that changes nothing moved the
            # node's last-seen time and is done.
            await self._inbox.put(HeartbeatNews(news))

    async def _on_telemetry(self, batch: TelemetryBatch, msg: Msg) -> None:
        if await self._from_own_node(batch.node, msg):
            self.ingest.telemetry(batch)
            self._notify(self.telemetry_observers, batch)

    async def _on_progress(self, report: Progress, msg: Msg) -> None:
        """A job's supervisor reports; only a running job's, on its own subject."""
        token = msg.subject.split(".")[2] if msg.subject.count(".") >= 3 else ""
        if token != report.job_id:
            reason = f"payload names job {report.job_id!r} but the subject is {token!r}"
            await self.bus.dead_letter(msg.subject, msg.data, reason)
            return
        job = self.state.jobs.get(report.job_id)
        if job is None or job.state is not JobState.RUNNING:
            return
        if report.attempt is not None and report.attempt != job.attempt:
            return  # an earlier run's supervisor, still stopping: not this run's news
        if self.progress.observe(report):
            self._dirty = True  # a first report, or a first at this size: news for policy

    async def _on_event(self, event: NodeEvent, msg: Msg) -> None:
        if msg.subject.startswith(f"{subjects.PREFIX}.job."):
            # A job's own report: only of kinds a job may make, about itself.
            refusal = job_event_refusal(msg.subject, event)
            if refusal is not None:
                await self.ingest_bus.dead_letter(msg.subject, msg.data, refusal)
                return
        elif not await self._from_own_node(event.node, msg):
            return
        try:
            await self.submit_item(EventArrived(event))
        except ApiError as error:
            if error.code != "unavailable":
                raise
            raise HandBack(error.message) from None  # the next leader records it

    async def _cluster_key(self) -> bytes:
        if not self._exec_key:  # read (or made) when first needed, not at start
            self._exec_key = await secrets.exec_key(self.bus)
        return self._exec_key

    def _running(self, job_id: str, attempt: int) -> bool:
        """Whether this attempt runs (its job's NATS token admits it only then)."""
        job = self.state.jobs.get(job_id)
        return job is not None and job.attempt == attempt and job.state is JobState.RUNNING

    async def _from_own_node(self, node: str, msg: Msg) -> bool:
        """A node speaks only for itself: the payload's node must be the subject's."""
        token = msg.subject.split(".")[2] if msg.subject.count(".") >= 3 else ""
        if token != node:
            await self.ingest_bus.dead_letter(
                msg.subject, msg.data, f"payload names node {node!r} but the subject is {token!r}"
            )
            return False
        return True

    async def submit_item(self, item: Item) -> object:
        item.done = asyncio.get_running_loop().create_future()
        await self._inbox.put(item)
        return await item.done

    async def call(self, tenant: str, request: WriteRequest, *, operator: bool = False) -> object:
        """Handle an API request that writes, as the writer; answered once stored."""
        return await self.submit_item(ApiCall(tenant, request, operator))

    async def _tick_forever(self) -> None:
        while not self._closing:
            due = self.monotonic() + self.config.tick_s
            await asyncio.sleep(self.config.tick_s)
            self._loop_lag_s = max(0.0, self.monotonic() - due)
            await self._inbox.put(Tick())

    def _takes_telemetry(self) -> bool:
        """False while the brain is behind: telemetry is what it sheds first."""
        return (
            self._loop_lag_s <= SHED_TELEMETRY_LAG_S and self._inbox.qsize() < SHED_TELEMETRY_INBOX
        )

    async def _run(self) -> None:
        """Handle the inbox in order, in groups: what is queued when the loop comes
        round (up to GROUP_MAX items) is handled as one unit, its records committed as
        one group, and only then is each caller answered. Scheduling happens in
        `_schedule_forever`, off this path."""
        while True:
            if self._inbox.empty():
                self._inbox_idle.set()
            batch = [await self._inbox.get()]
            self._inbox_idle.clear()
            while len(batch) < GROUP_MAX and not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            try:
                async with self._unit():
                    outcomes = [await self._outcome(item) for item in batch]
            except Exception as error:
                # The group was not stored (or not known to be): nobody is acknowledged,
                # and state, ahead of the log, is loaded again after stepping down.
                for item in batch:
                    if item.done is not None and not item.done.done():
                        item.done.set_exception(ApiError("unavailable", "brain lost leadership"))
                reason = f"the log did not take a group of {len(batch)} items: {error!r}"
                self.bus.spawn(self._stop_leading(reason), name="step-down")
                return
            for item, (result, failure) in zip(batch, outcomes, strict=True):
                if item.done is None or item.done.done():
                    continue
                if failure is None:
                    item.done.set_result(result)
                else:
                    item.done.set_exception(failure)
            if self._dirty:
                self._pass_wanted.set()

    async def _outcome(self, item: Item) -> tuple[object, BaseException | None]:
        """Handle one item of a group: its result, or what it failed with."""
        try:
            return await self._handle(item), None
        except ApiError as error:
            return None, error
        except Exception as error:
            if self.journal.tainted:
                raise  # a commit within the unit failed: the whole group is lost
            log.exception("brain failed handling %s", type(item).__name__)
            return None, error

    async def _schedule_forever(self) -> None:
        """Scheduling passes, coalesced: at most one runs at a time, and the next starts
        once state has changed since the last began, however many changes that was."""
        while True:
            await self._pass_wanted.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inbox_idle.wait(), PASS_WAITS_FOR_INBOX_S)
            self._pass_wanted.clear()
            try:
                await self._schedule()
            except Exception as error:
                if self.journal.tainted:
                    # The pass's group was not stored: state is ahead of the log.
                    reason = f"a scheduling pass's group was not stored: {error!r}"
                    self.bus.spawn(self._stop_leading(reason), name="step-down")
                    return
                leaving = isinstance(error, ApiError) and not self.leading.is_set()
                if not leaving:  # else: leadership ended mid-pass; the next plans anew
                    log.exception("scheduling cycle failed")
            if self._dirty:
                self._pass_wanted.set()

    async def _handle(self, item: Item) -> object:
        match item:
            case HeartbeatNews(news=news):
                try:
                    await self._heartbeat(news.beat)
                except BaseException:
                    # Not handled: the node's next heartbeat must be news again.
                    self.ingest.unsettle(news.beat.node)
                    raise
            case EventArrived(event=event):
                await self._event(event)
            case Tick():
                await self._tick()
            case ApiCall(tenant=tenant, request=request, operator=operator):
                return await self._write(tenant, request, operator=operator)
        return None

    async def _tick(self) -> None:
        await self._check_nodes()
        await self._reconcile_all()
        await self._check_vanished()
        await self._check_launches()
        await self._check_preruns()
        await self._check_resizes()
        if self._wake_at is not None and self.clock() >= self._wake_at:
            # decide() asked to be called again by now (a retry back-off ending).
            self._wake_at = None
            self._dirty = True
        # A snapshot covers stored records only: what this unit staged goes first.
        await self.journal.commit()
        await self._maybe_snapshot()
        # A profile that changed what policy sees (e.g. a job turned underused).
        self._dirty = self.profiles.poll() or self._dirty

    async def _write(self, tenant: str, request: WriteRequest, *, operator: bool) -> object:
        match request:
            case SubmitRequest():
                return await self._submit(tenant, request)
            case CancelRequest(job_id=job_id):
                return await self._cancel(tenant, job_id)
            case DrainRequest():
                await self._drain(tenant, request)
            case ResumeRequest():
                await self._resume(tenant, request)
            case BlacklistRequest():
                await self._edit_blacklist(tenant, request)
            case ResizeRequest():
                return await self._resize_request(tenant, request, operator=operator)
        return None

    # -- journal ---------------------------------------------------------------------

    def _record_id(self) -> str:
        self._record_counter += 1
        return f"{self.instance}-{self._record_counter}"

    async def _append(self, record: StateRecord, subject: str) -> None:
        """Apply now and stage for the unit's commit (brain/journal.py): stored, fenced,
        before any command that follows it goes out and before any caller is answered."""
        if not self.leading.is_set():
            raise ApiError("unavailable", "this brain is not the leader")
        assert self._writer.locked(), "records are staged by the writer only"
        self.journal.stage(record, subject)

    @contextlib.asynccontextmanager
    async def _unit(self) -> AsyncIterator[None]:
        """A unit of work as the writer: what it stages is committed as one group
        before the writer is let go. A failed commit means state ran ahead of the log:
        this brain steps down and loads it again (SequenceConflict, BusTimeout, ...)."""
        async with self._writer:
            try:
                yield
            finally:
                if self.journal.dirty and self.leading.is_set():
                    await self.journal.commit()
                elif self.journal.dirty:
                    self.journal.discard()  # left leading halfway: nothing may go out

    async def _job_changed(self, job: JobRecord, previous: JobState | None, cause: Cause) -> None:
        job = self._account(job)
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

    def _account(self, job: JobRecord) -> JobRecord:
        """Fold a run that is ending into the job's service, and note when a job starts
        waiting: every transition passes here, so no path can forget it."""
        old = self.state.jobs.get(job.job_id)
        now = self.clock()
        update: dict[str, object] = {}
        if (
            old is not None
            and old.state is JobState.RUNNING
            and job.state is not JobState.RUNNING
            and old.started_at is not None
        ):
            ran = max(0.0, now - old.started_at)
            # GPU-seconds at the size it ran at last (earlier sizes are counted already).
            at_size = current_size_s(old, now)
            update["attained_gpu_seconds"] = old.attained_gpu_seconds + at_size * old.gpu_count
            update["executed_seconds"] = old.executed_seconds + ran
        elif (
            old is not None
            and old.state is JobState.RUNNING
            and job.state is JobState.RUNNING
            and job.attempt == old.attempt
            and job.gpu_count != old.gpu_count
        ):
            # An elastic job changed size within its run: count the size it leaves.
            at_size = current_size_s(old, now)
            update["attained_gpu_seconds"] = old.attained_gpu_seconds + at_size * old.gpu_count
            update["resized_at"] = now
        if job.state is not JobState.RUNNING and job.resize is not None:
            update["resize"] = None  # a run that ends takes its staged resize with it
        if job.state is not JobState.RUNNING and job.last_resize_at is not None:
            update["last_resize_at"] = update["last_resize_s"] = None  # a new run, new sizes
        if job.state is JobState.PENDING and (old is None or old.state is not JobState.PENDING):
            update["pending_since"] = now
        return job.model_copy(update=update) if update else job

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
            record_id=self._record_id(), ts=self.clock(), epoch=self.epoch, event=event
        )
        await self._append(record, subjects.state_node(event.node))

    # -- commands --------------------------------------------------------------------

    async def _command(self, node: str, command: NodeCommand) -> None:
        """Sent once the records staged before it are stored (at the unit's commit)."""
        assert self._writer.locked(), "commands are sent by the writer only"
        self.journal.send_after(subjects.node(node, "cmd"), command, command.command_id)

    async def _stop(self, job_id: str, node: str, reason: str, attempt: int | None) -> None:
        if not self.leading.is_set():
            return  # stepping down mid-unit: only a leader (with an epoch) commands
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

    async def _submit(self, tenant: str, request: SubmitRequest) -> JobRecord:
        spec = request.spec
        check_tenant(self.config.tenants, tenant)
        if request.idempotency_key is not None:
            known = self.state.job_for_key(tenant, request.idempotency_key)
            if known is not None:
                return known
            away = self.state.job_away_for_key(tenant, request.idempotency_key)
            if away is not None and (finished := self.job_record(away)) is not None:
                return finished  # finished long ago: answered from the history
        # Against every registered GPU, not only those up right now: a job must not be
        # refused because nodes are briefly away (a NATS restart, a network blip).
        total, largest = self.state.registered_gpus()
        if self.state.nodes and spec.gpus > total:
            raise ApiError(
                "invalid",
                f"job asks for {spec.gpus} GPUs but the cluster has {total} "
                f"({len(self.state.nodes)} nodes, at most {largest} on one node)",
            )
        demand = job_demand(spec)
        if demand is not None:
            never = never_fits(demand, spec.gpus, self.state.registered_views())
            if never is not None:
                raise ApiError("invalid", f"no node could ever run this job: {never}")
        job = JobRecord(
            job_id=self.state.next_job_id(),
            tenant=tenant,
            spec=spec,
            state=JobState.PENDING,
            submitted_at=self.clock(),
            reason="submitted",
            idempotency_key=request.idempotency_key,
            prerun="pending" if self.config.failures.wants_prerun(spec.queue, spec.gpus) else None,
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
        job = self.job_record(job_id)
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
        """A heartbeat with news (brain/ingest.py): journal what changed, reconcile."""
        now = self.monotonic()
        known = self.state.nodes.get(beat.node)
        if known is not None and known.instance != beat.instance:
            self._agent_restarted(beat, now)
        drain_reason = known.drain_reason if known is not None else None
        fresh = NodeRecord(
            name=beat.node,
            state=NodeState.DRAINED if drain_reason else NodeState.READY,
            hostname=beat.hostname,
            backend=beat.backend,
            instance=beat.instance,
            gpus=beat.gpus,
            joined_at=known.joined_at if known is not None else self.clock(),
            drain_reason=drain_reason,
            drained_gpus=known.drained_gpus if known is not None else (),
            cpu_milli=beat.cpu_milli,
            memory_mib=beat.memory_mib,
        )
        if known is None or known.instance != beat.instance:
            self._check_fence(beat)
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

    def _agent_restarted(self, beat: Heartbeat, now: float) -> None:
        """A new agent instance does not know the processes of the old one (it stops any
        it finds left over): attempts it does not report are suspects. They are failed
        a node timeout later, if no exit from the old instance has arrived by then."""
        reported = {(r.job_id, r.attempt) for r in beat.running}
        for job in self.state.running_on(beat.node):
            grant = next(g for g in job.grants if g.node == beat.node)
            known = (job.job_id, job.attempt) in reported
            if grant.pid is not None and not grant.exited and not known:
                self._vanishing.setdefault((job.job_id, job.attempt, beat.node), now)

    async def _check_vanished(self) -> None:
        now = self.monotonic()
        for key, since in list(self._vanishing.items()):
            if now - since < self.config.node_timeout_s:
                continue
            del self._vanishing[key]
            job_id, attempt, node = key
            job = self._current(job_id, attempt, node)
            if (
                job is None
                or not self.ingest.known(node)
                or (job_id, attempt) in self.ingest.running(node)
            ):
                continue
            if any(g.exited for g in job.grants if g.node == node):
                continue
            await self._fail_attempt(
                job,
                node,
                Classification(
                    FailureClass.INFRASTRUCTURE,
                    f"the agent of node {node} restarted and attempt {attempt}'s process "
                    "went with the old agent",
                ),
            )

    async def _reconcile_all(self) -> None:
        """Reconcile every node that reports processes: a heartbeat that changes nothing
        is not handed to the loop, and what the brain holds may have changed since."""
        for beat in list(self.ingest.reporting(self.monotonic())):
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

    async def _drain(self, operator: str, request: DrainRequest) -> None:
        """Take a node's GPUs out of scheduling; what runs there goes on. A drained node
        stays drained through being lost and returning, until it is resumed."""
        node = self._known_node(request.node)
        if request.gpu is not None:
            await self._drain_gpu(node, request.gpu, f"drained by {operator}: {request.reason}")
            return
        if node.drain_reason == request.reason:
            return
        await self._node_changed(
            node.model_copy(
                update={
                    "state": NodeState.DRAINED if node.state is NodeState.READY else node.state,
                    "drain_reason": request.reason,
                }
            ),
            node.state,
            Cause(
                kind=CauseKind.NODE_DRAINED,
                node=node.name,
                message=f"drained by {operator}: {request.reason}",
            ),
        )

    async def _resume(self, operator: str, request: ResumeRequest) -> None:
        node = self._known_node(request.node)
        if node.drain_reason is None and not node.drained_gpus:
            raise ApiError("conflict", f"node {node.name} is not drained")
        await self._node_changed(
            node.model_copy(
                update={
                    "state": NodeState.READY if node.state is NodeState.DRAINED else node.state,
                    "drain_reason": None,
                    "drained_gpus": (),
                }
            ),
            node.state,
            Cause(
                kind=CauseKind.NODE_RESUMED,
                node=node.name,
                message=f"resumed by {operator}: its GPUs are schedulable again",
            ),
        )

    def _known_node(self, name: str) -> NodeRecord:
        node = self.state.nodes.get(name)
        if node is None:
            raise ApiError("not_found", f"no node {name}")
        return node

    async def _check_nodes(self) -> None:
        if self.hearing.deaf_within(self.config.node_timeout_s):
            return  # heartbeats may have been sent and lost on our side: judge none
        for name, silent in list(self.ingest.silent(self.monotonic())):
            node = self.state.nodes.get(name)
            if node is None:
                continue
            # A drained node can be lost too: its running jobs must be taken back.
            if node.state is not NodeState.LOST:
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
                # Not before its agent has fenced it: never two attempts at once.
                unheard_for = self._fenced_after(job)
                if silent < unheard_for:
                    continue
                await self._fail_attempt(
                    job,
                    name,
                    Classification(
                        FailureClass.INFRASTRUCTURE,
                        f"node {name} was lost (no heartbeat for {silent:.1f}s; its agent "
                        f"stops the job after {unheard_for - self.config.fence_margin_s:g}s "
                        f"without NATS, margin {self.config.fence_margin_s:g}s)",
                    ),
                )

    def _check_fence(self, beat: Heartbeat) -> None:
        """Say so when a node's agent may run its jobs on past the moment this brain
        runs them elsewhere (docs/operations.md, "Partitions")."""
        limit = self.config.node_timeout_s + self.config.fence_margin_s
        if beat.fence_s is None:
            log.warning(
                "node %s does not fence itself: a partition of it may run its jobs twice",
                beat.node,
            )
        elif beat.fence_s >= limit:
            log.warning(
                "node %s stops its jobs %gs after losing NATS, not before this brain runs "
                "them elsewhere (node timeout + fence margin = %gs): a partition of it may "
                "run them twice",
                beat.node,
                beat.fence_s,
                limit,
            )

    def _fenced_after(self, job: JobRecord) -> float:
        """How long a job's node must be silent before the job may run elsewhere."""
        if job.spec.on_disconnect == "keep":
            return self.config.keep_disconnected_s + self.config.fence_margin_s
        return self.config.node_timeout_s + self.config.fence_margin_s

    async def _check_launches(self) -> None:
        """Requeue a job whose launch a node never confirmed nor refused."""
        now = self.clock()
        for job in self.state.jobs_in(JobState.RUNNING):
            if job.started_at is None or now - job.started_at < self.config.launch_ttl_s + 5:
                continue
            for grant in job.grants:
                if grant.pid is not None or grant.exited:
                    continue
                if grant.node in elastic.joining(job):
                    continue  # launched by a grow: the resize's own timeout covers it
                if (job.job_id, job.attempt) in self.ingest.running(grant.node):
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
        if event.event_id in self.state.seen_events:
            return  # redelivered (a brain died before acknowledging it): done already
        # Effects first, the record last: the record marks the event done, so a brain
        # that dies in between leaves it undone, and its successor, handed the event
        # again, applies it (each effect checks the attempt, so twice is harmless).
        if isinstance(event, JobStarted):
            await self._job_started(event)
        elif isinstance(event, JobExited):
            await self._job_exited(event)
        elif isinstance(event, LaunchFailed):
            await self._launch_failed(event)
        elif isinstance(event, CommandRejected):
            await self._command_rejected(event)
        elif isinstance(event, GpuFault):
            await self._gpu_fault(event)
        elif isinstance(event, InputError):
            await self._input_error(event)
        elif isinstance(event, ResizeCompleted):
            await self._resize_completed(event)
        await self._event_recorded(event)
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
            # An elastic job across nodes ends with its supervisor (the first node's
            # process): its worker hosts on the others run until they are stopped.
            supervised = job.spec.elastic and event.node == job.grants[0].node
            if supervised or all(g.exited for g in updated.grants):
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
                if supervised:
                    await self._stop_parts(
                        updated, "the job's supervisor finished", except_node=event.node
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
        end = AttemptEnd(
            exit_code=event.exit_code,
            signal=event.signal,
            log_tail=event.log_tail,
            runtime_s=event.runtime_s,
            oom_limit_mb=event.oom_limit_mb,
            gpu_memory_over=(
                (event.gpu_memory_used_mib or 0.0, event.gpu_memory_limit_mib)
                if event.gpu_memory_limit_mib is not None
                else None
            ),
        )
        reported = self.state.input_reports.get((job.job_id, job.attempt))
        await self._fail_attempt(updated, event.node, classify(end, (), reported), end)

    async def _launch_failed(self, event: LaunchFailed) -> None:
        job = self._current(event.job_id, event.attempt, event.node)
        if job is None:
            return
        why = f"the job's worker host did not start on {event.node}: {event.reason}"
        if await self._join_failed(job, event.node, why):
            return
        updated = self._with_grant(job, event.node, exited=True)
        cause = Cause(
            kind=CauseKind.LAUNCH_FAILED,
            node=event.node,
            job_id=job.job_id,
            message=f"launch failed on {event.node}: {event.reason}",
        )
        failure_class = FailureClass.INFRASTRUCTURE if event.retryable else FailureClass.USER
        await self._fail_attempt(updated, event.node, Classification(failure_class, cause.message))

    async def _command_rejected(self, event: CommandRejected) -> None:
        log.warning("node %s rejected %s: %s", event.node, event.command_id, event.reason)
        if event.job_id is None or not event.command_id.startswith("launch-"):
            return
        job = self.state.jobs.get(event.job_id)
        if job is None or job.state is not JobState.RUNNING:
            return
        if event.command_id != _launch_id(job.job_id, job.attempt, event.node):
            return
        why = f"node {event.node} refused the job's worker host: {event.reason}"
        if not await self._join_failed(job, event.node, why):
            await self._requeue(
                job,
                Cause(
                    kind=CauseKind.LAUNCH_FAILED,
                    node=event.node,
                    job_id=job.job_id,
                    message=f"node {event.node} refused the launch: {event.reason}",
                ),
            )

    # -- failures (brain/core/failures.py decides; this journals and commands) -------

    async def _fail_attempt(
        self,
        job: JobRecord,
        node: str,
        classification: Classification,
        end: AttemptEnd | None = None,
    ) -> None:
        """Record a failed attempt with its class, then retry it or end it."""
        now = self.clock()
        user = classification.failure_class is FailureClass.USER
        failure = AttemptFailure(
            attempt=max(1, job.attempt),
            failure_class=classification.failure_class,
            reason=classification.reason,
            nodes=job.nodes or (node,),
            at=now,
            exit_code=end.exit_code if end is not None else None,
            signal=end.signal if end is not None else None,
            input_uri=classification.input_uri,
            log_tail=end.log_tail[-5:] if end is not None and user else (),
        )
        failures = (*job.failures, failure)
        decision = decide_retry(
            failures,
            job.spec.queue,
            now,
            self.config.failures,
            blacklisted=frozenset(self.state.blacklist),
        )
        what = f"{classification.failure_class.value} failure on {node}: {classification.reason}"
        if isinstance(decision, GiveUp):
            kind = (
                CauseKind.RETRIES_EXHAUSTED
                if decision.state is JobState.UNSUCCESSFUL
                else CauseKind.FAILURE_CLASSIFIED
            )
            ended = job.model_copy(
                update={
                    "state": decision.state,
                    "finished_at": now,
                    "exit_code": failure.exit_code,
                    "signal": failure.signal,
                    "failures": failures,
                    "reason": decision.cause,
                }
            )
            cause = Cause(
                kind=kind, node=node, job_id=job.job_id, message=f"{what}; {decision.cause}"
            )
            await self._job_changed(ended, job.state, cause)
            await self._stop_parts(job, f"failed: {classification.reason}", except_node=node)
            return
        pending = job.model_copy(
            update={
                "state": JobState.PENDING,
                "grants": (),
                "started_at": None,
                "failures": failures,
                "not_before": decision.not_before,
                "avoid_nodes": decision.avoid_nodes,
                # A pre-run that failed for reasons not its own tries its pre-run again.
                "prerun": "pending" if job.prerun == "running" else job.prerun,
                "reason": f"{what}; {decision.cause}",
            }
        )
        cause = Cause(
            kind=CauseKind.RETRY_SCHEDULED,
            node=node,
            job_id=job.job_id,
            message=f"{what}; {decision.cause}",
        )
        await self._job_changed(pending, job.state, cause)
        await self._stop_parts(job, f"retrying elsewhere: {classification.reason}")

    async def _gpu_fault(self, event: GpuFault) -> None:
        """Critical faults drain the GPU or the node; jobs on it fail as infrastructure."""
        action = fault_action(event.fault, event.xid, event.gpu)
        node = self.state.nodes.get(event.node)
        if node is None or action.drain == "none":
            log.info("node %s: %s (drains nothing)", event.node, action.reason)
            return
        if action.drain == "node":
            affected = self.state.running_on(node.name)
            if node.drain_reason is None:
                await self._node_changed(
                    node.model_copy(
                        update={
                            "state": NodeState.DRAINED
                            if node.state is NodeState.READY
                            else node.state,
                            "drain_reason": action.reason,
                        }
                    ),
                    node.state,
                    Cause(kind=CauseKind.NODE_DRAINED, node=node.name, message=action.reason),
                )
        else:
            affected = [
                j
                for j in self.state.running_on(node.name)
                if any(g.node == node.name and event.gpu in g.gpus for g in j.grants)
            ]
            await self._drain_gpu(node, event.gpu, action.reason)
        for job in affected:
            await self._fail_attempt(
                job, node.name, Classification(FailureClass.INFRASTRUCTURE, action.reason)
            )

    async def _drain_gpu(self, node: NodeRecord, gpu: int, reason: str) -> None:
        if gpu not in {g.index for g in node.gpus}:
            raise ApiError("not_found", f"node {node.name} has no GPU {gpu}")
        if any(d.index == gpu for d in node.drained_gpus):
            return
        drained = (*node.drained_gpus, DrainedGpu(index=gpu, reason=reason, at=self.clock()))
        await self._node_changed(
            node.model_copy(update={"drained_gpus": drained}),
            node.state,
            Cause(kind=CauseKind.GPU_DRAINED, node=node.name, message=reason),
        )

    async def _input_error(self, event: InputError) -> None:
        """Count distinct jobs failing per input; blacklist the input at K of them."""
        if event.uri in self.state.blacklist:
            return
        # The event's own record is journaled after its effects: count its job here.
        jobs = self.state.input_failures.get(event.uri, set()) | {event.job_id}
        limit = self.config.failures.blacklist_after_jobs
        if len(jobs) < limit:
            return
        await self._set_blacklist(
            {
                **self.state.blacklist,
                event.uri: BlacklistEntry(
                    uri=event.uri,
                    reason=f"{len(jobs)} jobs failed on it (limit {limit}); last: {event.reason}",
                    jobs=tuple(sorted(jobs, key=job_sequence)),
                    added_at=self.clock(),
                    added_by="brain",
                ),
            },
            Cause(
                kind=CauseKind.BLACKLISTED,
                message=f"input {event.uri} blacklisted: jobs {', '.join(sorted(jobs))} "
                f"failed on it",
            ),
        )

    async def _edit_blacklist(self, operator: str, request: BlacklistRequest) -> None:
        uri = request.uri
        if uri is None:
            raise ApiError("invalid", f"blacklist {request.action} needs an input URI")
        entries = dict(self.state.blacklist)
        if request.action == "add":
            if uri in entries:
                return
            entries[uri] = BlacklistEntry(
                uri=uri, reason=request.reason, added_at=self.clock(), added_by=operator
            )
            cause = Cause(
                kind=CauseKind.BLACKLISTED,
                message=f"input {uri} blacklisted by {operator}: {request.reason}",
            )
        else:
            if entries.pop(uri, None) is None:
                raise ApiError("not_found", f"input {uri} is not blacklisted")
            cause = Cause(
                kind=CauseKind.UNBLACKLISTED, message=f"input {uri} removed by {operator}"
            )
        await self._set_blacklist(entries, cause)

    async def _set_blacklist(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None:
        record = BlacklistChanged(
            record_id=self._record_id(),
            ts=self.clock(),
            epoch=self.epoch,
            entries=tuple(entries.values()),
            cause=cause,
        )
        await self._append(record, subjects.STATE_BLACKLIST)
        self._dirty = True
        await self._retry_input_failures()

    async def _retry_input_failures(self) -> None:
        """A job that ended FAILED on an input now blacklisted runs again without it."""
        for job in self.state.jobs_in(JobState.FAILED):
            last = job.failures[-1] if job.failures else None
            if (
                last is None
                or last.failure_class is not FailureClass.INPUT
                or last.input_uri not in self.state.blacklist
            ):
                continue
            decision = decide_retry(
                job.failures,
                job.spec.queue,
                self.clock(),
                self.config.failures,
                blacklisted=frozenset(self.state.blacklist),
            )
            if isinstance(decision, GiveUp):
                continue
            await self._job_changed(
                job.model_copy(
                    update={
                        "state": JobState.PENDING,
                        "grants": (),
                        "started_at": None,
                        "finished_at": None,
                        "not_before": decision.not_before,
                        "reason": decision.cause,
                    }
                ),
                job.state,
                Cause(kind=CauseKind.RETRY_SCHEDULED, job_id=job.job_id, message=decision.cause),
            )

    async def _check_preruns(self) -> None:
        """A pre-run that survived its trial gives its GPU back and waits for the full
        allocation (Philly's pre-run: fail fast on one GPU)."""
        now = self.clock()
        trial = self.config.failures.prerun_s
        for job in self.state.jobs_in(JobState.RUNNING):
            if job.prerun != "running" or job.started_at is None or now - job.started_at < trial:
                continue
            if not all(g.pid is not None for g in job.grants):
                continue  # not started yet: its trial has not begun
            passed = job.model_copy(
                update={
                    "state": JobState.PENDING,
                    "grants": (),
                    "started_at": None,
                    "prerun": "passed",
                    "reason": f"pre-run passed after {trial:g}s",
                }
            )
            await self._job_changed(
                passed,
                job.state,
                Cause(
                    kind=CauseKind.PRERUN_PASSED,
                    job_id=job.job_id,
                    message=f"survived {trial:g}s on one GPU; now waits for {job.spec.gpus} GPUs",
                ),
            )
            await self._stop_parts(job, "pre-run passed")

    # -- elastic resizes (brain/elastic.py says what changes; this journals, commands) --

    def _free_by_node(self) -> dict[str, frozenset[int]]:
        """Each ready node's schedulable GPUs that no running job holds."""
        return self.state.free_gpus()

    def _free_on(self, node: str) -> frozenset[int]:
        return self._free_by_node().get(node, frozenset())

    async def _resize_request(
        self, tenant: str, request: ResizeRequest, *, operator: bool
    ) -> JobRecord:
        """`alnair resize JOB N`: pin the job at N and stage the resize, or say why
        not (nothing changes then). Answered once staged; the commit (or roll-back)
        follows when the supervisor answers. `alnair resize JOB auto` lifts the pin."""
        job = self.state.jobs.get(request.job_id)
        if job is None or (job.tenant != tenant and not operator):
            raise ApiError("not_found", f"no job {request.job_id} for tenant {tenant}")
        who = "an operator" if operator and job.tenant != tenant else f"tenant {tenant}"
        if request.gpus == "auto":
            return await self._unpin(job, who)
        ready = self.progress.heard_from(job.job_id)
        refused = elastic.check_resizable(job, request.gpus, supervisor_ready=ready)
        if refused is not None:
            raise ApiError(refused.code, refused.reason)
        if placement_size(elastic.current_placement(job)) == request.gpus:
            return await self._pin(job, request.gpus, who)  # already that size
        free = self._free_by_node()
        target = elastic.choose_target(job, request.gpus, free)
        if isinstance(target, elastic.ResizeRefused):
            raise ApiError(target.code, target.reason)
        refused = elastic.check_target(job, target, free)
        if refused is not None:
            raise ApiError(refused.code, refused.reason)
        pinned = job.model_copy(update={"pinned_gpus": request.gpus})
        return await self._stage_resize(
            pinned, target, f"asked by {who}, who pins it at {request.gpus} GPUs"
        )

    async def _pin(self, job: JobRecord, gpus: int, who: str) -> JobRecord:
        message = f"pinned at {gpus} GPUs by {who}: the policy leaves its size alone"
        return await self._set_pin(job, gpus, CauseKind.RESIZE_PINNED, message)

    async def _unpin(self, job: JobRecord, who: str) -> JobRecord:
        if not job.spec.elastic:
            raise ApiError("invalid", elastic.not_elastic(job))
        if job.state.terminal:
            raise ApiError("conflict", f"job {job.job_id} is {job.state.value}")
        low, high = job.spec.gpu_range
        message = (
            f"pin at {job.pinned_gpus} GPUs lifted by {who}: the policy sizes it again "
            f"within {low}..{high}"
        )
        return await self._set_pin(job, None, CauseKind.RESIZE_UNPINNED, message)

    async def _set_pin(
        self, job: JobRecord, gpus: int | None, kind: CauseKind, message: str
    ) -> JobRecord:
        """Journal the job's new pin (None: none); nothing when it is already so."""
        if job.pinned_gpus == gpus:
            return job
        await self._job_changed(
            job.model_copy(update={"pinned_gpus": gpus, "reason": message}),
            job.state,
            Cause(kind=kind, job_id=job.job_id, message=message),
        )
        return self.state.jobs[job.job_id]

    async def _apply_resize(self, job: JobRecord, action: Resize) -> None:
        """The policy's resize, staged if it still holds against the live state."""
        target = tuple(NodeGpus(node=g.node, gpus=tuple(sorted(g.gpus))) for g in action.grants)
        current = elastic.current_placement(job)
        if job.state is JobState.RUNNING and elastic.same_placement(target, current):
            return
        refused = elastic.check_resize(
            job,
            target,
            self._free_by_node(),
            supervisor_ready=self.progress.heard_from(job.job_id),
        )
        if refused is not None:
            log.debug("policy resize of job %s not staged: %s", job.job_id, refused.reason)
            return
        if action.retreat:
            # The size it leaves did not earn its keep: not grown back on this evidence.
            size = placement_size(current)
            job = job.model_copy(update={"gain_ceiling": size, "gain_ceiling_at": self.clock()})
        await self._stage_resize(job, target, action.cause)

    async def _stage_resize(
        self, job: JobRecord, target: elastic.Placement, cause: str
    ) -> JobRecord:
        command_id = f"resize-{job.job_id}-{job.attempt}-{uuid.uuid4().hex[:12]}"
        staged = elastic.stage(job, target, command_id=command_id, now=self.clock(), cause=cause)
        assert staged.resize is not None
        await self._job_changed(
            staged,
            job.state,
            Cause(
                kind=CauseKind.RESIZE_STAGED,
                node=staged.resize.node,
                job_id=job.job_id,
                message=f"resize {elastic.describe(staged.resize)} staged: {cause}",
            ),
        )
        current = self.state.jobs[job.job_id]
        if staged.resize.grow:
            # The added GPUs are the job's from now on: their nodes must know, and a
            # node new to the job starts its worker host (horovodrun's workers there
            # start through it).
            await self._regrant(current, command_id, "staged")
            await self._send_launches(current)
        await self._send_resize(current)
        return current

    async def _send_resize(self, job: JobRecord) -> None:
        command = elastic.resize_command(job, epoch=self.epoch, issued_at=self.clock())
        self.journal.send_after(subjects.job(job.job_id, "cmd"), command, command.command_id)

    async def _regrant(self, job: JobRecord, resize_id: str, phase: str) -> None:
        """Tell the job's nodes which of their GPUs the attempt holds now (a node whose
        part has not started yet learns them from its launch)."""
        for grant in job.grants:
            if grant.pid is None:
                continue
            await self._command(
                grant.node,
                Regrant(
                    # One id per node: JetStream de-duplicates across the stream.
                    command_id=f"regrant-{resize_id}-{phase}-{grant.node}",
                    epoch=self.epoch,
                    issued_at=self.clock(),
                    job_id=job.job_id,
                    attempt=job.attempt,
                    gpus=grant.gpus,
                    reason=f"resize {phase}",
                ),
            )

    async def _resend_staged_resizes(self) -> None:
        """A brain may have died between staging a resize and commanding it; the ids
        are the same, so the supervisor and the agent drop what they had already."""
        for job in self.state.jobs_in(JobState.RUNNING):
            if not self.leading.is_set():
                return  # stepped down meanwhile: the next leader re-sends them
            if job.resize is None:
                continue
            if job.resize.grow:
                await self._regrant(job, job.resize.command_id, "staged")
                await self._send_launches(job)
            await self._send_resize(job)

    async def _resize_completed(self, event: ResizeCompleted) -> None:
        job = self.state.jobs.get(event.job_id)
        staged = job.resize if job is not None else None
        if (
            job is None
            or job.state is not JobState.RUNNING
            or staged is None
            or staged.command_id != event.command_id
        ):
            log.info(
                "resize outcome %s of job %s matches no staged resize; ignored",
                event.command_id,
                event.job_id,
            )
            return
        if not event.ok:
            # A supervisor that tried (to_size differs) may have moved part of the way.
            moved = event.to_size != event.from_size
            await self._roll_back_resize(
                job, f"its supervisor refused: {event.reason}", revert=moved
            )
            return
        if event.from_size != staged.from_size:
            log.warning(
                "job %s: the supervisor resized from %d workers, the brain thought %d",
                job.job_id,
                event.from_size,
                staged.from_size,
            )
        now = self.clock()
        message = f"resized {elastic.describe(staged)} in {event.duration_s:.1f}s"
        kept = elastic.committed_placement(staged, event.placement)
        if event.placement and not elastic.same_placement(kept, event.placement):
            log.warning(
                "job %s: its supervisor says its workers hold GPUs %s, which does not fit "
                "the resize %s; keeping %s",
                job.job_id,
                describe_placement(event.placement),
                elastic.describe(staged),
                describe_placement(kept),
            )
        if not staged.grow:
            message += f"; GPUs {describe_placement(elastic.released(staged, kept))} released"
        committed = elastic.commit(job, message, event.placement).model_copy(
            update={"last_resize_at": now, "last_resize_s": max(0.0, now - staged.staged_at)}
        )
        await self._job_changed(
            committed,
            job.state,
            Cause(kind=CauseKind.RESIZED, node=staged.node, job_id=job.job_id, message=message),
        )
        if not staged.grow:
            # Its workers on the released GPUs have exited: they are free now (a node
            # the job left keeps its worker host, idle, holding none).
            await self._regrant(self.state.jobs[job.job_id], staged.command_id, "committed")

    async def _roll_back_resize(
        self, job: JobRecord, why: str, *, revert: bool, drop: str | None = None
    ) -> None:
        """Back to the size before. With `revert` (the supervisor may have moved part of
        the way: it tried, or never answered) the old size is staged as a resize of its
        own, the job holding every GPU of both sizes until the supervisor confirms it: a
        grow's new workers may run on the added GPUs. A revert rolled back in turn ends
        holding them all, and is not reverted again. `drop`: a node the grow added
        whose worker host could not start; the job's part there goes."""
        staged = job.resize
        assert staged is not None
        message = f"resize {elastic.describe(staged)} rolled back: {why}"
        held = describe_placement(job.placement)
        if revert and not staged.reverting:
            message += f"; GPUs {held} stay the job's until its supervisor is back at "
            message += f"{staged.from_size}"
            changed = elastic.stage_revert(job, message, now=self.clock())
        else:
            if staged.reverting:
                message += f"; the job keeps GPUs {held} (its workers may use them)"
            changed = elastic.roll_back(job, message)
        if job.pinned_gpus == staged.to_size and not staged.reverting:
            # The size an operator pinned it at could not be reached: the job goes back
            # to the policy rather than being held at a size it does not run at.
            message += f"; the pin at {staged.to_size} GPUs is lifted"
            changed = changed.model_copy(update={"pinned_gpus": None, "reason": message})
        if drop is not None:
            changed = elastic.drop_node(changed, drop)
        await self._job_changed(
            changed,
            job.state,
            Cause(
                kind=CauseKind.RESIZE_ROLLED_BACK,
                node=staged.node,
                job_id=job.job_id,
                message=message,
            ),
        )
        current = self.state.jobs[job.job_id]
        if current.resize is not None:
            await self._send_resize(current)
        elif staged.grow and not staged.reverting:
            await self._regrant(current, staged.command_id, "rolled-back")
        if drop is not None:
            await self._stop(job.job_id, drop, message, job.attempt)

    async def _join_failed(self, job: JobRecord, node: str, why: str) -> bool:
        """A launch failed on `node`: if it was a staged grow's worker host there, the
        grow fails, not the job (True)."""
        if node not in elastic.joining(job):
            return False
        await self._roll_back_resize(job, why, revert=False, drop=node)
        return True

    async def _check_resizes(self) -> None:
        """Roll back a resize its supervisor has not answered in time (it died, or never
        heard the command)."""
        now = self.clock()
        limit = self.config.resize_timeout_s
        for job in self.state.jobs_in(JobState.RUNNING):
            if job.resize is not None and now - job.resize.staged_at > limit:
                await self._roll_back_resize(
                    job, f"no answer from its supervisor within {limit:g}s", revert=True
                )

    # -- scheduling ------------------------------------------------------------------

    async def _schedule(self) -> None:
        """One pass: snapshot, decide() (in a worker thread when it is slow: the inbox
        goes on meanwhile, submissions are stored and answered), then apply the decisions
        as the writer, each checked against the state as it is by then."""
        async with self._writer:  # not halfway through a handler's records
            self._dirty = False
            snapshot = self.state.snapshot(
                profiles=self.profiles.current(),
                now=self.clock(),
                queues=self.config.queues,
                # Elastic jobs' throughput per size and progress, from their supervisors.
                progress=self.progress.current(),
                # Learned only for the orders that read it: a rebuild costs milliseconds.
                service_prior=self.config.service_prior
                if self.config.policy.order in DISTRIBUTION_AWARE
                else None,
            )
        started = self.monotonic()
        if self._last_decide_s > DECIDE_IN_THREAD_AFTER_S:
            decisions = await asyncio.to_thread(decide, snapshot, self.clock(), self.config.policy)
        else:
            decisions = decide(snapshot, self.clock(), self.config.policy)
        self._last_decide_s = self.monotonic() - started
        self._wake_at = decisions.wake_at
        self._notify(self.decision_observers, decisions)
        async with self._unit():
            await self._apply(decisions)

    async def _preempt(self, action: Preempt, job: JobRecord | None) -> bool:
        """Requeue the victim, only as decided: on those GPUs, its beneficiary waiting
        (decide() may have run in a thread while the inbox went on). True if it was."""
        if job is not None and self.state.on_lost_node(job):
            # Never a victim on a lost node: its stop cannot arrive, and it would be
            # requeued (and run elsewhere) before its agent fenced it. The node's loss
            # frees it in its time, and makes state dirty then.
            return False
        if job is None or not _still_holds(action, job, self.state.jobs):
            self._dirty = True  # decided on a state that has moved: decide again
            return False
        await self._requeue(
            job,
            Cause(
                kind=CauseKind.PREEMPTED,
                job_id=job.job_id,
                message=action.reason,
                preemption=_preemption(action),
            ),
        )
        self.preemptions += 1
        return True

    async def _apply(self, decisions: Decisions) -> None:
        # Free GPUs now, for the placements: state may have moved while decide() ran (a
        # node lost or drained, a resize staged by an operator). None: to be computed.
        free: dict[str, frozenset[int]] | None = None
        for action in decisions.actions:
            job = self.state.jobs.get(action.job_id)
            if isinstance(action, Preempt):
                # Preemptions come first: the placements after them use the GPUs freed.
                if await self._preempt(action, job):
                    free = None
                continue
            if job is None:
                continue
            if isinstance(action, SetServiceLevel):
                if (job.service_level, job.service_level_since) != (action.level, action.since):
                    await self._job_changed(
                        job.model_copy(
                            update={
                                "service_level": action.level,
                                "service_level_since": action.since,
                            }
                        ),
                        job.state,
                        Cause(
                            kind=CauseKind.SERVICE_LEVEL, job_id=job.job_id, message=action.cause
                        ),
                    )
                continue
            if isinstance(action, Resize):
                await self._apply_resize(job, action)
                free = None
                continue
            if job.state is not JobState.PENDING:
                continue
            if isinstance(action, Place):
                free = self.state.free_gpus() if free is None else free
                if not _fits(action, free):
                    # Decided on a state that has moved on: the next pass decides again.
                    log.info("placement of job %s no longer fits; deciding again", job.job_id)
                    self._dirty = True
                    continue
                for grant in action.grants:
                    free[grant.node] = free[grant.node] - set(grant.gpus)
                await self._place(job, action)
            elif isinstance(action, Wait) and action.reason != job.reason:
                await self._note_wait(job, action.reason)

    async def _note_wait(self, job: JobRecord, reason: str) -> None:
        if _reason_kind(reason) == _reason_kind(job.reason):
            # Same reason, new figures (GPUs left, a blocker's id): shown, not journaled,
            # or every change of free capacity would write one entry per pending job.
            # The log keeps each change of kind.
            self.state.refresh_reason(job.job_id, reason)
            return
        await self._job_changed(
            job.model_copy(update={"reason": reason}),
            job.state,
            Cause(kind=CauseKind.WAITING, job_id=job.job_id, message=reason),
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
                "not_before": None,
                # A new attempt may grow onto any node again.
                "failed_nodes": (),
                "prerun": "running" if job.prerun == "pending" else job.prerun,
            }
        )
        await self._job_changed(
            running,
            job.state,
            Cause(kind=CauseKind.PLACED, job_id=job.job_id, message=action.cause),
        )
        await self._send_launches(running)

    async def _send_launches(self, job: JobRecord) -> None:
        """Command every node of the job's attempt that has not confirmed its start."""
        now = self.clock()
        nodes = job.nodes
        # An elastic job: the supervisor on the first node, worker hosts on the others
        # (there from its launch, or added by a grow), each told the attempt's secret
        # that signs the supervisor's worker starts.
        remote = tuple((g.node, len(g.gpus)) for g in job.grants[1:])
        env = dict(job.spec.env)
        if job.spec.elastic:
            key = await self._cluster_key()
            env[EXEC_SECRET_ENV] = secrets.exec_secret(key, job.job_id, job.attempt)
        if self.credentials is not None:
            key = await self._cluster_key()
            env[secrets.JOB_TOKEN_ENV] = secrets.job_token(key, job.job_id, job.attempt)
        for rank, grant in enumerate(job.grants):
            if grant.pid is not None or grant.exited:
                continue
            await self._command(
                grant.node,
                Launch(
                    command_id=_launch_id(job.job_id, job.attempt, grant.node),
                    epoch=self.epoch,
                    issued_at=now,
                    job_id=job.job_id,
                    attempt=job.attempt,
                    gpus=grant.gpus,
                    command=elastic.launch_command(
                        job.spec, len(grant.gpus), rank=rank, remote=remote if rank == 0 else ()
                    ),
                    env=env,
                    cwd=job.spec.cwd,
                    expires_at=now + self.config.launch_ttl_s,
                    node_rank=rank,
                    nodes=nodes,
                    blacklist=tuple(sorted(self.state.blacklist)),
                    prerun=job.prerun == "running",
                    tenant=job.tenant,
                    memory_mb=job_limits(job.spec, len(grant.gpus))[0],
                    cpus=job_limits(job.spec, len(grant.gpus))[1],
                    fence_after_s=self.config.keep_disconnected_s
                    if job.spec.on_disconnect == "keep"
                    else None,
                    gpu_milli=job.spec.gpu_milli,
                    gpu_memory_mib=job.spec.gpu_memory_mib if job.spec.shared else None,
                    shareable=job.spec.shareable,
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

    def job_record(self, job_id: str) -> JobRecord | None:
        """The job as it stands: from memory, or, for a finished job no longer held
        there, from the history (a projection of the log)."""
        job = self.state.jobs.get(job_id)
        if job is None:
            try:
                job = self.history.last_job(job_id)
            except Exception:
                log.exception("reading job %s from the history failed", job_id)
        return job

    def last_seen_ago(self, node: str) -> float | None:
        return self.ingest.last_seen_ago(node, self.monotonic())

    def shares(self, node: str) -> tuple[GpuShares, ...]:
        beat = self.ingest.latest_beat(node)
        return beat.shares if beat is not None else ()

    @property
    def pid(self) -> int:
        return os.getpid()


def _reason_kind(reason: str | None) -> str:
    """A waiting reason without its figures: what changes of it are journaled."""
    return _FIGURES.sub("#", reason or "")


_FIGURES: Final = re.compile(r"\d+(?:\.\d+)?")


def _still_holds(action: Preempt, job: JobRecord, jobs: Mapping[str, JobRecord]) -> bool:
    """Whether a preemption decided on an earlier snapshot still stands: the victim runs
    on the GPUs it was decided for, and the job it makes room for still waits."""
    if job.state is not JobState.RUNNING:
        return False
    held = tuple((g.node, tuple(g.gpus)) for g in job.grants if g.gpus)
    if held != tuple((g.node, tuple(g.gpus)) for g in action.grants):
        return False
    cause = action.cause
    if isinstance(cause, MemoryPressure):
        # Moved off its host's GPU: while the host runs there.
        host = jobs.get(cause.host_job)
        return host is not None and host.state is JobState.RUNNING
    beneficiary = jobs.get(cause.for_job if isinstance(cause, QuotaReclaim) else cause.by_job)
    return beneficiary is not None and beneficiary.state is JobState.PENDING


def _fits(action: Place, free: dict[str, frozenset[int]]) -> bool:
    """Every GPU the placement takes is free on a ready node (a share on a GPU already
    shared takes none: `Place.takes`), and every node it names is ready."""
    takes = action.grants if action.takes is None else action.takes
    return all(g.node in free for g in action.grants) and all(
        set(g.gpus) <= free.get(g.node, frozenset()) for g in takes
    )


def _preemption(action: Preempt) -> Preemption:
    """The core's typed cause, as the journal keeps it."""
    cause = action.cause
    if isinstance(cause, MemoryPressure):
        return Preemption(
            reason="memory_pressure",
            for_job=cause.host_job,
            node=cause.node,
            gpu=cause.gpu,
            forecast_mem_mib=cause.forecast_mem_mib,
            gpu_memory_mib=cause.gpu_memory_mib,
        )
    if isinstance(cause, QuotaReclaim):
        return Preemption(
            reason="quota_reclaim",
            for_job=cause.for_job,
            owner_queue=cause.owner_queue,
            victim_queue=cause.victim_queue,
        )
    return Preemption(
        reason="outranked",
        for_job=cause.by_job,
        order=cause.order,
        winner_rank=cause.winner_rank,
        victim_rank=cause.victim_rank,
    )


def _launch_id(job_id: str, attempt: int, node: str) -> str:
    return f"launch-{job_id}-{attempt}-{node}"
