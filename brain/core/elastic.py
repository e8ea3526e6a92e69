"""The elasticity stage: how many GPUs each elastic job runs on, between min and max.

It owns the elastic moves of a decision cycle (Elastic-KubeFlow's and Alnair's
allocator semantics), which `decide` runs around its rigid pipeline:

1. admission — selection counts an elastic job at its `min_gpus` (a running one can
   shrink to it), so every elastic job whose minimum fits runs; only when the
   minimums of better-ranked jobs fill the cluster does one wait (or, running, become
   a preemption candidate, exactly as a rigid job would);
2. targets   — the GPUs that selected jobs' minimums leave raise elastic jobs toward
   what they asked for (`gpus`), one GPU at a time to the job whose next GPU adds the
   most (relative marginal gain), within entitlement classes (quota standing; a
   priority, not a queue heuristic such as a LAS band: `Ordered.rank_entitles`), and
   only while that GPU earns its keep (`worth_growing`): the asked size is a claim
   against other jobs, not a reason to grow into bad scaling;
3. reclaim   — when a selected pending job does not fit, running elastic jobs give back
   GPUs above their target, lowest marginal loss first, *before* any job is
   preempted; reclaimed GPUs nobody took are handed back; a pending elastic job that
   still does not fit at its target starts smaller, down to its minimum;
4. evacuate  — a running job leaves GPUs that are no longer schedulable (drained,
   faulty, on a node gone), in place, down to its minimum;
5. retreat   — a running job gives back GPUs its measured throughput says do not earn
   their keep: the mirror of growth's test (see 7), one measured size at a time;
6. entitle   — in rank order, elastic jobs below their target grow to it: from idle
   GPUs, else from GPUs other jobs hold above their targets;
7. grow      — GPUs still idle go to elastic jobs, highest relative marginal gain
   first, up to `max_gpus`, while the next GPU adds at least `elastic_min_gain` of
   what the job's average GPU does. Past its asked size a job grows only on evidence:
   once measured at its asked size or more, and not past twice the largest size
   measured.

Settling: measured rates carry their error (`Measured.rel_error`, from the reports'
spread); between two measured sizes a job grows only when the gain clears the bar by
`CONFIDENCE_Z` standard errors, and retreats only when it falls short by as much, so it
stays put on a difference within the noise. Steps 4-7 leave a running job alone until
its size is measured and it has run `payback` times as long as its last resize took
(`settle`; the shell is woken when that ends); a size it left for lack of gain
(`JobView.gain_ceiling`) and measurements older than `reprobe_s` count until then
(`fresh_evidence`). A job an operator pinned (`JobView.pinned_gpus`) runs at exactly
that size: its minimum and maximum here, and no move of its own.

With `Policy.elastic_resize_interval_s` > 0, steps 4-7 resize running jobs only in
cycles at the start of a round (a multiple of the interval; Pollux schedules every
60 s) and the stage asks to be woken at the next; admission, placement and reclaims
(1-3) go on at every cycle. It needs no memory: the round follows from `now`.

The rank is the selection order, except that within one rank class (the ordering's
first rank key: the LAS band, the priority) jobs with less attained service come
first, by doubling buckets (`service_bucket`; `decide` sorts so when this stage is
on): with every job running at least at its minimum, an in-band FIFO would let a huge
job that entered the band first take every spare GPU; buckets rather than raw service
keep two similar jobs from swapping GPUs at every step.

Gains and losses come from each job's throughput per world size (`JobView.throughput`,
observed), interpolated between observed sizes and extrapolated with a concave
speedup prior (never steeper than the last observed slope). The plugin
(`ELASTICITIES`, an `Elasticity` each) is that throughput estimate. `decide` sees its
stage through `Sizing`; "none" is the identity (`Rigid`, which also sizes every cycle
without an elastic job): elastic jobs then run at the size they asked for, exactly as
rigid ones.

Locality: with `elastic_may_spread` on (the default of the live brain and of the
simulator, as Pollux) a job may span nodes only when it asked for more than a node or
already fills one: cross-node synchronisation can cost more than a GPU adds. A running
job never gives up the last GPU of its first node (its supervisor's), and does not
grow onto its `avoid_nodes` (in the live brain, also the nodes it left in this
attempt). With it off an elastic job is placed on one node and grows only there. A
job whose resize is still staged (`JobView.resizing`) keeps its size. Pure and
deterministic, like the rest of the core: no clock, no I/O, ties broken by rank and job
id.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import ClassVar, Final, Protocol

from brain.core.model import (
    Action,
    ClusterSnapshot,
    Evacuated,
    Grant,
    Grown,
    JobView,
    Measured,
    Moved,
    NoFit,
    Place,
    Resize,
    Retreated,
    ShrunkFor,
)
from brain.core.ordering import job_sequence
from brain.core.placement import Fit, FreeGpus, PlacementResult

# Estimated throughput of a job at a world size, in any unit consistent for that job
# (only ratios between sizes of one job are used).
Estimator = Callable[[JobView, int], float]

# The prior's serial fraction (Amdahl): speedup n / (1 + f (n - 1)); 0.05 gives 5.9x
# at 8 GPUs and 9.1x at 16, a typical data-parallel curve.
PRIOR_SERIAL_FRACTION: Final = 0.05

# Within a rank class, jobs are ranked by attained service in buckets that double
# from this (GPU-seconds); within a bucket, by the order's own rank. Buckets, not raw
# service: two jobs side by side would otherwise swap ranks (and GPUs) at every step.
SERVICE_BUCKET_GPU_S: Final = 100.0
# Growth goes at most this far past the largest size a job was observed at.
EXPLORE_FACTOR: Final = 2.0
# With a resize interval, a cycle this close after a round's start (seconds) is that
# round's: the shell wakes the brain at the round, a little late.
ROUND_TOLERANCE_S: Final = 1.0
# How many standard errors apart two measured rates must be before a resize rests on
# their difference (about 95 % one-sided): a job grows into a measured size only when
# the gain clears `elastic_min_gain` by this margin, and retreats only when it falls
# short by it. Between the two it stays where it is.
CONFIDENCE_Z: Final = 2.0
# A running elastic job that has reported no throughput this long after it started is
# taken never to report: the prior sizes it from then on.
UNREPORTED_AFTER_S: Final = 60.0


def is_resize_round(now: float, interval_s: float) -> bool:
    """Whether a cycle at `now` may resize running jobs by itself (evacuate, retreat, entitle,
    grow): every cycle without an interval, else only at the start of a round (a
    multiple of `interval_s`, within `ROUND_TOLERANCE_S`)."""
    if interval_s <= 0:
        return True
    phase = now % interval_s
    return phase < min(ROUND_TOLERANCE_S, interval_s / 2) or interval_s - phase < 1e-6


def next_resize_round(now: float, interval_s: float) -> float:
    """The start of the first round after `now`."""
    return (math.floor(now / interval_s + 1e-9) + 1) * interval_s


def prior_speedup(size: int) -> float:
    return size / (1.0 + PRIOR_SERIAL_FRACTION * (size - 1))


def _observed(job: JobView) -> list[tuple[int, float]]:
    last: dict[int, float] = {}
    for point in job.throughput:
        # A point with too few reports to know its error is not evidence yet.
        if point.size >= 1 and point.rate > 0 and point.settled:
            last[point.size] = point.rate
    return sorted(last.items())


def _measured(job: JobView, size: int) -> Measured | None:
    """The job's settled measurement at `size`, if it has one."""
    for point in job.throughput:
        if point.size == size and point.rate > 0 and point.settled:
            return point
    return None


def fresh_evidence(job: JobView, now: float, reprobe_s: float) -> JobView:
    """The job as the stage reasons about it: measurements and a gain ceiling older
    than `reprobe_s` no longer count (the job may be tried at those sizes again), but
    the size it runs at now is always measured afresh by its reports."""
    if reprobe_s <= 0:
        return job
    cutoff = now - reprobe_s
    size = job.held_gpus
    kept = tuple(p for p in job.throughput if p.at is None or p.at >= cutoff or p.size == size)
    if job.gain_ceiling_at is not None and job.gain_ceiling_at < cutoff:
        return replace(job, throughput=kept, gain_ceiling=None, gain_ceiling_at=None)
    return job if len(kept) == len(job.throughput) else replace(job, throughput=kept)


def estimate_throughput(job: JobView, size: int) -> float:
    """Observed throughput at `size` if measured; linear between measured sizes;
    beyond them the concave prior, and above the largest measured size never more
    than the last measured slope predicts (returns diminish)."""
    points = _observed(job)
    if not points:
        return prior_speedup(size)
    below = [(n, t) for n, t in points if n <= size]
    above = [(n, t) for n, t in points if n >= size]
    if below and below[-1][0] == size:
        return below[-1][1]
    if below and above:
        (n0, t0), (n1, t1) = below[-1], above[0]
        return t0 + (t1 - t0) * (size - n0) / (n1 - n0)
    if above:
        n1, t1 = above[0]
        return t1 * prior_speedup(size) / prior_speedup(n1)
    top_n, top_t = points[-1]
    by_prior = top_t * prior_speedup(size) / prior_speedup(top_n)
    if len(points) < 2:
        return by_prior
    prev_n, prev_t = points[-2]
    slope = (top_t - prev_t) / (top_n - prev_n)
    return min(by_prior, top_t + slope * (size - top_n))


def service_bucket(attained_gpu_seconds: float) -> int:
    """The doubling bucket of attained service the elastic rank sorts by (0 below
    `SERVICE_BUCKET_GPU_S`, then 1, 2, ... each twice as wide)."""
    return int(math.log2(1.0 + max(attained_gpu_seconds, 0.0) / SERVICE_BUCKET_GPU_S))


def linear_throughput(job: JobView, size: int) -> float:
    """Perfect scaling, observations ignored: idle GPUs go to the smallest elastic
    jobs first (an even split), as a throughput-blind allocator would."""
    return float(size)


class Sizing(Protocol):
    """The elasticity stage as `decide` drives it, around its rigid pipeline (the
    module's docstring, 1-7): what each job takes in selection and is placed at, the
    GPUs elastic jobs give back before anyone is preempted, and the resizes after the
    placements. `Rigid` is the identity; `ElasticStage` sizes elastic jobs."""

    @property
    def resizes(self) -> bool:
        """Whether it may size a job other than at what it asked (reclaim its GPUs,
        place it smaller, grow it), and so ranks by attained service within a rank
        class. False: every job takes, and is placed at, exactly its `gpus`, and
        `decide` asks it neither `need`, `select` nor `size` of a whole-GPU job."""
        ...

    @property
    def next_round(self) -> float | None:
        """When its next resize round starts (`decide` wakes then), if it waits for one."""
        ...

    @property
    def wakes(self) -> Sequence[float]:
        """When a job it holds still may move again (`decide` wakes then)."""
        ...

    def views(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        """The snapshot as the rest of the cycle must see it (`running_views`)."""
        ...

    def need(self, job: JobView) -> int:
        """GPUs the job takes in selection."""
        ...

    def select(self, job: JobView, size: int) -> None:
        """Selection kept the job, taking `size` GPUs."""
        ...

    def set_ranks(
        self, job_ids: Sequence[str], share_class: dict[str, tuple[float, ...]] | None = None
    ) -> None:
        """Every job in selection order, and what entitles each to GPUs above its minimum."""
        ...

    def plan(self, capacity: int) -> None:
        """After selection: the sizes the selected jobs are placed at."""
        ...

    def size(self, job: JobView) -> int:
        """The size to place a selected job at."""
        ...

    def reclaim_one(self, ledger: FreeGpus, for_job: str, exclude: set[str]) -> bool:
        """Give back GPUs one elastic job holds above its target, for `for_job`; False
        when none can. Only asked while `resizes`."""
        ...

    def place(self, job: JobView, ledger: FreeGpus, *, partial: bool) -> PlacementResult:
        """Place an elastic job at its target (`partial`: or at what is left, down to its
        minimum); only asked while `resizes`."""
        ...

    def finish(
        self,
        ledger: FreeGpus,
        actions: list[Action],
        exclude: set[str],
        outside: Iterable[str] = (),
    ) -> tuple[list[Resize], list[Action], list[Resize]]:
        """After the placements: (shrinks, the actions with elastic placements at their
        final size, grows)."""
        ...


_GPUS: Final = attrgetter("gpus")


class Rigid:
    """The identity stage: "none", and any cycle without an elastic job. Every job
    takes and is placed at its `gpus`; nothing is reclaimed, resized or woken for."""

    __slots__ = ()

    resizes: Final = False
    next_round: Final = None
    wakes: Final[tuple[float, ...]] = ()
    # `gpus`, at C speed: selection asks it of every job of the cycle.
    need: Final = staticmethod(_GPUS)
    size: Final = staticmethod(_GPUS)

    def views(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        return snapshot

    def select(self, job: JobView, size: int) -> None:
        pass

    def set_ranks(
        self, job_ids: Sequence[str], share_class: dict[str, tuple[float, ...]] | None = None
    ) -> None:
        pass

    def plan(self, capacity: int) -> None:
        pass

    def reclaim_one(self, ledger: FreeGpus, for_job: str, exclude: set[str]) -> bool:
        return False

    def place(self, job: JobView, ledger: FreeGpus, *, partial: bool) -> PlacementResult:
        raise AssertionError(f"job {job.job_id}: the identity stage sizes no job")

    def finish(
        self,
        ledger: FreeGpus,
        actions: list[Action],
        exclude: set[str],
        outside: Iterable[str] = (),
    ) -> tuple[list[Resize], list[Action], list[Resize]]:
        return [], actions, []


RIGID: Final = Rigid()

_MIN_GPUS: Final = attrgetter("min_gpus")


def any_elastic(snapshot: ClusterSnapshot) -> bool:
    """Does any job of the snapshot run or wait elastically (`JobView.elastic`: it has a
    minimum size)? Without one, every stage is the identity."""
    return any(
        bool(set(map(_MIN_GPUS, jobs)) - {None}) for jobs in (snapshot.running, snapshot.pending)
    )


@dataclass(frozen=True, slots=True)
class Elasticity:
    """An elasticity plugin (`Policy.elasticity` names it): the throughput estimate its
    stage sizes elastic jobs by; None for "none", whose stage is the identity."""

    name: str
    estimate: Estimator | None

    @property
    def sizes_jobs(self) -> bool:
        """Whether its stage sizes elastic jobs (when the cycle has one): they then need
        only their minimum to run, and it reads what the identity does not: their
        throughput reports (`JobView.throughput`) and running jobs' attained service."""
        return self.estimate is not None

    def start(
        self,
        snapshot: ClusterSnapshot,
        *,
        may_spread: bool,
        min_gain: float,
        now: float,
        resize_interval_s: float,
        payback: float,
        reprobe_s: float,
    ) -> Sizing:
        """The cycle's stage: the identity without an estimate or an elastic job."""
        if self.estimate is None or not any_elastic(snapshot):
            return RIGID
        return ElasticStage.start(
            self.estimate,
            snapshot,
            may_spread=may_spread,
            min_gain=min_gain,
            now=now,
            resize_interval_s=resize_interval_s,
            payback=payback,
            reprobe_s=reprobe_s,
        )


ELASTICITIES: Final[dict[str, Elasticity]] = {
    e.name: e
    for e in (
        # Elastic jobs run at their asked size, as rigid ones.
        Elasticity("none", None),
        Elasticity("marginal-gain", estimate_throughput),
        Elasticity("linear", linear_throughput),
    )
}


_Gpu = tuple[str, int]


def _as_grants(gpus: Iterable[_Gpu]) -> tuple[Grant, ...]:
    """Grants per node, in the order the nodes first appear: a running job's first node
    (its supervisor's) stays first."""
    by_node: dict[str, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    return tuple(Grant(node, tuple(sorted(gpus))) for node, gpus in by_node.items())


def _gpus(grants: Iterable[Grant]) -> list[_Gpu]:
    return [(g.node, gpu) for g in grants for gpu in g.gpus]


@dataclass(slots=True)
class _Sized:
    """An elastic job whose size this cycle decides: running, or placed in it."""

    job: JobView
    held: list[_Gpu]
    # Its size when the cycle began (0: placed in this cycle).
    before: int
    # GPUs it gave back this cycle and not yet handed back (reclaims not settled).
    reclaimed: list[_Gpu] = field(default_factory=list)
    # Why it shrank: the job the first reclaim was for (None: a retreat, or off the GPUs
    # in `evacuated`).
    shrunk_for: str | None = None
    # GPUs it left because they are no longer schedulable (`evacuate`).
    evacuated: list[_Gpu] = field(default_factory=list)
    shrank: bool = False
    grown: int = 0


@dataclass(slots=True)
class ElasticStage:
    """One cycle's elastic bookkeeping (a `Sizing` that resizes); built by `decide`,
    never escapes it."""

    resizes: ClassVar[bool] = True

    estimate: Estimator
    may_spread: bool
    min_gain: float
    # Elastic jobs by id (pending and running) as the snapshot gave them: `gpus` is
    # the size each asked for.
    asked: dict[str, JobView]
    # Running elastic jobs whose size may change (not mid-resize), and pending ones
    # once placed in this cycle.
    sized: dict[str, _Sized]
    targets: dict[str, int] = field(default_factory=dict)
    selected: dict[str, int] = field(default_factory=dict)
    rank_of: dict[str, int] = field(default_factory=dict)
    # What entitles a job to GPUs above its minimum before worse classes (`plan`).
    share_class: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # Whether this cycle may resize running jobs by itself (evacuate, retreat, entitle, grow);
    # reclaims for pending jobs happen at every cycle. Off: the next round's start.
    resize_round: bool = True
    next_round: float | None = None
    # Running jobs that make no move of their own this cycle (evacuate, retreat, entitle, grow):
    # pinned by an operator, their current size not measured well enough yet, or their
    # last resize not paid back yet (`settle`). Reclaims for pending jobs may still
    # shrink them (a pinned one only down to its pin).
    settling: set[str] = field(default_factory=set)
    # When a job's payback hold ends: the shell should call `decide` again then.
    wakes: list[float] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        estimate: Estimator,
        snapshot: ClusterSnapshot,
        *,
        may_spread: bool,
        min_gain: float,
        now: float = 0.0,
        resize_interval_s: float = 0.0,
        payback: float = 0.0,
        reprobe_s: float = 0.0,
    ) -> ElasticStage:
        asked = {
            j.job_id: fresh_evidence(j, now, reprobe_s)
            for j in (*snapshot.running, *snapshot.pending)
            if j.elastic
        }
        sized = {
            j.job_id: _Sized(asked[j.job_id], _gpus(j.grants), j.held_gpus)
            for j in snapshot.running
            if j.elastic and not j.resizing
        }
        stage = cls(estimate, may_spread, min_gain, asked, sized)
        if not is_resize_round(now, resize_interval_s):
            stage.resize_round = False
            if sized:
                stage.next_round = next_resize_round(now, resize_interval_s)
        for sized_job in sized.values():
            stage.settle(sized_job.job, now, payback)
        return stage

    def views(self, snapshot: ClusterSnapshot) -> ClusterSnapshot:
        return running_views(snapshot)

    def settle(self, job: JobView, now: float, payback: float) -> None:
        """Hold a running job still this cycle unless it may move by itself: not
        pinned, its size measured (enough reports to know the rate's error), and run at
        that size `payback` times as long as its last resize took, so that each resize
        pays back the time the job stood still for it."""
        if job.pinned_gpus is not None:
            self.settling.add(job.job_id)
            return
        if _measured(job, job.held_gpus) is None:
            # Wait for its reports; a job that has reported nothing for
            # `UNREPORTED_AFTER_S` never will (its script does not use the SDK): the
            # prior sizes it, as it sized it at placement.
            quiet_since = job.started_at if job.started_at is not None else now
            if job.throughput or now < quiet_since + UNREPORTED_AFTER_S:
                self.settling.add(job.job_id)
                if not job.throughput:
                    self.wakes.append(quiet_since + UNREPORTED_AFTER_S)
                return
        if job.last_resize_at is not None and job.last_resize_s is not None:
            until = job.last_resize_at + payback * job.last_resize_s
            if now < until:
                self.settling.add(job.job_id)
                self.wakes.append(until)

    # -- sizes -----------------------------------------------------------------------

    @staticmethod
    def least(job: JobView) -> int:
        if job.pinned_gpus is not None:
            return job.pinned_gpus
        return max(1, job.min_gpus or 1)

    @staticmethod
    def most(job: JobView) -> int:
        if job.pinned_gpus is not None:
            return job.pinned_gpus
        return max(ElasticStage.least(job), job.max_gpus or job.gpus)

    def wanted(self, job_id: str) -> int:
        """What a job asked for, within its range: its size against worse-ranked jobs."""
        job = self.asked[job_id]
        return min(max(job.gpus, self.least(job)), self.most(job))

    def need(self, job: JobView) -> int:
        """GPUs a job takes in selection: an elastic job its minimum (a running one can
        shrink to it), unless a staged resize pins its current size."""
        if not job.elastic:
            return job.gpus
        if job.running and job.resizing:
            return job.held_gpus
        return self.least(job)

    def select(self, job: JobView, size: int) -> None:
        self.selected[job.job_id] = size
        if job.elastic:
            self.targets[job.job_id] = size

    def plan(self, capacity: int) -> None:
        """After selection: GPUs no selected job's minimum needs raise elastic jobs'
        targets toward what they asked for, one at a time, within the best entitlement
        class first, to the job whose next GPU has the highest relative marginal gain
        (ties: better rank).

        By gain, not by rank: a queue order's rank (a LAS band) says who should start
        first, not who makes best use of a GPU above its minimum. Handing a newcomer
        its whole ask shrinks the long jobs already running to their minimum, where
        they stay while newcomers keep arriving; sharing by gain keeps every job near
        its efficient size (on Pollux's workloads, 0.83 -> 0.76 of static `las`'s
        average JCT, docs/elastic.md).

        With hysteresis: a GPU a running job holds counts at the upper bound of its
        measured gain, one it would add at the lower bound, so two jobs whose gains
        differ by less than their measurements' error do not trade GPUs back and forth."""
        left = capacity - sum(self.selected.values())
        heap: list[tuple[tuple[float, ...], float, int, tuple[int, str], str]] = []

        def push(job_id: str) -> None:
            size = self.targets[job_id]
            job = self.asked[job_id]
            if size < self.wanted(job_id) and self.worth_growing(job, size):
                gain, error = self._gain_error(job, size)
                held = self.sized[job_id].before if job_id in self.sized else 0
                gain += CONFIDENCE_Z * error if size < held else -CONFIDENCE_Z * error
                key = (self.share_class.get(job_id, ()), -gain, self._rank(job_id))
                heapq.heappush(heap, (*key, job_sequence(job_id), job_id))

        for job_id in self.targets:
            push(job_id)
        while heap and left > 0:
            job_id = heapq.heappop(heap)[-1]
            self.targets[job_id] += 1
            left -= 1
            push(job_id)

    def size(self, job: JobView) -> int:
        """The size to place a selected job at."""
        return self.targets.get(job.job_id, job.gpus)

    def set_ranks(
        self, job_ids: Sequence[str], share_class: dict[str, tuple[float, ...]] | None = None
    ) -> None:
        """Every job of the cycle, best-ranked first (the selection order), and what
        entitles each to GPUs above its minimum before others (smaller first)."""
        self.rank_of = {job_id: i for i, job_id in enumerate(job_ids)}
        self.share_class = dict(share_class or {})

    def _rank(self, job_id: str) -> int:
        return self.rank_of.get(job_id, 1 << 30)

    def _target(self, job_id: str) -> int:
        sized = self.sized[job_id]
        return self.targets.get(job_id, len(sized.held))

    def _rate(self, job: JobView, size: int) -> float:
        return max(self.estimate(job, size), 0.0)

    def gain(self, job: JobView, size: int) -> float:
        """Relative throughput gain of the next GPU: T(n+1)/T(n) - 1."""
        now = self._rate(job, size)
        return self._rate(job, size + 1) / now - 1.0 if now > 0 else 0.0

    def _gain_error(self, job: JobView, size: int) -> tuple[float, float]:
        """`gain(job, size)` and its standard error (0 unless both sizes are measured)."""
        gain = self.gain(job, size)
        a, b = _measured(job, size), _measured(job, size + 1)
        if a is None or b is None:
            return gain, 0.0
        return gain, (1.0 + gain) * math.hypot(a.rel_error, b.rel_error)

    def loss(self, job: JobView, size: int) -> float:
        """Relative throughput lost by giving up one GPU: 1 - T(n-1)/T(n)."""
        now = self._rate(job, size)
        return 1.0 - self._rate(job, size - 1) / now if now > 0 else 0.0

    def _margin(self, job: JobView, low: int, high: int) -> tuple[float, float]:
        """How far the GPUs from `low` to `high` clear the bar of `min_gain` of an
        average GPU each (throughput above the bar; negative: short of it), and the
        standard error of that difference (0 unless both sizes are measured: an
        estimated size is a guess, which growth may probe and retreat never uses)."""
        rate_low, rate_high = self._rate(job, low), self._rate(job, high)
        bar = self.min_gain * (high - low) * rate_low / low
        margin = rate_high - rate_low - bar
        a, b = _measured(job, low), _measured(job, high)
        if a is None or b is None:
            return margin, 0.0
        return margin, math.hypot(a.rel_error * a.rate, b.rel_error * b.rate)

    def _falls_short(self, job: JobView, low: int, high: int) -> bool:
        """Whether the GPUs from `low` to `high` miss the bar beyond the error."""
        margin, error = self._margin(job, low, high)
        return margin + CONFIDENCE_Z * error < 0

    def worth_growing(self, job: JobView, size: int) -> bool:
        """Whether the job's next GPU earns its keep: it adds at least `min_gain` of
        what an average GPU of the job does, by a margin beyond the measurements'
        error when both sizes are measured; never back to a size the job left for lack
        of gain (its `gain_ceiling`) until that evidence is stale. The one test that
        targets, entitlement and growth apply, whatever the job asked for: the asked
        size is a claim against other jobs, not a reason to grow into bad scaling."""
        if job.gain_ceiling is not None and size + 1 >= job.gain_ceiling:
            return False
        margin, error = self._margin(job, size, size + 1)
        return margin - CONFIDENCE_Z * error >= 0

    # -- placement of a pending elastic job -----------------------------------------

    def _may_span(self, job: JobView, held: Sequence[_Gpu], ledger: FreeGpus) -> bool:
        """Whether a job may hold GPUs on several nodes: only when spreading is allowed
        and it asked for more than a node, or fills (or spans) nodes already."""
        if not self.may_spread:
            return False
        largest = ledger.largest_node()
        return (
            self.wanted(job.job_id) > largest
            or len(held) >= largest
            or len({node for node, _ in held}) > 1
        )

    def place(self, job: JobView, ledger: FreeGpus, *, partial: bool) -> PlacementResult:
        """Place a selected pending elastic job at its target: on the one node with the
        most room up to its maximum (best fit for its maximum, so it can grow there),
        or, when it may span nodes, on the fewest nodes. `partial`: when that fails,
        start it smaller, down to its minimum."""
        size = self.size(job)
        least, most = self.least(job), self.most(job)
        view = ledger.excluding(job.avoid_nodes) if job.avoid_nodes else ledger
        nodes = view.nodes()
        one = [n for n in nodes if ledger.free_on(n) >= size]
        if one:
            node = min(one, key=lambda n: (-min(ledger.free_on(n), most), ledger.free_on(n), n))
            return Fit((Grant(node, ledger.lowest(node, size)),))
        spans = self._may_span(job, [], ledger)
        if spans:
            grants = view.gather(size)
            if grants is not None:
                return Fit(grants)
        free = sum(ledger.free_on(n) for n in nodes)
        roomiest = max((ledger.free_on(n) for n in nodes), default=0)
        if partial and spans and free >= least:
            grants = view.gather(min(size, free))
            if grants is not None:
                return Fit(grants)
        if partial and roomiest >= least:
            node = min(nodes, key=lambda n: (-ledger.free_on(n), n))
            return Fit((Grant(node, ledger.lowest(node, min(size, roomiest))),))
        if spans:
            return NoFit(f"needs at least {least} GPUs; {free} free", kind="too_few_free")
        return NoFit(
            f"needs at least {least} GPUs on one node (an elastic job that fits a node "
            "runs on one); "
            f"at most {roomiest} free on any node",
            kind="node_too_small",
        )

    # -- reclaim ---------------------------------------------------------------------

    @staticmethod
    def _givable(sized: _Sized, ledger: FreeGpus, *, usable: bool) -> list[_Gpu]:
        """The GPUs a job may give back: never the last on a running job's first node
        (its supervisor runs there, and Horovod carries the state over from a host of
        the old world); `usable`: only those another job could take (not drained,
        faulty or on a node gone from the cluster)."""
        count: dict[str, int] = {}
        for node, _ in sized.held:
            count[node] = count.get(node, 0) + 1
        first = sized.job.grants[0].node if sized.job.grants else None
        return [
            g
            for g in sized.held
            if (g[0] != first or count[g[0]] > 1) and (not usable or ledger.schedulable(*g))
        ]

    def _give_back(
        self, sized: _Sized, ledger: FreeGpus, near: set[str], *, usable: bool = True
    ) -> _Gpu:
        """Take one GPU from a job into the ledger (`_givable`): on a node in `near` if
        it has one; else from a node other than its first (which it never leaves: giving
        back there frees no node), where it holds the fewest (a job on fewer nodes syncs
        faster), then where the most GPUs are free already (free GPUs together fit a
        gang). The operator's shrink chooses alike (brain/elastic.py, `choose_target`)."""
        count: dict[str, int] = {}
        for node, _ in sized.held:
            count[node] = count.get(node, 0) + 1
        first = sized.job.grants[0].node if sized.job.grants else None
        held = self._givable(sized, ledger, usable=usable)
        preferred = [g for g in held if g[0] in near] or held
        node, gpu = min(
            preferred,
            key=lambda g: (g[0] == first, count[g[0]], -ledger.free_on(g[0]), g[0], -g[1]),
        )
        sized.held.remove((node, gpu))
        sized.shrank = True
        ledger.give((Grant(node, (gpu,)),))
        return node, gpu

    def reclaim_one(self, ledger: FreeGpus, for_job: str, exclude: set[str]) -> bool:
        """Take one GPU, into the ledger, from the running elastic job with the lowest
        marginal loss among those above their target, to make room for `for_job`.
        False when no job is above its target."""
        best: tuple[tuple[float, tuple[int, str]], _Sized] | None = None
        for job_id, sized in self.sized.items():
            size = len(sized.held)
            if job_id in exclude or sized.before == 0 or size <= self._target(job_id):
                continue
            if not self._givable(sized, ledger, usable=True):
                continue  # what it holds above its target is no use to anyone
            key = (self.loss(sized.job, size), job_sequence(job_id))
            if best is None or key < best[0]:
                best = (key, sized)
        if best is None:
            return False
        sized = best[1]
        sized.reclaimed.append(self._give_back(sized, ledger, set()))
        if sized.shrunk_for is None:
            sized.shrunk_for = for_job
        return True

    def settle_reclaims(self, ledger: FreeGpus) -> None:
        """Hand back every reclaimed GPU that no placement took."""
        for job_id in sorted(self.sized, key=job_sequence):
            sized = self.sized[job_id]
            for gpu in list(sized.reclaimed):
                grant = Grant(gpu[0], (gpu[1],))
                if ledger.all_free((grant,)):
                    ledger.take((grant,))
                    sized.held.append(gpu)
            sized.reclaimed.clear()
            sized.shrank = len(sized.held) < sized.before

    # -- evacuate, retreat, entitle, grow --------------------------------------------

    def evacuate(self, ledger: FreeGpus, exclude: set[str], outside: Iterable[str]) -> None:
        """Shrink running jobs, in place, off GPUs that are no longer schedulable (drained
        by an operator or a fault, or on a node gone from the cluster), down to their
        minimum: a drained node empties of elastic jobs without a restart, where a rigid
        job runs on until it ends. The last GPU on a job's first node stays (`_givable`:
        its supervisor runs there). Nothing goes back to the ledger: those GPUs are for
        no one. `outside`: the jobs that hold such GPUs (`FreeGpus.held_outside`, which
        `decide` works out once a cycle); nearly always none."""
        for job_id in sorted(outside, key=job_sequence):
            sized = self.sized.get(job_id)
            if sized is None or job_id in exclude or sized.before == 0 or sized.shrank:
                continue
            least = self.least(sized.job)
            while len(sized.held) > least:
                drained = [
                    g
                    for g in self._givable(sized, ledger, usable=False)
                    if not ledger.schedulable(*g)
                ]
                if not drained:
                    break
                gpu = min(drained)
                sized.held.remove(gpu)
                sized.evacuated.append(gpu)
            if sized.evacuated:
                sized.shrank = True
                size = len(sized.held)
                self.targets[job_id] = min(self.targets.get(job_id, size), size)

    def retreat(self, ledger: FreeGpus, exclude: set[str]) -> None:
        """Shrink running jobs whose measured throughput says their last GPUs do not
        earn their keep: down one measured size at a time, largest first, while the
        GPUs between the two fall short of `min_gain` of an average GPU each beyond the
        measurements' error. The mirror of growth (`worth_growing`): the same margin
        over the same pairs of sizes, so a job that retreated is not grown back, and
        one that would grow is not shrunk. Only measured sizes count: an estimate is a
        guess to probe, not evidence against GPUs a job holds."""
        for job_id in sorted(self.sized, key=job_sequence):
            sized = self.sized[job_id]
            if job_id in exclude or sized.before == 0 or sized.shrank:
                continue
            job = sized.job
            target = len(sized.held)
            if _measured(job, target) is None:
                continue
            below = [p.size for p in job.throughput if p.settled and p.rate > 0]
            for size in sorted((n for n in below if self.least(job) <= n < target), reverse=True):
                if not self._falls_short(job, size, target):
                    break
                target = size
            while len(sized.held) > target:
                # Its own retreat: a drained GPU may go as well as any.
                self._give_back(sized, ledger, set(), usable=False)
            if len(sized.held) < sized.before:
                self.targets[job_id] = min(self.targets.get(job_id, target), target)

    def _grow_node(self, sized: _Sized, ledger: FreeGpus) -> str | None:
        mine: dict[str, int] = {}
        for node, _ in sized.held:
            mine[node] = mine.get(node, 0) + 1
        candidates = [n for n in mine if ledger.free_on(n) > 0]
        if not candidates and self._may_span(sized.job, sized.held, ledger):
            avoid = sized.job.avoid_nodes
            candidates = [n for n in ledger.nodes() if ledger.free_on(n) > 0 and n not in avoid]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (-mine.get(n, 0), -ledger.free_on(n), n))

    def _take(self, sized: _Sized, ledger: FreeGpus) -> bool:
        node = self._grow_node(sized, ledger)
        if node is None:
            return False
        gpu = ledger.lowest(node, 1)[0]
        ledger.take((Grant(node, (gpu,)),))
        sized.held.append((node, gpu))
        sized.grown += 1
        return True

    def _reclaim_for(self, sized: _Sized, ledger: FreeGpus, exclude: set[str]) -> bool:
        """Take one GPU, into the ledger, from another running job above its target
        (lowest marginal loss first), on a node `sized` may grow on."""
        job_id = sized.job.job_id
        mine = {node for node, _ in sized.held}
        spans = self._may_span(sized.job, sized.held, ledger)
        best: tuple[tuple[float, tuple[int, str]], _Sized] | None = None
        for other_id, other in self.sized.items():
            size = len(other.held)
            if (
                other_id == job_id
                or other_id in exclude
                or other.before == 0
                or size <= self._target(other_id)
            ):
                continue
            if not spans and not any(node in mine for node, _ in other.held):
                continue
            if not self._givable(other, ledger, usable=True):
                continue
            key = (self.loss(other.job, size), job_sequence(other_id))
            if best is None or key < best[0]:
                best = (key, other)
        if best is None:
            return False
        other = best[1]
        self._give_back(other, ledger, mine)
        if other.shrunk_for is None:
            other.shrunk_for = job_id
        return True

    def entitle(self, ledger: FreeGpus, exclude: set[str]) -> None:
        """In rank order, bring each elastic job below its target up to it: from idle
        GPUs, else from GPUs other jobs hold above their targets."""
        order = sorted(self.sized, key=lambda j: (self._rank(j), job_sequence(j)))
        for job_id in order:
            sized = self.sized[job_id]
            if job_id in exclude or sized.shrank:
                continue
            target = self._target(job_id)
            while len(sized.held) < target:
                if self._take(sized, ledger):
                    continue
                if not self._reclaim_for(sized, ledger, exclude):
                    break

    def grow(self, ledger: FreeGpus, exclude: set[str]) -> None:
        """Give the GPUs still idle to elastic jobs, one at a time, highest marginal
        gain first (ties: better rank)."""
        heap: list[tuple[float, int, tuple[int, str], str]] = []
        for job_id, sized in self.sized.items():
            if job_id not in exclude and not sized.shrank:
                self._push(heap, sized)
        while heap and ledger.total_free() > 0:
            sized = self.sized[heapq.heappop(heap)[-1]]
            if self._take(sized, ledger):
                self._push(heap, sized)

    def _push(self, heap: list[tuple[float, int, tuple[int, str], str]], sized: _Sized) -> None:
        job = sized.job
        size = len(sized.held)
        if size >= self.most(job):
            return
        observed = [n for n, _ in _observed(job)]
        if size >= self.wanted(job.job_id) and (
            not observed
            or max(observed) < self.wanted(job.job_id)
            or size >= EXPLORE_FACTOR * max(observed)
        ):
            # Past what it asked for only on evidence: measured at its ask or more, and
            # not past twice the largest size measured (the prior is only a guess).
            return
        if not self.worth_growing(job, size):
            return
        gain = self.gain(job, size)
        job_id = job.job_id
        heapq.heappush(heap, (-gain, self._rank(job_id), job_sequence(job_id), job_id))

    # -- the cycle's elastic actions -------------------------------------------------

    def finish(
        self,
        ledger: FreeGpus,
        actions: Sequence[Action],
        exclude: set[str],
        outside: Iterable[str] = (),
    ) -> tuple[list[Resize], list[Action], list[Resize]]:
        """Settle reclaims, evacuate, retreat, entitle and grow; return (shrinks, `actions` with
        the placements of elastic jobs at their final size, grows). `exclude`: running
        jobs that keep their size (preemption candidates); `outside`: running jobs holding
        GPUs no longer schedulable (`evacuate`)."""
        self.settle_reclaims(ledger)
        for action in actions:
            if isinstance(action, Place) and action.job_id in self.asked:
                job = self.asked[action.job_id]
                self.sized[action.job_id] = _Sized(job, _gpus(action.grants), 0)
        exclude = exclude | self.settling
        if not self.resize_round:
            # Between rounds running jobs keep their size (bar reclaims): only the
            # jobs placed in this cycle take part.
            exclude = exclude | {j for j, s in self.sized.items() if s.before > 0}
        self.evacuate(ledger, exclude, outside)
        self.retreat(ledger, exclude)
        self.entitle(ledger, exclude)
        self.grow(ledger, exclude)
        rewritten = [
            self._placed(a) if isinstance(a, Place) and a.job_id in self.asked else a
            for a in actions
        ]
        shrinks: list[Resize] = []
        grows: list[Resize] = []
        for job_id in sorted(self.sized, key=job_sequence):
            sized = self.sized[job_id]
            if sized.before == 0 or len(sized.held) == sized.before:
                if sized.before and sorted(sized.held) != sorted(_gpus(sized.job.grants)):
                    # Same size on other GPUs (given back and taken in one cycle).
                    cause = Moved(sized.before, self._basis(sized.job))
                    grows.append(Resize(job_id, _as_grants(sized.held), cause))
                continue
            grants = _as_grants(sized.held)
            if len(sized.held) < sized.before:
                shrinks.append(Resize(job_id, grants, self._shrink_cause(sized)))
            else:
                grows.append(Resize(job_id, grants, self._grow_cause(sized)))
        return shrinks, rewritten, grows

    def _placed(self, action: Place) -> Place:
        sized = self.sized[action.job_id]
        job = sized.job
        grants = _as_grants(sized.held)
        target = self.targets.get(job.job_id, job.gpus)
        size = f"{len(sized.held)} GPUs of {self.least(job)}..{self.most(job)}"
        if sized.grown:
            note = f"elastic: {size}, {sized.grown} of them idle ({self._basis(job)})"
        elif len(sized.held) < self.wanted(job.job_id):
            note = f"elastic: {size}, less than the {job.gpus} asked for: what was left"
        else:
            note = f"elastic: {size}"
        if target != len(sized.held) and not sized.grown:
            note += f" (target {target})"
        why = replace(action.why, grants=grants, extra=(*action.why.extra, note))
        return replace(action, grants=grants, why=why)

    def _basis(self, job: JobView) -> str:
        sizes = [n for n, _ in _observed(job)]
        if not sizes:
            return "no throughput observed yet: concave prior"
        return f"throughput observed at {', '.join(map(str, sizes))} GPUs"

    def _shrink_cause(self, sized: _Sized) -> Evacuated | Retreated | ShrunkFor:
        job = sized.job
        before, after = sized.before, len(sized.held)
        if sized.evacuated:
            return Evacuated(before, after, tuple(sorted(sized.evacuated)))
        if sized.shrunk_for is None:
            return Retreated(
                before, after, self._rate(job, before), self._rate(job, after), self.min_gain
            )
        loss = 1.0 - self._rate(job, after) / max(self._rate(job, before), 1e-12)
        return ShrunkFor(
            before, after, sized.shrunk_for, loss, job.gpus, self.least(job), self._basis(job)
        )

    def _grow_cause(self, sized: _Sized) -> Grown:
        job = sized.job
        before, after = sized.before, len(sized.held)
        gain = self._rate(job, after) / max(self._rate(job, before), 1e-12) - 1.0
        return Grown(before, after, gain, job.gpus, self.most(job), self._basis(job))


def running_views(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """Running elastic jobs as the rest of the core must see them: `gpus` is the size
    they run at now (their grants), which is what they accrue service at."""
    if not any(j.elastic and j.held_gpus != j.gpus for j in snapshot.running):
        return snapshot
    running = tuple(
        replace(j, gpus=j.held_gpus) if j.elastic and j.held_gpus != j.gpus else j
        for j in snapshot.running
    )
    return replace(snapshot, running=running)
