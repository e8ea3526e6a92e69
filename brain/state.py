"""The brain's in-memory state: a fold of the STATE log, and the snapshot it yields.

`BrainState.apply` is the only way state changes, and it takes a journal record; the
live brain appends a record to the log before applying it, and a restarted brain
replays the log through the same `apply`. Because every job or node record carries the
whole entity, applying a record twice changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from brain.core.model import ClusterSnapshot, Grant, JobView, NodeView, UtilizationProfile
from brain.core.ordering import job_sequence
from schemas.events import InputError
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeRecord, NodeState
from schemas.state import (
    BlacklistChanged,
    BlacklistEntry,
    BrainSnapshot,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
)
from schemas.telemetry import GpuHealth

SEEN_EVENTS: Final = 100_000


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

    def apply(self, record: StateRecord, seq: int) -> None:
        if isinstance(record, JobChanged):
            self._put_job(record.job)
        elif isinstance(record, NodeChanged):
            self.nodes[record.node.name] = record.node
        elif isinstance(record, NodeEventRecorded):
            self._saw_event(record.event.event_id)
            if isinstance(record.event, InputError):
                event = record.event
                self.input_failures.setdefault(event.uri, set()).add(event.job_id)
                self.input_reports[(event.job_id, event.attempt)] = event.uri
        elif isinstance(record, BlacklistChanged):
            self.blacklist = {e.uri: e for e in record.entries}
        self.last_seq = max(self.last_seq, seq)

    def _saw_event(self, event_id: str) -> None:
        self.seen_events[event_id] = None
        while len(self.seen_events) > SEEN_EVENTS:
            self.seen_events.popitem(last=False)

    def _put_job(self, job: JobRecord) -> None:
        previous = self.jobs.get(job.job_id)
        if previous is not None:
            self.by_state[previous.state].discard(job.job_id)
        self.jobs[job.job_id] = job
        self.by_state[job.state].add(job.job_id)
        if job.job_id.isdigit():
            self.last_job_number = max(self.last_job_number, int(job.job_id))
        if job.idempotency_key is not None:
            self.by_key[(job.tenant, job.idempotency_key)] = job.job_id

    @classmethod
    def from_snapshot(cls, snapshot: BrainSnapshot) -> BrainState:
        state = cls(last_seq=snapshot.last_seq, last_job_number=snapshot.last_job_number)
        for job in snapshot.jobs:
            state._put_job(job)
        state.nodes = {node.name: node for node in snapshot.nodes}
        state.blacklist = {e.uri: e for e in snapshot.blacklist}
        state.input_failures = {uri: set(jobs) for uri, jobs in snapshot.input_failures.items()}
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
        )

    def job_for_key(self, tenant: str, key: str) -> JobRecord | None:
        job_id = self.by_key.get((tenant, key))
        return self.jobs.get(job_id) if job_id is not None else None

    def next_job_id(self) -> str:
        return str(self.last_job_number + 1)

    def jobs_in(self, *states: JobState) -> list[JobRecord]:
        # In job-id order, so the same state always yields the same snapshot.
        ids = sorted((i for state in states for i in self.by_state[state]), key=job_sequence)
        return [self.jobs[job_id] for job_id in ids]

    def running_on(self, node: str) -> list[JobRecord]:
        return [j for j in self.jobs_in(JobState.RUNNING) if node in j.nodes]

    def allocated(self) -> dict[str, set[int]]:
        """GPUs held by running jobs, per node."""
        held: dict[str, set[int]] = {}
        for job in self.jobs_in(JobState.RUNNING):
            for grant in job.grants:
                held.setdefault(grant.node, set()).update(grant.gpus)
        return held

    def schedulable_gpus(self, node: NodeRecord) -> tuple[int, ...]:
        drained = {d.index for d in node.drained_gpus}
        return tuple(
            g.index for g in node.gpus if g.health is GpuHealth.HEALTHY and g.index not in drained
        )

    def registered_gpus(self) -> tuple[int, int]:
        """Every GPU of every known node, whatever its state now, and the most on one
        node: what a job may ever hope for (a node away for a minute comes back)."""
        sizes = [len(n.gpus) for n in self.nodes.values()]
        return sum(sizes), max(sizes, default=0)

    def capacity(self) -> int:
        return sum(
            len(self.schedulable_gpus(n)) for n in self.nodes.values() if n.state is NodeState.READY
        )

    def largest_node(self) -> int:
        return max(
            (
                len(self.schedulable_gpus(n))
                for n in self.nodes.values()
                if n.state is NodeState.READY
            ),
            default=0,
        )

    def snapshot(
        self, *, profiles: Mapping[str, UtilizationProfile] | None = None, now: float | None = None
    ) -> ClusterSnapshot:
        """The frozen view `decide` sees; `profiles` (job id -> profile) come from the
        brain's telemetry, which the log does not hold; `now` adds the current run to
        running jobs' attained service."""
        profiles = profiles or {}
        held = self.allocated()
        nodes = tuple(
            NodeView(
                name=n.name,
                gpus=self.schedulable_gpus(n),
                free=frozenset(self.schedulable_gpus(n)) - held.get(n.name, set()),
            )
            for n in sorted(self.nodes.values(), key=lambda n: n.name)
            if n.state is NodeState.READY
        )
        return ClusterSnapshot(
            nodes=nodes,
            pending=tuple(job_view(j) for j in self.jobs_in(JobState.PENDING)),
            running=tuple(
                job_view(j, profiles.get(j.job_id), now=now) for j in self.jobs_in(JobState.RUNNING)
            ),
        )


def current_run_s(job: JobRecord, now: float | None) -> float:
    """Seconds of the run in progress, or 0 when none is (or no clock was given)."""
    if now is None or job.state is not JobState.RUNNING or job.started_at is None:
        return 0.0
    return max(0.0, now - job.started_at)


def job_view(
    job: JobRecord, profile: UtilizationProfile | None = None, *, now: float | None = None
) -> JobView:
    run_s = current_run_s(job, now)
    return JobView(
        job_id=job.job_id,
        # A pre-run takes one GPU for its trial.
        gpus=1 if job.prerun in ("pending", "running") else job.spec.gpus,
        submitted_at=job.submitted_at,
        queue=job.spec.queue,
        priority=job.spec.priority,
        grants=tuple(Grant(g.node, g.gpus) for g in job.grants),
        started_at=job.started_at,
        waiting_reason=job.reason if job.state is JobState.PENDING else None,
        profile=profile,
        not_before=job.not_before,
        avoid_nodes=frozenset(job.avoid_nodes),
        attained_gpu_seconds=job.attained_gpu_seconds + run_s * job.gpu_count,
        executed_seconds=job.executed_seconds + run_s,
        pending_since=job.pending_since,
        service_level=job.service_level,
        service_level_since=job.service_level_since,
    )
