"""The policy core's own view of the cluster: a frozen snapshot in, decisions out.

These types are deliberately not the wire schemas: the live brain builds a snapshot
from its records, the simulator builds one from a trace, and neither leaks into the
other. Everything here is immutable: a `record` (brain/core/record.py), which the type
checker holds frozen and which costs a tenth of a frozen dataclass to build.
"""

from __future__ import annotations

import functools
import math
from dataclasses import KW_ONLY, field
from typing import Literal

from brain.core.distribution import ServiceByClass, ServiceDistribution
from brain.core.record import record
from brain.core.sharing import GPU_MILLI


@record
class Grant:
    """GPUs of one node given to a job."""

    node: str
    gpus: tuple[int, ...]


@record
class NodeView:
    name: str
    # GPUs the scheduler may use (healthy, not drained), and those of them not allocated.
    gpus: tuple[int, ...]
    free: frozenset[int]
    # Locality group: nodes under one switch (or rack) talk faster to each other.
    switch: str = "default"
    # What jobs with a `Demand` are placed by (brain/core/shares.py): the GPUs' model
    # and memory (MiB per GPU, 0: unknown), and CPUs (thousandths) and memory (MiB)
    # jobs may reserve here (None: the agent did not say; only jobs asking none fit).
    model: str = ""
    gpu_memory_mib: int = 0
    cpu_milli: int | None = None
    memory_mib: int | None = None


@record
class Demand:
    """What a job asks beyond whole GPUs: a share of one GPU (`gpu_milli` < 1000), GPU
    memory per GPU, allowed GPU models, CPUs and memory on its node. A job with a
    demand is placed through the sharing ledger (brain/core/shares.py), on one node;
    one that asks whole GPUs and no CPUs or memory (`shares.spreads`) may, where no one
    node has room, go on several, as the whole-GPU placement puts a job without a
    demand (None), on the nodes whose GPUs satisfy it."""

    gpu_milli: int = 1000
    gpu_memory_mib: int = 0
    gpu_types: tuple[str, ...] = ()
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def fractional(self) -> bool:
        return self.gpu_milli < 1000


# `build` queues hold interactive work: a fixed quota, never preempted. `train` queues
# may borrow idle GPUs beyond their guarantee, and their jobs may be preempted.
JobClass = Literal["build", "train"]


@record
class QueueQuota:
    """A queue's share of the cluster (Run:ai): GPUs it is guaranteed, and its class.

    A job whose queue is not configured belongs to an implicit `train` queue with no
    guarantee: it may use any idle GPU and may always be preempted.
    """

    name: str
    guaranteed_gpus: int
    job_class: JobClass = "train"


@record
class GpuMemory:
    """A job's memory on one of its GPUs (MiB): its peak and its forecast."""

    node: str
    gpu: int
    peak_mib: float
    forecast_mib: float


@record
class UtilizationProfile:
    """What a running job does with the GPUs it holds, from its telemetry (brain/profiles.py).

    Utilisation is in percent of the job's GPUs (mean over them), memory in MiB on its
    busiest GPU; the forecast covers the next window. `underused` is set when the job
    holds GPUs it barely uses, so placement and elasticity can take them back.
    """

    mean_util_pct: float
    p95_util_pct: float
    mem_peak_mib: float
    # The job's cycle (an iteration, an epoch, a checkpoint), if one was detected.
    period_s: float | None
    forecast_util_pct: float
    forecast_mem_mib: float
    underused: bool = False
    # GPUs among those held whose mean utilisation is below the "barely used" line.
    idle_gpus: int = 0
    # Per GPU, for a job that shares may run beside (`JobSpec.shareable`): its memory on
    # each of its GPUs, which co-location reckons with (brain/core/shares.py). Empty:
    # only its busiest GPU's (above) is known.
    gpu_memory: tuple[GpuMemory, ...] = ()

    def memory_on(self, node: str, gpu: int) -> float:
        """What the job is reckoned to use of one of its GPUs' memory: its peak or its
        forecast, whichever is higher, of that GPU where known, else of its busiest."""
        for known in self.gpu_memory:
            if known.gpu == gpu and known.node == node:
                return max(known.peak_mib, known.forecast_mib)
        return max(self.mem_peak_mib, self.forecast_mem_mib)


@record
class Measured:
    """A job's throughput at one world size, from its progress reports."""

    size: int
    # Mean samples/s of the whole job (or goodput) over the reports in the window.
    rate: float
    # Relative standard error of `rate` (0: exact, as the simulator reports); infinite
    # while too few reports came to know it: no decision rests on such a point.
    rel_error: float = 0.0
    # When the last report at this size came (the snapshot's clock); None: unknown.
    at: float | None = None

    @property
    def settled(self) -> bool:
        return math.isfinite(self.rel_error)


@record
class Service:
    """What a job has run: one model of service for the live brain's job records
    (`brain.state.service_of`) and the simulator's jobs, so that both reckon it alike.

    `attained_gpu_s` and `executed_s` are closed: the runs that ended, and the sizes an
    elastic job left within its run. The run in progress, if any, began at `run_since`
    and has held `size` GPUs (a share: its fraction of one) since `size_since`, which is
    later than `run_since` once the job resized in this run. `attained_to(now)` and
    `executed_to(now)` add the run in progress; a clock at or behind `size_since` adds
    nothing (service never goes back). Each transition returns the next value."""

    attained_gpu_s: float = 0.0
    executed_s: float = 0.0
    run_since: float | None = None
    size_since: float | None = None
    size: float = 0.0

    def attained_to(self, now: float) -> float:
        """GPU-seconds to `now` (Tiresias' attained service), the run in progress included."""
        since = self.size_since
        if since is None or now <= since:
            return self.attained_gpu_s
        return self.attained_gpu_s + (now - since) * self.size

    def executed_to(self, now: float) -> float:
        """Wall seconds run to `now`, over every run."""
        since = self.run_since
        if since is None or now <= since:
            return self.executed_s
        return self.executed_s + (now - since)

    def started(self, now: float, size: float) -> Service:
        """A run begins at `now` on `size` GPUs."""
        if self.run_since is not None:
            raise ValueError(f"a run began at {self.run_since} and has not ended")
        return Service(self.attained_gpu_s, self.executed_s, now, now, size)

    def resized(self, now: float, size: float) -> Service:
        """The run in progress holds `size` GPUs from `now`: the size it leaves is counted."""
        since = self.run_since
        if since is None:
            raise ValueError("resized, but no run is in progress")
        return Service(self.attained_to(now), self.executed_s, since, max(now, since), size)

    def ended(self, now: float) -> Service:
        """The run in progress ends at `now`: folded into what is closed."""
        if self.run_since is None:
            return self
        return Service(self.attained_to(now), self.executed_to(now))


@record
class JobView:
    job_id: str
    gpus: int
    submitted_at: float
    queue: str = "default"
    # Whose job it is; None where not known (a trace without users: one tenant). A
    # shared GPU serves one tenant's shares (brain/core/sharing.py).
    tenant: str | None = None
    priority: int = 0
    # Set for running jobs: the GPUs held, and when the current run began.
    grants: tuple[Grant, ...] = ()
    started_at: float | None = None
    # GPUs x seconds the job has run so far, over all its runs (Tiresias' attained
    # service): its `Service.attained_to` the snapshot's clock. It is never reset.
    attained_gpu_seconds: float = 0.0
    # When the job last became pending (submission, or its last preemption); None
    # means `submitted_at`. Drives the starvation guard and the locality back-off.
    pending_since: float | None = None
    # The LAS band the job was last put in (see `SetServiceLevel`), and since when.
    # The shell stores what the last `SetServiceLevel` said; None means `submitted_at`.
    service_level: int = 0
    service_level_since: float | None = None
    # Run time on the requested GPUs, when the submitter declared it (srtf only).
    declared_duration_s: float | None = None
    # Fraction of its declared work the job reports done (step / total steps), if it
    # reports progress; None when unknown.
    progress_fraction: float | None = None
    # How fast `progress_fraction` grows while the job runs (fraction per second),
    # measured from its recent progress reports; None when unknown.
    progress_rate_per_s: float | None = None
    # Seconds the job has actually run (wall clock, all runs: `Service.executed_to`);
    # 0 when unknown.
    executed_seconds: float = 0.0
    # Network-bound jobs keep strict consolidation: no locality relaxation.
    network_sensitive: bool = False
    # Running jobs with enough telemetry: their utilisation profile; None otherwise.
    profile: UtilizationProfile | None = None
    # Retry stage: a job retried after a failure waits until `not_before` (its
    # back-off) and is never placed on `avoid_nodes` (where it failed).
    not_before: float | None = None
    avoid_nodes: frozenset[str] = frozenset()
    # Elastic jobs (Horovod) run anywhere between `min_gpus` and `max_gpus`; None for a
    # rigid job, which runs on exactly `gpus`. A running elastic job's current size is
    # the GPUs its grants hold; `gpus` is the size it asked to start at.
    min_gpus: int | None = None
    max_gpus: int | None = None
    # Observed throughput (samples/s, whole job) per world size, from its progress
    # reports: what the elasticity stage ranks marginal gains by. Sorted by size.
    throughput: tuple[Measured, ...] = ()
    # A resize was staged and the job's supervisor has not acknowledged it yet: the
    # policy leaves the job's size alone until it has.
    resizing: bool = False
    # When the job's last resize took effect in this run, and how long it took from
    # command to commit: the policy moves it again only once it has run k times that
    # at its size (`Policy.elastic_payback`). None: not resized in this run.
    last_resize_at: float | None = None
    last_resize_s: float | None = None
    # An operator pinned the job at this many GPUs (`alnair resize JOB N`): the policy
    # runs it at exactly that size until the pin is lifted (`resize JOB auto`).
    pinned_gpus: int | None = None
    # The policy shrank the job from this size because the GPUs above did not earn
    # their keep, at `gain_ceiling_at`: it grows back to it only on new evidence
    # (`Policy.elastic_reprobe_s` later).
    gain_ceiling: int | None = None
    gain_ceiling_at: float | None = None
    # A share, a GPU type, CPUs or memory (see `Demand`); None: whole GPUs only.
    demand: Demand | None = None
    # A whole-GPU job that lets shares run beside it while its profile leaves room.
    shareable: bool = False
    # The job array it belongs to (any name, one per array: the shell's, within a
    # tenant), and how many of the array's jobs may hold GPUs at once (sbatch's %N):
    # past it, it waits (`AtArrayLimit`). None: no array, or no limit.
    array: str | None = None
    array_limit: int | None = None

    @property
    def shared(self) -> bool:
        """Holds (or asks) a share of one GPU."""
        return self.demand is not None and self.demand.fractional

    @property
    def running(self) -> bool:
        return bool(self.grants)

    @property
    def elastic(self) -> bool:
        return self.min_gpus is not None

    @property
    def held_gpus(self) -> int:
        return sum(len(g.gpus) for g in self.grants)

    @property
    def gpu_size(self) -> float:
        """GPUs its service is reckoned in: a share of one GPU its share, any other job
        its GPUs (`gpus`). A second of a 0.25 share is 0.25 GPU-seconds of service."""
        demand = self.demand
        return (
            demand.gpu_milli / GPU_MILLI if demand is not None and demand.fractional else self.gpus
        )

    def waiting_since(self) -> float:
        return self.submitted_at if self.pending_since is None else self.pending_since


@record
class Ask:
    """What a job asked of placement: GPUs, a demand beyond them, and its tenant (a
    share is bound to its tenant's GPUs)."""

    gpus: int
    demand: Demand | None = None
    tenant: str | None = None


@record
class ClusterSnapshot:
    nodes: tuple[NodeView, ...]
    pending: tuple[JobView, ...]
    running: tuple[JobView, ...] = ()
    # Quota configuration; queues not listed have no guarantee (see `QueueQuota`).
    queues: tuple[QueueQuota, ...] = ()
    # The rest by name only: a field added among them cannot shift a caller's argument
    # into another's place.
    _: KW_ONLY
    # What the jobs that finished lately asked, each with how many asked it: with the
    # jobs running and pending, the workload fgd weighs fragment against
    # (brain/core/shares.py). Empty: the jobs held alone.
    recent_asks: tuple[tuple[Ask, int], ...] = ()
    # The distribution of finished jobs' service, for the Gittins ordering; None
    # means the core's built-in prior alone.
    service_distribution: ServiceDistribution | None = None
    # Finished jobs' actual total over the total their progress reports believed,
    # for orders that read it (`progress-gittins`); None: the core's built-in prior.
    error_distribution: ServiceDistribution | None = None
    # The service distribution by job size class, for orders that read it
    # (`gittins-size`); None: `service_distribution` for every job.
    service_by_class: ServiceByClass | None = None


def gpus_said(count: int) -> str:
    """`1 GPU`, `2 GPUs`."""
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def describe_grants(grants: tuple[Grant, ...]) -> str:
    """`node0[0,1], node1[3]`: where a job's GPUs are, for an operator."""
    if len(grants) == 1:
        grant = grants[0]
        return f"{grant.node}[{_gpu_list(grant.gpus)}]"
    return ", ".join(f"{g.node}[{_gpu_list(g.gpus)}]" for g in grants)


@functools.lru_cache(maxsize=1 << 12)
def _gpu_list(gpus: tuple[int, ...]) -> str:
    """`0,1`: a grant's GPU indexes. Cached: a cycle describes thousands of grants, and
    a node's GPUs come in few combinations."""
    return ",".join(map(str, gpus))


@record
class Placed:
    """Why a job was placed where it was: the GPUs, and the notes of each stage that
    had a say (the order and its rank, a guard, a quota, the elasticity stage)."""

    grants: tuple[Grant, ...]
    notes: tuple[str, ...]
    # Said after the notes' parenthesis (the elasticity stage's account of the size).
    extra: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"placed on {describe_grants(self.grants)} ({'; '.join(self.notes)})"
        return "; ".join((text, *self.extra))


@record
class Place:
    """Start a pending job on these GPUs (a gang: every grant or none), for the typed
    reason `why`. Every action keeps its typed cause and says it in `reason`, built
    when asked for, not by the cycle: a cycle places thousands of jobs, and the
    simulator reads none of their reasons."""

    job_id: str
    grants: tuple[Grant, ...]
    why: Placed
    # The GPUs it takes from those free, when not all of `grants`: a share on a GPU
    # already shared takes none (brain/core/shares.py). None: all of them. Not in the
    # repr: a whole-GPU placement reads as it always did.
    takes: tuple[Grant, ...] | None = field(default=None, repr=False)

    @property
    def reason(self) -> str:
        return self.why.describe()


@record
class Wait:
    """The job stays pending, for the typed reason `cause`; `reason` tells its owner
    why. The text is built when asked for: a cycle explains thousands of waits, and the
    shell journals a wait only when its `kind` changes (the same kind with other
    figures is shown, not journaled)."""

    job_id: str
    cause: WaitCause

    @property
    def reason(self) -> str:
        return self.cause.describe()


@record
class BackingOff:
    """Retried after a failure, the job waits out its back-off."""

    kind = "backing_off"

    def describe(self) -> str:
        return "waiting out its retry back-off"


@record
class AtFixedQuota:
    """Its queue has a fixed quota (a `build` queue), all of it in use: it does not
    borrow what other queues leave idle."""

    queue: str

    kind = "fixed_quota"

    def describe(self) -> str:
        return f"queue {self.queue} is at its fixed quota (build jobs do not borrow)"


@record
class AtArrayLimit:
    """As many of its array's jobs as its limit allows hold GPUs (`JobView.array_limit`):
    it starts when one of them ends or is preempted, whatever ranks ahead of it."""

    limit: int

    kind = "array_limit"

    def describe(self) -> str:
        return f"{self.limit} of its array's jobs run, as many as it allows at once"


@record
class LargerThanCluster:
    """It needs more GPUs than the cluster has schedulable, free or not."""

    need: int
    # An elastic job's minimum (with an elasticity stage), not its whole size.
    at_least: bool
    capacity: int

    kind = "larger_than_cluster"

    def describe(self) -> str:
        return (
            f"needs {_needs(self.need, self.at_least)}; the cluster has {self.capacity} schedulable"
        )


@record
class QueuedBehind:
    """A job ahead of it that does not fit yet holds back every job behind it: an order
    with head-of-line blocking (`fifo`), or a job past the starvation guard."""

    # What holds them back: the order's name, or the starvation guard.
    by: str

    kind = "queued_behind"

    def describe(self) -> str:
        # Deliberately not naming the blocker: the head changes at every placement.
        return f"queued behind an earlier job that does not fit yet ({self.by})"


@record
class RankedOut:
    """Once every job ranked ahead of it has its GPUs, fewer are left than it needs."""

    need: int
    at_least: bool
    left: int
    # Its rank and the order's name: "las band 1, las"; the name alone for an order
    # whose rank says nothing more (fifo).
    ranked: str
    # GPUs that shares alone hold, which are not for whole-GPU jobs.
    shared: int = 0

    kind = "ranked_out"

    def describe(self) -> str:
        held = f" and the {gpus_said(self.shared)} that shares hold" if self.shared else ""
        return (
            f"needs {_needs(self.need, self.at_least)}; {self.left} left after "
            f"higher-ranked jobs ({self.ranked}){held}"
        )


@record
class NoFit:
    """Nothing fits the request now: a placement plugin's answer (brain/core/placement.py),
    and so the cause of the wait of a job that selection kept but no placement fits. Why,
    in words, and the kind of reason it is, the plugin's own (`scattered`,
    `too_few_free`, `node_too_small`, `no_gpu_type`, `no_share_fits`): a change of kind
    is journaled, a change of figures alone is not."""

    reason: str
    kind: str

    def describe(self) -> str:
        return self.reason


@record
class MakingRoom:
    """Shares ranked behind it are preempted, so that it starts on their GPUs."""

    gpus: int

    kind = "making_room"

    def describe(self) -> str:
        return f"shares on {gpus_said(self.gpus)} ranked behind it are preempted to make room"


WaitCause = (
    BackingOff
    | AtFixedQuota
    | AtArrayLimit
    | LargerThanCluster
    | QueuedBehind
    | RankedOut
    | NoFit
    | MakingRoom
)


def _needs(need: int, at_least: bool) -> str:
    return f"at least {gpus_said(need)}" if at_least else gpus_said(need)


@record
class QuotaReclaim:
    """A queue needed GPUs within its guarantee that an over-quota job had borrowed."""

    owner_queue: str
    for_job: str
    victim_queue: str

    def describe(self) -> str:
        # The same queue: the victim asked more than its queue's guarantee had left when
        # its turn came (a gang larger than the guarantee never fits in it).
        over = (
            "this job of the same queue was beyond the guarantee"
            if self.victim_queue == self.owner_queue
            else f"queue {self.victim_queue} was over its quota"
        )
        return (
            f"quota reclaim: queue {self.owner_queue} needs its guaranteed GPUs for job "
            f"{self.for_job}; {over}"
        )


@record
class Outranked:
    """A job ranked ahead by the queue order needed the GPUs."""

    by_job: str
    order: str
    victim_rank: str
    winner_rank: str

    def describe(self) -> str:
        return (
            f"outranked by job {self.by_job} under {self.order}: "
            f"{self.winner_rank} ahead of {self.victim_rank}"
        )


@record
class MemoryPressure:
    """A share co-located on a shareable job's GPU is moved off before the GPU runs out
    of memory: the host's own forecast memory (its profile leaves its guests out) neared
    what the guests' memory (`guest_memory_mib`, theirs as reckoned when it was moved,
    this share's included) leaves of the GPU's."""

    host_job: str
    node: str
    gpu: int
    forecast_mem_mib: float
    gpu_memory_mib: int
    guest_memory_mib: int

    def describe(self) -> str:
        return (
            f"memory pressure: GPU {self.gpu} of {self.node}, shared with job "
            f"{self.host_job}, is forecast to use {self.forecast_mem_mib:.0f} MiB besides "
            f"the {self.guest_memory_mib} its shares may use, of {self.gpu_memory_mib} MiB; "
            "moved off before it runs out of memory"
        )


PreemptCause = QuotaReclaim | Outranked | MemoryPressure


@record
class Preempt:
    """Stop a running job and requeue it pending; it keeps its attained service and
    resumes later (from its checkpoint) when it is placed again."""

    job_id: str
    grants: tuple[Grant, ...]
    cause: PreemptCause

    @property
    def reason(self) -> str:
        return self.cause.describe()


@record
class BandCrossed:
    """The job's attained service put it in another LAS band."""

    attained_gpu_s: float
    # The threshold of the band it is in now (0 for the first band).
    threshold_gpu_s: float
    before: int
    after: int

    def describe(self) -> str:
        return (
            f"attained {self.attained_gpu_s:.0f} GPU-s >= {self.threshold_gpu_s:.0f}: "
            f"band {self.before} -> {self.after}"
        )


@record
class SetServiceLevel:
    """The job moved to another LAS band; the shell stores `level` and `since` on the
    job and reports them back in its `JobView`."""

    job_id: str
    level: int
    since: float
    cause: BandCrossed

    @property
    def reason(self) -> str:
        return self.cause.describe()


@record
class Grown:
    """The elasticity stage grew the job: the GPUs added are estimated to pay."""

    before: int
    after: int
    # Estimated throughput at `after` over that at `before`, less one.
    gain: float
    asked: int
    most: int
    # What the estimate rests on (the sizes throughput was observed at, or the prior).
    basis: str

    kind = "grow"

    def describe(self) -> str:
        return (
            f"grown from {self.before} to {self.after} GPUs (estimated throughput "
            f"{self.gain:+.0%}; asked for {self.asked}, max {self.most}; {self.basis})"
        )


@record
class ShrunkFor:
    """Shrunk to make room for another job: of the jobs above their share, the one whose
    estimated throughput loses least."""

    before: int
    after: int
    for_job: str
    # Estimated throughput lost, as a fraction of that at `before`.
    loss: float
    asked: int
    least: int
    basis: str

    kind = "shrink_for"

    def describe(self) -> str:
        return (
            f"shrunk from {self.before} to {self.after} GPUs for job {self.for_job} "
            f"(estimated throughput -{self.loss:.0%}, the lowest loss among jobs above their "
            f"share; it asked for {self.asked}, min {self.least}; {self.basis})"
        )


@record
class Retreated:
    """Shrunk because its last GPUs did not earn their keep (observed throughput): the
    shell records the size left as the job's `gain_ceiling`."""

    before: int
    after: int
    rate_before: float
    rate_after: float
    # Each GPU above must add this share of an average GPU's throughput.
    min_gain: float

    kind = "retreat"

    def describe(self) -> str:
        return (
            f"shrunk from {self.before} to {self.after} GPUs: the last "
            f"{self.before - self.after} did not earn their keep (observed "
            f"{self.rate_after:.4g}/s at {self.after}, {self.rate_before:.4g}/s at "
            f"{self.before}: less than {self.min_gain:.0%} of an average GPU each); they go "
            "to other jobs"
        )


@record
class Evacuated:
    """Shrunk off GPUs that are no longer schedulable (drained, faulty or gone)."""

    before: int
    after: int
    # (node, GPU) of each GPU it left.
    left: tuple[tuple[str, int], ...]

    kind = "evacuate"

    def describe(self) -> str:
        left = ", ".join(f"{node}:{gpu}" for node, gpu in self.left)
        return (
            f"shrunk from {self.before} to {self.after} GPUs off {left}, no longer "
            "schedulable (drained, faulty or gone): it runs on in place"
        )


@record
class Moved:
    """The same size on other GPUs (given back and taken within one cycle)."""

    size: int
    basis: str

    kind = "move"

    def describe(self) -> str:
        return f"moved to other GPUs, still {self.size} ({self.basis})"


ResizeCause = Grown | ShrunkFor | Retreated | Evacuated | Moved


@record
class Resize:
    """Change a running elastic job's size (staged: the shell commits it when the job's
    supervisor acknowledges). `grants` are the job's whole grants after the resize: a
    grow holds every GPU it had plus the added ones; a shrink, the ones it keeps."""

    job_id: str
    grants: tuple[Grant, ...]
    cause: ResizeCause

    @property
    def reason(self) -> str:
        return self.cause.describe()

    @property
    def retreat(self) -> bool:
        """The GPUs given back did not earn their keep (`Retreated`)."""
        return isinstance(self.cause, Retreated)

    @property
    def size(self) -> int:
        return sum(len(g.gpus) for g in self.grants)


Action = Place | Wait | Preempt | SetServiceLevel | Resize


@record
class Decisions:
    actions: tuple[Action, ...] = field(default=())
    # Call `decide` again no later than this (a LAS threshold crossing, a locality
    # back-off or the starvation guard expiring), even if no event arrives.
    wake_at: float | None = None

    @property
    def placements(self) -> tuple[Place, ...]:
        return tuple(a for a in self.actions if isinstance(a, Place))

    @property
    def waits(self) -> tuple[Wait, ...]:
        return tuple(a for a in self.actions if isinstance(a, Wait))

    @property
    def preemptions(self) -> tuple[Preempt, ...]:
        return tuple(a for a in self.actions if isinstance(a, Preempt))

    @property
    def level_changes(self) -> tuple[SetServiceLevel, ...]:
        return tuple(a for a in self.actions if isinstance(a, SetServiceLevel))

    @property
    def resizes(self) -> tuple[Resize, ...]:
        return tuple(a for a in self.actions if isinstance(a, Resize))
