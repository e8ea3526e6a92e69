"""Queue-order plugins: how jobs rank against each other for GPUs.

An ordering ranks every runnable job, pending and running alike, so that the decision
pipeline can both start pending jobs and preempt running ones that rank behind them.
It says whether a pending job that cannot be placed holds back every pending job
behind it (strict FIFO) or lets them try (backfill), which LAS bands jobs moved to,
and when its ranks will next change on their own (a job crossing a band threshold).

Rank keys are tuples compared ascending: smaller runs first. The pipeline breaks ties
by submission, so a plugin never has to.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

from brain.core.distribution import (
    DEFAULT_ERROR_PRIOR,
    ServiceByClass,
    ServiceDistribution,
    gpu_class,
)
from brain.core.model import BandCrossed, Grant, JobView, SetServiceLevel
from brain.core.sharing import GPU_MILLI

# Attained service is accumulated in floating point; a job that reaches a threshold
# exactly must count as past it, or the core would ask to be woken again and again
# a hair before the crossing.
SERVICE_EPSILON: Final = 1e-6


@functools.lru_cache(maxsize=1 << 16)
def job_sequence(job_id: str) -> tuple[int, str]:
    """Sort key for job ids: numeric ids in numeric order, others after, by text.
    Cached: it is asked for every job of every cycle whose submissions tie."""
    return (int(job_id), "") if job_id.isdigit() else (1 << 62, job_id)


class _Indices:
    """What `gittins`, `gittins-size` and `progress-gittins` make of one distribution
    object, kept from one cycle to the next while it is in use (`indices_of`): a
    learned distribution stays the same object over many cycles, and so do a waiting
    job's service and belief. Keyed by identity, not value: hashing a distribution's
    samples for every look-up cost more than most look-ups saved."""

    __slots__ = ("_compact", "_exact", "_indexers", "_remaining", "_scaled", "distribution")

    def __init__(self, distribution: ServiceDistribution) -> None:
        self.distribution = distribution  # held: its id is no other object's meanwhile
        self._compact: Callable[[float, float], float | None] | None = None
        self._exact: dict[float, float] = {}
        self._indexers: dict[float, Callable[[float], float]] = {}
        self._remaining: Callable[[float, float], float | None] | None = None
        self._scaled: dict[tuple[float, float], float | None] = {}

    def at_quantum(self, quantum: float) -> Callable[[float], float]:
        """`ServiceDistribution.gittins_indexer` (`gittins`): its tail sums are linear
        in the samples, thousands once many jobs finished, for every cycle."""
        indexer = self._indexers.get(quantum)
        if indexer is None:
            indexer = self._indexers[quantum] = self.distribution.gittins_indexer(quantum)
        return indexer

    def exact(self, attained: float) -> float:
        """`ServiceDistribution.gittins_index_exact` of the distribution compressed to
        `GITTINS_POINTS` (each index is then linear in at most that many samples)."""
        index = self._exact.get(attained)
        if index is None:
            if self._compact is None:
                compact = self.distribution.compressed(GITTINS_POINTS)
                self._compact = compact.remaining_indexer()
            left = self._compact(1.0, attained)
            index = self._exact[attained] = (
                0.0 if left is None else math.inf if left <= 0.0 else 1.0 / left
            )
            _MEMO.added()
        return index

    def scaled(self, scale: float, done: float) -> float | None:
        """`ServiceDistribution.scaled_gittins_remaining`."""
        key = (scale, done)
        if key in self._scaled:
            return self._scaled[key]
        if self._remaining is None:
            self._remaining = self.distribution.remaining_indexer()
        left = self._scaled[key] = self._remaining(scale, done)
        _MEMO.added()
        return left

    def held(self) -> int:
        return len(self._exact) + len(self._scaled)

    def forget(self) -> None:
        """The indices computed (what keeps the distribution's chains stays)."""
        self._exact.clear()
        self._scaled.clear()


class _MemoBudget:
    """How many indices the kept distributions hold together: past `limit` (about
    20 MB), every one's are forgotten and computed again as they are asked for. A
    running job's belief moves every cycle, so without a bound the indices of the
    distribution in use would grow for as long as it is."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def added(self) -> None:
        self.held += 1
        if self.held > self.limit:
            with _INDICES_LOCK:
                for kept in _INDICES.values():
                    kept.forget()
                self.held = 0


# The distributions whose indices are kept (the latest used).
_INDICES_KEPT: Final = 16
_INDICES: dict[int, _Indices] = {}
_INDICES_LOCK = threading.Lock()  # the live brain may decide in a worker thread
_MEMO = _MemoBudget(1 << 17)


def indices_of(distribution: ServiceDistribution) -> _Indices:
    with _INDICES_LOCK:
        kept = _INDICES.get(id(distribution))
        if kept is None or kept.distribution is not distribution:
            if len(_INDICES) >= _INDICES_KEPT:
                _MEMO.held -= _INDICES.pop(next(iter(_INDICES))).held()
            kept = _INDICES[id(distribution)] = _Indices(distribution)
        return kept


def submission_key(job: JobView) -> tuple[float, tuple[int, str]]:
    return (job.submitted_at, job_sequence(job.job_id))


@dataclass(frozen=True, slots=True)
class OrderContext:
    now: float
    las_thresholds_gpu_s: tuple[float, ...]
    gittins_quantum_gpu_s: float
    distribution: ServiceDistribution
    progress_probe_s: float = 60.0
    # Finished jobs' actual total over the total they believed (their progress
    # reports), for orders that read `progress_error`; None: `DEFAULT_ERROR_PRIOR`.
    error_distribution: ServiceDistribution | None = None
    # The service distribution by size class, for orders that read
    # `class_distribution`; None: `distribution` for every job.
    service_by_class: ServiceByClass | None = None


class Ranked(NamedTuple):
    """A job and its rank. A named tuple, not a dataclass: one is built per job per
    decision cycle, and tuples are the cheapest immutable record to build."""

    job: JobView
    rank: tuple[float, ...]
    # What the rank means, for an operator reading a cause: "las band 1".
    label: str


@dataclass(frozen=True, slots=True)
class Ordered:
    ranked: tuple[Ranked, ...]
    # True: a pending job that cannot start holds back every pending job behind it.
    head_of_line_blocking: bool
    level_changes: tuple[SetServiceLevel, ...] = ()
    wake_at: float | None = None
    # True: the first rank key is an entitlement (a declared priority), so elastic jobs
    # of a better class reach what they asked for before a worse class gets more than
    # its minimum. False (queue heuristics: LAS bands, Gittins, FIFO): the elasticity
    # stage shares the GPUs above minimums by marginal gain alone.
    rank_entitles: bool = False
    # Set when ranks change as running jobs cross LAS band thresholds: when a job
    # running on these grants from now will cross its band's threshold. The pipeline
    # asks to be woken then for every job it starts in this cycle, too.
    crossing: Crossing | None = None

    @property
    def jobs(self) -> tuple[JobView, ...]:
        ordered = sorted(self.ranked, key=lambda r: (r.rank, submission_key(r.job)))
        return tuple(r.job for r in ordered)


Ordering = Callable[[Sequence[JobView], OrderContext], Ordered]


def fifo(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """First come, first served, strictly: nothing overtakes the head of the queue,
    and nothing preempts a running job (only a quota reclaim can).

    Tiresias' `fifo` is the same: it stops at the first pending job that does not fit.
    """
    running, pending = (0.0,), (1.0,)
    new = tuple.__new__  # `Ranked(...)`, without its Python-level constructor
    ranked = tuple([new(Ranked, (j, running if j.grants else pending, "fifo")) for j in jobs])
    return Ordered(ranked, head_of_line_blocking=True)


def priority(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """Higher priority first; at equal priority a running job keeps its GPUs (no
    churn among equals), then FIFO. Lower priorities may backfill."""
    labels: dict[int, str] = {}
    ranked: list[Ranked] = []
    add, new = ranked.append, tuple.__new__  # `Ranked(...)`, without its constructor
    for j in jobs:
        label = labels.get(j.priority)
        if label is None:
            label = labels[j.priority] = f"priority {j.priority}"
        add(new(Ranked, (j, (-j.priority, 0 if j.grants else 1), label)))
    return Ordered(tuple(ranked), head_of_line_blocking=False, rank_entitles=True)


@dataclass(frozen=True, slots=True)
class _Band:
    level: int
    since: float
    change: SetServiceLevel | None


def _band(job: JobView, context: OrderContext) -> _Band:
    """The LAS band a job's attained service puts it in, and since when it is there."""
    thresholds = context.las_thresholds_gpu_s
    level = bisect.bisect_right(thresholds, job.attained_gpu_seconds + SERVICE_EPSILON)
    if level == job.service_level:
        since = job.submitted_at if job.service_level_since is None else job.service_level_since
        return _Band(level, since, None)
    crossed = thresholds[level - 1] if level > 0 else 0.0
    cause = BandCrossed(job.attained_gpu_seconds, crossed, job.service_level, level)
    return _Band(level, context.now, SetServiceLevel(job.job_id, level, context.now, cause))


def next_band_crossing(
    job: JobView, grants: Sequence[Grant], thresholds: Sequence[float], now: float
) -> float | None:
    """When a job running on `grants` from `now` will cross its band's upper
    threshold (None: it is in the last band, or holds no GPU). A share accrues its
    share of a GPU a second."""
    gpus = _accruing(job, grants)
    if gpus <= 0:
        return None
    level = bisect.bisect_right(thresholds, job.attained_gpu_seconds + SERVICE_EPSILON)
    if level >= len(thresholds):
        return None
    return now + (thresholds[level] - job.attained_gpu_seconds) / gpus


def _accruing(job: JobView, grants: Sequence[Grant]) -> float:
    """GPU-seconds of service a second on `grants`: their GPUs, or a share's share."""
    # Once for every running job a cycle ranks, and every job it starts: a loop, not
    # `sum` over a generator, whose frame cost more than the rest (most hold one grant).
    gpus = 0
    for grant in grants:
        gpus += len(grant.gpus)
    # `JobView.shared` and `gpu_size`, inline.
    demand = job.demand
    if gpus and demand is not None and demand.fractional:
        return demand.gpu_milli / GPU_MILLI
    return gpus


def tiresias_band_crossing(
    job: JobView, grants: Sequence[Grant], thresholds: Sequence[float], now: float
) -> float | None:
    """When Tiresias' simulator next looks at a running job's band: it subtracts the
    job's *wall* seconds run (not its GPU-seconds) from the threshold before dividing
    by its GPUs, and rounds down (Python 2), so a multi-GPU job that has run before
    is looked at late, and demoted only then (or at an unrelated event before)."""
    gpus = _accruing(job, grants)
    if gpus <= 0:
        return None
    level = bisect.bisect_right(thresholds, job.attained_gpu_seconds + SERVICE_EPSILON)
    if level >= len(thresholds):
        return None
    at = now + math.floor((thresholds[level] - job.executed_seconds) / gpus)
    return at if at > now else next_band_crossing(job, grants, thresholds, now)


Crossing = Callable[[JobView, Sequence[Grant], Sequence[float], float], float | None]


def _within_band(job: JobView, level: float, since: float, now: float) -> tuple[float, ...]:
    """A job's rank: its LAS band `level`, then where it stands within it (smaller first).

    The jobs running in the band keep going (bands exist so that jobs of one band do
    not churn), in the order they started running there: the job that has held its
    GPUs in the band the shortest time is the first to lose them, so a job that
    entered the last band long ago does not hold its GPUs there for good. Then the
    band's other jobs (waiting, or just demoted into it) by least attained service,
    LAS's own rule: with service times whose hazard falls as service grows (as job
    durations on GPU clusters do), less service means likelier to finish soon."""
    if job.grants and since < now:
        started = job.started_at if job.started_at is not None else since
        return (level, 0.0, started if started > since else since)
    return (level, 1.0, job.attained_gpu_seconds)


def _within_band_tiresias(
    job: JobView, level: float, since: float, now: float
) -> tuple[float, ...]:
    """Tiresias' simulator's order within a queue, as its lists behave: a job enters
    at the tail (new, or demoted); after every pass the waiting jobs are moved behind
    the running ones, in the order they stood. So running jobs stand in the order they
    started in the queue, and among waiting jobs the one preempted last stands first,
    ahead of every job that has not run in the queue since it entered it."""
    if job.grants:
        if since < now:
            started = job.started_at if job.started_at is not None else since
            return (level, 0.0, max(started, since))
        return (level, 2.0, now)
    waiting = job.submitted_at if job.pending_since is None else job.pending_since
    if waiting > since:
        return (level, 1.0, -waiting)
    return (level, 2.0, since)


WithinBand = Callable[[JobView, float, float, float], tuple[float, ...]]


def _las(
    jobs: Sequence[JobView], context: OrderContext, within: WithinBand, crossing: Crossing
) -> Ordered:
    ranked: list[Ranked] = []
    changes: list[SetServiceLevel] = []
    thresholds = context.las_thresholds_gpu_s
    now = context.now
    last = len(thresholds)
    labels = [f"las band {level}" for level in range(last + 1)]
    levels = [float(level) for level in range(last + 1)]
    wakes: list[float] = []
    # This loop runs once per job per cycle: `_band` is inlined, and look-ups hoisted
    # (not `ranked.append`: Python 3.11 specialises that call as a method, not bound).
    band_of, new = bisect.bisect_right, tuple.__new__
    for job in jobs:
        level = band_of(thresholds, job.attained_gpu_seconds + SERVICE_EPSILON)
        if level == job.service_level:
            since = job.submitted_at if job.service_level_since is None else job.service_level_since
        else:
            band = _band(job, context)
            if band.change is not None:
                changes.append(band.change)
            since = band.since
        # `Ranked(...)`, without the named tuple's Python-level constructor.
        ranked.append(new(Ranked, (job, within(job, levels[level], since, now), labels[level])))
        if level < last and job.grants:
            wake = crossing(job, job.grants, thresholds, now)
            if wake is not None:
                wakes.append(wake)
    wake_at = min(wakes) if wakes else None
    return Ordered(tuple(ranked), False, tuple(changes), wake_at, crossing=crossing)


def las(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """Discretised 2D-LAS (Tiresias' dlas-gpu).

    Attained service is GPUs x executed time; thresholds split it into K bands and a
    lower band always runs first. Within a band, the jobs running there keep going
    (the last to start there is the first to yield), then the others by least
    attained service (`_within_band`).
    """
    return _las(jobs, context, _within_band, next_band_crossing)


def las_tiresias(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """`las` as Tiresias' simulator runs it: the order within a band its queue lists
    produce (`_within_band_tiresias`: the job preempted last waits first), and its
    late look at a multi-GPU job's band (`tiresias_band_crossing`)."""
    return _las(jobs, context, _within_band_tiresias, tiresias_band_crossing)


class _GittinsIndices:
    """What each (size class, attained service) makes of a job's rank, worked out once a
    cycle: many jobs share a service (every new job has none). Without size classes the
    key is the service alone: a float hashes for less than a tuple, once per job."""

    def __init__(self, context: OrderContext, *, tiresias: bool, by_class: bool) -> None:
        self._context = context
        self._tiresias = tiresias
        self._by_class = by_class
        self.classes = context.service_by_class if by_class else None
        self.seen: dict[float | tuple[int, float], _Known] = {}
        # One float per band, shared by every rank that begins with it: sorting by rank
        # compares equal first keys by identity, not value.
        bands = range(len(context.las_thresholds_gpu_s) + 1)
        self._levels = [float(level) for level in bands]
        # Each band's label but for the index: formatting the band's number again for
        # each of thousands of services cost a third as much as the index.
        self._labels = [f"band {level} gittins %.3g" for level in bands]
        # `gittins`'s index, by an indexer made for the cycle (`gittins_indexer`).
        self._plain: Callable[[float], float] | None = None
        if not tiresias and not by_class:
            quantum = context.gittins_quantum_gpu_s
            self._plain = indices_of(context.distribution).at_quantum(quantum)

    def add(self, key: float | tuple[int, float], gpus: int, attained: float) -> _Known:
        context = self._context
        level = bisect.bisect_right(context.las_thresholds_gpu_s, attained + SERVICE_EPSILON)
        index = self._plain(attained) if self._plain is not None else self._index(gpus, attained)
        first, score = self._levels[level], -index
        known = self.seen[key] = (
            level,
            first,
            score,
            self._labels[level] % index,
            (first, score, 1.0, attained),
        )
        return known

    def _index(self, gpus: int, attained: float) -> float:
        """The index of `gittins-tiresias` and `gittins-size`."""
        context = self._context
        distribution, quantum = context.distribution, context.gittins_quantum_gpu_s
        if self.classes is not None:
            distribution = self.classes.of(gpus) or distribution
        if self._tiresias:
            return distribution.gittins_index_tiresias(attained, quantum)
        return indices_of(distribution).exact(attained)


# What `_GittinsIndices` knows of a service: its LAS band, the band and the negated
# index that begin the rank, the label, and the whole rank of a job that is not running
# in its band (every job of that service ranks alike then: one tuple for them all).
_Known = tuple[int, float, float, str, tuple[float, ...]]


def _gittins(
    jobs: Sequence[JobView], context: OrderContext, *, tiresias: bool, by_class: bool = False
) -> Ordered:
    ranked: list[Ranked] = []
    changes: list[SetServiceLevel] = []
    thresholds = context.las_thresholds_gpu_s
    last = len(thresholds)
    now = context.now
    crossing = tiresias_band_crossing if tiresias else next_band_crossing
    wakes: list[float] = []
    indices = _GittinsIndices(context, tiresias=tiresias, by_class=by_class)
    by_size = indices.classes is not None
    # This loop runs once per job per cycle: `_band` and `_within_band` are inlined,
    # and look-ups hoisted (not `ranked.append`: Python 3.11 specialises that call as
    # a method, not bound); a job's band comes with its service's index (`_Known`).
    new = tuple.__new__
    get = indices.seen.get
    for job in jobs:
        attained = job.attained_gpu_seconds
        key = (gpu_class(job.gpus), attained) if by_size else attained
        known = get(key)
        if known is None:
            known = indices.add(key, job.gpus, attained)
        level = known[0]
        grants = job.grants
        if job.service_level != level:
            band = _band(job, context)
            if band.change is not None:
                changes.append(band.change)
            since = band.since
        elif grants:
            since = job.submitted_at if job.service_level_since is None else job.service_level_since
        else:
            since = now  # only a running job's rank reads when it entered its band
        if tiresias:
            rank: tuple[float, ...] = (known[1], known[2], -job.submitted_at)
        elif grants and since < now:
            # Equal indices (every job past the largest sample has 0): as `las` within
            # a band (`_within_band`), so an old huge job does not hold its GPUs for
            # good.
            started = job.started_at
            if started is None or started < since:
                started = since
            rank = (known[1], known[2], 0.0, started)
        else:
            rank = known[4]
        # `Ranked(...)`, without the named tuple's Python-level constructor.
        ranked.append(new(Ranked, (job, rank, known[3])))
        # A job in the last band crosses nothing (`crossing` would say None).
        if grants and level < last:
            wake = crossing(job, grants, thresholds, now)
            if wake is not None:
                wakes.append(wake)
    wake_at = min(wakes) if wakes else None
    return Ordered(tuple(ranked), False, tuple(changes), wake_at, crossing=crossing)


def gittins(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """2D-Gittins (Tiresias' dlas-gpu-gittins): LAS bands, and within a band the
    higher Gittins index of the job's attained service first; equal indices (every
    new job has the same, every job past the largest sample 0) as `las` orders a band
    (`_within_band`: the jobs running there first, by when they started there, then
    the others by least attained service).

    The index comes from the distribution of finished jobs' service the shell has
    seen so far (with a prior), not from a fixed file, so it adapts to the cluster.
    """
    return _gittins(jobs, context, tiresias=False)


# `gittins-size` ranks by distributions compressed to this many samples (each index
# is linear in them; `ServiceDistribution.compressed` keeps each group's mean).
GITTINS_POINTS: Final = 128


def gittins_by_size(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """`gittins`, each job's index from the service distribution of its size class
    (`gpu_class`: 1, 2, 3-4, 5-8, ... GPUs), shrunk toward the pooled distribution
    while the class has few finished jobs (`ServiceByClass`); without classes (a
    shell that does not learn them), the pooled one. A job's size is known at
    submission and is not its duration, but jobs of different sizes are different
    work: on GPU clusters multi-GPU jobs run far longer in GPU-time, so a new 8-GPU
    job is less likely to finish soon than a new 1-GPU job.

    The index is the exact Gittins index (`ServiceDistribution.gittins_index_exact`:
    the best look-ahead, not a fixed quantum): size classes differ in scale by orders
    of magnitude, and a quantum fitted to one says nothing in another (within a
    class of jobs of days, every index at a 3,250 GPU-s quantum is near 0)."""
    return _gittins(jobs, context, tiresias=False, by_class=True)


def gittins_tiresias(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """`gittins` as Tiresias' simulator computes it: its index formula
    (`ServiceDistribution.gittins_index_tiresias`), and its tie order: it sorts each
    queue by (index, submission time) descending, so among equal indices (every job
    past the largest sample has 0) the newest job runs first."""
    return _gittins(jobs, context, tiresias=True)


def remaining_gpu_seconds(job: JobView) -> float | None:
    if job.declared_duration_s is None:
        return None
    return max(0.0, job.declared_duration_s * job.gpu_size - job.attained_gpu_seconds)


def srtf(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """Shortest remaining GPU-time first (Tiresias' shortest-gpu), for jobs that
    declare a duration; jobs that declare none come after them, FIFO."""
    ranked: list[Ranked] = []
    for job in jobs:
        remaining = remaining_gpu_seconds(job)
        if remaining is None:
            ranked.append(Ranked(job, (1.0, 0.0), "no declared duration"))
        else:
            ranked.append(Ranked(job, (0.0, remaining), f"{remaining:.0f} GPU-s remaining"))
    return Ordered(tuple(ranked), head_of_line_blocking=False)


def estimated_remaining_gpu_seconds(job: JobView) -> float | None:
    """Remaining GPU-time from the job's own progress reports: the work left at the
    rate it was last measured to progress, or, without a rate, extrapolated from the
    time it took to get this far."""
    done = job.progress_fraction
    if done is None:
        return None
    if done >= 1.0:
        return 0.0
    rate = job.progress_rate_per_s
    if rate is not None and rate > 0.0:
        # A job that has run longer than its reports say its whole run takes (1 /
        # rate) misjudged its total: what it says is left no longer tells anything.
        # Expect it to need as long again as it has overrun (with job durations'
        # falling hazard, the longer past a prediction, the longer still to go).
        overrun_s = job.executed_seconds - 1.0 / rate
        return job.gpu_size * max((1.0 - done) / rate, overrun_s)
    if done <= 0.0 or job.executed_seconds <= 0.0:
        return None
    return job.gpu_size * job.executed_seconds * (1.0 - done) / done


def progress(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """Shortest *estimated* remaining GPU-time first, the estimate coming from the
    progress each job reports (step / total steps) and the time it took to get there.

    No job declares a duration. A job that has not reported progress yet is ranked by
    what is left of its probe (`progress_probe_s` of running, the time its first
    reports take): a newcomer is worth a short probe, but it does not push aside a
    job observed to be nearly done. A job that never reports progress ranks after all
    of those, least attained service first (LAS), so it cannot hog the cluster.
    """
    return _by_remaining(jobs, context, estimated_remaining_gpu_seconds, "observed")


def _by_remaining(
    jobs: Sequence[JobView],
    context: OrderContext,
    remaining: Callable[[JobView], float | None],
    said: str,
) -> Ordered:
    """Least remaining GPU-time first, by `remaining` (None: nothing reported yet);
    a job still in its probe by what is left of it; one that never reports, last, by
    least attained service."""
    probe_s = context.progress_probe_s
    ranked: list[Ranked] = []
    for job in jobs:
        estimate = remaining(job)
        if estimate is not None:
            ranked.append(Ranked(job, (0.0, estimate), f"~{estimate:.0f} GPU-s left ({said})"))
        elif job.executed_seconds < probe_s:
            left = job.gpu_size * (probe_s - job.executed_seconds)
            ranked.append(Ranked(job, (0.0, left), "probing (no progress reported yet)"))
        else:
            ranked.append(Ranked(job, (1.0, job.attained_gpu_seconds), "reports no progress"))
    return Ordered(tuple(ranked), head_of_line_blocking=False)


def believed_remaining_gpu_seconds(
    job: JobView,
    ratios: ServiceDistribution,
    scaled_remaining: Callable[[float, float], float | None] | None = None,
) -> float | None:
    """Remaining GPU-time from the job's progress reports, the belief they carry
    taken as evidence rather than truth: its actual total is its believed total
    (1 / rate, in seconds at the speed it runs) times a ratio drawn from `ratios`
    (what finished jobs' reports turned out to be off by), given that it has already
    done what it has. Ranked by the Gittins index of that remainder
    (`ServiceDistribution.scaled_gittins_remaining`): with exact beliefs (one ratio,
    1) it is the remaining time, SRTF; the wider the ratios, the more a job near its
    believed end is worth only what its likely overrun is. A job that has outrun
    every ratio seen is expected to need as long again as it has overrun."""
    done = job.progress_fraction
    if done is None:
        return None
    if done >= 1.0:
        return 0.0
    rate = job.progress_rate_per_s
    if rate is None or rate <= 0.0:
        return estimated_remaining_gpu_seconds(job)
    believed_s = 1.0 / rate
    # Past its believed total a job's fraction stops moving: its run time says more.
    done_s = job.executed_seconds if job.executed_seconds > believed_s else done / rate
    if scaled_remaining is None:
        scaled_remaining = indices_of(ratios).scaled
    remaining = scaled_remaining(believed_s, done_s)
    if remaining is None:
        remaining = max(done_s - believed_s, 0.0)
    return job.gpu_size * remaining


def progress_gittins(jobs: Sequence[JobView], context: OrderContext) -> Ordered:
    """`progress`, with each job's believed total weighed by how wrong finished
    jobs' beliefs turned out to be (`believed_remaining_gpu_seconds`)."""
    ratios = context.error_distribution or DEFAULT_ERROR_PRIOR
    scaled = indices_of(ratios).scaled
    return _by_remaining(
        jobs, context, lambda job: believed_remaining_gpu_seconds(job, ratios, scaled), "believed"
    )


# What an order may read beyond a job's size, submission, grants and attained service:
# the shell and the simulator fill (and a simulator refuses a trace without) exactly
# what an order declares, so that every other order is provably blind to it.
#   declared_duration: `JobView.declared_duration_s` (the simulator reveals the trace's)
#   progress:          `JobView.progress_fraction`/`progress_rate_per_s` (reports)
#   distribution:      `ClusterSnapshot.service_distribution` (finished jobs' service)
#   priority:          `JobView.priority` (a trace must carry a `priority` column)
#   class_distribution: `ClusterSnapshot.service_by_class` (finished jobs' service by
#                      the size class of the job)
#   progress_error:    `ClusterSnapshot.error_distribution` (finished jobs' actual total
#                      over the total their progress reports believed)
Input = Literal[
    "declared_duration",
    "progress",
    "distribution",
    "class_distribution",
    "priority",
    "progress_error",
]


@dataclass(frozen=True, slots=True)
class QueueOrder:
    """A queue-order plugin: its name (what `Policy.order` says), its ranking, and what
    it reads. Adding an order is one of these in `QUEUE_ORDERS` around a function
    `(jobs, OrderContext) -> Ordered`; nothing else names orders."""

    name: str
    rank: Ordering
    reads: frozenset[Input] = frozenset()
    # Whether the ranking reads running jobs' attained service or run time, which grow
    # with the clock. An order that does not lets the live brain reuse running jobs'
    # views from pass to pass (brain/state.py); when in doubt, leave it True.
    reads_running_service: bool = True
    # Whether a job's rank and label are a function of its view alone (not of the clock,
    # nor of anything else in the context), and the ranking says nothing of a job but
    # its rank (no level changes, no wake-ups): then a caller deciding again and again
    # may keep the ranking from one cycle to the next (brain/core/ranking.py,
    # `Ranking`), and only new views are ranked. When in doubt, leave it False.
    view_only: bool = False
    # Whether its ranks begin with a LAS band (`JobView.service_level`, which its
    # `SetServiceLevel`s move): what `alnair why` shows of a job's band.
    banded: bool = False

    def __call__(self, jobs: Sequence[JobView], context: OrderContext) -> Ordered:
        return self.rank(jobs, context)


QUEUE_ORDERS: Final[tuple[QueueOrder, ...]] = (
    QueueOrder("fifo", fifo, reads_running_service=False, view_only=True),
    QueueOrder(
        "priority",
        priority,
        frozenset({"priority"}),
        reads_running_service=False,
        view_only=True,
    ),
    QueueOrder("las", las, banded=True),
    QueueOrder("las-tiresias", las_tiresias, banded=True),
    QueueOrder("gittins", gittins, frozenset({"distribution"}), banded=True),
    QueueOrder(
        "gittins-size",
        gittins_by_size,
        frozenset({"distribution", "class_distribution"}),
        banded=True,
    ),
    QueueOrder("gittins-tiresias", gittins_tiresias, frozenset({"distribution"}), banded=True),
    QueueOrder("srtf", srtf, frozenset({"declared_duration"})),
    QueueOrder("progress", progress, frozenset({"progress"})),
    QueueOrder("progress-gittins", progress_gittins, frozenset({"progress", "progress_error"})),
)
ORDERINGS: Final[dict[str, QueueOrder]] = {order.name: order for order in QUEUE_ORDERS}
ORDER_READS: Final[dict[str, frozenset[Input]]] = {o.name: o.reads for o in QUEUE_ORDERS}


def reads(order: str, what: Input) -> bool:
    """Does the ordering named `order` read `what`?"""
    return what in ORDER_READS.get(order, frozenset())
