"""The scheduling pass: a snapshot of state, the pure `decide()`, and its decisions
applied as the writer.

A pass takes its snapshot under the writer lock (never halfway through a unit's
records), runs `decide()` (brain/core) on it, in a worker thread when the last one was
slow so that the inbox goes on and submissions are stored and answered meanwhile, and
then applies the decisions in one unit of work, each checked against state as it is by
then: preemptions first (only one that still holds: its victim on those GPUs, its
beneficiary waiting), resizes and service levels, then placements (only one whose GPUs
are still free), each placement's Launches sent once its record is stored. Why the
other jobs wait is noted after, in a unit of its own, off the path to the Launches.

When passes run is the brain's (brain/service.py: coalesced, one at a time, paced by
brain/pacing.py). What makes the next one due is kept here, in `dirty`: any change
decide() would see (the writer sets it), a decision made on a state that has moved, a
wake-up decide() asked for (`due`), or reasons owed. This part reads state and never
writes it but through the writer's protocols (brain/writer.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Final, Protocol

from brain.core import (
    ELASTICITIES,
    ORDERINGS,
    ClusterSnapshot,
    Decisions,
    Grant,
    KeptLedger,
    MemoryPressure,
    Place,
    Policy,
    Preempt,
    QueueQuota,
    QuotaReclaim,
    Ranking,
    Resize,
    ServiceDistribution,
    SetServiceLevel,
    Wait,
    decide,
    reads,
)
from brain.core.collector import collector_paused
from brain.core.model import UtilizationProfile
from brain.progress import ObservedProgress
from brain.state import BrainState
from brain.writer import Clock, JobRecords
from schemas.jobs import JobRecord, JobState, NodeGrant
from schemas.state import Cause, CauseKind, Preemption

log = logging.getLogger(__name__)

# A decide() that took longer than this (CPU time) last time runs in a worker thread, so the loop
# (heartbeats, the API, the lease) goes on beside it; a shorter one runs in the loop,
# where it does not make every wake-up of the loop wait for the GIL.
DECIDE_IN_THREAD_AFTER_S: Final = 0.05
# Why every waiting job waits is worked out by at most one pass in this long; every
# other pass asks only why the jobs that became pending since the last pass wait
# (`decide(waits=False, explain=...)`), so a job is told why at once, and a reason's
# figures (GPUs left) are brought up to date at this interval. Without a `Wait` per
# pending job, and the shell's look-ups of each, a pass at 10,000 pending costs about
# half; an owner reads a waiting reason on a person's time scale. A pass that left
# them out owes them: the tick makes state dirty once they are due (`due`).
EXPLAIN_WAITS_EVERY_S: Final = 5.0
# A pass that failed (JetStream out of reach for a launch's key, say) is tried again
# after this long even if nothing else happens: its jobs still wait.
RETRY_FAILED_PASS_S: Final = 2.0


class SchedulerSettings(Protocol):
    """brain.service.BrainConfig is one."""

    @property
    def policy(self) -> Policy: ...

    @property
    def queues(self) -> tuple[QueueQuota, ...]: ...

    @property
    def service_prior(self) -> ServiceDistribution: ...


class Writes(JobRecords, Protocol):
    """The writer as a pass uses it (brain.service's `_Shell` is one)."""

    @property
    def writer(self) -> asyncio.Lock:
        """Held by an inbox item being handled, or by a pass taking its snapshot."""
        ...

    def unit(self) -> AbstractAsyncContextManager[None]:
        """A unit of work as the writer: what it stages is stored as one group before
        the writer is let go, and the commands it sent go out after, in order."""
        ...

    async def launch_ready(self, job: JobRecord) -> None:
        """Raises if the job's launch could not be built now (brain/launches.py)."""
        ...

    async def send_launches(self, job: JobRecord) -> None: ...


class Requeues(Protocol):
    """brain.attempts.Attempts is one."""

    async def requeue(self, job: JobRecord, cause: Cause) -> None: ...


class AppliesResizes(Protocol):
    """brain.resizes.Resizes is one."""

    async def apply_resize(self, job: JobRecord, action: Resize) -> None: ...


class Scheduler:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: Writes,
        requeues: Requeues,
        resizes: AppliesResizes,
        settings: SchedulerSettings,
        *,
        clock: Clock,
        monotonic: Clock,
        profiles: Callable[[], Mapping[str, UtilizationProfile]] = dict,
        progress: Callable[[], Mapping[str, ObservedProgress]] = dict,
        errors: Callable[[], ServiceDistribution | None] = lambda: None,
        decided: Callable[[Decisions], None] = lambda decisions: None,
    ) -> None:
        """`progress` and `errors` are what jobs' progress reports told (brain/progress.py);
        `decided` is told each pass's decisions, before they are applied."""
        self._state = state
        self._writes = writes
        self._requeues = requeues
        self._resizes = resizes
        self._settings = settings
        self._clock = clock
        self._monotonic = monotonic
        self._profiles = profiles
        self._progress = progress
        self._errors = errors
        self._decided = decided
        # State changed since the last pass began: one more pass is due.
        self.dirty = True
        # A job was submitted since the last pass began: the next one is prompt.
        self.submitted = asyncio.Event()
        # When the last decide() asked to be called again, even if nothing happens.
        self.wake_at: float | None = None
        # When a pass may next explain why jobs wait (monotonic), and whether one that
        # left it out owes it (`EXPLAIN_WAITS_EVERY_S`).
        self.waits_due = 0.0
        self.waits_owed = False
        # CPU time of the last decide(): where the next one runs.
        self.last_decide_s = 0.0
        # Jobs that became pending since the last pass was planned: the next is asked
        # why they wait, whether or not it explains every waiting job.
        self._newly_pending: set[str] = set()
        # The last pass's ranking and free-GPU ledger, for the next (brain/core/ranking.py,
        # brain/core/placement.py): the snapshot reuses the views of jobs and nodes that
        # did not change, so a pass ranks only the other jobs and brings only the other
        # nodes up to date.
        self._ranking = Ranking()
        self._ledger = KeptLedger()

    def became_pending(self, job_id: str) -> None:
        """A job (new, requeued or retried) waits now: the next pass says why."""
        self._newly_pending.add(job_id)

    def due(self) -> None:
        """At a tick: make a pass due (`dirty`) though nothing changed, when decide()
        asked to be called again by now or a pass owes why jobs wait."""
        if self.wake_at is not None and self._clock() >= self.wake_at:
            self.wake_at = None  # a retry back-off ending, say
            self.dirty = True
        if self.waits_owed and self._monotonic() >= self.waits_due:
            self.dirty = True

    def failed(self) -> None:
        """A pass failed before it was through: the next is due after
        `RETRY_FAILED_PASS_S`, whether or not state changes meanwhile."""
        retry_at = self._clock() + RETRY_FAILED_PASS_S
        self.wake_at = retry_at if self.wake_at is None else min(self.wake_at, retry_at)

    async def run_pass(self) -> None:
        """One pass: snapshot, decide(), the decisions applied, then the waits noted."""
        settings = self._settings
        async with self._writes.writer:  # not halfway through a handler's records
            self.dirty = False
            self.submitted.clear()
            newly_pending, self._newly_pending = self._newly_pending, set()
            state = self._state()
            snapshot = state.snapshot(
                # As they stand: recomputed a little at a time beside the passes
                # (brain/service.py, `_profiles_forever`), never on the path to a Launch.
                profiles=self._profiles(),
                now=self._clock(),
                queues=settings.queues,
                # Elastic jobs' throughput per size and progress, from their supervisors.
                progress=self._progress(),
                # Learned only for the orders that read it: a rebuild costs milliseconds.
                service_prior=settings.service_prior
                if reads(settings.policy.order, "distribution")
                else None,
                running_service=self._reads_running_service(state),
                by_class=reads(settings.policy.order, "class_distribution"),
                error_distribution=self._errors()
                if reads(settings.policy.order, "progress_error")
                else None,
            )
        # A pass at scale decides on tens of thousands of jobs, each decision an object
        # the cyclic collector tracks (about 160,000 at 5,000 nodes): collected as they
        # were made, the first allocation after decide() would walk them all, 5-11 % of
        # its time. Paused until they are applied and freed (by reference counts: they
        # hold no cycles), the collector never sees them.
        with collector_paused():
            await self._decide_and_apply(snapshot, newly_pending)

    async def _decide_and_apply(self, snapshot: ClusterSnapshot, newly_pending: set[str]) -> None:
        now, policy = self._clock(), self._settings.policy
        explain = self._explains_waits(waiting=bool(snapshot.pending))
        if self.last_decide_s > DECIDE_IN_THREAD_AFTER_S:
            ranking, ledger = self._ranking, self._ledger
            try:
                decisions, self.last_decide_s = await asyncio.to_thread(
                    timed_decide, snapshot, now, policy, explain, newly_pending, ranking, ledger
                )
            except asyncio.CancelledError:
                # The thread may go on with this ranking and ledger: the next pass takes
                # new ones.
                self._ranking, self._ledger = Ranking(), KeptLedger()
                raise
        else:
            decisions, self.last_decide_s = timed_decide(
                snapshot, now, policy, explain, newly_pending, self._ranking, self._ledger
            )
        self.wake_at = decisions.wake_at
        self._decided(decisions)
        async with self._writes.unit():
            waits = await self.apply(decisions)
        # The placements are stored and their Launches sent: now why the rest wait
        # (one per pending job: thousands of look-ups, off the path to the Launches).
        if waits:
            async with self._writes.unit():
                await self.note_waits(waits)

    def _explains_waits(self, *, waiting: bool) -> bool:
        """Does this pass say why jobs wait? At most one pass per
        `EXPLAIN_WAITS_EVERY_S`; one that does not, with jobs waiting, owes it to a
        later one."""
        if not waiting:
            # Nothing to explain, nor owed any more: it costs nothing, uses up no turn.
            self.waits_owed = False
            return True
        now = self._monotonic()
        if now < self.waits_due:
            self.waits_owed = True
            return False
        self.waits_due = now + EXPLAIN_WAITS_EVERY_S
        self.waits_owed = False
        return True

    def _reads_running_service(self, state: BrainState) -> bool:
        """Does this pass's policy read running jobs' service as it grows? If not, the
        pass reuses their views (brain/state.py, `snapshot`). The order says; an
        elasticity stage reads it, and runs only while some job is elastic."""
        policy = self._settings.policy
        order = ORDERINGS.get(policy.order)
        if order is None or order.reads_running_service:
            return True
        elasticity = ELASTICITIES.get(policy.elasticity)
        return elasticity is not None and elasticity.sizes_jobs and state.live_elastic > 0

    async def apply(self, decisions: Decisions) -> list[Wait]:
        """Apply every action but the waits, which are returned (noted apart), as the
        writer, within a unit."""
        # Free GPUs now, for the placements: state may have moved while decide() ran (a
        # node lost or drained, a resize staged by an operator). Looked up by node as
        # placements name them (a pass places a few jobs on a cluster of thousands of
        # nodes); None: forgotten, since a preemption or a resize changed them.
        free: FreeNow | None = None
        waits: list[Wait] = []
        for action in decisions.actions:
            if type(action) is Wait:  # most actions: noted together, below
                waits.append(action)
                continue
            state = self._state()  # as it is now: an action before may have waited
            job = state.jobs.get(action.job_id)
            if isinstance(action, Preempt):
                # Preemptions come first: the placements after them use the GPUs freed.
                if await self._preempt(action, job):
                    free = None
                continue
            if job is None:
                continue
            if isinstance(action, SetServiceLevel):
                await self._set_service_level(job, action)
                continue
            if isinstance(action, Resize):
                await self._resizes.apply_resize(job, action)
                free = None
                continue
            if job.state is not JobState.PENDING:
                continue
            if isinstance(action, Place):
                free = FreeNow(state) if free is None else free
                if not free.fits(action):
                    # Decided on a state that has moved on: the next pass decides again.
                    log.info("placement of job %s no longer fits; deciding again", job.job_id)
                    self.dirty = True
                    continue
                free.take(action.grants)
                await self._place(job, action)
        return waits

    async def _preempt(self, action: Preempt, job: JobRecord | None) -> bool:
        """Requeue the victim, only as decided: on those GPUs, its beneficiary waiting
        (decide() may have run in a thread while the inbox went on). True if it was."""
        state = self._state()
        if job is not None and state.on_lost_node(job):
            # Never a victim on a lost node: its stop cannot arrive, and it would be
            # requeued (and run elsewhere) before its agent fenced it. The node's loss
            # frees it in its time, and makes state dirty then.
            return False
        if job is None or not still_holds(action, job, state.jobs):
            self.dirty = True  # decided on a state that has moved: decide again
            return False
        await self._requeues.requeue(
            job,
            Cause(
                kind=CauseKind.PREEMPTED,
                job_id=job.job_id,
                message=action.reason,
                preemption=preemption(action),
            ),
        )
        return True

    async def _set_service_level(self, job: JobRecord, action: SetServiceLevel) -> None:
        if (job.service_level, job.service_level_since) == (action.level, action.since):
            return
        await self._writes.job_changed(
            job.model_copy(
                update={"service_level": action.level, "service_level_since": action.since}
            ),
            job.state,
            Cause(kind=CauseKind.SERVICE_LEVEL, job_id=job.job_id, message=action.reason),
        )

    async def _place(self, job: JobRecord, action: Place) -> None:
        attempt = job.attempt + 1
        reason = action.reason  # built here, once: the record and its cause say it
        grants = tuple(NodeGrant(node=g.node, gpus=g.gpus) for g in action.grants)
        running = job.model_copy(
            update={
                "state": JobState.RUNNING,
                "attempt": attempt,
                "grants": grants,
                "started_at": self._clock(),
                "finished_at": None,
                "exit_code": None,
                "signal": None,
                "reason": reason,
                "not_before": None,
                # A new attempt may grow onto any node again.
                "failed_nodes": (),
                "prerun": "running" if job.prerun == "pending" else job.prerun,
            }
        )
        # Before the placement is staged: a launch that cannot be built (the cluster key
        # out of reach) leaves the job pending for a later pass, not running on nodes
        # never told to start it until the launch times out.
        await self._writes.launch_ready(running)
        await self._writes.job_changed(
            running,
            job.state,
            Cause(kind=CauseKind.PLACED, job_id=job.job_id, message=reason),
        )
        await self._writes.send_launches(running)

    async def note_waits(self, waits: list[Wait]) -> None:
        """Why each waiting job waits, as the writer, within a unit. A wait of a new
        kind is journaled, with its kind (`JobRecord.wait_kind`); one of the kind the
        record has, with new figures (GPUs left), is shown, not journaled, or every
        change of free capacity would write one entry per pending job. One per pending
        job per pass: a look-up and a comparison each, and no text built but for the
        waits journaled."""
        state = self._state()
        jobs = state.jobs
        for action in waits:
            job = jobs.get(action.job_id)
            if job is None or job.state is not JobState.PENDING:
                continue
            cause = action.cause
            if cause.kind == job.wait_kind:
                state.refresh_wait(job.job_id, cause)
                continue
            reason = cause.describe()
            await self._writes.job_changed(
                job.model_copy(update={"reason": reason, "wait_kind": cause.kind}),
                job.state,
                Cause(kind=CauseKind.WAITING, job_id=job.job_id, message=reason),
            )


def timed_decide(
    snapshot: ClusterSnapshot,
    now: float,
    policy: Policy,
    waits: bool,
    explain: set[str],
    ranking: Ranking,
    ledger: KeptLedger,
) -> tuple[Decisions, float]:
    """decide(), and the CPU time it took: its own cost, not the time its thread
    waited for the interpreter or a core (a decide() moved to a thread beside a busy
    loop takes several times longer, and would stay there however cheap it was)."""
    started = time.thread_time()
    decisions = decide(
        snapshot, now, policy, waits=waits, explain=explain, ranking=ranking, ledger=ledger
    )
    return decisions, time.thread_time() - started


def still_holds(action: Preempt, job: JobRecord, jobs: Mapping[str, JobRecord]) -> bool:
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


class FreeNow:
    """Free GPUs of ready nodes as a pass's placements are applied: each node's read
    from state when a placement first names it, less what placements took since."""

    def __init__(self, state: BrainState) -> None:
        self._state = state
        self._free: dict[str, frozenset[int] | None] = {}

    def _on(self, node: str) -> frozenset[int] | None:
        if node not in self._free:
            self._free[node] = self._state.free_on(node)
        return self._free[node]

    def fits(self, action: Place) -> bool:
        """Every GPU the placement takes is free on a ready node (a share on a GPU
        already shared takes none: `Place.takes`), and every node it names is ready."""
        takes = action.grants if action.takes is None else action.takes
        return all(self._on(g.node) is not None for g in action.grants) and all(
            set(g.gpus) <= (self._on(g.node) or frozenset()) for g in takes
        )

    def take(self, grants: tuple[Grant, ...]) -> None:
        for grant in grants:
            free = self._on(grant.node)
            if free is not None:
                self._free[grant.node] = free - set(grant.gpus)


def preemption(action: Preempt) -> Preemption:
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
            guest_memory_mib=cause.guest_memory_mib,
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
