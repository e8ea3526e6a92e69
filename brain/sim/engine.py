"""The discrete-event replay: a trace in, what every job experienced out.

This module owns simulated time and the simulated cluster. At every event (a job
arrives, a job finishes, or the core asked to be woken) it builds a `ClusterSnapshot`
exactly as the live shell would, calls `brain.core.decide`, checks the decisions and
applies them: `Place` starts a job, `Preempt` stops it and requeues it pending (it
keeps its attained service and pays `preemption_cost_s` of lost work when it
resumes), `Resize` changes an elastic job's GPUs at once (it then stalls for
`resize_cost_s`, or `shrink_cost_s` when it shrank), `SetServiceLevel` is stored on
the job. The core never knows it is simulated; a decision the cluster cannot carry
out is a bug and raises.

Like Tiresias' simulator, a job runs at the speed of its trace duration wherever it
is placed, unless the config carries a `Scaling` model (Pollux's measured step times,
brain/sim/pollux.py): then a job's speed depends on how many GPUs it holds on how many
nodes, and an elastic job reports the throughput it saw at each size it ran at. A
model may also make a job's speed change as its work goes on (a `SpeedCurve`: a job
that re-chooses its batch size per epoch); the engine then integrates it exactly.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, cast, runtime_checkable

from brain.core import (
    DEFAULT_SERVICE_PRIOR,
    ELASTICITIES,
    BeliefErrors,
    ClusterSnapshot,
    Decisions,
    Grant,
    JobView,
    Measured,
    NodeView,
    Place,
    Policy,
    Preempt,
    QueueQuota,
    Resize,
    Service,
    ServiceDistribution,
    SetServiceLevel,
    Wait,
    decide,
    reads,
)
from brain.core.distribution import NO_SAMPLES, ServiceByClass, by_size_class, gpu_class
from brain.core.ordering import job_sequence
from brain.sim.trace import ClusterSpec, TraceError, TraceJob
from schemas.errors import AlnairError

# Work left below this many seconds is done: time is floating point.
_DONE_EPSILON = 1e-6
ProgressCallback = Callable[[int, int], None]


class SimulationError(AlnairError, RuntimeError):
    """The core produced a decision the simulated cluster cannot carry out (a bug)."""

    def __init__(self, reason: str, *, job_id: str | None = None, at: float | None = None) -> None:
        super().__init__(f"t={at}: job {job_id}: {reason}" if job_id else reason)
        self.job_id = job_id
        self.at = at


class Scaling(Protocol):
    """How fast a job runs on a placement (GPUs per node, in node order)."""

    def speed(self, job: TraceJob, per_node: Sequence[int]) -> float:
        """Trace seconds of work done per second: 1.0 at the job's requested size."""
        ...

    def throughput(self, job: TraceJob, per_node: Sequence[int]) -> float:
        """What the job's progress reports say there (samples/s, whole job)."""
        ...


@dataclass(frozen=True, slots=True)
class SpeedCurve:
    """A speed that changes with the work left (trace seconds): `speeds[i]` applies
    while the work left is above `floors[i]` (and at or below `floors[i - 1]`). Floors
    descend to 0; the first speed also applies above the first floor (work redone
    after a preemption). `tails[i]`: seconds to go from `floors[i]` to done."""

    floors: tuple[float, ...]
    speeds: tuple[float, ...]
    tails: tuple[float, ...]

    @classmethod
    def of(cls, phases: Sequence[tuple[float, float]]) -> SpeedCurve:
        """From (trace seconds of work, speed) per phase, in the order they run;
        phases with no work are dropped."""
        kept = [(work, speed) for work, speed in phases if work > 0]
        if not kept or any(speed <= 0 for _, speed in kept):
            raise ValueError("a speed curve needs work, and positive speeds")
        floors = [0.0] * len(kept)
        tails = [0.0] * len(kept)
        for i in range(len(kept) - 2, -1, -1):
            work, speed = kept[i + 1]
            floors[i] = floors[i + 1] + work
            tails[i] = tails[i + 1] + work / speed
        return cls(tuple(floors), tuple(speed for _, speed in kept), tuple(tails))

    def _phase(self, left: float) -> int:
        """The phase that runs with `left` trace seconds of work to do."""
        # First phase whose floor is below `left` (floors descend: bisect negated).
        i = bisect.bisect_right(self.floors, -left, key=lambda floor: -floor)
        return min(i, len(self.floors) - 1)

    def speed_at(self, left: float) -> float:
        return self.speeds[self._phase(left)]

    def seconds_to_finish(self, left: float) -> float:
        i = self._phase(left)
        return max(left - self.floors[i], 0.0) / self.speeds[i] + self.tails[i]

    def run(self, left: float, seconds: float) -> float:
        """Work left after running `seconds` from `left`."""
        while seconds > 0 and left > 0:
            i = self._phase(left)
            to_floor = (left - self.floors[i]) / self.speeds[i]
            if to_floor >= seconds or i == len(self.floors) - 1:
                return left - self.speeds[i] * seconds
            left = self.floors[i]
            seconds -= to_floor
        return left


@runtime_checkable
class CurvedScaling(Scaling, Protocol):
    """A `Scaling` whose speed on a placement may change as the job's work goes on."""

    def speed_curve(self, job: TraceJob, per_node: Sequence[int]) -> SpeedCurve | None:
        """The job's speed there by work left, or None: `speed` throughout."""
        ...


class LinearScaling:
    """No scaling data: a job runs at its trace speed at its requested size, and an
    elastic job proportionally faster or slower at another size."""

    def speed(self, job: TraceJob, per_node: Sequence[int]) -> float:
        size = sum(per_node)
        return 1.0 if size == job.gpus else size / job.gpus

    def throughput(self, job: TraceJob, per_node: Sequence[int]) -> float:
        return self.speed(job, per_node)


LINEAR_SCALING = LinearScaling()


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: Policy
    cluster: ClusterSpec
    preemption_cost_s: float = 0.0
    # Pseudo-samples the Gittins distribution starts from; finished jobs are added.
    service_prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR
    # False: the prior is the whole distribution (Tiresias reads a fixed file);
    # True: every finished job's service is added to it, as the live brain does.
    learn_service: bool = True
    # With `learn_service`: also learn from the jobs that have not finished (each has
    # run X GPU-s without finishing: its total exceeds X), by the Kaplan-Meier
    # estimate (`ServiceDistribution.with_censored`). False: finished jobs only.
    learn_censored: bool = True
    # Attained services (GPU-s) at which to record the learned Gittins index each
    # time the learned distribution changes (`SimResult.learned_index`); () records
    # nothing. For judging how fast the distribution converges.
    index_probes_gpu_s: tuple[float, ...] = ()
    queues: tuple[QueueQuota, ...] = ()
    # A running job's first progress report arrives after it has run this long (a few
    # steps to measure); only progress-aware orderings are told.
    progress_report_after_s: float = 60.0
    # How wrong a job's own idea of its total work may be: each job's total is off by
    # a fixed factor in [1/(1+e), 1+e], drawn from a hash of its id (deterministic).
    # 0 means jobs know their total steps exactly (as `iterations` in the trace).
    progress_error: float = 0.0
    # Speeds per placement (None: trace speed, linear for elastic jobs at other sizes).
    scaling: Scaling | None = None
    # Seconds a job makes no progress after a resize (restart of its workers), and
    # after it first starts (Pollux's simulator charges 30 s for both).
    resize_cost_s: float = 0.0
    start_cost_s: float = 0.0
    # A shrink's stall when it differs from a grow's (Horovod elastic: a grow waits for
    # new workers to start, a shrink only for the removed ones to leave). None: the
    # same as `resize_cost_s`.
    shrink_cost_s: float | None = None
    # An elastic job reports its throughput at a new size this long after it starts
    # stepping there (past any start or resize stall); with an elasticity policy the
    # report is an event for the brain, as a progress message on the bus.
    throughput_report_after_s: float = 30.0


class _Phase(Enum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True)
class _Job:
    """The simulator's mutable record of one job; private to the event loop."""

    spec: TraceJob
    phase: _Phase = _Phase.PENDING
    grants: tuple[Grant, ...] = ()
    # What it has run, as the core's model reckons it for the live brain too.
    service: Service = field(default_factory=Service)
    pending_since: float = 0.0
    remaining_s: float = 0.0
    queued_s: float = 0.0
    service_level: int = 0
    service_level_since: float | None = None
    first_started_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    resizes: int = 0
    # Trace seconds of work per second on the current grants, and seconds of no
    # progress still owed (start or resize cost).
    speed: float = 1.0
    stall_s: float = 0.0
    # Set: the speed changes with the work left (`speed` is the current one).
    curve: SpeedCurve | None = None
    # Throughput the job reported at each size it ran at (elastic jobs only), and the
    # report still to come for its current size: (when, size, samples/s).
    observed: dict[int, Measured] = field(default_factory=dict)
    report: tuple[float, int, float] | None = None
    view: JobView | None = None
    # When its last resize took effect (after its stall) and how long that stall was;
    # the size its last retreat left, and when (see `JobView`).
    last_resize_at: float | None = None
    last_resize_s: float | None = None
    gain_ceiling: int | None = None
    gain_ceiling_at: float | None = None
    # GPU-seconds held while stalled by resizes.
    resize_gpu_seconds: float = 0.0

    @property
    def size(self) -> int:
        return sum(len(g.gpus) for g in self.grants)


@dataclass(frozen=True, slots=True)
class JobOutcome:
    job_id: str
    gpus: int
    submitted_at: float
    first_started_at: float | None
    finished_at: float | None
    # Wall seconds the job held GPUs (including time lost to preemptions).
    executed_s: float
    # Seconds the job spent pending, over all its waits.
    queued_s: float
    preemptions: int
    resizes: int = 0
    # GPU-seconds held (GPUs x seconds, over every size it ran at), and of them those
    # held while a resize stalled the job.
    gpu_seconds: float = 0.0
    resize_gpu_seconds: float = 0.0

    @property
    def jct(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass(frozen=True, slots=True)
class PreemptionRecord:
    at: float
    job_id: str
    # The cause's type ("Outranked", "QuotaReclaim") and what it says.
    kind: str
    cause: str


@dataclass(frozen=True, slots=True)
class SimResult:
    outcomes: tuple[JobOutcome, ...]
    capacity_gpus: int
    # (time, GPUs busy from then on), one point per change.
    busy_timeline: tuple[tuple[float, int], ...]
    preemptions: tuple[PreemptionRecord, ...]
    decide_calls: int
    # With `SimConfig.index_probes_gpu_s`: (finished jobs so far, the Gittins index
    # at each probe) every time the learned distribution changed.
    learned_index: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @property
    def unfinished(self) -> tuple[str, ...]:
        return tuple(o.job_id for o in self.outcomes if o.finished_at is None)


@dataclass(slots=True)
class _Replay:
    config: SimConfig
    jobs: list[_Job]
    nodes: tuple[str, ...]
    switch_of: dict[str, str]
    free: dict[str, set[int]]
    reveal_durations: bool
    report_progress: bool
    report_throughput: bool = False
    now: float = 0.0
    next_arrival: int = 0
    pending: dict[str, _Job] = field(default_factory=dict)
    running: dict[str, _Job] = field(default_factory=dict)
    finished: int = 0
    distribution: ServiceDistribution = DEFAULT_SERVICE_PRIOR
    # Learn finished jobs' service only for an order that reads the distribution.
    learn_service: bool = False
    # The finished jobs' distribution (on the prior) that `distribution` derives from
    # when unfinished jobs are learned from too (censored samples), and how many jobs
    # had finished when `distribution` was last derived.
    learned: ServiceDistribution = DEFAULT_SERVICE_PRIOR
    learn_censored: bool = False
    learned_at: int = 0
    learned_index: list[tuple[int, tuple[float, ...]]] = field(default_factory=list)
    # For an order that reads `class_distribution`: finished jobs' service by size
    # class (`gpu_class`), and what the order sees (each shrunk toward the pooled).
    learn_classes: bool = False
    learned_by_class: dict[int, ServiceDistribution] = field(default_factory=dict)
    service_by_class: ServiceByClass | None = None
    # For an order that reads `progress_error`: every finished job's actual total over
    # the total its progress reports believed, learned as the live brain learns it.
    learn_error: bool = False
    errors: BeliefErrors = field(default_factory=BeliefErrors)
    # The scaling model's speed may change as work goes on (`CurvedScaling`): asked
    # once, as a runtime Protocol check is slow and a start asks it every time.
    curved: bool = False
    # Hand `decide` only the pending jobs it can act on (`_deciding`): set for strict
    # FIFO with nothing that reorders its walk (no quotas, no starvation guard).
    head_of_line_prefix: bool = False
    wake_at: float | None = None
    busy: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)
    preemption_log: list[PreemptionRecord] = field(default_factory=list)
    decide_calls: int = 0

    # -- time ------------------------------------------------------------------------

    def next_event_time(self) -> float | None:
        candidates: list[float] = []
        if self.next_arrival < len(self.jobs):
            candidates.append(self.jobs[self.next_arrival].spec.submit_time)
        candidates.extend(
            self.now
            + job.stall_s
            + (
                job.remaining_s / job.speed
                if job.curve is None
                else job.curve.seconds_to_finish(job.remaining_s)
            )
            for job in self.running.values()
        )
        if self.wake_at is not None and self.wake_at > self.now:
            candidates.append(self.wake_at)
        if self.report_throughput:
            candidates.extend(
                job.report[0] for job in self.running.values() if job.report is not None
            )
        if self.report_progress:
            # The first progress report is an event for the brain, as on the bus.
            warmup = self.config.progress_report_after_s
            candidates.extend(
                self.now + warmup - ran
                for ran in (job.service.executed_to(self.now) for job in self.running.values())
                if ran < warmup
            )
        return min(candidates) if candidates else None

    def advance(self, to: float) -> None:
        elapsed = to - self.now
        if elapsed > 0:
            for job in self.running.values():
                stalled = min(job.stall_s, elapsed)
                job.stall_s -= stalled
                if job.curve is None:
                    job.remaining_s -= job.speed * (elapsed - stalled)
                else:
                    job.remaining_s = job.curve.run(job.remaining_s, elapsed - stalled)
                    job.speed = job.curve.speed_at(job.remaining_s)
        self.now = to

    # -- events ----------------------------------------------------------------------

    def complete(self) -> None:
        done = [job for job in self.running.values() if job.remaining_s <= _DONE_EPSILON]
        for job in done:
            self._release(job)
            del self.running[job.spec.job_id]
            job.phase = _Phase.DONE
            job.finished_at = self.now
            job.service = job.service.ended(self.now)
            self.finished += 1
            if self.learn_error and job.spec.duration_s > 0:
                # What a shell sees: the run time, and the rate its reports showed.
                self.errors.learn(job.service.executed_s, self._progress_rate(job))
            if self.learn_service:
                # Learn the service distribution online, as the live brain does.
                self.learned = self.learned.with_sample(job.service.attained_gpu_s)
                if self.learn_classes:
                    size_class = gpu_class(job.spec.gpus)
                    own = self.learned_by_class.get(size_class, NO_SAMPLES)
                    self.learned_by_class[size_class] = own.with_sample(job.service.attained_gpu_s)
                if not self.learn_censored:
                    self.distribution = self.learned
                    self._record_index()

    def learn_unfinished(self) -> None:
        """Derive the distribution the policy sees from the finished jobs and, as
        censored samples, the service of every job not finished yet (running, or
        preempted with service); and, for an order that reads it, each size class's,
        shrunk toward the pooled one. Re-derived once another 1/64 of the jobs finished
        so far (at least one) have finished: each derivation is linear in the jobs
        seen, so deriving at every finish would make a replay quadratic in its trace."""
        if not self.learn_censored and not self.learn_classes:
            return
        since = self.finished - self.learned_at
        if since <= 0 or since < self.finished // 64:
            return
        self.learned_at = self.finished
        now = self.now
        unfinished = [
            (job.spec.gpus, attained)
            for job in (*self.running.values(), *self.pending.values())
            if (attained := job.service.attained_to(now)) > 0.0
        ]
        if self.learn_censored:
            self.distribution = self.learned.with_censored(attained for _, attained in unfinished)
            self._record_index()
        if self.learn_classes:
            censored = unfinished if self.learn_censored else []
            self.service_by_class = by_size_class(
                self.learned_by_class, censored, self.distribution
            )

    def _record_index(self) -> None:
        probes = self.config.index_probes_gpu_s
        if probes:
            index = self.distribution.gittins_indexer(self.config.policy.gittins_quantum_gpu_s)
            self.learned_index.append((self.finished, tuple(map(index, probes))))

    def measure(self) -> None:
        """Throughput reports that arrived by now become what the policy sees."""
        for job in self.running.values():
            if job.report is not None and job.report[0] <= self.now + _DONE_EPSILON:
                at, size, rate = job.report
                job.observed[size] = Measured(size, rate, at=at)
                job.report = None
                job.view = None

    def arrive(self) -> None:
        while (
            self.next_arrival < len(self.jobs)
            and self.jobs[self.next_arrival].spec.submit_time <= self.now
        ):
            job = self.jobs[self.next_arrival]
            job.pending_since = job.spec.submit_time
            self.pending[job.spec.job_id] = job
            self.next_arrival += 1

    # -- the core --------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        nodes = tuple(
            NodeView(
                name=name,
                gpus=tuple(range(self.config.cluster.gpus_per_node)),
                free=frozenset(self.free[name]),
                switch=self.switch_of[name],
            )
            for name in self.nodes
        )
        return ClusterSnapshot(
            nodes=nodes,
            # A pending job's view is dropped whenever it changes (placed, preempted,
            # band set), so a kept one is current: most cycles rebuild none.
            pending=tuple(
                [
                    job.view if job.view is not None else self._view(job)
                    for job in (
                        self._deciding() if self.head_of_line_prefix else self.pending.values()
                    )
                ]
            ),
            running=tuple(self._view(job) for job in self.running.values()),
            queues=self.config.queues,
            service_distribution=self.distribution,
            error_distribution=self.errors.view if self.learn_error else None,
            service_by_class=self.service_by_class,
        )

    def _deciding(self) -> list[_Job]:
        """Under strict FIFO, the pending jobs up to the first that cannot fit.

        `fifo` walks pending jobs in submission order (the order they arrive here), places
        each that fits in the GPUs left and stops at the first that does not (a job larger
        than the cluster is skipped, not stopped at). The jobs after that first one only
        get a `Wait`, which the simulator does not act on: leaving them out changes no
        placement and no wake, and makes a cycle cost the jobs it can start, not the
        thousands queued behind them (a 9,953-job replay: 129 CPU-s before)."""
        capacity = self.config.cluster.total_gpus
        free = capacity - self.busy
        wanted = 0
        kept: list[_Job] = []
        for job in self.pending.values():
            kept.append(job)
            gpus = job.spec.gpus
            if gpus <= capacity:
                wanted += gpus
                if wanted > free:
                    break
        return kept

    def _view(self, job: _Job) -> JobView:
        # Pending jobs do not change between events; running ones gain service.
        if job.view is not None and job.phase is _Phase.PENDING:
            return job.view
        spec = job.spec
        progress = self._progress(job) if self.report_progress else None
        view = JobView(
            job_id=spec.job_id,
            gpus=spec.gpus,
            submitted_at=spec.submit_time,
            queue=spec.queue,
            tenant=spec.tenant,
            priority=spec.priority or 0,
            grants=job.grants,
            started_at=job.service.run_since,
            attained_gpu_seconds=job.service.attained_to(self.now),
            pending_since=job.pending_since,
            service_level=job.service_level,
            service_level_since=job.service_level_since,
            declared_duration_s=spec.duration_s if self.reveal_durations else None,
            executed_seconds=job.service.executed_to(self.now),
            progress_fraction=progress,
            progress_rate_per_s=None if progress is None else self._progress_rate(job),
            min_gpus=spec.min_gpus,
            max_gpus=spec.max_gpus,
            throughput=(
                tuple(job.observed[size] for size in sorted(job.observed)) if job.observed else ()
            ),
            last_resize_at=job.last_resize_at,
            last_resize_s=job.last_resize_s,
            gain_ceiling=job.gain_ceiling,
            gain_ceiling_at=job.gain_ceiling_at,
        )
        job.view = view
        return view

    def _progress(self, job: _Job) -> float | None:
        """Fraction of its work the job reports done. Work lost to a preemption shows
        as progress lost, as when a job restores an older checkpoint."""
        warmup = self.config.progress_report_after_s
        if not self.report_progress or job.service.executed_to(self.now) < warmup:
            return None
        if job.spec.duration_s <= 0:
            return 1.0
        done_s = job.spec.duration_s - job.remaining_s
        believed_total_s = job.spec.duration_s * _misestimate(
            job.spec.job_id, self.config.progress_error
        )
        # A job that overran its believed total still reports "almost done".
        return min(0.999, max(0.0, done_s / believed_total_s))

    def _progress_rate(self, job: _Job) -> float:
        """The fraction per second the job's reports show while it runs."""
        believed_total_s = job.spec.duration_s * _misestimate(
            job.spec.job_id, self.config.progress_error
        )
        return job.speed / believed_total_s if believed_total_s > 0 else 1.0

    def apply(self, decisions: Decisions) -> None:
        for action in decisions.actions:
            if type(action) is Wait:
                continue  # most actions, and nothing for the cluster to do
            if isinstance(action, Preempt):
                self._preempt(action)
            elif isinstance(action, Place):
                self._place(action)
            elif isinstance(action, Resize):
                self._resize(action)
            elif isinstance(action, SetServiceLevel):
                job = self._known(action.job_id)
                job.service_level = action.level
                job.service_level_since = action.since
                job.view = None
        self.wake_at = decisions.wake_at
        if not self.timeline or self.timeline[-1][1] != self.busy:
            self.timeline.append((self.now, self.busy))

    def _known(self, job_id: str) -> _Job:
        job = self.pending.get(job_id) or self.running.get(job_id)
        if job is None:
            raise SimulationError(
                "decision for a job that is neither pending nor running", job_id=job_id, at=self.now
            )
        return job

    def _place(self, action: Place) -> None:
        job = self.pending.pop(action.job_id, None)
        if job is None:
            raise SimulationError("placed, but not pending", job_id=action.job_id, at=self.now)
        self._check_size(job, action.grants, action.job_id)
        for grant in action.grants:
            free = self.free.get(grant.node)
            if (
                free is None
                or not set(grant.gpus) <= free
                or len(set(grant.gpus)) != len(grant.gpus)
            ):
                raise SimulationError(
                    f"granted busy or unknown GPUs {grant}", job_id=action.job_id, at=self.now
                )
            free.difference_update(grant.gpus)
        job.queued_s += self.now - job.pending_since
        if job.first_started_at is None:
            job.first_started_at = self.now
            job.remaining_s = job.spec.duration_s
            job.stall_s += self.config.start_cost_s
        job.phase = _Phase.RUNNING
        job.grants = action.grants
        job.service = job.service.started(self.now, job.size)
        job.view = None
        self._set_speed(job)
        self.busy += job.size
        self.running[action.job_id] = job

    def _check_size(self, job: _Job, grants: tuple[Grant, ...], job_id: str) -> None:
        granted = sum(len(g.gpus) for g in grants)
        spec = job.spec
        if spec.min_gpus is None or spec.max_gpus is None:
            if granted != spec.gpus:
                raise SimulationError(
                    f"granted {granted} GPUs for a {spec.gpus}-GPU gang", job_id=job_id, at=self.now
                )
        elif not spec.min_gpus <= granted <= spec.max_gpus:
            raise SimulationError(
                f"granted {granted} GPUs to an elastic job of {spec.min_gpus}..{spec.max_gpus}",
                job_id=job_id,
                at=self.now,
            )

    def _set_speed(self, job: _Job) -> None:
        per_node = [len(g.gpus) for g in job.grants]
        scaling = self.config.scaling or LINEAR_SCALING
        job.curve = (
            cast(CurvedScaling, scaling).speed_curve(job.spec, per_node) if self.curved else None
        )
        if job.curve is None:
            job.speed = scaling.speed(job.spec, per_node)
        else:
            job.speed = job.curve.speed_at(job.remaining_s)
        if job.spec.elastic:
            # Its supervisor reports the samples/s (a batch-adapting job: its goodput)
            # at this size once it has stepped there a while; the policy reads it from
            # `JobView.throughput`.
            when = self.now + job.stall_s + self.config.throughput_report_after_s
            job.report = (when, job.size, scaling.throughput(job.spec, per_node))

    def _resize(self, action: Resize) -> None:
        job = self.running.get(action.job_id)
        if job is None or not job.spec.elastic:
            raise SimulationError(
                "resized, but not a running elastic job", job_id=action.job_id, at=self.now
            )
        self._check_size(job, action.grants, action.job_id)
        held = {(g.node, gpu) for g in job.grants for gpu in g.gpus}
        wanted = [(g.node, gpu) for g in action.grants for gpu in g.gpus]
        if len(set(wanted)) != len(wanted):
            raise SimulationError("resize grants a GPU twice", job_id=action.job_id, at=self.now)
        added = [(node, gpu) for node, gpu in wanted if (node, gpu) not in held]
        for node, gpu in added:
            if gpu not in self.free.get(node, set()):
                raise SimulationError(
                    f"resize grants busy or unknown GPU {node}[{gpu}]",
                    job_id=action.job_id,
                    at=self.now,
                )
        for node, gpu in held - set(wanted):
            self.free[node].add(gpu)
        for node, gpu in added:
            self.free[node].discard(gpu)
        self.busy += len(wanted) - len(held)
        job.grants = action.grants
        job.service = job.service.resized(self.now, len(wanted))
        job.resizes += 1
        shrink_cost = self.config.shrink_cost_s
        shrank = len(wanted) < len(held)
        cost = shrink_cost if shrank and shrink_cost is not None else self.config.resize_cost_s
        job.stall_s += cost
        # It commits once its workers step at the new size: after the stall.
        job.last_resize_at = self.now + job.stall_s
        job.last_resize_s = cost
        job.resize_gpu_seconds += cost * len(wanted)
        if action.retreat:
            job.gain_ceiling, job.gain_ceiling_at = len(held), self.now
        job.view = None
        self._set_speed(job)

    def _preempt(self, action: Preempt) -> None:
        job = self.running.pop(action.job_id, None)
        if job is None or job.grants != action.grants:
            raise SimulationError(
                "preempted, but not running on those GPUs", job_id=action.job_id, at=self.now
            )
        self._release(job)
        job.phase = _Phase.PENDING
        job.grants = ()
        job.service = job.service.ended(self.now)
        job.pending_since = self.now
        job.preemptions += 1
        # Work since the last checkpoint and the restart are lost: charged on resume.
        job.remaining_s += self.config.preemption_cost_s
        job.stall_s = 0.0
        job.report = None
        job.last_resize_at = job.last_resize_s = None
        job.view = None
        self.pending[action.job_id] = job
        self.preemption_log.append(
            PreemptionRecord(self.now, action.job_id, type(action.cause).__name__, action.reason)
        )

    def _release(self, job: _Job) -> None:
        for grant in job.grants:
            self.free[grant.node].update(grant.gpus)
        self.busy -= job.size


def _misestimate(job_id: str, error: float) -> float:
    if error <= 0:
        return 1.0
    spread = zlib.crc32(job_id.encode()) / 0xFFFFFFFF * 2.0 - 1.0
    return float((1.0 + error) ** spread)


def _new_replay(trace: Sequence[TraceJob], config: SimConfig) -> _Replay:
    cluster = config.cluster
    names = tuple(f"node{i:03d}" for i in range(cluster.nodes))
    per_switch = cluster.nodes_per_switch or cluster.nodes
    # Validated by `simulate`: the policy names a known plugin.
    sizes_jobs = ELASTICITIES[config.policy.elasticity].sizes_jobs
    return _Replay(
        config=config,
        # In the core's submission order (time, then job id), so that pending jobs
        # arrive in the order every order breaks its ties by.
        jobs=[
            _Job(spec)
            for spec in sorted(trace, key=lambda j: (j.submit_time, job_sequence(j.job_id)))
        ],
        nodes=names,
        switch_of={name: f"switch{i // per_switch}" for i, name in enumerate(names)},
        free={name: set(range(cluster.gpus_per_node)) for name in names},
        reveal_durations=reads(config.policy.order, "declared_duration"),
        report_progress=reads(config.policy.order, "progress"),
        learn_error=reads(config.policy.order, "progress_error"),
        learn_classes=config.learn_service and reads(config.policy.order, "class_distribution"),
        report_throughput=sizes_jobs,
        distribution=config.service_prior,
        learn_service=config.learn_service and reads(config.policy.order, "distribution"),
        learned=config.service_prior,
        learn_censored=config.learn_service
        and config.learn_censored
        and reads(config.policy.order, "distribution"),
        curved=isinstance(config.scaling, CurvedScaling),
        head_of_line_prefix=(
            config.policy.order == "fifo"
            and not config.queues
            and config.policy.starvation_guard_s is None
            and not sizes_jobs
        ),
    )


def check_trace_fits(trace: Sequence[TraceJob], policy: Policy) -> None:
    """Refuse a trace that lacks what the policy's order reads: `priority` on a trace
    with no priorities would silently be FIFO with backfill."""
    if reads(policy.order, "priority") and all(job.priority is None for job in trace):
        raise TraceError(
            f"--policy {policy.order} orders by priority, and this trace has no `priority` "
            "column (or no job with one); add the column, or choose another order"
        )


def simulate(
    trace: Sequence[TraceJob], config: SimConfig, *, on_progress: ProgressCallback | None = None
) -> SimResult:
    """Replay `trace` to the end (or until nothing can ever start) under `config`.
    Raises `TraceError` for a trace the policy cannot run on (`check_trace_fits`)."""
    policy = config.policy.validate()
    check_trace_fits(trace, policy)
    replay = _new_replay(trace, config)
    total = len(replay.jobs)
    while True:
        at = replay.next_event_time()
        if at is None:
            break
        replay.advance(at)
        before = replay.finished
        replay.complete()
        replay.measure()
        replay.arrive()
        replay.learn_unfinished()
        replay.decide_calls += 1
        replay.apply(decide(replay.snapshot(), replay.now, policy, waits=False))
        if on_progress is not None and replay.finished != before:
            on_progress(replay.finished, total)
    outcomes = tuple(
        JobOutcome(
            job_id=job.spec.job_id,
            gpus=job.spec.gpus,
            submitted_at=job.spec.submit_time,
            first_started_at=job.first_started_at,
            finished_at=job.finished_at,
            executed_s=job.service.executed_to(replay.now),
            queued_s=job.queued_s,
            preemptions=job.preemptions,
            resizes=job.resizes,
            gpu_seconds=job.service.attained_to(replay.now),
            resize_gpu_seconds=job.resize_gpu_seconds,
        )
        for job in replay.jobs
    )
    return SimResult(
        outcomes=outcomes,
        capacity_gpus=config.cluster.total_gpus,
        busy_timeline=tuple(replay.timeline),
        preemptions=tuple(replay.preemption_log),
        decide_calls=replay.decide_calls,
        learned_index=tuple(replay.learned_index),
    )
