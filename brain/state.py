"""The brain's in-memory state: a fold of the STATE log, and the snapshot it yields.

`BrainState.apply` is the only way state changes, and it takes a journal record; the
live brain stages a record (brain/journal.py) and applies it, and a restarted brain
replays the log through the same `apply`. Because every job or node record carries the
whole entity, applying a record twice changes nothing.

Memory grows with live jobs, not with history: of the finished jobs, the latest
`FINISHED_KEPT` stay; older ones leave (their records stay in the log and the sqlite
history, where queries find them), counted by final state, their idempotency keys kept
a while longer (`KEYS_KEPT`). Which ones leave follows from the log alone, so every
replica, and a brain started from a snapshot, holds the same ones.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from brain.core.distribution import (
    DEFAULT_SERVICE_PRIOR,
    NO_SAMPLES,
    ServiceByClass,
    ServiceDistribution,
    by_size_class,
    gpu_class,
)
from brain.core.failures import NodeFailure
from brain.core.model import (
    Ask,
    ClusterSnapshot,
    Demand,
    Grant,
    JobView,
    NodeView,
    QueueQuota,
    Service,
    UtilizationProfile,
    WaitCause,
)
from brain.core.ordering import job_sequence
from brain.core.sharing import share_memory_mib
from brain.progress import ObservedProgress
from schemas.events import InputError
from schemas.jobs import AttemptFailure, FailureClass, JobRecord, JobSpec, JobState
from schemas.nodes import NodeRecord, NodeState
from schemas.state import (
    BlacklistChanged,
    BlacklistEntry,
    BlamedFailure,
    BrainSnapshot,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
)
from schemas.telemetry import GpuHealth

SEEN_EVENTS: Final = 100_000
# Finished jobs' service the Gittins distribution learns from: the latest this many, so
# memory stays bounded and the distribution follows the cluster's recent workload.
SERVICE_SAMPLES: Final = 10_000
# The learned Gittins distribution also counts the service of jobs not finished yet,
# as censored samples (Kaplan-Meier): re-derived when a job finishes, and otherwise at
# most this often, since running jobs' service grows with the clock.
CENSORED_REFRESH_S: Final = 60.0
# Finished jobs kept in memory, newest: `alnair jobs` lists them (and the live ones);
# older ones are read from the history. About 7 KB each.
FINISHED_KEPT: Final = 2_000
# The latest infrastructure failures kept per node (`BrainState.node_failures`).
NODE_FAILURES_KEPT: Final = 16
# Idempotency keys of finished jobs no longer in memory, newest: a submission retried
# with one of these is answered with its job (read from the history), not run again.
KEYS_KEPT: Final = 50_000
# An empty mapping no one may change (what running views were first built with).
_NO_ENTRIES: Final[Mapping[str, object]] = MappingProxyType({})


@dataclass
class BrainState:
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    last_seq: int = 0
    last_job_number: int = 0
    # (tenant, idempotency key) -> job id
    by_key: dict[tuple[str, str], str] = field(default_factory=dict)
    # Node events already folded, newest last: a redelivered event is recognised and
    # skipped. Bounded; an event older than the window is long settled.
    seen_events: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Job ids by state: each decision cycle reads the pending and running jobs, and
    # finished jobs (kept for ever) must not make it scan them all.
    by_state: dict[JobState, set[str]] = field(
        default_factory=lambda: {state: set() for state in JobState}
    )
    # The input blacklist (uri -> entry), and the distinct jobs that reported failing
    # on each input; (job, attempt) -> the input that attempt reported.
    blacklist: dict[str, BlacklistEntry] = field(default_factory=dict)
    input_failures: dict[str, set[str]] = field(default_factory=dict)
    input_reports: dict[tuple[str, int], str] = field(default_factory=dict)
    # Attained GPU-seconds of the latest SUCCEEDED jobs, oldest first (the Gittins
    # order's samples), and the distribution last built from them, by prior.
    service_samples: deque[float] = field(default_factory=lambda: deque(maxlen=SERVICE_SAMPLES))
    # The GPUs each of those jobs asked for, in the same order (0: not known, from a
    # snapshot that did not keep them): `gittins-size` learns per size class.
    service_sample_gpus: deque[int] = field(default_factory=lambda: deque(maxlen=SERVICE_SAMPLES))
    # Finished jobs in memory, in the order they finished; those gone from memory, by
    # final state; and the idempotency keys of those gone, (tenant, key) -> job id.
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict)
    finished_away: dict[JobState, int] = field(default_factory=dict)
    keys_away: OrderedDict[tuple[str, str], str] = field(default_factory=OrderedDict)
    # Pending jobs' waits with today's figures (`refresh_wait`), in memory only: their
    # records keep the reason of the last change of kind, as the log does.
    wait_details: dict[str, WaitCause] = field(default_factory=dict, compare=False)
    # Elastic jobs pending or running: without one, an elasticity stage does not run.
    live_elastic: int = field(default=0, compare=False)
    # Running jobs with a time limit (`JobSpec.time_limit_s`): what the tick looks over.
    time_limited: set[str] = field(default_factory=set, compare=False)
    # Dependencies (`JobSpec.after`): pending jobs some of whose jobs to run after have
    # not SUCCEEDED yet, with those (left out of decisions: `_pending_job_views`);
    # pending jobs one of whose ended otherwise, with why (the tick cancels them); and
    # who runs after each job.
    blocked: dict[str, set[str]] = field(default_factory=dict, compare=False)
    doomed: dict[str, str] = field(default_factory=dict, compare=False)
    _dependents: dict[str, set[str]] = field(default_factory=dict, compare=False)
    # The latest infrastructure failures blamed on each node (`AttemptFailure.at_fault`),
    # oldest first, from the job records as they are applied: what the black-hole rule
    # reads (brain/core/failures.py). Kept in snapshots, so a brain loaded from one
    # knows those of jobs gone from memory too.
    node_failures: dict[str, deque[NodeFailure]] = field(default_factory=dict, compare=False)
    # What the finished jobs in memory asked, counted: the recent workload that sharing
    # placement weighs (`ClusterSnapshot.recent_asks`).
    _asks: Counter[Ask] = field(default_factory=Counter, init=False, repr=False, compare=False)
    _distribution: tuple[ServiceDistribution, ServiceDistribution] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # (what it was derived from, when, the distribution with unfinished jobs censored,
    # and those jobs' (GPUs asked, service so far), which `service_by_class` reads too).
    _censored: (
        tuple[ServiceDistribution, float, ServiceDistribution, list[tuple[int, float]]] | None
    ) = field(default=None, init=False, repr=False, compare=False)
    # Likewise each size class's (`service_by_class`), from the censored pooled one.
    _by_class: tuple[ServiceDistribution, ServiceByClass] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # Each READY node's snapshot view, with the record and the GPUs held there that it
    # was built from: a snapshot rebuilds only the views of nodes that changed, so a
    # pass after one node joined does not redo thousands. And the node names, sorted.
    _views: dict[str, tuple[NodeRecord, frozenset[int], NodeView]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _sorted_names: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    # The snapshot's node views, kept between passes: each node's (None: not READY) in
    # name order, the nodes whose record or held GPUs changed since, and the tuple a
    # snapshot hands out (None: to be made again from the list). A pass after nothing
    # changed costs nothing; after k nodes changed, k views and a copy of the list.
    _node_list: list[NodeView | None] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    _node_position: dict[str, int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _nodes_stale: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _node_tuple: tuple[NodeView, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # GPUs on every known node, and schedulable GPUs of READY nodes: counted when first
    # asked, then kept as each node's record changes (`status`, /metrics and every
    # submission ask; counting anew walked every node, at every request of a mass join).
    _registered: _Sizes | None = field(default=None, init=False, repr=False, compare=False)
    _schedulable: _Sizes | None = field(default=None, init=False, repr=False, compare=False)
    # The LOST nodes' names, until a node's record changes.
    _lost_nodes: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    # Each node's schedulable GPUs, with the record they were read from (records are
    # replaced, never changed, so a new one is known by identity).
    _schedulable_sets: dict[str, tuple[NodeRecord, frozenset[int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Pending and running job ids in job order, kept as jobs come and go: a pass reads
    # them without sorting the queue again.
    _ordered: dict[JobState, _JobOrder] = field(
        default_factory=lambda: {JobState.PENDING: _JobOrder(), JobState.RUNNING: _JobOrder()},
        init=False,
        repr=False,
        compare=False,
    )
    # GPUs held by running jobs, per node, kept as jobs start, resize and end: how many
    # jobs hold each GPU (a shared GPU has several), and the set of those held.
    _holders: dict[str, Counter[int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _held: dict[str, frozenset[int]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # The (job, attempt) pairs the brain runs on each node (a running job's, on every
    # node it has a grant on): the reconciler checks a node's reported processes
    # against it in one look-up. And the running jobs a node has not confirmed the
    # launch of on some node yet (a grant without a process, not exited): what the
    # launch check reads, rather than every running job.
    _attempts_on: dict[str, set[tuple[str, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _unconfirmed: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    # Nodes whose (job, attempt) pairs changed since the reconciler last asked.
    _attempts_changed: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    # Each pending job's view: it does not depend on the clock, so a pass builds again
    # only those whose record or progress changed (`_pending_job_views`).
    _pending_views: dict[str, JobView] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Pending jobs whose record changed since their view was built, and the progress
    # each view with progress was built with.
    _pending_stale: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _pending_progress: dict[str, ObservedProgress] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # The same for running jobs' views without the clock (see `snapshot`): each running
    # job's view and the profile and progress it was built with; those whose record
    # changed since; the profile and progress mappings of the last build (a new mapping
    # is compared entry by entry, by identity first); and the tuple handed out, until
    # something changes.
    _running_views: dict[str, JobView] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _running_inputs: dict[str, tuple[UtilizationProfile | None, ObservedProgress | None]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _running_stale: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    _running_built_with: tuple[Mapping[str, object], Mapping[str, object]] = field(
        default=(_NO_ENTRIES, _NO_ENTRIES), init=False, repr=False, compare=False
    )
    _running_tuple: tuple[JobView, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def apply(self, record: StateRecord, seq: int) -> None:
        if isinstance(record, JobChanged):
            # An entry at or before the last one applied was applied already.
            self._put_job(record.job, new=seq > self.last_seq)
        elif isinstance(record, NodeChanged):
            node = record.node
            self.nodes[node.name] = node
            self._nodes_stale.add(node.name)
            if self._registered is not None:
                self._registered.set(node.name, len(node.gpus))
            if self._schedulable is not None:
                self._schedulable.set(node.name, self._schedulable_size(node))
            if self._lost_nodes is None or (record.node.state is NodeState.LOST) != (
                record.node.name in self._lost_nodes
            ):
                self._lost_nodes = None
                self._running_tuple = None  # jobs on a LOST node are left out
        elif isinstance(record, NodeEventRecorded):
            self._saw_event(record.event.event_id)
            if isinstance(record.event, InputError):
                event = record.event
                self.input_failures.setdefault(event.uri, set()).add(event.job_id)
                self.input_reports[(event.job_id, event.attempt)] = event.uri
        elif isinstance(record, BlacklistChanged):
            self.blacklist = {e.uri: e for e in record.entries}
        self.last_seq = max(self.last_seq, seq)

    def refresh_wait(self, job_id: str, cause: WaitCause) -> None:
        """Show a pending job's waiting reason with today's figures. Not journaled, and
        not in its record (which keeps the reason of the last change of kind, as the
        log does): the only state a replica may see differently; the next leader's
        first pass refreshes its own. Kept typed: the text is built when someone reads
        it, not by every pass."""
        if job_id in self.by_state[JobState.PENDING]:
            self.wait_details[job_id] = cause

    def reason_of(self, job: JobRecord) -> str | None:
        """Why the job waits, with today's figures (else as its record says)."""
        detail = self.wait_details.get(job.job_id)
        return job.reason if detail is None else detail.describe()

    def shown(self, job: JobRecord) -> JobRecord:
        """The record as callers see it: with its waiting reason's figures of now."""
        detail = self.wait_details.get(job.job_id)
        if detail is None:
            return job
        reason = detail.describe()
        return job if reason == job.reason else job.model_copy(update={"reason": reason})

    def _blame(self, job_id: str, failures: Iterable[AttemptFailure]) -> None:
        for failure in failures:
            if failure.failure_class is not FailureClass.INFRASTRUCTURE:
                continue
            blamed = NodeFailure(failure.at, job_id, failure.reason)
            for node in failure.nodes if failure.at_fault is None else failure.at_fault:
                kept = self.node_failures.get(node)
                if kept is None:
                    kept = self.node_failures[node] = deque(maxlen=NODE_FAILURES_KEPT)
                kept.append(blamed)

    def _saw_event(self, event_id: str) -> None:
        self.seen_events[event_id] = None
        while len(self.seen_events) > SEEN_EVENTS:
            self.seen_events.popitem(last=False)

    def _put_job(self, job: JobRecord, *, new: bool = True) -> None:
        previous = self.jobs.get(job.job_id)
        if (
            new
            and job.state is JobState.SUCCEEDED
            and (previous is None or previous.state is not JobState.SUCCEEDED)
        ):
            # Once per job, and only from an entry not applied before.
            self._learn_service(job.attained_gpu_seconds, job.spec.gpus)
        self._index(previous, job)
        known = len(previous.failures) if previous is not None else 0
        if len(job.failures) > known:
            self._blame(job.job_id, job.failures[known:])
        self.jobs[job.job_id] = job
        if job.spec.after or job.spec.after_any:
            self._follow(job)
        waiting = self._dependents.get(job.job_id)
        if waiting and job.state.terminal and (previous is None or not previous.state.terminal):
            for other in sorted(waiting):
                if (dependent := self.jobs.get(other)) is not None:
                    self._follow(dependent)
        if job.job_id.isdigit():
            self.last_job_number = max(self.last_job_number, int(job.job_id))
        if job.idempotency_key is not None:
            self.by_key[(job.tenant, job.idempotency_key)] = job.job_id
        if job.state.terminal:
            if job.job_id in self.finished:
                self.finished.move_to_end(job.job_id)
            else:
                self.finished[job.job_id] = None
                self._asks[job_ask(job)] += 1
            self._let_go_oldest()
        elif job.job_id in self.finished:
            del self.finished[job.job_id]
            self._forget_ask(job)

    def _follow(self, job: JobRecord) -> None:
        """Whether a job with `after` or `after_any` waits for them, may go, or never
        can. A job to run after that is gone from memory has ended, and SUCCEEDED: a
        submission after one that ended otherwise is refused, its dependents are doomed
        when it ends, and it stays in memory while they are pending (`_let_go_oldest`)."""
        job_id = job.job_id
        spec = job.spec
        if job.state is not JobState.PENDING:
            self.blocked.pop(job_id, None)
            self.doomed.pop(job_id, None)
            for before in (*spec.after, *spec.after_any):
                dependents = self._dependents.get(before)
                if dependents is not None:
                    dependents.discard(job_id)
                    if not dependents:
                        del self._dependents[before]
            return
        unmet = set()
        for before in spec.after:
            self._dependents.setdefault(before, set()).add(job_id)
            other = self.jobs.get(before)
            if other is None or other.state is JobState.SUCCEEDED:
                continue
            if other.state.terminal and job_id not in self.doomed:
                self.doomed[job_id] = (
                    f"job {before}, which it was to run after, ended {other.state.value}"
                )
            unmet.add(before)
        for before in spec.after_any:
            self._dependents.setdefault(before, set()).add(job_id)
            other = self.jobs.get(before)
            if other is not None and not other.state.terminal:
                unmet.add(before)
        if unmet:
            self.blocked[job_id] = unmet
        else:
            self.blocked.pop(job_id, None)

    def _forget_ask(self, job: JobRecord) -> None:
        ask = job_ask(job)
        left = self._asks[ask] - 1
        if left > 0:
            self._asks[ask] = left
        else:
            self._asks.pop(ask, None)

    def _index(self, previous: JobRecord | None, job: JobRecord) -> None:
        """Keep what passes read without scanning every job: ids by state (pending and
        running in job order), GPUs held, pending views to build again."""
        job_id = job.job_id
        moved = previous is None or previous.state is not job.state
        if previous is not None and previous.state in _LIVE and previous.spec.elastic:
            self.live_elastic -= 1
        if job.state in _LIVE and job.spec.elastic:
            self.live_elastic += 1
        if job.state is JobState.RUNNING and job.spec.time_limit_s is not None:
            self.time_limited.add(job_id)
        else:
            self.time_limited.discard(job_id)
        self.wait_details.pop(job_id, None)  # the record says why, until refreshed
        if previous is not None:
            self.by_state[previous.state].discard(job_id)
            if moved and previous.state in self._ordered:
                self._ordered[previous.state].discard(job_id)
            if previous.state is JobState.RUNNING:
                self._hold(previous, -1)
                self._place_attempt(previous, add=False)
                self._unconfirmed.discard(job_id)
                self._running_tuple = None
                if moved:  # what a standby marks must leave with the job
                    self._running_views.pop(job_id, None)
                    self._running_inputs.pop(job_id, None)
                    self._running_stale.discard(job_id)
            if moved and previous.state is JobState.PENDING:
                self._pending_views.pop(job_id, None)
                self._pending_progress.pop(job_id, None)
                # A standby takes no snapshot: what it marks must leave with the job.
                self._pending_stale.discard(job_id)
        self.by_state[job.state].add(job_id)
        if moved and job.state in self._ordered:
            self._ordered[job.state].add(job_id)
        if job.state is JobState.RUNNING:
            self._hold(job, +1)
            self._place_attempt(job, add=True)
            if any(g.pid is None and not g.exited for g in job.grants):
                self._unconfirmed.add(job_id)
            self._running_stale.add(job_id)
        if job.state is JobState.PENDING:
            self._pending_stale.add(job_id)

    def _hold(self, job: JobRecord, sign: int) -> None:
        for grant in job.grants:
            if not grant.gpus:
                continue
            counts = self._holders.setdefault(grant.node, Counter())
            counts.update({gpu: sign for gpu in grant.gpus})
            held = frozenset(gpu for gpu, n in counts.items() if n > 0)
            self._nodes_stale.add(grant.node)
            if held:
                self._held[grant.node] = held
            else:
                self._held.pop(grant.node, None)
                del self._holders[grant.node]

    def _place_attempt(self, job: JobRecord, *, add: bool) -> None:
        attempt = (job.job_id, job.attempt)
        for node in job.nodes:
            self._attempts_changed.add(node)
            if add:
                self._attempts_on.setdefault(node, set()).add(attempt)
                continue
            here = self._attempts_on.get(node)
            if here is not None:
                here.discard(attempt)
                if not here:
                    del self._attempts_on[node]

    def _let_go_oldest(self) -> None:
        """Past FINISHED_KEPT, the finished jobs that ended longest ago leave memory; but
        not one a pending job is to run after: how it ended says whether that job may
        ever start, after a restart from a snapshot too (`_follow`). It is kept, as if
        it had just ended, until no pending job waits on it."""
        finished, waited_on = self.finished, self._dependents
        looked = 0
        while len(finished) > FINISHED_KEPT and looked < len(finished):
            oldest = next(iter(finished))
            if oldest in waited_on:
                finished.move_to_end(oldest)
                looked += 1
                continue
            self._let_go(oldest)

    def _let_go(self, job_id: str) -> None:
        """A finished job leaves memory (the log and the history keep it)."""
        del self.finished[job_id]
        job = self.jobs.pop(job_id)
        self._forget_ask(job)
        self.by_state[job.state].discard(job_id)
        self.finished_away[job.state] = self.finished_away.get(job.state, 0) + 1
        for attempt in range(1, job.attempt + 1):
            self.input_reports.pop((job_id, attempt), None)
        if job.idempotency_key is not None:
            key = (job.tenant, job.idempotency_key)
            if self.by_key.pop(key, None) is not None:
                self.keys_away[key] = job_id
                while len(self.keys_away) > KEYS_KEPT:
                    self.keys_away.popitem(last=False)

    def waits_by_kind(self) -> dict[str, int]:
        """Pending jobs by the kind of their wait, most first (ties by kind);
        "unexplained": no pass has said why yet."""
        counts: dict[str, int] = {}
        for job_id in self.by_state[JobState.PENDING]:
            kind = "after_jobs" if job_id in self.blocked else self.jobs[job_id].wait_kind
            kind = kind or "unexplained"
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def counts_by_state(self) -> dict[JobState, int]:
        """Jobs by state, those gone from memory included."""
        return {
            state: len(ids) + self.finished_away.get(state, 0)
            for state, ids in self.by_state.items()
        }

    def _learn_service(self, attained_gpu_seconds: float, gpus: int) -> None:
        self.service_samples.append(attained_gpu_seconds)
        self.service_sample_gpus.append(gpus)
        self._distribution = None

    def service_distribution(
        self, prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR, *, now: float | None = None
    ) -> ServiceDistribution:
        """`prior` and the finished jobs' service; rebuilt only after a job finished.

        Given `now`, also the service of every job not finished yet (running, to `now`;
        pending after a preemption) as a censored sample, by the Kaplan-Meier estimate
        (`ServiceDistribution.with_censored`): finished jobs alone are biased to short ones
        while long ones still run. Re-derived after a job finished, else at most every
        `CENSORED_REFRESH_S`."""
        if self._distribution is None or self._distribution[0] is not prior:
            self._distribution = (prior, prior.with_samples(self.service_samples))
        learned = self._distribution[1]
        if now is None:
            return learned
        kept = self._censored
        if kept is None or kept[0] is not learned or not 0 <= now - kept[1] < CENSORED_REFRESH_S:
            unfinished = self._unfinished_service(now)
            censored = learned.with_censored(service for _, service in unfinished)
            kept = self._censored = (learned, now, censored, unfinished)
        return kept[2]

    def _unfinished_service(self, now: float) -> list[tuple[int, float]]:
        """(GPUs asked, service so far) of every job not finished that has run: the
        running ones' to `now`, the preempted ones' as recorded."""
        unfinished = [
            (job.spec.gpus, served(job, now)[0]) for job in self.jobs_in(JobState.RUNNING)
        ]
        unfinished += [
            (job.spec.gpus, job.attained_gpu_seconds)
            for job in self.jobs_in(JobState.PENDING)
            if job.attained_gpu_seconds > 0.0
        ]
        return unfinished

    def service_by_class(
        self, prior: ServiceDistribution = DEFAULT_SERVICE_PRIOR, *, now: float
    ) -> ServiceByClass:
        """Each size class's service distribution (`gpu_class`): its finished jobs, its
        unfinished ones censored, shrunk toward the pooled distribution
        (`service_distribution`, `CLASS_SHRINK_WEIGHT`), as the simulator derives it.
        Derived again whenever the pooled one is."""
        pooled = self.service_distribution(prior, now=now)
        if self._by_class is None or self._by_class[0] is not pooled:
            finished: dict[int, list[float]] = {}
            for service, gpus in zip(self.service_samples, self.service_sample_gpus, strict=True):
                if gpus > 0:
                    finished.setdefault(gpu_class(gpus), []).append(service)
            assert self._censored is not None  # derived with `pooled`, just above
            classes = by_size_class(
                {c: NO_SAMPLES.with_samples(samples) for c, samples in finished.items()},
                self._censored[3],
                pooled,
            )
            self._by_class = (pooled, classes)
        return self._by_class[1]

    @classmethod
    def from_snapshot(cls, snapshot: BrainSnapshot) -> BrainState:
        state = cls(last_seq=snapshot.last_seq, last_job_number=snapshot.last_job_number)
        # In the order they finished, as the log's replay would have learned them (and,
        # from a snapshot that has them, the service samples as they were).
        learned = snapshot.service_samples is None
        for job in sorted(snapshot.jobs, key=_finish_order):
            state._put_job(job, new=learned)
        if snapshot.service_samples is not None:
            state.service_samples.extend(snapshot.service_samples)
            gpus = snapshot.service_sample_gpus
            if gpus is None or len(gpus) != len(snapshot.service_samples):
                gpus = (0,) * len(snapshot.service_samples)  # not known: pooled only
            state.service_sample_gpus.extend(gpus)
        # Finished jobs in the order they finished (ties as the log had them).
        order = {job_id: i for i, job_id in enumerate(snapshot.finished)}
        for job_id in sorted(state.finished, key=lambda j: order.get(j, -1)):
            state.finished.move_to_end(job_id)
        state.finished_away = {JobState(k): v for k, v in snapshot.finished_away.items()}
        state.keys_away = OrderedDict(((t, k), j) for t, k, j in snapshot.keys_away)
        state.nodes = {node.name: node for node in snapshot.nodes}
        state.blacklist = {e.uri: e for e in snapshot.blacklist}
        state.input_failures = {uri: set(jobs) for uri, jobs in snapshot.input_failures.items()}
        if snapshot.node_failures is not None:  # else as its jobs' records tell
            state.node_failures = {
                node: deque(
                    (NodeFailure(f.at, f.job_id, f.reason) for f in failures),
                    maxlen=NODE_FAILURES_KEPT,
                )
                for node, failures in snapshot.node_failures.items()
            }
        return state

    def to_snapshot(self, *, taken_at: float, epoch: int) -> BrainSnapshot:
        return BrainSnapshot(
            last_seq=self.last_seq,
            last_job_number=self.last_job_number,
            taken_at=taken_at,
            epoch=epoch,
            jobs=tuple(self.jobs.values()),
            nodes=tuple(self.nodes.values()),
            blacklist=tuple(self.blacklist.values()),
            input_failures={u: tuple(sorted(j)) for u, j in self.input_failures.items()},
            service_samples=tuple(self.service_samples),
            service_sample_gpus=tuple(self.service_sample_gpus),
            finished=tuple(self.finished),
            finished_away={state.value: n for state, n in self.finished_away.items()},
            keys_away=tuple((t, k, j) for (t, k), j in self.keys_away.items()),
            node_failures={
                node: tuple(BlamedFailure(at=f.at, job_id=f.job_id, reason=f.reason) for f in kept)
                for node, kept in self.node_failures.items()
            },
        )

    def job_for_key(self, tenant: str, key: str) -> JobRecord | None:
        job_id = self.by_key.get((tenant, key))
        return self.jobs.get(job_id) if job_id is not None else None

    def job_away_for_key(self, tenant: str, key: str) -> str | None:
        """The id of a finished job no longer in memory that was submitted with `key`."""
        return self.keys_away.get((tenant, key))

    def next_job_id(self) -> str:
        return str(self.last_job_number + 1)

    def jobs_in(self, *states: JobState) -> list[JobRecord]:
        # In job-id order, so the same state always yields the same snapshot.
        if len(states) == 1 and states[0] in self._ordered:
            return [self.jobs[job_id] for job_id in self._ordered[states[0]]]
        ids = sorted((i for state in states for i in self.by_state[state]), key=job_sequence)
        return [self.jobs[job_id] for job_id in ids]

    def running_on(self, node: str) -> list[JobRecord]:
        return [j for j in self.jobs_in(JobState.RUNNING) if node in j.nodes]

    def attempts_on(self, node: str) -> AbstractSet[tuple[str, int]]:
        """The (job, attempt) pairs running on `node`, as the brain holds them (read only)."""
        return self._attempts_on.get(node, _NONE_RUNNING)

    def take_attempts_changed(self) -> set[str]:
        """The nodes whose (job, attempt) pairs changed since the last call."""
        changed, self._attempts_changed = self._attempts_changed, set()
        return changed

    def unconfirmed(self) -> list[JobRecord]:
        """Running jobs with a grant whose process no node has reported yet (nor its
        exit), in job order."""
        return [self.jobs[job_id] for job_id in sorted(self._unconfirmed, key=job_sequence)]

    def allocated(self) -> Mapping[str, frozenset[int]]:
        """GPUs held by running jobs, per node (kept up to date, not computed: read only)."""
        return self._held

    def schedulable_gpus(self, node: NodeRecord) -> tuple[int, ...]:
        drained = {d.index for d in node.drained_gpus}
        return tuple(
            g.index for g in node.gpus if g.health is GpuHealth.HEALTHY and g.index not in drained
        )

    def schedulable_set(self, node: NodeRecord) -> frozenset[int]:
        """`schedulable_gpus` as a set, kept until the node's record is replaced."""
        kept = self._schedulable_sets.get(node.name)
        if kept is None or kept[0] is not node:
            kept = (node, frozenset(self.schedulable_gpus(node)))
            self._schedulable_sets[node.name] = kept
        return kept[1]

    def registered_gpus(self) -> tuple[int, int]:
        """Every GPU of every known node, whatever its state now, and the most on one
        node: what a job may ever hope for (a node away for a minute comes back)."""
        if self._registered is None:
            self._registered = _Sizes((n.name, len(n.gpus)) for n in self.nodes.values())
        return self._registered.total, self._registered.most()

    def registered_views(self) -> tuple[NodeView, ...]:
        """Every known node with all its GPUs, whatever their state: what a job asking a
        share, a type, CPUs or memory may ever hope for."""
        return tuple(
            node_view(n, tuple(g.index for g in n.gpus), frozenset())
            for _, n in sorted(self.nodes.items())
        )

    def capacity(self) -> int:
        """Schedulable GPUs of READY nodes."""
        return self._schedulable_counts()[0]

    def largest_node(self) -> int:
        """The most schedulable GPUs on one READY node."""
        return self._schedulable_counts()[1]

    def _schedulable_counts(self) -> tuple[int, int]:
        if self._schedulable is None:
            self._schedulable = _Sizes(
                (n.name, self._schedulable_size(n)) for n in self.nodes.values()
            )
        return self._schedulable.total, self._schedulable.most()

    def _schedulable_size(self, node: NodeRecord) -> int:
        return len(self.schedulable_set(node)) if node.state is NodeState.READY else 0

    def snapshot(
        self,
        *,
        profiles: Mapping[str, UtilizationProfile] | None = None,
        now: float | None = None,
        queues: tuple[QueueQuota, ...] = (),
        service_prior: ServiceDistribution | None = DEFAULT_SERVICE_PRIOR,
        progress: Mapping[str, ObservedProgress] | None = None,
        running_service: bool = True,
        by_class: bool = False,
        error_distribution: ServiceDistribution | None = None,
    ) -> ClusterSnapshot:
        """The frozen view `decide` sees; `profiles` (job id -> profile) come from the
        brain's telemetry, which the log does not hold; `now` adds the current run to
        running jobs' attained service; `queues` and `service_prior` are configuration (no
        prior: no learned distribution, for the orders that do not read it);
        `progress` (job id -> what its reports said) comes from its supervisor;
        `by_class`: the distribution of each size class too (`service_by_class`, for the
        orders that read it), which needs `service_prior` and `now`;
        `error_distribution`: how far finished jobs' progress reports were off
        (brain/progress.py), for the orders that read it.

        `running_service` False: running jobs' service and run time are as of their
        records (for a policy that reads neither), so their views are reused from pass
        to pass until a record, profile or progress report changes."""
        profiles = profiles or {}
        progress = progress or {}
        nodes = self._node_views()
        if running_service:
            running = tuple(
                job_view(j, profiles.get(j.job_id), now=now, progress=progress.get(j.job_id))
                for j in self.jobs_in(JobState.RUNNING)
                if not self.on_lost_node(j)
            )
        else:
            running = self._running_job_views(profiles, progress)
        return ClusterSnapshot(
            nodes=nodes,
            pending=self._pending_job_views(progress),
            running=running,
            queues=queues,
            recent_asks=tuple(self._asks.items()),
            service_distribution=(
                None if service_prior is None else self.service_distribution(service_prior, now=now)
            ),
            service_by_class=(
                self.service_by_class(service_prior, now=now)
                if by_class and service_prior is not None and now is not None
                else None
            ),
            error_distribution=error_distribution,
        )

    def _running_job_views(
        self,
        profiles: Mapping[str, UtilizationProfile],
        progress: Mapping[str, ObservedProgress],
    ) -> tuple[JobView, ...]:
        """Running jobs' views without the clock, in job order. Built again: the views
        of jobs whose record changed, or whose profile or progress is another (by
        identity, then by value); the tuple, after any of that or a node turning LOST
        or back. A pass after nothing changed costs a few look-ups; a new profile
        mapping, one walk of it."""
        views, inputs, stale = self._running_views, self._running_inputs, self._running_stale
        built_profiles, built_progress = self._running_built_with
        if profiles is not built_profiles:
            stale.update(_changed(inputs, profiles, 0, built_profiles))
        if progress is not built_progress:
            stale.update(_changed(inputs, progress, 1, built_progress))
        self._running_built_with = (profiles, progress)
        if stale:
            running = self.by_state[JobState.RUNNING]
            for job_id in stale:
                if job_id not in running:  # a profile of a job no longer running
                    continue
                profile, seen = profiles.get(job_id), progress.get(job_id)
                views[job_id] = job_view(self.jobs[job_id], profile, progress=seen)
                inputs[job_id] = (profile, seen)
            stale.clear()
            self._running_tuple = None
        if self._running_tuple is None:
            ordered = self._ordered[JobState.RUNNING]
            if self.lost_nodes():
                self._running_tuple = tuple(
                    views[job_id] for job_id in ordered if not self.on_lost_node(self.jobs[job_id])
                )
            else:
                self._running_tuple = tuple(map(views.__getitem__, ordered))
        return self._running_tuple

    def _pending_job_views(self, progress: Mapping[str, ObservedProgress]) -> tuple[JobView, ...]:
        """Pending jobs' views in job order. A pending job's view does not depend on the
        clock: only those whose record changed since the last pass, or whose progress
        did, are built again; the rest of the queue costs a look-up each."""
        views = self._pending_views
        built_with = self._pending_progress
        stale = self._pending_stale
        pending = self.by_state[JobState.PENDING]
        for job_id in progress.keys() | built_with.keys():
            if progress.get(job_id) != built_with.get(job_id) and job_id in pending:
                stale.add(job_id)
        for job_id in stale:  # pending, all: a job leaving the queue leaves `stale`
            seen = progress.get(job_id)
            views[job_id] = job_view(self.jobs[job_id], progress=seen)
            if seen is None:
                built_with.pop(job_id, None)
            else:
                built_with[job_id] = seen
        stale.clear()
        if self.blocked:  # waiting for jobs to run after: not to be decided on yet
            return tuple(views[i] for i in self._ordered[JobState.PENDING] if i not in self.blocked)
        return tuple(map(views.__getitem__, self._ordered[JobState.PENDING]))

    def on_lost_node(self, job: JobRecord) -> bool:
        """A job waiting out its lost node's fence margin (docs/operations.md,
        Partitions) is left out of decisions: its GPUs are not in the capacity, it
        cannot be stopped, and it is neither a victim nor a claim on other GPUs."""
        lost = self.lost_nodes()
        return bool(lost) and any(g.node in lost for g in job.grants)

    def lost_nodes(self) -> frozenset[str]:
        """The LOST nodes' names (counted again after such a node's record changed)."""
        if self._lost_nodes is None:
            self._lost_nodes = frozenset(
                name for name, node in self.nodes.items() if node.state is NodeState.LOST
            )
        return self._lost_nodes

    def free_gpus(self) -> dict[str, frozenset[int]]:
        """Each READY node's schedulable GPUs that no running job holds (from the same
        views a snapshot reuses: cheap when few nodes changed)."""
        return {view.name: view.free for view in self._node_views()}

    def free_on(self, name: str) -> frozenset[int] | None:
        """`free_gpus()` of one node, without building every node's: None unless the
        node is known and READY."""
        record = self.nodes.get(name)
        if record is None or record.state is not NodeState.READY:
            return None
        return self._node_view(name, record, self._held.get(name, _NOTHING)).free

    def _node_views(self) -> tuple[NodeView, ...]:
        """READY nodes' views in name order: the views of nodes whose record or held
        GPUs changed are built again, the rest are kept."""
        stale = self._nodes_stale
        if len(self._sorted_names) != len(self.nodes):  # nodes are added, never removed
            self._sorted_names = sorted(self.nodes)
            self._node_position = {name: i for i, name in enumerate(self._sorted_names)}
            self._node_list = [None] * len(self._sorted_names)
            stale.update(self._sorted_names)
        if stale:
            listed, position, held = self._node_list, self._node_position, self._held
            for name in stale:
                record = self.nodes.get(name)
                if record is None:  # GPUs held on a node never registered
                    continue
                listed[position[name]] = (
                    self._node_view(name, record, held.get(name, _NOTHING))
                    if record.state is NodeState.READY
                    else None
                )
            stale.clear()
            self._node_tuple = None
        if self._node_tuple is None:
            self._node_tuple = tuple(filter(None, self._node_list))
        return self._node_tuple

    def _node_view(self, name: str, record: NodeRecord, here: frozenset[int]) -> NodeView:
        """The node's view, reused while its record and held GPUs are the same objects
        as when it was built."""
        cached = self._views.get(name)
        if cached is not None and cached[0] is record and cached[1] is here:
            return cached[2]
        gpus = self.schedulable_gpus(record)
        view = node_view(record, gpus, frozenset(gpus) - here)
        self._views[name] = (record, here, view)
        return view


class _Sizes:
    """A number per node (its GPUs), kept as nodes change: the sum, and the most by how
    many nodes have each number (a handful of distinct numbers)."""

    __slots__ = ("each", "nodes_of", "total")

    def __init__(self, sizes: Iterable[tuple[str, int]]) -> None:
        self.each: dict[str, int] = {}
        self.nodes_of: Counter[int] = Counter()
        self.total = 0
        for name, size in sizes:
            self.set(name, size)

    def set(self, name: str, size: int) -> None:
        old = self.each.get(name, 0)
        if size == old:
            return
        self.total += size - old
        if old:
            self.nodes_of[old] -= 1
            if not self.nodes_of[old]:
                del self.nodes_of[old]
        if size:
            self.nodes_of[size] += 1
            self.each[name] = size
        else:
            self.each.pop(name, None)

    def most(self) -> int:
        return max(self.nodes_of, default=0)


_NOTHING: Final[frozenset[int]] = frozenset()
_NONE_RUNNING: Final[frozenset[tuple[str, int]]] = frozenset()


def _changed(
    built: Mapping[str, tuple[object, ...]],
    now: Mapping[str, object],
    at: int,
    before: Mapping[str, object],
) -> Iterator[str]:
    """The ids whose entry in `now` is not the one their view was built with
    (`built[id][at]`), and those `before` had that `now` lacks."""
    for key, value in now.items():
        kept = built.get(key)
        if kept is None or (kept[at] is not value and kept[at] != value):
            yield key
    yield from before.keys() - now.keys()


_LIVE: Final = frozenset({JobState.PENDING, JobState.RUNNING})


class _JobOrder:
    """Job ids in job order (`job_sequence`), kept sorted as they come and go."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: list[str] = []

    def add(self, job_id: str) -> None:
        bisect.insort(self._ids, job_id, key=job_sequence)

    def discard(self, job_id: str) -> None:
        i = bisect.bisect_left(self._ids, job_sequence(job_id), key=job_sequence)
        if i < len(self._ids) and self._ids[i] == job_id:
            del self._ids[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def node_view(record: NodeRecord, gpus: tuple[int, ...], free: frozenset[int]) -> NodeView:
    """A node as `decide` sees it: the GPUs it may use, and what jobs with a demand are
    placed by (the GPUs' model and least memory, the node's CPUs and memory)."""
    return NodeView(
        name=record.name,
        gpus=gpus,
        free=free,
        model=record.gpus[0].model if record.gpus else "",
        gpu_memory_mib=node_gpu_memory_mib(record),
        cpu_milli=record.cpu_milli,
        memory_mib=record.memory_mib,
    )


def node_gpu_memory_mib(record: NodeRecord) -> int:
    """The memory of the node's smallest GPU: what placement reckons each of its GPUs
    has (a node's GPUs are one model)."""
    return min((g.memory_mib for g in record.gpus), default=0)


def share_memory_limit(job: JobRecord, node: NodeRecord | None) -> int | None:
    """A share's GPU memory limit, the one placement reckoned with and MPS holds it to:
    its own, or its share of its node's GPU memory (`share_memory_mib`); None for a
    whole-GPU job, or a share with no limit of its own and no node yet."""
    spec = job.spec
    if not spec.shared or spec.gpu_milli is None:
        return None
    gpu_mib = node_gpu_memory_mib(node) if node is not None else 0
    limit = share_memory_mib(spec.gpu_milli, spec.gpu_memory_mib or 0, gpu_mib)
    return limit if limit > 0 else None


def job_ask(job: JobRecord) -> Ask:
    """What the job asked of placement (a share, with its tenant)."""
    return Ask(job.spec.gpus, job_demand(job.spec), job.tenant if job.spec.shared else None)


def job_demand(spec: JobSpec) -> Demand | None:
    """What placement reads of a job beyond its GPU count; None for whole GPUs only."""
    if not spec.constrained:
        return None
    return Demand(
        gpu_milli=spec.gpu_milli if spec.gpu_milli is not None else 1000,
        gpu_memory_mib=spec.gpu_memory_mib or 0,
        gpu_types=spec.gpu_types,
        cpu_milli=round(spec.cpus * 1000) if spec.cpus is not None else 0,
        memory_mib=spec.memory_mib or 0,
    )


def _finish_order(job: JobRecord) -> tuple[float, tuple[int, str]]:
    finished = job.finished_at if job.finished_at is not None else float("-inf")
    return finished, job_sequence(job.job_id)


def service_of(job: JobRecord) -> Service:
    """The job's service as the core's model has it (`brain.core.model.Service`): what
    its record has closed, and the run in progress, which has held its GPUs since it
    began or since its last resize within the run."""
    started = job.started_at
    if job.state is not JobState.RUNNING or started is None:
        return Service(job.attained_gpu_seconds, job.executed_seconds)
    resized = job.resized_at
    since = started if resized is None else max(started, resized)
    return Service(job.attained_gpu_seconds, job.executed_seconds, started, since, job.gpu_size)


def served(job: JobRecord, now: float | None) -> tuple[float, float]:
    """(GPU-seconds of service, seconds run) to `now`, the run in progress included; the
    record's `attained_gpu_seconds` and `executed_seconds` count only what ended or was
    resized before, and are all there is without a clock."""
    if now is None or job.state is not JobState.RUNNING:
        return job.attained_gpu_seconds, job.executed_seconds
    service = service_of(job)
    return service.attained_to(now), service.executed_to(now)


def accounted(old: JobRecord | None, job: JobRecord, now: float) -> JobRecord:
    """`job` as it is journaled after `old`, at `now`: a run that ends folded into its
    service, an elastic job's size that it leaves counted, a staged resize and the
    run's sizes gone with the run, when a job starts waiting, and a wait's kind gone
    with the wait's reason. Every transition of the live brain passes here, so no path
    can forget it."""
    update: dict[str, object] = {}
    service = service_of(old) if old is not None else Service()
    if service.run_since is not None and job.state is not JobState.RUNNING:
        ended = service.ended(now)
        update["attained_gpu_seconds"] = ended.attained_gpu_s
        update["executed_seconds"] = ended.executed_s
    elif (
        old is not None
        and service.run_since is not None
        and job.attempt == old.attempt
        and job.gpu_count != old.gpu_count
    ):
        # An elastic job changed size within its run: count the size it leaves.
        update["attained_gpu_seconds"] = service.resized(now, job.gpu_size).attained_gpu_s
        update["resized_at"] = now
    if job.state is not JobState.RUNNING and job.resize is not None:
        update["resize"] = None  # a run that ends takes its staged resize with it
    if job.state is not JobState.RUNNING and job.last_resize_at is not None:
        update["last_resize_at"] = update["last_resize_s"] = None  # a new run, new sizes
    if job.state is JobState.PENDING and (old is None or old.state is not JobState.PENDING):
        update["pending_since"] = now
    if job.wait_kind is not None and (
        job.state is not JobState.PENDING
        or (old is not None and job.reason != old.reason and job.wait_kind == old.wait_kind)
    ):
        # Its reason is no longer the wait whose kind it kept (a wait of another kind
        # comes with its own: `Scheduler.note_waits`).
        update["wait_kind"] = None
    return job.model_copy(update=update) if update else job


def job_view(
    job: JobRecord,
    profile: UtilizationProfile | None = None,
    *,
    now: float | None = None,
    progress: ObservedProgress | None = None,
) -> JobView:
    low, high = job.spec.gpu_range
    progress = progress or ObservedProgress()
    attained, executed = served(job, now)
    return JobView(
        job_id=job.job_id,
        # A pre-run takes one GPU for its trial.
        gpus=1 if job.prerun in ("pending", "running") else job.spec.gpus,
        submitted_at=job.submitted_at,
        queue=job.spec.queue,
        tenant=job.tenant,
        priority=job.spec.priority,
        # Not a node where an elastic job's worker host idles with no GPU.
        grants=tuple(Grant(g.node, g.gpus) for g in job.grants if g.gpus),
        started_at=job.started_at,
        profile=profile,
        not_before=job.not_before,
        # A running elastic job does not grow onto its barred nodes either.
        avoid_nodes=frozenset(job.avoid_nodes) | job.barred_nodes,
        attained_gpu_seconds=attained,
        executed_seconds=executed,
        pending_since=job.pending_since,
        service_level=job.service_level,
        service_level_since=job.service_level_since,
        declared_duration_s=job.spec.declared_duration_s,
        network_sensitive=job.spec.network_sensitive,
        min_gpus=low if job.spec.elastic else None,
        max_gpus=high if job.spec.elastic else None,
        throughput=progress.throughput,
        resizing=job.resize is not None,
        last_resize_at=job.last_resize_at,
        last_resize_s=job.last_resize_s,
        pinned_gpus=job.pinned_gpus,
        gain_ceiling=job.gain_ceiling,
        gain_ceiling_at=job.gain_ceiling_at,
        progress_fraction=progress.progress_fraction,
        progress_rate_per_s=progress.progress_rate_per_s,
        demand=job_demand(job.spec),
        shareable=job.spec.shareable,
        # An array is its tenant's: another's of the same name is another array.
        array=None if job.spec.array is None else f"{job.tenant}/{job.spec.array}",
        array_limit=job.spec.array_limit,
    )
