"""`decide(snapshot, now)`: the brain's whole policy, as one pure function.

Synchronous, deterministic, no I/O, no clock and no randomness of its own: the live
brain and the trace simulator call this very function. The pipeline is fixed; which
ordering, placement and preemption run are plugins named in the `Policy`:

0. retries    — a job retried after a failure waits out its back-off, and avoids the
                nodes it failed on while any other node could ever run it;
1. ordering   — rank every runnable job, pending and running (`ORDERINGS`);
2. admission  — each job's standing against its queue's quota (`quota.QuotaWalk`);
3. selection  — walk jobs by (standing, preemption hold, starvation, rank) and keep
                those that fit in the cluster's GPUs, as Tiresias' simulator does: a
                running job that no longer fits is a preemption candidate;
4. placement  — place the selected pending jobs (`PLACEMENTS`), releasing candidate
                victims worst-ranked first, only as far as a placement needs; a victim
                whose GPUs nobody took keeps running. A job asking a share of a GPU, a
                GPU type, CPUs or memory is placed on one node by the policy's sharing
                plugin instead (brain/core/shares.py; whole GPUs of a type, asking no
                CPUs or memory, on several where none has room); a share needs none of the
                whole-GPU budget in 3, and shares are victims a GPU at a time, for
                the first whole-GPU job their GPUs would make room for
                (`_make_room_in_shares`);
5. elasticity — the `ELASTICITIES` plugin's stage (brain/core/elastic.py, `Sizing`;
                "none" and a cycle without an elastic job: the identity); one that
                resizes:
                elastic jobs count at their minimum in 3, get targets toward what
                they asked for in rank order (less attained service first within a
                rank class), shrink toward them before anyone is preempted, and idle
                GPUs left at the end grow them, highest marginal gain first.

Every action carries its cause.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from operator import attrgetter, itemgetter
from typing import Final

from brain.core.collector import collector_paused
from brain.core.distribution import DEFAULT_SERVICE_PRIOR
from brain.core.elastic import ELASTICITIES, RIGID, Sizing, service_bucket
from brain.core.model import (
    Action,
    AtArrayLimit,
    AtFixedQuota,
    BackingOff,
    ClusterSnapshot,
    Decisions,
    Demand,
    Grant,
    JobView,
    LargerThanCluster,
    MakingRoom,
    NodeView,
    NoFit,
    Outranked,
    Place,
    Placed,
    Preempt,
    PreemptCause,
    QueuedBehind,
    QuotaReclaim,
    RankedOut,
    Wait,
    WaitCause,
)
from brain.core.ordering import (
    ORDERINGS,
    Crossing,
    OrderContext,
    Ranked,
    job_sequence,
)
from brain.core.placement import (
    PLACEMENTS,
    Fit,
    FreeGpus,
    KeptLedger,
    Placement,
    PlacementRequest,
    PlacementResult,
)
from brain.core.preemption import PREEMPTIONS, UNIFORM_HOLDS, Preemption
from brain.core.quota import (
    QuotaWalk,
    Standing,
    at_array_limit,
    quota_of,
    smallest_ask,
    standings_in_order,
)
from brain.core.ranking import Ranking, rank_order
from brain.core.shares import (
    SharePlacer,
    describe_demand,
    hosting,
    memory_pressure,
    never_fits,
    shares_by_gpu,
    spreads,
)
from brain.core.sharing import SHARING_PLUGINS
from schemas.errors import AlnairError

# A retried job placed back on a node it failed on, said after its placement's notes.
AVOIDANCE_RELEASED: Final = "on a node it failed on: no other node could ever run it"
# What a job that waited past `Policy.starvation_guard_s` is placed, preempts and
# reserves GPUs by.
STARVING: Final = "starvation guard"


class UnknownPlugin(AlnairError, KeyError):
    def __init__(self, stage: str, name: str, known: list[str]) -> None:
        super().__init__(f"unknown {stage} policy {name!r}; known: {', '.join(sorted(known))}")
        self.stage = stage
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])  # not KeyError's repr of the message


class InvalidSnapshot(AlnairError, ValueError):
    """A snapshot the core cannot decide on (a bug in whoever built it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid snapshot: {reason}")
        self.reason = reason


class InvalidPolicy(AlnairError, ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid policy: {reason}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Policy:
    order: str = "fifo"
    placement: str = "consolidate"
    # How jobs that ask a share of a GPU, a GPU type, CPUs or memory are placed
    # (`SHARING_PLUGINS`, brain/core/shares.py); whole-GPU jobs never use it.
    share_placement: str = "fgd"
    preemption: str = "by-rank"
    # LAS band thresholds in GPU-seconds: K-1 of them make K bands. Tiresias' defaults
    # (its third limit, 18000, is never reached with three queues).
    las_thresholds_gpu_s: tuple[float, ...] = (3250.0, 7200.0)
    # The Gittins quantum: how far ahead in service the index looks (Tiresias: 3250).
    gittins_quantum_gpu_s: float = 3250.0
    # A pending job that waited this long ranks ahead of every job of its standing
    # that is not starving too. None: no guard (Tiresias' dlas-gpu has none).
    starvation_guard_s: float | None = None
    # Philly: a job that waited this long for its preferred locality may spread.
    relax_locality_after_s: float = 0.0
    # `progress`: how long a job runs before its progress reports are trusted.
    progress_probe_s: float = 60.0
    # Elasticity stage (`ELASTICITIES`); "none": elastic jobs run at their asked size.
    elasticity: str = "none"
    # May an elastic job span nodes (when it asks for more than a node, or fills one)?
    # Off: each runs on one node and grows only there.
    elastic_may_spread: bool = True
    # Grow a job only while its next GPU adds at least this share of what one of its
    # GPUs does on average (estimated): a resize is not free.
    elastic_min_gain: float = 0.25
    # Resize running elastic jobs by the stage's own choice (retreat, entitle, grow)
    # only at rounds every this many seconds (Pollux: 60), not at every cycle; a
    # reclaim for a pending job is not deferred. 0: at every cycle.
    elastic_resize_interval_s: float = 0.0
    # A running elastic job is moved by the policy again (retreat, entitle, grow) only
    # once it has run this many times as long as its last resize took at that size:
    # a resize stalls the job, so each must pay back its cost (docs/elastic.md says
    # how the default was chosen on the Pollux bench).
    elastic_payback: float = 4.0
    # Evidence against a size (its measurement, a size left for lack of gain) counts
    # this long; then the job may be tried there again. 0: for ever.
    elastic_reprobe_s: float = 1800.0

    def validate(self) -> Policy:
        plugins: tuple[tuple[str, str, Sequence[str]], ...] = (
            ("order", self.order, list(ORDERINGS)),
            ("placement", self.placement, list(PLACEMENTS)),
            ("share_placement", self.share_placement, list(SHARING_PLUGINS)),
            ("preemption", self.preemption, list(PREEMPTIONS)),
        )
        for stage, name, known in plugins:
            if name not in known:
                raise UnknownPlugin(stage, name, list(known))
        # Each test passes only for a number in range: NaN fails every comparison, so
        # `x <= 0` would have let it through.
        thresholds = self.las_thresholds_gpu_s
        if not all(0 < t < math.inf for t in thresholds) or list(thresholds) != sorted(
            set(thresholds)
        ):
            raise InvalidPolicy(f"las thresholds must be positive and rising: {thresholds}")
        if not 0 < self.gittins_quantum_gpu_s < math.inf:
            raise InvalidPolicy(
                f"the Gittins quantum must be positive, not {self.gittins_quantum_gpu_s:g}"
            )
        guard = self.starvation_guard_s
        if guard is not None and not 0 < guard <= math.inf:
            raise InvalidPolicy(f"the starvation guard must be positive, not {guard:g}")
        if not 0 <= self.relax_locality_after_s <= math.inf:
            raise InvalidPolicy(
                f"the locality relaxation cannot be negative, not {self.relax_locality_after_s:g}"
            )
        if not 0 <= self.progress_probe_s < math.inf:
            raise InvalidPolicy(
                f"the progress probe cannot be negative, not {self.progress_probe_s:g}"
            )
        if self.elasticity not in ELASTICITIES:
            raise UnknownPlugin("elasticity", self.elasticity, list(ELASTICITIES))
        if not 0.0 <= self.elastic_min_gain <= 1.0:
            raise InvalidPolicy("the elastic minimum gain must be within 0..1")
        # (what, value, the most it may be: a re-probe may be never, inf)
        ranges = (
            ("the elastic resize interval", self.elastic_resize_interval_s, sys.float_info.max),
            ("the elastic payback factor", self.elastic_payback, sys.float_info.max),
            ("the elastic re-probe interval", self.elastic_reprobe_s, math.inf),
        )
        for what, value, most in ranges:
            if not 0 <= value <= most:
                raise InvalidPolicy(f"{what} must be a number >= 0, not {value:g}")
        return self

    def describe(self) -> str:
        text = f"order={self.order} placement={self.placement} preemption={self.preemption}"
        text += f" share-placement={self.share_placement}"
        if self.elasticity != "none":
            text += f" elasticity={self.elasticity}"
            if not self.elastic_may_spread:
                text += " one-node"
        return text


DEFAULT_POLICY = Policy()


@dataclass(slots=True)
class _Entry:
    """One job in the cycle, with everything its rank depends on. Not frozen only
    because frozen dataclasses are slow to build, and one is built per job a cycle
    decides on (and per job, where a stage sorts or indexes them: `_flat`); nothing
    mutates it. (A named tuple built with `tuple.__new__` was cheaper to build
    and dearer to read: 1.4 % more instructions a `las` cycle, by callgrind.)"""

    ranked: Ranked
    standing: Standing
    starving: bool
    # The preemption plugin's hold (`PREEMPTIONS`).
    hold: int

    @property
    def job(self) -> JobView:
        return self.ranked.job

    @property
    def sort_key(self) -> tuple[int, int, int, float, tuple[float, ...], float, tuple[int, str]]:
        """Where the job stands in the selection order (smaller first)."""
        job = self.ranked.job
        return (
            int(self.standing),
            self.hold,
            0 if self.starving else 1,
            job.waiting_since() if self.starving else 0.0,
            self.ranked.rank,
            job.submitted_at,
            job_sequence(job.job_id),
        )


@dataclass(slots=True)
class _Cycle:
    """The mutable working state of one `decide` call; never escapes it."""

    snapshot: ClusterSnapshot
    now: float
    policy: Policy
    place: Placement
    ledger: FreeGpus
    actions: list[Action] = field(default_factory=list)
    preemptions: list[Preempt] = field(default_factory=list)
    wakes: list[float] = field(default_factory=list)
    placed: list[tuple[_Entry, tuple[Grant, ...]]] = field(default_factory=list)
    # The GPUs of the victims released so far, by node, each with its victim's place in
    # the released list; and each released victim's winner, the first placement to take
    # one of its GPUs (None: none has). Kept as placements take GPUs (`_placed`), so that
    # no victim's cause has to look through every placement of the cycle.
    claims: dict[str, dict[int, int]] = field(default_factory=dict)
    winners: list[_Entry | None] = field(default_factory=list)
    # The elasticity stage (brain/core/elastic.py); the identity unless it resizes.
    elastic: Sizing = RIGID
    shares: SharePlacer | None = None
    # Retried jobs that may go back to the nodes they failed on (`_avoidance_stage`).
    unavoided: AbstractSet[str] = frozenset()
    # Does any job of the cycle ask a share, a GPU type, CPUs or memory? Without one,
    # the sharing machinery has nothing to say and is skipped.
    sharing: bool = True
    # Whether the caller reads `Wait`s (`decide(..., waits=False)`: the simulator), and
    # the jobs it wants them of anyway (`decide(..., explain=...)`).
    waits: bool = True
    explain: AbstractSet[str] = frozenset()
    # Running jobs holding GPUs outside the schedulable ones (a drained or faulty GPU,
    # a node drained or lost), and how many (`FreeGpus.held_outside`): those take
    # nothing from the budget of the GPUs there are.
    outside: Mapping[str, int] = field(default_factory=dict)
    # The GPUs that running shares alone hold, with the shares on each
    # (`shares.shares_by_gpu`), and the whole-GPU jobs that waited for want of GPUs
    # while there were any: (entry, the GPUs left for it, its need), in selection order
    # (`_make_room_in_shares`).
    share_gpus: Mapping[tuple[str, int], list[JobView]] = field(default_factory=dict)
    short: list[tuple[_Entry, int, int]] = field(default_factory=list)
    # Running whole-GPU jobs with shares beside them (`shares.hosting`): never victims.
    hosts: AbstractSet[str] = frozenset()
    # How many jobs of each array hold GPUs, or are selected to (`JobView.array`), for a
    # cycle with a job whose array has a limit; None: none has.
    arrays: Counter[str] | None = None

    def explains(self, job_id: str) -> bool:
        """Is this job's `Wait` wanted, if it waits?"""
        return self.waits or job_id in self.explain

    def sharer(self) -> SharePlacer:
        """The placer of jobs with a demand, built when the cycle meets the first."""
        if self.shares is None:
            self.shares = SharePlacer(self.snapshot, self.policy.share_placement)
        return self.shares


def _standings(
    by_rank: list[Ranked],
    holds: list[int],
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobView],
    smallest: int,
    arrays: Mapping[str, int] | None,
) -> list[Standing] | None:
    """Each job's quota standing (`quota.standings_in_order`), in the order of `by_rank`,
    the queues walked by (hold, rank); None when no queue is configured (every job is
    over quota, whatever its rank)."""
    queues = quota_of(snapshot.queues)
    if not queues:
        return None
    ranked_jobs = [r.job for r in by_rank]
    if min(holds, default=0) == max(holds, default=0):
        return standings_in_order(
            ranked_jobs, queues, unordered=jobs, smallest=smallest, arrays=arrays
        )
    # Stable: within one hold, still by rank.
    walk = sorted(range(len(ranked_jobs)), key=holds.__getitem__)
    walked = standings_in_order(
        [ranked_jobs[i] for i in walk], queues, unordered=jobs, smallest=smallest, arrays=arrays
    )
    result = [Standing.OVER_QUOTA] * len(ranked_jobs)
    for position, standing in zip(walk, walked, strict=True):
        result[position] = standing
    return result


@dataclass(frozen=True, slots=True)
class _Group:
    """A run of the selection order whose jobs share their standing, hold and whether
    they starve: the selection walks these, and builds an `_Entry` only for a job it
    decides on (to place, a victim, short of GPUs), not for each of the thousands that
    merely wait."""

    standing: Standing
    hold: int
    starving: bool
    ranked: list[Ranked]

    def entries(self) -> list[_Entry]:
        return [_Entry(r, self.standing, self.starving, self.hold) for r in self.ranked]


def _selection_order(
    by_rank: list[Ranked],
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobView],
    now: float,
    policy: Policy,
    hold: Preemption,
    smallest: int,
    arrays: Mapping[str, int] | None,
) -> list[_Group]:
    """Every job in selection order: by (standing, hold, starving first and longest
    waiting first among them, rank, submission, id), as runs of one class each.

    `by_rank` is every job by (rank, submission, id) (brain/core/ranking.py); standings
    and the selection order are stable partitions of it, so that a cycle sorts its jobs
    once (sorting tuples is most of what ranking costs). `jobs` are the jobs ranked, in
    snapshot order, for walks that need no order; `smallest` the least any of them takes
    of a guarantee (`quota.smallest_ask`); `arrays` how many jobs of each array run, for
    a cycle with a job whose array has a limit (`_Cycle.arrays`)."""
    uniform = UNIFORM_HOLDS.get(hold)
    guard = policy.starvation_guard_s
    if guard is None and uniform is not None:
        # Every job holds alike: no list of holds to build and scan.
        return _by_standing(by_rank, uniform if by_rank else 0, snapshot, jobs, smallest, arrays)
    holds = [hold(r.job) for r in by_rank] if uniform is None else [uniform] * len(by_rank)
    if guard is None and min(holds, default=0) == max(holds, default=0):
        return _by_standing(by_rank, holds[0] if holds else 0, snapshot, jobs, smallest, arrays)
    standing_of = _standings(by_rank, holds, snapshot, jobs, smallest, arrays)
    over = Standing.OVER_QUOTA
    standing_list = standing_of or [over] * len(by_rank)
    groups: dict[tuple[int, int, bool], list[Ranked]] = {}
    for item, held, standing in zip(by_rank, holds, standing_list, strict=True):
        job = item.job
        starving = guard is not None and not job.grants and now - job.waiting_since() >= guard
        group = groups.get((standing, held, not starving))
        if group is None:
            groups[(standing, held, not starving)] = [item]
        else:
            group.append(item)
    runs: list[_Group] = []
    for key in sorted(groups):
        group = groups[key]
        if not key[2]:
            # Starving jobs: the longest waiting first (stable: then by rank).
            group.sort(key=lambda r: r.job.waiting_since())
        runs.append(_Group(Standing(key[0]), key[1], not key[2], group))
    return runs


def _by_standing(
    by_rank: list[Ranked],
    hold: int,
    snapshot: ClusterSnapshot,
    jobs: Sequence[JobView],
    smallest: int,
    arrays: Mapping[str, int] | None,
) -> list[_Group]:
    """`_selection_order` when every job has the same hold and nobody can starve (no guard):
    the rank order, partitioned by standing alone (with no quotas, one partition), in
    one walk: the quota walk's, as far as a guarantee has room; after it, every job is
    over quota but those of `build` queues (`QuotaWalk.rest`)."""
    queues = quota_of(snapshot.queues)
    if not queues:
        return [_Group(Standing.OVER_QUOTA, hold, False, by_rank)]
    walk = QuotaWalk(queues, jobs, smallest, arrays)
    walked = walk.standings(map(_JOB, by_rank))
    partitions: list[list[Ranked]] = [[] for _ in Standing]
    appends = [partition.append for partition in partitions]
    for item, standing in zip(by_rank, walked, strict=False):
        appends[standing](item)
    rest = by_rank[len(walked) :]
    over = partitions[Standing.OVER_QUOTA]
    if not walk.of_builds:
        over += rest
    else:
        # Over quota but for the few jobs of `build` queues. One walk in the interpreter,
        # whose specialised reads cost less than chained `map`s over the jobs; finding
        # them by identity instead (no read of a view out of order) allocated an int per
        # job for its `id`, and took as long by the clock. `QuotaWalk.rest`, inline: its
        # table, read here, rather than a call for each job of a `build` queue. (And
        # `over.append` as a method: Python 3.11 specialises that call, not a bound one.)
        rest_by_queue = walk.rest_by_queue
        for item in rest:
            job = item[0]  # Ranked.job
            if job.queue in rest_by_queue:
                appends[rest_by_queue[job.queue][not job.grants]](item)
            else:
                over.append(item)
    return [
        _Group(standing, hold, False, partition)
        for standing, partition in zip(Standing, partitions, strict=True)
        if partition
    ]


_JOB: Final = itemgetter(0)  # Ranked.job


def _flat(groups: list[_Group]) -> list[_Entry]:
    """The selection order job by job, for the stages that index or sort it (elastic
    jobs' ranks, making room among shares)."""
    return [entry for group in groups for entry in group.entries()]


def _regrouped(entries: list[_Entry]) -> list[_Group]:
    """Entries (in an order that keeps each class together) back as runs."""
    groups: list[_Group] = []
    for entry in entries:
        last = groups[-1] if groups else None
        if (
            last is None
            or last.standing is not entry.standing
            or last.hold != entry.hold
            or last.starving != entry.starving
        ):
            groups.append(_Group(entry.standing, entry.hold, entry.starving, [entry.ranked]))
        else:
            last.ranked.append(entry.ranked)
    return groups


_ElasticKey = tuple[
    int, int, int, float, tuple[float, ...], int, tuple[float, ...], float, tuple[int, str]
]


def _elastic_key(entry: _Entry) -> _ElasticKey:
    """With an elasticity stage: within one rank class (the order's first rank key),
    less attained service first, by doubling buckets (see brain/core/elastic.py)."""
    key = entry.sort_key
    service = service_bucket(entry.job.attained_gpu_seconds)
    return (key[0], key[1], key[2], key[3], entry.ranked.rank[:1], service, *key[4:])


def _share_class(entry: _Entry, rank_entitles: bool) -> tuple[float, ...]:
    """What entitles an elastic job to GPUs above its minimum before others get any:
    its quota standing, whether it may be preempted, and the order's rank class when
    that is an entitlement (a priority), not a queue heuristic (`Ordered.rank_entitles`)."""
    key = entry.sort_key
    return (key[0], key[1], *(entry.ranked.rank[:1] if rank_entitles else ()))


# What a wait's cause is built from: the GPUs it needs now and asked for, the budget
# left (none below 0), its rank's label, and whether a blocker is set. A cycle has one
# blocker at most, set once: whether it has been is all the key needs of it (hashing
# the record would call its Python-level `__hash__` for every wait). A held job's cause
# is keyed by its queue alone (`AtFixedQuota`), a capped one's by its array's limit
# (`AtArrayLimit`).
_WaitKey = tuple[int, int, int, str, bool]


def _select(
    cycle: _Cycle, groups: list[_Group], head_of_line_blocking: bool, capacity: int
) -> tuple[list[_Entry], list[_Entry]]:
    """Walk the selection order, run by run, and keep what fits by GPU count: (pending
    to place, victims), each an `_Entry`.

    One pass, and most of it over jobs that wait: once the GPUs run out, a job costs
    its `Wait` and nothing more (a cause that repeats is built once, and no `_Entry`)."""
    # GPUs that shares hold are not for whole-GPU jobs; a share needs no whole GPU of
    # the budget (its placement says whether it fits), and is no victim here: a GPU's
    # shares make room for a better-ranked whole-GPU job together, after the placements
    # (`_make_room_in_shares`), which is why those that wait for want of GPUs are noted.
    sharing = cycle.sharing
    _note_shares(cycle)
    budget = capacity - len(cycle.share_gpus)
    short = cycle.short if cycle.share_gpus else None
    hosts = cycle.hosts
    to_place: list[_Entry] = []
    victims: list[_Entry] = []
    blocked_by: QueuedBehind | None = None
    need_of, select = cycle.elastic.need, cycle.elastic.select
    # A stage that does not resize takes every job at its `gpus` and is told nothing
    # (`Sizing.resizes`): a job's need is read, not asked (a call or two for each job:
    # 1.3 % of a gittins cycle's instructions at 5,000 nodes).
    rigid = not cycle.elastic.resizes
    actions = cycle.actions
    policy = cycle.policy
    explain, also = cycle.waits, cycle.explain
    reasons: dict[_WaitKey | str | int | None, WaitCause] = {}
    outside = cycle.outside
    arrays = cycle.arrays
    for group in groups:
        standing, starving, hold = group.standing, group.starving, group.hold
        pinned = standing is Standing.PINNED
        held = standing is Standing.HELD
        for ranked in group.ranked:
            job = ranked.job
            need = 0 if sharing and job.shared else job.gpus if rigid else need_of(job)
            if job.grants:
                # What it holds outside the schedulable GPUs is not in `capacity`.
                takes = (
                    max(0, need - outside[job.job_id])
                    if outside and job.job_id in outside
                    else need
                )
                if job.resizing or (sharing and (job.shared or job.job_id in hosts)):
                    # Never victims: shares, whole-GPU jobs with shares beside them, and
                    # a job mid-resize, whose GPUs are spoken for (a shrink's, for the
                    # job it shrank for, which waits for them): if its rank says it must
                    # go, it goes once the resize has settled, not in the pass after
                    # staging.
                    budget = max(0, budget - takes)
                elif takes <= budget or pinned:
                    budget -= takes
                else:
                    victims.append(_Entry(ranked, standing, starving, hold))
                    continue
                if not rigid:
                    select(job, need)
                continue
            # Held to its array's limit (sbatch's %N), a job is as one held to its
            # queue's fixed quota: it takes nothing from the budget, holds no job back.
            capped = arrays is not None and at_array_limit(arrays, job)
            if need <= budget and blocked_by is None and need <= capacity and not (held or capped):
                budget -= need
                if not rigid or arrays is not None:
                    _selected(job, need, None if rigid else select, arrays)
                to_place.append(_Entry(ranked, standing, starving, hold))
                continue
            if explain or (also and job.job_id in also):
                # Most waits of a cycle repeat a cause built for a job before them; a
                # capped job's is its limit's alone (`AtArrayLimit`), a held one's its
                # queue's (`AtFixedQuota`).
                key = (
                    job.array_limit
                    if capped
                    else job.queue
                    if held
                    else (
                        need,
                        job.gpus,
                        budget if budget > 0 else 0,
                        ranked.label,
                        blocked_by is not None,
                    )
                )
                cause = reasons.get(key)
                if cause is None:
                    cause = reasons[key] = _wait_cause(
                        group, ranked, need, capacity, budget, blocked_by, cycle, capped
                    )
                actions.append(Wait(job.job_id, cause))
            if (
                short is not None
                and blocked_by is None
                and need <= capacity
                and not (held or capped)
                and job.demand is None
            ):
                short.append((_Entry(ranked, standing, starving, hold), budget, need))
            # A starving job that cannot start yet reserves the GPUs that free up: no
            # job behind it may backfill them, or it could wait forever.
            if (
                (head_of_line_blocking or starving)
                and blocked_by is None
                and need <= capacity
                and not (held or capped)
            ):
                # Not naming the blocker (`QueuedBehind`): the head changes at every
                # placement.
                blocked_by = QueuedBehind(STARVING if starving else policy.order)
    return to_place, victims


def _selected(
    job: JobView,
    need: int,
    select: Callable[[JobView, int], None] | None,
    arrays: Counter[str] | None,
) -> None:
    """A pending job selected to be placed: told to a stage that resizes (`select`),
    and counted in its array (`_Cycle.arrays`)."""
    if select is not None:
        select(job, need)
    if arrays is not None and job.array is not None:
        arrays[job.array] += 1


def _note_shares(cycle: _Cycle) -> None:
    """For a cycle with a share: the GPUs that running shares alone hold
    (`_Cycle.share_gpus`), and the whole-GPU jobs with shares beside them (`hosts`)."""
    if cycle.sharing:
        running = cycle.snapshot.running
        cycle.share_gpus = shares_by_gpu(running, cycle.ledger)
        cycle.hosts = hosting(running)


def _wait_cause(
    group: _Group,
    ranked: Ranked,
    need: int,
    capacity: int,
    budget: int,
    blocked_by: QueuedBehind | None,
    cycle: _Cycle,
    capped: bool,
) -> WaitCause:
    """Why a selected-out job (`ranked`, of `group`) waits; `capped`: held to its array's
    limit."""
    if capped:
        return AtArrayLimit(ranked.job.array_limit or 0)
    entry = _Entry(ranked, group.standing, group.starving, group.hold)
    cause = _pending_wait_cause(
        entry, need, capacity, budget, blocked_by, cycle.policy, len(cycle.share_gpus)
    )
    assert cause is not None  # it does not fit: there is a reason
    return cause


def _pending_wait_cause(
    entry: _Entry,
    need: int,
    capacity: int,
    budget: int,
    blocked_by: QueuedBehind | None,
    policy: Policy,
    shared: int = 0,
) -> WaitCause | None:
    """Why a job that does not fit waits; `shared`: the GPUs that shares alone hold,
    which are not for whole-GPU jobs (`shares.shares_by_gpu`)."""
    job = entry.job
    # An elastic job (with an elasticity stage) needs its minimum.
    at_least = need != job.gpus
    if entry.standing is Standing.HELD:
        return AtFixedQuota(job.queue)
    if need > capacity:
        return LargerThanCluster(need, at_least, capacity)
    if blocked_by is not None:
        return blocked_by
    if need > budget:
        # An order whose rank says nothing more than its name (fifo) is named once.
        label = entry.ranked.label
        ranked = policy.order if label == policy.order else f"{label}, {policy.order}"
        return RankedOut(need, at_least, max(budget, 0), ranked, shared)
    return None


def _place_all(cycle: _Cycle, to_place: list[_Entry], victims: list[_Entry]) -> list[_Entry]:
    """Place in rank order, releasing victims worst-ranked first only when needed.
    Returns the victims whose GPUs were released.

    Runs once per placement and once per preemption of the cycle (thousands when new
    jobs outrank long-running ones): what every job reads is hoisted out of the loop."""
    # Worst-ranked first; `next_victim` walks it, so that releasing one is O(1).
    unreleased = list(reversed(victims))
    left = len(unreleased)
    next_victim = 0
    released: list[_Entry] = []
    elastic = cycle.elastic
    ledger = cycle.ledger
    total_free, give = ledger.total_free, ledger.give
    policy = cycle.policy
    now, relax = cycle.now, policy.relax_locality_after_s
    resizes, size_of, reclaim_one = elastic.resizes, elastic.size, elastic.reclaim_one
    victim_ids = {v.job.job_id for v in victims} if resizes else set()
    sharing = cycle.sharing
    # The GPUs given back by victims, with where each victim stood: a share needs none
    # of the budget the victims were selected out by, so it takes (and releases) the
    # GPUs only of victims ranked behind it.
    released_at: dict[tuple[str, int], tuple[object, ...]] = {}
    # Requests and notes repeat: most jobs of a cycle ask alike and rank alike.
    requests: dict[tuple[int, bool], PlacementRequest] = {}
    notes: dict[tuple[str, bool, Standing, str], tuple[str, ...]] = {}
    for entry in to_place:
        job = entry.ranked.job
        # `job.waiting_since()`, inline.
        since = job.submitted_at if job.pending_since is None else job.pending_since
        may_spread = not job.network_sensitive and now - since >= relax
        # A stage that does not resize places a job at its `gpus` (`Sizing.resizes`).
        asked = (size_of(job) if resizes else job.gpus, may_spread)
        request = requests.get(asked)
        if request is None:
            request = requests[asked] = PlacementRequest(*asked)
        # No placement fits a gang while fewer GPUs than it needs are free: with victims
        # left to release, release them first (below) rather than ask for a reason
        # nobody will read.
        doomed = (
            not resizes
            and not (sharing and job.shared)
            and total_free() < request.gpus
            and next_victim < left
        )
        rank = _rank_of(entry, resizes) if sharing and job.shared else None
        hidden = _NOTHING_HIDDEN if rank is None else _released_ahead(released_at, rank)
        result = None if doomed else _try_place(cycle, request, job, hidden)
        # Take the GPUs elastic jobs hold above their targets before preempting anyone.
        while (
            resizes and not isinstance(result, Fit) and reclaim_one(ledger, job.job_id, victim_ids)
        ):
            result = _try_place(cycle, request, job, hidden)
        # Linear in the victims released: no placement can fit a gang while fewer GPUs
        # than it needs are free, so it is tried again only once enough are (and then
        # costs a few index look-ups); a reason that went stale is asked for once.
        stale = False
        while (
            not isinstance(result, Fit)
            and next_victim < left
            and (rank is None or _rank_of(unreleased[next_victim], resizes) > rank)
        ):
            victim = unreleased[next_victim]
            next_victim += 1
            give(victim.ranked.job.grants)
            _claim(cycle, victim, len(released))
            released.append(victim)
            if sharing:
                at = _rank_of(victim, resizes)
                released_at.update(((g.node, gpu), at) for g in victim.job.grants for gpu in g.gpus)
            stale = total_free() < request.gpus
            if not stale:
                result = _try_place(cycle, request, job, hidden)
        if stale or result is None:
            result = _try_place(cycle, request, job, hidden)
        if not isinstance(result, Fit) and resizes and job.elastic:
            # What is left, down to its minimum.
            result = elastic.place(job, ledger, partial=True)
        if isinstance(result, Fit):
            _placed(cycle, entry, result, notes)
            continue
        if cycle.explains(job.job_id):
            cycle.actions.append(Wait(job.job_id, result))
        if not may_spread and not job.network_sensitive:
            cycle.wakes.append(since + relax)
    return released


def _claim(cycle: _Cycle, victim: _Entry, position: int) -> None:
    """Note the GPUs of a victim just released (`position` in the released list), for
    the placement that takes one of them first: its winner (`_Cycle.winners`)."""
    claims = cycle.claims
    for grant in victim.ranked.job.grants:
        on_node = claims.get(grant.node)
        if on_node is None:
            on_node = claims[grant.node] = {}
        for gpu in grant.gpus:
            on_node[gpu] = position
    cycle.winners.append(None)


def _rank_of(entry: _Entry, resizes: bool) -> tuple[object, ...]:
    """Where a job stands in the cycle's selection order (smaller first); a stage that
    resizes jobs ranks by attained service within a rank class (`_elastic_key`)."""
    return _elastic_key(entry) if resizes else entry.sort_key


_NOTHING_HIDDEN: Final[frozenset[tuple[str, int]]] = frozenset()


def _released_ahead(
    released_at: dict[tuple[str, int], tuple[object, ...]], rank: tuple[object, ...]
) -> frozenset[tuple[str, int]]:
    """The GPUs released from victims ranked ahead of a share standing at `rank`: not
    for it. (A job that is no share hides nothing: every GPU released is for it.)"""
    return frozenset(gpu for gpu, at in released_at.items() if at < rank)


def _placed(
    cycle: _Cycle,
    entry: _Entry,
    fit: Fit,
    notes: dict[tuple[str, bool, Standing, str], tuple[str, ...]],
) -> None:
    """Take a placement's GPUs and say why; `notes` keeps the cycle's note tuples by
    what they say (most placements of a cycle are noted alike)."""
    job = entry.ranked.job
    grants = fit.grants
    cycle.ledger.take(grants if fit.takes is None else fit.takes)
    cycle.placed.append((entry, grants))
    claims = cycle.claims
    if claims:
        # It is the winner of the victims whose GPUs these were (`_claim`), unless one
        # placed before it took another of theirs.
        winners = cycle.winners
        for grant in grants:
            on_node = claims.get(grant.node)
            if on_node:
                for gpu in grant.gpus:
                    position = on_node.pop(gpu, None)
                    if position is not None and winners[position] is None:
                        winners[position] = entry
    extra: tuple[str, ...] = ()
    if job.demand is not None:
        sharer = cycle.sharer()
        sharer.placed(job, grants)
        colocated = sharer.colocated_with(grants)
        # On several nodes, it was placed as a job without a demand is (`_try_place`).
        plugin = cycle.policy.share_placement if len(grants) == 1 else cycle.policy.placement
        extra = (describe_demand(job, plugin),)
        extra += (colocated,) if colocated is not None else ()
    if job.job_id in cycle.unavoided:
        extra += (AVOIDANCE_RELEASED,)
    said = (entry.ranked.label, entry.starving, entry.standing, job.queue)
    noted = notes.get(said)
    if noted is None:
        noted = notes[said] = _place_notes(entry, cycle.policy)
    why = Placed(grants, noted, extra)
    cycle.actions.append(Place(job.job_id, grants, why, fit.takes))


def _try_place(
    cycle: _Cycle,
    request: PlacementRequest,
    job: JobView,
    hidden: AbstractSet[tuple[str, int]] = frozenset(),
) -> PlacementResult:
    """Place on the cycle's ledger, minus the nodes a retried job must avoid (and, for
    a share, the `hidden` GPUs: `_released_ahead`)."""
    if job.demand is not None:
        sharer = cycle.sharer()
        result = sharer.place(job, cycle.ledger, job.avoid_nodes, hidden)
        if (
            isinstance(result, Fit)
            or result.kind != "no_share_fits"
            or not spreads(job.demand, job.gpus)
        ):
            return result
        # On no one node: on several, as a job without a demand, of the nodes that fit.
        types = job.demand.gpu_types
        narrowed = sharer.narrowed(cycle.ledger, sharer.unfit(job.demand) | job.avoid_nodes)
        wider = cycle.place(request, narrowed)
        if isinstance(wider, Fit):
            return wider
        where = f"GPUs of type {'|'.join(types)}" if types else "enough GPU memory"
        reason = f"{wider.reason} on nodes with {where}"
        if job.avoid_nodes:
            reason += f" (avoiding {', '.join(sorted(job.avoid_nodes))}, where it failed)"
        return NoFit(reason, wider.kind)
    if cycle.elastic.resizes and job.elastic:
        return cycle.elastic.place(job, cycle.ledger, partial=False)
    if not job.avoid_nodes:
        return cycle.place(request, cycle.ledger)
    result = cycle.place(request, cycle.ledger.excluding(job.avoid_nodes))
    if isinstance(result, NoFit):
        avoided = ", ".join(sorted(job.avoid_nodes))
        return NoFit(f"{result.reason} (avoiding {avoided}, where it failed)", result.kind)
    return result


def _retry_stage(
    snapshot: ClusterSnapshot, now: float
) -> tuple[ClusterSnapshot, list[Wait], list[float]]:
    """Retry stage: a job retried after a failure waits out its back-off, and the cycle
    wakes when the back-off ends."""
    waits: list[Wait] = []
    wakes: list[float] = []
    for job in snapshot.pending:
        if job.not_before is not None and job.not_before > now:
            # One kind, no figures: the shell journals a wait only when its kind changes.
            waits.append(Wait(job.job_id, BackingOff()))
            wakes.append(job.not_before)
    if not waits:
        return snapshot, [], []
    backing_off = {w.job_id for w in waits}
    eligible = tuple(j for j in snapshot.pending if j.job_id not in backing_off)
    return replace(snapshot, pending=eligible), waits, wakes


def _avoidance_stage(
    snapshot: ClusterSnapshot, sizes_elastic: bool
) -> tuple[ClusterSnapshot, frozenset[str]]:
    """A retried job avoids the nodes it failed on (`JobView.avoid_nodes`), unless no
    other node could ever run it: too few GPUs on the others together for its size (an
    elastic job's minimum, when an elasticity stage sizes it), or, for a job with a
    demand, none of them that satisfies it. Avoiding them would then keep it waiting
    for ever (a one-node cluster; a gang as large as the cluster), so it may go back.
    Returns the snapshot with those jobs' views avoiding nothing, and their ids."""
    if not any(map(_AVOID_NODES, snapshot.pending)):
        return snapshot, frozenset()
    released: list[str] = []
    pending: list[JobView] = []
    for job in snapshot.pending:
        if job.avoid_nodes:
            others = [n for n in snapshot.nodes if n.name not in job.avoid_nodes]
            if not _could_ever_run(job, others, sizes_elastic):
                released.append(job.job_id)
                job = replace(job, avoid_nodes=frozenset())
        pending.append(job)
    if not released:
        return snapshot, frozenset()
    return replace(snapshot, pending=tuple(pending)), frozenset(released)


def _could_ever_run(job: JobView, nodes: Sequence[NodeView], sizes_elastic: bool) -> bool:
    """Could `nodes`, every GPU of them free, run `job`?"""
    if not nodes:
        return False
    if job.demand is not None:
        return never_fits(job.demand, job.gpus, nodes) is None
    need = job.min_gpus if sizes_elastic and job.min_gpus is not None else job.gpus
    return sum(len(n.gpus) for n in nodes) >= need


def _place_notes(entry: _Entry, policy: Policy) -> tuple[str, ...]:
    label = entry.ranked.label
    # An order whose rank says nothing more than its name (fifo) is named once.
    notes = [policy.order] if label == policy.order else [policy.order, label]
    if entry.starving:
        notes.append(STARVING)
    if entry.standing is Standing.IN_QUOTA:
        notes.append(f"within queue {entry.job.queue}'s guarantee")
    return tuple(notes)


# Read for every victim (`_cause`): a member of an enum read off its class is a lookup
# through the metaclass, a module's constant a specialised read.
_OVER_QUOTA: Final = Standing.OVER_QUOTA
_IN_QUOTA: Final = Standing.IN_QUOTA


def _cause(victim: _Entry, winner: _Entry, policy: Policy) -> PreemptCause:
    ahead = winner.ranked
    if victim.standing is _OVER_QUOTA and winner.standing is _IN_QUOTA:
        return QuotaReclaim(ahead.job.queue, ahead.job.job_id, victim.ranked.job.queue)
    # A starving winner is ahead by the guard, whatever the order says of the two.
    label = f"{ahead.label} ({STARVING})" if winner.starving else ahead.label
    return Outranked(ahead.job.job_id, policy.order, victim.ranked.label, label)


def _settle_victims(cycle: _Cycle, released: list[_Entry]) -> None:
    # Best-ranked victims first: if their GPUs are still free, they simply keep them. A
    # victim with a winner has not: a GPU placed in the cycle is not given back in it.
    ledger = cycle.ledger
    preemptions = cycle.preemptions
    outside = cycle.outside
    placed = cycle.placed
    for victim, winner in zip(reversed(released), reversed(cycle.winners), strict=True):
        job = victim.ranked.job
        if winner is None:
            # Of what it holds, only its schedulable GPUs were given back (`FreeGpus.give`).
            held = ledger.within(job.grants) if outside and job.job_id in outside else job.grants
            if ledger.all_free(held):
                ledger.take(held)
                continue
            # Not free, and no placement took them: the cycle's first is its cause.
            winner = placed[0][0] if placed else victim
        preemptions.append(Preempt(job.job_id, job.grants, _cause(victim, winner, cycle.policy)))


def _make_room_in_shares(cycle: _Cycle, entries: list[_Entry]) -> None:
    """Shares are preemption victims a GPU at a time: a GPU comes back whole only once
    every share on it has gone. The first whole-GPU job in selection order that waited
    for want of GPUs (`_Cycle.short`), and that the GPUs of shares all ranked behind it
    would make room for, has those shares preempted, each with its cause; it is placed
    in the next cycle, on the GPUs they free (its place there is by the same selection).

    Which GPUs: the job is placed on a copy of the ledger given every GPU ranked behind
    it (those shares', and those of the whole-GPU jobs that are its victims once it is
    selected), and only the shares on the GPUs of that fit are preempted, so that the
    room made is where the job will go. A GPU a share was placed on in this cycle, or
    whose shares one ranked ahead, pinned or already preempted shares, is not touched.
    One job a cycle: the next cycle sees the room made and goes on from there."""
    short, groups = cycle.short, cycle.share_gpus
    if not short or not groups:
        return
    index = {entry.ranked.job.job_id: i for i, entry in enumerate(entries)}
    behind = _share_standings(cycle, entries, index)
    bests = sorted(behind.values())
    for entry, budget, need in short:
        position = index[entry.ranked.job.job_id]
        if budget + len(bests) - bisect_right(bests, position) < need:
            continue
        room = [key for key, best in behind.items() if best > position]
        job = entry.job
        relax = cycle.policy.relax_locality_after_s
        may_spread = not job.network_sensitive and cycle.now - job.waiting_since() >= relax
        ledger = _ledger_behind(cycle, entries, index, position, room)
        fit = cycle.place(PlacementRequest(need, may_spread), ledger)
        taken = (
            {(g.node, gpu) for g in fit.grants for gpu in g.gpus} if isinstance(fit, Fit) else ()
        )
        freed = [key for key in room if key in taken]
        for key in freed:
            for share in groups[key]:
                cause = _cause(entries[index[share.job_id]], entry, cycle.policy)
                cycle.preemptions.append(Preempt(share.job_id, share.grants, cause))
        if freed and cycle.explains(job.job_id):
            # Its wait said what it was short of; now it is what is being done about it.
            actions = cycle.actions
            at = next(
                i for i, a in enumerate(actions) if type(a) is Wait and a.job_id == job.job_id
            )
            actions[at] = Wait(job.job_id, MakingRoom(len(freed)))
        return


def _share_standings(
    cycle: _Cycle, entries: list[_Entry], index: dict[str, int]
) -> dict[tuple[str, int], int]:
    """For `_make_room_in_shares`: each GPU whose shares may go, with the best position
    in `entries` among them (`index`, by job id): a job ahead of that may have it."""
    gone = {p.job_id for p in cycle.preemptions}
    kept = {
        (g.node, gpu)
        for entry, grants in cycle.placed
        if entry.job.shared
        for g in grants
        for gpu in g.gpus
    }
    pinned = Standing.PINNED
    behind: dict[tuple[str, int], int] = {}
    for key, on in cycle.share_gpus.items():
        if key in kept:
            continue
        best = len(entries)
        for share in on:
            at = index.get(share.job_id)
            if at is None or share.job_id in gone or entries[at].standing is pinned:
                break
            best = min(best, at)
        else:
            behind[key] = best
    return behind


def _ledger_behind(
    cycle: _Cycle,
    entries: list[_Entry],
    index: dict[str, int],
    position: int,
    room: list[tuple[str, int]],
) -> FreeGpus:
    """A ledger of the cycle's free GPUs (without the nodes the job at `position`
    avoids) and the GPUs of `room` and of every whole-GPU job behind it that may be its
    victim, running or placed in this cycle: copied once with them, rather than given
    back job by job."""
    job = entries[position].job
    ledger = cycle.ledger
    more: dict[str, set[int]] = {}
    for node, gpu in room:
        more.setdefault(node, set()).add(gpu)
    gone = {p.job_id for p in cycle.preemptions}
    pinned, hosts = Standing.PINNED, cycle.hosts
    held = [(other, other.grants) for other in cycle.snapshot.running]
    held += [(e.ranked.job, grants) for e, grants in cycle.placed]
    for other, grants in held:
        if other.shared or other.resizing or other.job_id in gone or other.job_id in hosts:
            continue
        at = index.get(other.job_id)
        if at is None or at <= position or entries[at].standing is pinned:
            continue
        for grant in ledger.within(grants):
            more.setdefault(grant.node, set()).update(grant.gpus)
    return ledger.excluding(job.avoid_nodes, more)


def _starvation_wakes(groups: list[_Group], policy: Policy) -> list[float]:
    guard = policy.starvation_guard_s
    if guard is None:
        return []
    return [
        r.job.waiting_since() + guard
        for group in groups
        if not group.starving
        for r in group.ranked
        if not r.job.running
    ]


def _placed_crossings(cycle: _Cycle, crossing: Crossing) -> list[float]:
    """When the jobs this cycle starts will cross their bands' thresholds: without these
    wakes a job started and crossing in the same decision would be demoted only at the
    next unrelated event. Jobs alike in what a crossing reads (most are new: no service)
    are asked once."""
    thresholds, now = cycle.policy.las_thresholds_gpu_s, cycle.now
    asked: dict[tuple[float, float, float], float | None] = {}
    times: list[float | None] = []
    for entry, grants in cycle.placed:
        job = entry.ranked.job
        # `JobView.elastic`, inline: this runs for every job a cycle starts.
        if job.min_gpus is not None:
            # Its size is what it was granted, not what it asked for.
            times.append(crossing(job, grants, thresholds, now))
            continue
        key = (
            job.attained_gpu_seconds,
            job.executed_seconds,
            job.gpus if job.demand is None else job.gpu_size,
        )
        if key not in asked:
            asked[key] = crossing(job, grants, thresholds, now)
    return [t for t in (*times, *asked.values()) if t is not None]


def decide(
    snapshot: ClusterSnapshot,
    now: float,
    policy: Policy = DEFAULT_POLICY,
    *,
    waits: bool = True,
    explain: AbstractSet[str] = frozenset(),
    ranking: Ranking | None = None,
    ledger: KeptLedger | None = None,
) -> Decisions:
    """The cycle's decisions for `snapshot` at `now` under `policy`.

    `waits=False` leaves out the `Wait` of every job that stays pending but those in
    `explain`, and nothing else: for a caller that acts on none (the simulator), whose
    cycles would otherwise spend much of their time explaining why queued jobs still
    queue, or that asks why only of the jobs it has not been told about (the live
    brain, between passes that explain every job).

    `ranking`, kept by a caller from one call to the next, spares ranking and sorting
    the jobs whose views it has seen (brain/core/ranking.py); `ledger`, likewise kept,
    spares building the free-GPU ledger of every node again (brain/core/placement.py,
    `KeptLedger`). The decisions are the same with them or without them.

    The cyclic garbage collector is paused while it runs (and left as it was found):
    a cycle allocates a few objects per job, nearly all freed by reference counting
    as it goes, and at 14,000 jobs the collections those allocations trigger
    (generation 2 walks the whole snapshot) were a third to a half of its time. It
    creates no reference cycles, so nothing is left for the collector to find. The
    decisions it returns are walked by the first collection after it, unless the
    caller keeps the collector paused until it has freed them (the brain's pass
    does: brain/scheduler.py)."""
    with collector_paused():
        decisions = _decide(snapshot, now, policy, waits, explain, ranking, ledger)
    if ledger is not None:
        ledger.done()
    return decisions


def _checked_demands(jobs: Sequence[JobView]) -> tuple[set[Demand], bool]:
    """The demands the jobs make (most make none), and whether any job's array has a
    limit, checking that every job asks for a GPU or more. One walk, in snapshot order,
    before ranking: a pass in the order the jobs were built reads memory in order, one
    in rank order does not; and one loop in the interpreter, whose specialised reads
    cost less than a `map` with an `attrgetter` for each of the three."""
    demands: set[Demand] = set()
    limited = False
    for job in jobs:
        if job.gpus < 1:
            raise InvalidSnapshot(f"job {job.job_id} asks for {job.gpus} GPUs")
        if job.demand is not None:
            demands.add(job.demand)
        if job.array_limit is not None:
            limited = True
    return demands, limited


_AVOID_NODES: Final = attrgetter("avoid_nodes")


def _decide(
    snapshot: ClusterSnapshot,
    now: float,
    policy: Policy,
    waits: bool,
    explain: AbstractSet[str],
    ranking: Ranking | None,
    kept: KeptLedger | None,
) -> Decisions:
    order = ORDERINGS.get(policy.order)
    place = PLACEMENTS.get(policy.placement)
    hold = PREEMPTIONS.get(policy.preemption)
    if order is None or place is None or hold is None:
        policy.validate()
        raise AssertionError("unreachable: validate() raises for an unknown plugin")
    context = OrderContext(
        now=now,
        las_thresholds_gpu_s=policy.las_thresholds_gpu_s,
        gittins_quantum_gpu_s=policy.gittins_quantum_gpu_s,
        distribution=snapshot.service_distribution or DEFAULT_SERVICE_PRIOR,
        progress_probe_s=policy.progress_probe_s,
        error_distribution=snapshot.error_distribution,
        service_by_class=snapshot.service_by_class,
    )
    snapshot, backoff_waits, backoff_wakes = _retry_stage(snapshot, now)
    elasticity = ELASTICITIES.get(policy.elasticity)
    if elasticity is None:
        policy.validate()
        raise AssertionError("unreachable: validate() raises for an unknown plugin")
    snapshot, unavoided = _avoidance_stage(snapshot, sizes_elastic=elasticity.sizes_jobs)
    # The identity (`Rigid`) for "none", and for a cluster without elastic jobs.
    stage = elasticity.start(
        snapshot,
        may_spread=policy.elastic_may_spread,
        min_gain=policy.elastic_min_gain,
        now=now,
        resize_interval_s=policy.elastic_resize_interval_s,
        payback=policy.elastic_payback,
        reprobe_s=policy.elastic_reprobe_s,
    )
    snapshot = stage.views(snapshot)
    jobs = (*snapshot.running, *snapshot.pending)
    demands, limited = _checked_demands(jobs)
    if ranking is None:
        ordered = order(jobs, context)
        by_rank = rank_order(ordered.ranked)
    else:
        ordered, by_rank = ranking.rank(order, jobs, context)
    ledger = FreeGpus(snapshot.nodes) if kept is None else kept.for_nodes(snapshot.nodes)
    cycle = _Cycle(
        snapshot,
        now,
        policy,
        place,
        ledger,
        elastic=stage,
        sharing=bool(demands),
        waits=waits,
        explain=explain,
        unavoided=unavoided,
        outside=ledger.held_outside(snapshot.running),
        arrays=Counter(j.array for j in snapshot.running if j.array is not None)
        if limited
        else None,
    )
    cycle.actions.extend(w for w in backoff_waits if cycle.explains(w.job_id))
    groups = _selection_order(
        by_rank, snapshot, jobs, now, policy, hold, smallest_ask(demands), cycle.arrays
    )
    # The stages that index or sort the selection order job by job, and only they, have
    # it as entries: most cycles (no stage that resizes, no share) never do.
    entries = _flat(groups) if stage.resizes or cycle.sharing else []
    if stage.resizes:
        entries.sort(key=_elastic_key)
        stage.set_ranks(
            [e.job.job_id for e in entries],
            {e.job.job_id: _share_class(e, ordered.rank_entitles) for e in entries},
        )
        groups = _regrouped(entries)
    to_place, victims = _select(
        cycle, groups, ordered.head_of_line_blocking, ledger.total_capacity()
    )
    stage.plan(ledger.total_capacity())
    released = _place_all(cycle, to_place, victims)
    _settle_victims(cycle, released)
    if cycle.sharing:
        # Shares on a shareable job's GPU that is running out of memory move off it.
        cycle.preemptions.extend(memory_pressure(snapshot))
        _make_room_in_shares(cycle, entries)
    excluded = {v.job.job_id for v in victims} if stage.resizes else set()
    shrinks, cycle.actions, grows = stage.finish(ledger, cycle.actions, excluded, cycle.outside)
    if stage.next_round is not None:
        cycle.wakes.append(stage.next_round)
    cycle.wakes.extend(stage.wakes)
    wakes = [*cycle.wakes, *_starvation_wakes(groups, policy)]
    wakes += backoff_wakes
    if ordered.wake_at is not None:
        wakes.append(ordered.wake_at)
    if ordered.crossing is not None:
        wakes += _placed_crossings(cycle, ordered.crossing)
    future = [t for t in wakes if t > now]
    # Preemptions and shrinks first: the placements after them may use the GPUs they
    # free; grows last, into what nobody else took.
    changes = sorted(ordered.level_changes, key=lambda c: job_sequence(c.job_id))
    actions = (*cycle.preemptions, *shrinks, *cycle.actions, *grows, *changes)
    return Decisions(actions, min(future) if future else None)
