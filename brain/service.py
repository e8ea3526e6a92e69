"""The brain's asyncio shell and composition root: fold events into state, decide,
command, journal.

Every input that may change state (a heartbeat with news, a node event, an API call,
a tick) goes through one inbox and is handled to completion before the next; heartbeats
and telemetry stop in brain/ingest.py, which passes on only their news. State has one
writer at a time: the inbox loop, or a scheduling pass applying its decisions (passes
are coalesced and run decide() off the request path). Each change is staged in the
journal (brain/journal.py: applied to memory at once) and stored on the STATE stream as
one group with its unit of work, before any command or answer of that unit goes out, so
what any client was told is in the log. Decisions come from the pure `decide()`; this
module only turns them into records and commands.

`Brain` owns the inbox loop and when scheduling passes run, the journal's records and the
commands. The rest is in parts it wires here, each behind the narrow protocols of
brain/writer.py (`_Shell` implements them over the brain): the scheduling pass
(brain/scheduler.py), launches (brain/launches.py), submissions and cancellations
(brain/submissions.py), leadership (brain/leadership.py, with `_BrainTenure`), liveness
of nodes (brain/liveness.py), attempts and failures (brain/attempts.py), the blacklist
and pre-runs (brain/blacklist.py), resizes (brain/resizes.py) and the reconciler
(brain/reconciler.py). The parts never import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from brain import queues as queue_config
from brain import secrets
from brain.api import ApiServer
from brain.attempts import Attempts
from brain.blacklist import Blacklist
from brain.core import (
    DEFAULT_POLICY,
    DEFAULT_SERVICE_PRIOR,
    Decisions,
    Policy,
    QueueQuota,
    Resize,
    ServiceDistribution,
)
from brain.core.failures import (
    DEFAULT_FAILURE_POLICY,
    FailurePolicy,
)
from brain.credentials import DEFAULT_TTL_S as DEFAULT_JOB_CREDENTIAL_TTL_S
from brain.credentials import JobCredentials, load_signer
from brain.hearing import Hearing
from brain.history import History
from brain.inbox import (
    ApiCall,
    EventArrived,
    GroupLoop,
    HeartbeatNews,
    Item,
    Tick,
    WriteRequest,
)
from brain.ingest import (
    SHED_TELEMETRY_INBOX,
    SHED_TELEMETRY_LAG_S,
    TELEMETRY_PENDING_BYTES,
    TELEMETRY_PENDING_MSGS,
    NodeIngest,
)
from brain.journal import Journal
from brain.launches import Launches
from brain.leader import Lease
from brain.leadership import Leadership
from brain.liveness import Liveness
from brain.pacing import PassPacer
from brain.profiles import Profiler, ProfileStore, profiles_path
from brain.progress import ProgressTracker
from brain.reconciler import Reconciler
from brain.replica import LOG_KEEP_ENTRIES, Replica, snapshot_due
from brain.resizes import Resizes
from brain.scheduler import Scheduler
from brain.state import BrainState, accounted, job_view
from brain.submissions import Submissions
from brain.telemetry import LatestTelemetry
from brain.tenants import job_event_refusal
from bus.client import DAY_S, Bus, Consumer
from schemas import subjects
from schemas.api import (
    BlacklistRequest,
    BrainInfo,
    CancelRequest,
    DrainRequest,
    ResizeRequest,
    ResumeRequest,
    SubmitRequest,
    ThrottleRequest,
)
from schemas.commands import NodeCommand, Stop
from schemas.errors import AlnairError, ApiError, HandBack
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
    JobRecord,
    JobState,
)
from schemas.nodes import NodeRecord, NodeState
from schemas.progress import Progress
from schemas.state import (
    BlacklistChanged,
    BlacklistEntry,
    Cause,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
)
from schemas.telemetry import GpuShares, Heartbeat, RunningJob, TelemetryBatch

log = logging.getLogger(__name__)

# A pass waits for the inbox to empty (one pass for all the changes queued), but no
# longer than this: a steady stream of requests must not starve scheduling.
PASS_WAITS_FOR_INBOX_S: Final = 0.05
# Utilisation profiles due are recomputed this often, for at most
# `ProfileSettings.refresh_budget_s` each time: a little at a time beside everything
# else (4 % of the loop at most), rather than a stall of tens of ms at every tick and
# pass of a large cluster.
PROFILES_EVERY_S: Final = 0.05
# How often a brain with `history_keep_days` prunes its history (and once at start).
PRUNE_EVERY_S: Final = 3600.0
# A node's clock this far from the brain's is said (`Brain._check_clock`).
CLOCK_SKEW_WARN_S: Final = 5.0
# How long a brain stepping down lets the commands of its stored groups go out.
COMMANDS_GRACE_S: Final = 1.0


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
    # Write a snapshot after this many log entries, to bound a restart's replay, or
    # after as many as the jobs it holds if that is more (`snapshot_due`).
    snapshot_every: int = 1000
    # Compact the log behind snapshots, keeping at least this many of the latest
    # entries (brain/replica.py); 0: keep every entry for ever.
    log_keep_entries: int = LOG_KEEP_ENTRIES
    # Forget, from this brain's sqlite history, what ended more than this many days ago
    # (`History.prune`, every `PRUNE_EVERY_S`); None: keep it all.
    history_keep_days: float | None = None
    # Where this brain's HTTP API listens, if anywhere (shown by `alnair status`).
    http_address: str | None = None
    # Failure classes, retries and back-off, input blacklisting, pre-run.
    failures: FailurePolicy = DEFAULT_FAILURE_POLICY
    # An elastic resize its supervisor has not answered within this long is rolled
    # back (the supervisor gives up on its own after 120 s and says so).
    resize_timeout_s: float = 300.0
    # Queue quotas (`alnair brain --queues FILE`); a queue not listed has no guarantee.
    queues: tuple[QueueQuota, ...] = ()
    # Refuse a job for a queue `queues` does not list (else: train, no guarantee).
    strict_queues: bool = False
    # What the Gittins order believes of job service before any job has finished; the
    # finished jobs' service (from the log) is learned on top of it.
    service_prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR
    # The tenants of the tenant map (`--tenant-users`): others are refused at submit.
    # None: no map, every tenant may submit (its jobs run as the agent's user).
    tenants: frozenset[str] | None = None
    # The account seed that signs jobs' NATS users (auth callout, brain/credentials.py);
    # None: jobs get no token, and use their node's job identity if it gives them one.
    callout_seed: Path | None = None
    # How long a job's NATS user lives before its connection must renew it; None:
    # for ever (brain/credentials.py).
    job_credential_ttl_s: float | None = DEFAULT_JOB_CREDENTIAL_TTL_S

    def __post_init__(self) -> None:
        """Refuse times that make no sense (NaN would never time out, a negative lease
        would never hold), naming the setting and the `alnair brain` flag."""
        seconds = {
            "node_timeout_s": ("--node-timeout", self.node_timeout_s, False),
            "fence_margin_s": ("--fence-margin", self.fence_margin_s, True),
            "keep_disconnected_s": ("--keep-disconnected", self.keep_disconnected_s, False),
            "tick_s": (None, self.tick_s, False),
            "launch_ttl_s": ("--launch-ttl", self.launch_ttl_s, False),
            "stop_grace_s": (None, self.stop_grace_s, True),
            "lease_ttl_s": ("--lease-ttl", self.lease_ttl_s, False),
            "resize_timeout_s": (None, self.resize_timeout_s, False),
        }
        if self.job_credential_ttl_s is not None:
            seconds["job_credential_ttl_s"] = (
                "--job-credential-ttl",
                self.job_credential_ttl_s,
                False,
            )
        for name, (flag, value, zero) in seconds.items():
            if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
                said = f" ({flag})" if flag else ""
                least = "at least 0" if zero else "more than 0"
                raise InvalidBrainConfig(
                    f"{name}{said} must be a number of seconds {least}, not {value:g}"
                )
        if self.snapshot_every < 1:
            raise InvalidBrainConfig(
                f"snapshot_every must be at least 1, not {self.snapshot_every}"
            )
        if self.history_keep_days is not None and not (
            math.isfinite(self.history_keep_days) and self.history_keep_days > 0
        ):
            raise InvalidBrainConfig(
                "history_keep_days (--history-keep-days) must be a number of days more "
                f"than 0, not {self.history_keep_days:g}"
            )
        if self.log_keep_entries < 0:
            raise InvalidBrainConfig(
                f"log_keep_entries (--log-keep-entries) must be at least 0 (0: keep "
                f"every entry), not {self.log_keep_entries}"
            )


class InvalidBrainConfig(AlnairError, ValueError):
    """A brain setting that makes no sense; says which and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid brain setting: {reason}")
        self.reason = reason


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
        self.replica = Replica(bus, self.history, keep_entries=self.config.log_keep_entries or None)
        self.lease = Lease(bus, ttl_s=self.config.lease_ttl_s)
        # 0 while standing by; the lease revision it was taken at while leading.
        self.epoch = 0
        self.leadership = Leadership(
            self.lease,
            _BrainTenure(self),
            spawn=lambda coro, name: self.bus.spawn(coro, name=name),
            ttl_s=self.config.lease_ttl_s,
            monotonic=monotonic,
            closing=lambda: self._closing,
        )
        self.leading = self.leadership.leading
        self.instance = uuid.uuid4().hex[:12]
        self.started_at = clock()
        self.host = socket.gethostname()
        # Heartbeats and telemetry arrive on a connection of their own (`ingest_bus`,
        # opened at start) and stop in `ingest`; only their news reaches the inbox.
        self.ingest = NodeIngest(node_timeout_s=self.config.node_timeout_s)
        # Nodes whose clocks differ from this brain's by CLOCK_SKEW_WARN_S or more.
        self._skewed_clocks: set[str] = set()
        self.hearing = Hearing(monotonic)
        self.ingest_bus: Bus = bus
        # (node, job, attempt) -> when a stop for it was last sent (the reconciler's).
        self._stops_sent: dict[tuple[str, str, int], float] = {}
        self._inbox = GroupLoop(
            handle=self._handle,
            unit=self._unit,
            tainted=lambda: self.journal.tainted,
            after_group=self._after_group,
        )
        # State and the log have one writer at a time: an inbox item being handled, or
        # a scheduling pass applying its decisions (decide() itself runs outside it).
        self._writer = asyncio.Lock()
        self._pass_wanted = asyncio.Event()
        # When the next pass may start (brain/pacing.py).
        self._pacer = PassPacer(since=monotonic())
        # How late the last tick woke up: how far behind the event loop runs.
        self._loop_lag_s = 0.0
        self._exec_key = b""  # the cluster's key for worker starts (brain/secrets.py)
        self._key_read = asyncio.Lock()  # one read of it at a time
        self.credentials = (
            JobCredentials(
                load_signer(self.config.callout_seed),
                self._cluster_key,
                self._running,
                ttl_s=self.config.job_credential_ttl_s,
            )
            if self.config.callout_seed is not None
            else None
        )
        self._record_counter = 0
        self._leader_tasks: list[asyncio.Task[None]] = []
        self._leader_subs: list[Subscription] = []
        self._events: Consumer | None = None
        self._election: asyncio.Task[None] | None = None
        self._pruner: asyncio.Task[None] | None = None
        # Loops end on this flag, not on cancellation alone: nats-py turns a
        # cancellation into ConnectionClosedError once the connection is closed.
        self._closing = False
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
            shares=self.shares,
        )
        self.telemetry_observers.append(self.profiles.observe)
        self.record_observers.append(self.profiles.on_record)
        # Elastic jobs' throughput per world size, from their supervisors' reports.
        self.progress = ProgressTracker()
        self.record_observers.append(self.progress.on_record)
        # Records staged by the writer, stored as one group per unit of work.
        self.journal = Journal(bus, self.history, lambda: self.state, self.record_observers)
        # The parts of the brain, each behind the narrow protocols of brain/writer.py
        # that `_Shell` implements over this brain; each reads state as it stands.
        shell = _Shell(self)
        self.reconciler = Reconciler(
            lambda: self.state,
            self.ingest,
            shell,
            stops_sent=self._stops_sent,
            monotonic=monotonic,
            clock=clock,
        )
        self.blacklist = Blacklist(
            lambda: self.state, shell, policy=self.config.failures, clock=clock
        )
        self.resizes = Resizes(
            lambda: self.state,
            shell,
            self.journal,
            self.progress,
            clock=clock,
            timeout_s=self.config.resize_timeout_s,
            leading=self.leading.is_set,
            fail_attempt=lambda job, node, why: self.attempts.fail_attempt(job, node, why),
        )
        self.launches = Launches(
            lambda: self.state,
            shell,
            self.config,
            clock=clock,
            cluster_key=self._cluster_key,
            tokens=self.credentials,
            clock_offset=self.ingest.clock_offset,
        )
        self.attempts = Attempts(
            lambda: self.state,
            shell,
            self.resizes,
            policy=self.config.failures,
            clock=clock,
        )
        self.liveness = Liveness(
            lambda: self.state,
            shell,
            self.attempts,
            self.ingest,
            self.hearing,
            self.resizes,
            settings=self.config,
            clock=clock,
            monotonic=monotonic,
        )
        # The scheduling pass; when passes run is `_schedule_forever`'s.
        self.scheduler = Scheduler(
            lambda: self.state,
            shell,
            self.attempts,
            self.resizes,
            self.config,
            clock=clock,
            monotonic=monotonic,
            profiles=lambda: self.profiles.current(refresh=False),
            progress=self.progress.current,
            errors=lambda: self.progress.errors.view,
            decided=lambda decisions: self._notify(self.decision_observers, decisions),
        )
        self.submissions = Submissions(
            lambda: self.state,
            shell,
            self.config,
            clock=clock,
            job_record=self.job_record,
            # Its pass need not wait out the last one's rest.
            submitted=self.scheduler.submitted.set,
        )

    @property
    def state(self) -> BrainState:
        return self.replica.state

    @property
    def telemetry(self) -> LatestTelemetry:
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
        self._election = self.bus.spawn(self.leadership.elect_forever(), name="brain-election")
        if self.config.history_keep_days is not None:
            self._pruner = self.bus.spawn(self._prune_forever(), name="history-prune")
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
        for task in (self._election, self._pruner):
            if task is not None:
                task.cancel()
                await asyncio.wait({task}, timeout=3.0)
        await self.leadership.stop_leading("brain shutting down", planned=True)
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

    # -- leadership (brain/leadership.py orders it; these are the tenure's parts) ---

    async def _stop_leading(self, reason: str) -> None:
        await self.leadership.stop_leading(reason)

    async def _catch_up(self) -> int:
        await self.replica.stop_following()
        if self.journal.tainted:
            # The last tenure's state ran ahead of the log and could not be read again
            # then (cut off from NATS, say): it must be before this one begins.
            await self.replica.reload()
            self.journal.tainted = False
        return await self.replica.catch_up()

    async def _begin(self, epoch: int) -> None:
        self.epoch = epoch
        # Records the replica followed were not observed: the profiler follows the
        # running jobs afresh.
        self.profiles.resync()
        now = self.monotonic()
        self.ingest.reset()
        for node in self.state.nodes.values():
            # Liveness is not in the log: every known node gets a fresh grace period.
            self.ingest.expect(node.name, node.instance, now)
        ingest = self.ingest_bus
        self._leader_subs = [
            await ingest.subscribe(
                subjects.ALL_HEARTBEATS,
                Heartbeat,
                self._on_heartbeat,
                known=self._repeated_heartbeat,
            ),
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
            self.bus.spawn(self._profiles_forever(), name="brain-profiles"),
            self.bus.spawn(self._read_cluster_key(), name="brain-cluster-key"),
            self.bus.spawn(
                self.hearing.watch(self.ingest_bus, every_s=self.config.tick_s),
                name="brain-hearing",
            ),
        ]
        self.scheduler.dirty = True
        self._pass_wanted.set()

    async def _take_over(self, epoch: int, caught_up: int) -> None:
        async with self._unit():
            await self._resend_unconfirmed_launches()
            await self.resizes.resend_staged_resizes()
        log.info(
            "brain %s leads with epoch %d (caught up %d entries, seq %d)",
            self.instance,
            epoch,
            caught_up,
            self.state.last_seq,
        )

    async def _end(self, reason: str, renewer: asyncio.Task[None] | None) -> None:
        self.epoch = 0
        current = asyncio.current_task()
        subs, events = self._leader_subs, self._events
        others = [t for t in (*self._leader_tasks, renewer) if t and t is not current]
        self._leader_subs, self._leader_tasks, self._events = [], [], None
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if events is not None:
            await events.stop()
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=3.0)
        # Commands of stored groups still queued get a moment to go out; the rest are
        # dropped (the next leader sends again what the log says is unconfirmed).
        await self.journal.stop_sending(grace_s=COMMANDS_GRACE_S)
        self._inbox.refuse_waiting(f"brain stepped down: {reason}")
        self.journal.discard()  # staged by a unit cut short: never stored
        if self.journal.tainted:
            # State ran ahead of the log (a group not stored): read it all again.
            try:
                await self.replica.reload()
                self.journal.tainted = False
            except Exception as error:  # cut off from NATS, say: before leading again
                log.warning("reading state again failed (%r); retried before leading", error)

    def _follow(self) -> None:
        if not self.journal.tainted:  # else its state is read again before it leads
            self.replica.follow()

    async def _resend_unconfirmed_launches(self) -> None:
        """A brain may have died between journaling a placement and commanding it.

        Re-sending is safe: the command id is the same, so JetStream drops it if it
        was stored, and agents ignore a launch they have already run.
        """
        for job in self.state.jobs_in(JobState.RUNNING):
            if not self.leading.is_set():
                return  # stepped down meanwhile: the next leader re-sends them
            if any(g.pid is None and not g.exited for g in job.grants):
                await self.launches.send(job)

    async def _maybe_snapshot(self) -> None:
        if self.journal.tainted:
            return  # state holds records the log refused: never in a snapshot
        since = self.state.last_seq - self.replica.snapshot_seq
        if not snapshot_due(since, len(self.state.jobs), self.config.snapshot_every):
            return
        # Stored in the background (encoded in a thread), one at a time: the loop goes on.
        self.replica.write_snapshot_soon(taken_at=self.clock(), epoch=self.epoch)

    # -- inbound ---------------------------------------------------------------------

    async def _on_heartbeat(self, beat: Heartbeat, msg: Msg) -> None:
        if not await self._from_own_node(beat.node, msg):
            return
        news = self.ingest.heartbeat(beat, self.monotonic(), msg.data, wall=self.clock())
        if news is not None:
            # Only news reaches the inbox: a heartbeat that changes nothing moved the
            # node's last-seen time and is done.
            await self._inbox.put(HeartbeatNews(news))

    def _check_clocks(self) -> None:
        """Say when a node's clock comes to differ from this brain's by
        `CLOCK_SKEW_WARN_S` or more, and when it agrees again, of the nodes whose offset
        may have moved since the last look (a tick's). Launches go by the node's clock
        (`Launches`); logs, events and `alnair` read times from several clocks."""
        moved, self.ingest.clocks_moved = self.ingest.clocks_moved, set()
        for node in moved:
            self._check_clock(node)

    def _check_clock(self, node: str) -> None:
        offset = self.ingest.clock_offset(node)
        skewed = abs(offset) >= CLOCK_SKEW_WARN_S
        if skewed == (node in self._skewed_clocks):
            return
        if skewed:
            self._skewed_clocks.add(node)
            log.warning(
                "node %s's clock is %.1f s %s this brain's: keep every host's clock "
                "synchronised (NTP, chrony); its launches expire by its own clock",
                node,
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        else:
            self._skewed_clocks.discard(node)
            log.info("node %s's clock agrees with this brain's again (%+.1f s)", node, -offset)

    def _repeated_heartbeat(self, msg: Msg) -> bool:
        """A node's last heartbeat again, but for its clock: noted without decoding."""
        parts = msg.subject.split(".")
        return len(parts) == 4 and self.ingest.repeat(
            parts[2], msg.data, self.monotonic(), wall=self.clock()
        )

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
            self.scheduler.dirty = True  # a first report, or a first at this size: news for policy

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
        """The cluster key, read (or made) once; a caller that waited for another's
        read takes what it read, or, if that failed, reads itself."""
        if not self._exec_key:
            async with self._key_read:
                if not self._exec_key:
                    self._exec_key = await secrets.exec_key(self.bus)
        return self._exec_key

    async def _read_cluster_key(self) -> None:
        """As a tenure begins, read the cluster key if launches will need it: every
        launch of a brain that admits jobs (`credentials`: each carries a token under
        it), and an elastic job's. Off the writer: read in a pass instead, it would hold
        every unit while JetStream cannot answer (a bucket just made, in a cluster,
        elects its stream's leader first), up to `secrets.KEY_RETRY_FOR_S`. A cluster
        with neither is not given a bucket it does not need."""
        if self.credentials is None and not any(
            job.spec.elastic for job in self.state.jobs.values()
        ):
            return
        try:
            await self._cluster_key()
        except Exception as error:
            log.warning("the cluster key could not be read (%r): read again when needed", error)

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
        return await self._inbox.submit(item)

    async def call(self, tenant: str, request: WriteRequest, *, operator: bool = False) -> object:
        """Handle an API request that writes, as the writer; answered once stored."""
        return await self.submit_item(ApiCall(tenant, request, operator))

    async def _tick_forever(self) -> None:
        while not self._closing:
            due = self.monotonic() + self.config.tick_s
            await asyncio.sleep(self.config.tick_s)
            self._loop_lag_s = max(0.0, self.monotonic() - due)
            self._check_clocks()
            await self._inbox.put(Tick())

    async def _prune_forever(self) -> None:
        """Every brain keeps its own history: each forgets what ended more than
        `history_keep_days` ago, at start and every `PRUNE_EVERY_S`."""
        assert self.config.history_keep_days is not None
        keep_s = self.config.history_keep_days * DAY_S
        while not self._closing:
            try:
                removed = await self.history.prune(self.clock() - keep_s)
                if removed:
                    log.info(
                        "history: %d entries older than %g days forgotten",
                        removed,
                        self.config.history_keep_days,
                    )
            except Exception:
                log.exception("pruning the history failed; tried again in %g s", PRUNE_EVERY_S)
            await asyncio.sleep(PRUNE_EVERY_S)

    async def _profiles_forever(self) -> None:
        """Recompute the profiles due; one that changed in a way policy acts on (a
        first profile, a job turning underused or back) makes state dirty."""
        while not self._closing:
            await asyncio.sleep(PROFILES_EVERY_S)
            try:
                changed = self.profiles.poll()
            except Exception:
                log.exception("recomputing profiles failed; tried again in %gs", PROFILES_EVERY_S)
                continue
            if changed:
                self.scheduler.dirty = True
                self._pass_wanted.set()

    def _takes_telemetry(self) -> bool:
        """False while the brain is behind: telemetry is what it sheds first."""
        return (
            self._loop_lag_s <= SHED_TELEMETRY_LAG_S
            and self._inbox.queue.qsize() < SHED_TELEMETRY_INBOX
        )

    async def _run(self) -> None:
        """The inbox, in groups (brain/inbox.py); scheduling happens in
        `_schedule_forever`, off this path. A group the log did not take ends leading:
        state, ahead of the log, is loaded again after stepping down."""
        error = await self._inbox.run()
        reason = f"the log did not take a group of inbox items: {error!r}"
        self.bus.spawn(self._stop_leading(reason), name="step-down")

    def _after_group(self) -> None:
        if self.scheduler.dirty:
            self._pass_wanted.set()

    async def _schedule_forever(self) -> None:
        """Scheduling passes, coalesced: at most one runs at a time, and the next starts
        once state has changed since the last began, however many changes that was,
        and passes owe the loop no more time than allowed (brain/pacing.py)."""
        while True:
            await self._pass_wanted.wait()
            await self._rest()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inbox.idle.wait(), PASS_WAITS_FOR_INBOX_S)
            self._pass_wanted.clear()
            began = self.monotonic()
            try:
                await self.scheduler.run_pass()
            except Exception as error:
                if self.journal.tainted:
                    # The pass's group was not stored: state is ahead of the log.
                    reason = f"a scheduling pass's group was not stored: {error!r}"
                    self.bus.spawn(self._stop_leading(reason), name="step-down")
                    return
                leaving = isinstance(error, ApiError) and not self.leading.is_set()
                if not leaving:  # else: leadership ended mid-pass; the next plans anew
                    log.exception("scheduling cycle failed")
                    self.scheduler.failed()
            if self.scheduler.dirty:
                self._pass_wanted.set()
            self._pacer.ran(began, self.monotonic())

    async def _rest(self) -> None:
        """Wait until the pacer lets the next pass start: sooner once a job is
        submitted meanwhile."""
        pacer, submitted = self._pacer, self.scheduler.submitted
        while (wait_s := pacer.wait_s(self.monotonic(), prompt=submitted.is_set())) > 0:
            if submitted.is_set():
                await asyncio.sleep(wait_s)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(submitted.wait(), wait_s)

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
        await self.liveness.check_nodes()
        await self.reconciler.reconcile_all()
        await self.liveness.check_vanished()
        await self.liveness.check_launches()
        await self.attempts.check_time_limits()
        await self.submissions.cancel_orphans()
        await self.blacklist.check_preruns()
        await self.resizes.check_resizes()
        self.scheduler.due()  # decide() asked to be called again, or owes reasons
        # A snapshot covers stored records only: what this unit staged goes first.
        await self.journal.commit()
        await self._maybe_snapshot()

    async def _write(self, tenant: str, request: WriteRequest, *, operator: bool) -> object:
        match request:
            case SubmitRequest():
                return await self.submissions.submit(tenant, request)
            case CancelRequest(job_id=job_id):
                return await self.submissions.cancel(tenant, job_id, operator=operator)
            case DrainRequest():
                await self._drain(tenant, request)
            case ResumeRequest():
                await self._resume(tenant, request)
            case BlacklistRequest():
                await self._edit_blacklist(tenant, request)
            case ResizeRequest():
                return await self._resize_request(tenant, request, operator=operator)
            case ThrottleRequest():
                return await self.submissions.throttle(tenant, request)
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
        if self.journal.tainted:
            # A group was refused and the step-down has not come round yet: what this
            # unit would derive from state could not be stored (brain/journal.py).
            raise ApiError("unavailable", "this brain is stepping down to read its state again")
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
        old = self.state.jobs.get(job.job_id)
        job = accounted(old, job, self.clock())
        record = JobChanged(
            record_id=self._record_id(),
            ts=self.clock(),
            epoch=self.epoch,
            job=job,
            previous=previous,
            cause=cause,
        )
        await self._append(record, subjects.state_job(job.job_id))
        if job.state is JobState.PENDING and (old is None or old.state is not JobState.PENDING):
            self.scheduler.became_pending(job.job_id)
        if old is None or not _same_to_policy(old, job):
            # Not, say, for a process that started where it was placed: decide() would
            # see nothing new, and a pass of 10,000 pending jobs costs tens of ms.
            self.scheduler.dirty = True

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
        self.scheduler.dirty = True

    async def _blacklist_changed(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None:
        record = BlacklistChanged(
            record_id=self._record_id(),
            ts=self.clock(),
            epoch=self.epoch,
            entries=tuple(entries.values()),
            cause=cause,
        )
        await self._append(record, subjects.STATE_BLACKLIST)
        self.scheduler.dirty = True

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

    # -- nodes (brain/liveness.py) -----------------------------------------------------

    async def _heartbeat(self, beat: Heartbeat) -> None:
        """A heartbeat with news (brain/ingest.py): journal what changed, reconcile."""
        await self.liveness.heartbeat(beat)
        await self.reconciler.reconcile(beat)

    async def _drain(self, operator: str, request: DrainRequest) -> None:
        await self.liveness.drain(operator, request)

    async def _resume(self, operator: str, request: ResumeRequest) -> None:
        await self.liveness.resume(operator, request)

    async def _requeue(self, job: JobRecord, cause: Cause) -> None:
        """Back to PENDING, keeping its attempt count (brain/attempts.py)."""
        await self.attempts.requeue(job, cause)

    # -- node events (brain/attempts.py, brain/blacklist.py, brain/resizes.py) ---------

    async def _event(self, event: NodeEvent) -> None:
        if event.event_id in self.state.seen_events:
            return  # redelivered (a brain died before acknowledging it): done already
        # Effects first, the record last: the record marks the event done, so a brain
        # that dies in between leaves it undone, and its successor, handed the event
        # again, applies it (each effect checks the attempt, so twice is harmless).
        if isinstance(event, JobStarted):
            await self.attempts.job_started(event)
        elif isinstance(event, JobExited):
            self.reconciler.exited(event)
            marked = await self.blacklist.job_exited(event)
            if marked is not None:
                await self._event_recorded(marked)
            await self.attempts.job_exited(event)
        elif isinstance(event, LaunchFailed):
            await self.attempts.launch_failed(event)
        elif isinstance(event, CommandRejected):
            await self.attempts.command_rejected(event)
        elif isinstance(event, GpuFault):
            await self.attempts.gpu_fault(event)
        elif isinstance(event, InputError):
            await self.blacklist.input_error(event)
        elif isinstance(event, ResizeCompleted):
            await self.resizes.resize_completed(event)
        # What the event changed for decide() made state dirty as it was staged (a
        # job's, a node's or the blacklist's record); the event's own record does not.
        await self._event_recorded(event)

    async def _edit_blacklist(self, operator: str, request: BlacklistRequest) -> None:
        await self.blacklist.edit(operator, request)

    # -- elastic resizes (brain/resizes.py) --------------------------------------------

    def _free_on(self, node: str) -> frozenset[int]:
        """The node's schedulable GPUs that no running job holds (if it is ready)."""
        return self.state.free_on(node) or frozenset()

    async def _resize_request(
        self, tenant: str, request: ResizeRequest, *, operator: bool
    ) -> JobRecord:
        return await self.resizes.resize_request(tenant, request, operator=operator)

    async def _apply_resize(self, job: JobRecord, action: Resize) -> None:
        await self.resizes.apply_resize(job, action)

    @staticmethod
    def _notify(observers: list[Callable[..., None]], *args: object) -> None:
        for observer in observers:
            try:
                observer(*args)
            except Exception:
                log.exception("observer %r failed", observer)

    # -- views -----------------------------------------------------------------------

    async def settled(self) -> None:
        """Returns once the writer is free. A unit applies its records to state as it
        stages them and stores them as a group at its end: while it awaits (its
        commit's append, above all), state holds records that are not stored yet, and
        would not be if the append failed. Released, the lock is not taken again by
        the next unit before this returns and its caller reads (asyncio runs the
        waiter later), so a read that awaits nothing after this sees stored state.

        A group the log did not take leaves state ahead of it until the brain, stepping
        down, reads it again: meanwhile reads are refused as `unavailable`."""
        writer = self._writer
        while writer.locked():
            async with writer:
                pass
        if self.journal.tainted:
            raise ApiError(
                "unavailable", "brain stepping down: its state is being read again from the log"
            )

    async def job_record(self, job_id: str) -> JobRecord | None:
        """The job as it stands: from memory, or, for a finished job no longer held
        there, from the history (a projection of the log)."""
        job = self.state.jobs.get(job_id)
        if job is not None:
            return self.state.shown(job)
        try:
            return await self.history.read_last_job(job_id)
        except Exception:
            log.exception("reading job %s from the history failed", job_id)
            return None

    def last_seen_ago(self, node: str) -> float | None:
        return self.ingest.last_seen_ago(node, self.monotonic())

    def shares(self, node: str) -> tuple[GpuShares, ...]:
        beat = self.ingest.latest_beat(node)
        return beat.shares if beat is not None else ()

    def processes(self, node: str) -> tuple[RunningJob, ...]:
        beat = self.ingest.latest_beat(node)
        return beat.running if beat is not None else ()

    def commands_queued(self) -> int:
        return self.journal.queued

    @property
    def pid(self) -> int:
        return os.getpid()


def _same_to_policy(old: JobRecord, new: JobRecord) -> bool:
    """Whether decide() sees a running job the same after a change as before it: the
    same view (without the clock; grants are seen only as the GPUs they hold, not as
    the processes started there). A pending job's change is its waiting reason, or
    more: news either way."""
    return (
        old.state is JobState.RUNNING
        and new.state is JobState.RUNNING
        and job_view(old, now=None) == job_view(new, now=None)
    )


class _Shell:
    """The writer's protocols (brain/writer.py) over a `Brain`: what its parts may do."""

    def __init__(self, brain: Brain) -> None:
        self._brain = brain

    @property
    def epoch(self) -> int:
        return self._brain.epoch

    async def job_changed(self, job: JobRecord, previous: JobState | None, cause: Cause) -> None:
        await self._brain._job_changed(job, previous, cause)

    async def node_changed(
        self, node: NodeRecord, previous: NodeState | None, cause: Cause
    ) -> None:
        await self._brain._node_changed(node, previous, cause)

    async def blacklist_changed(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None:
        await self._brain._blacklist_changed(entries, cause)

    async def command(self, node: str, command: NodeCommand) -> None:
        await self._brain._command(node, command)

    async def stop(self, job_id: str, node: str, reason: str, attempt: int | None) -> None:
        await self._brain._stop(job_id, node, reason, attempt)

    async def stop_parts(
        self, job: JobRecord, reason: str, *, except_node: str | None = None
    ) -> None:
        await self._brain._stop_parts(job, reason, except_node=except_node)

    async def launch_ready(self, job: JobRecord) -> None:
        await self._brain.launches.ready(job)

    async def send_launches(self, job: JobRecord) -> None:
        await self._brain.launches.send(job)

    @property
    def writer(self) -> asyncio.Lock:
        return self._brain._writer

    def unit(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._brain._unit()


class _BrainTenure:
    """A `Brain`'s tenure as brain/leadership.py sees it."""

    def __init__(self, brain: Brain) -> None:
        self._brain = brain

    def info(self) -> BrainInfo:
        return self._brain.info()

    async def catch_up(self) -> int:
        return await self._brain._catch_up()

    async def begin(self, epoch: int) -> None:
        await self._brain._begin(epoch)

    async def take_over(self, epoch: int, caught_up: int) -> None:
        await self._brain._take_over(epoch, caught_up)

    async def end(self, reason: str, renewer: asyncio.Task[None] | None) -> None:
        await self._brain._end(reason, renewer)

    def follow(self) -> None:
        self._brain._follow()
