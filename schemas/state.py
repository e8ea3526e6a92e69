"""The STATE stream: the brain's journal.

Every job and node state change is appended with its cause; so is every node event the
brain folded. A job or node entry carries the whole record after the change, so the
brain's state is the fold "last record wins" of this log, and replaying an entry twice
changes nothing.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.base import Message
from schemas.events import NodeEvent
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeRecord, NodeState


class CauseKind(StrEnum):
    SUBMITTED = "submitted"
    WAITING = "waiting"
    PREEMPTED = "preempted"
    SERVICE_LEVEL = "service_level"
    PLACED = "placed"
    STARTED = "started"
    EXITED = "exited"
    LAUNCH_FAILED = "launch_failed"
    PEER_FAILED = "peer_failed"
    CANCELLED = "cancelled"
    NODE_JOINED = "node_joined"
    NODE_UPDATED = "node_updated"
    NODE_LOST = "node_lost"
    NODE_RETURNED = "node_returned"
    NODE_EVENT = "node_event"
    NODE_DRAINED = "node_drained"
    NODE_RESUMED = "node_resumed"
    GPU_DRAINED = "gpu_drained"
    # A failed attempt and its class (user / infrastructure / input), then what follows:
    # a retry after a back-off, or the end (FAILED for user errors, UNSUCCESSFUL past
    # the retry limit).
    FAILURE_CLASSIFIED = "failure_classified"
    RETRY_SCHEDULED = "retry_scheduled"
    RETRIES_EXHAUSTED = "retries_exhausted"
    PRERUN_PASSED = "prerun_passed"
    BLACKLISTED = "blacklisted"
    UNBLACKLISTED = "unblacklisted"
    # Elastic jobs: a resize commanded (staged), acknowledged by the job's supervisor
    # (committed), or refused / unanswered (rolled back to the size before).
    RESIZE_STAGED = "resize_staged"
    RESIZED = "resized"
    RESIZE_ROLLED_BACK = "resize_rolled_back"
    # An operator pinned an elastic job at a size (`alnair resize JOB N`), or handed it
    # back to the policy (`alnair resize JOB auto`).
    RESIZE_PINNED = "resize_pinned"
    RESIZE_UNPINNED = "resize_unpinned"
    # Its array's limit changed (`alnair throttle ARRAY N`): the job's `array_limit`.
    ARRAY_THROTTLED = "array_throttled"


class Preemption(BaseModel):
    """Why the policy took a running job's GPUs (the core's typed `Preempt` cause)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # quota_reclaim: a queue took back GPUs within its guarantee that this job had
    # borrowed over its own queue's quota. outranked: a better-ranked job needed them.
    # memory_pressure: a share was moved off a shareable job's GPU (`for_job`, the
    # host) forecast to run out of memory.
    reason: Literal["quota_reclaim", "outranked", "memory_pressure"]
    # The job the GPUs were taken for.
    for_job: str
    # quota_reclaim: the queue whose guarantee it was, and the borrower's queue.
    owner_queue: str | None = None
    victim_queue: str | None = None
    # outranked: the queue order, and the two jobs' ranks in its words.
    order: str | None = None
    winner_rank: str | None = None
    victim_rank: str | None = None
    # memory_pressure: the GPU, the host's own forecast memory, what the GPU has and
    # what the shares on it may use, this one's included (MiB).
    node: str | None = None
    gpu: int | None = Field(default=None, ge=0)
    forecast_mem_mib: float | None = Field(default=None, ge=0)
    gpu_memory_mib: int | None = Field(default=None, ge=0)
    guest_memory_mib: int | None = Field(default=None, ge=0)


class Cause(BaseModel):
    """Why something changed, in words an operator can act on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: CauseKind
    message: str
    node: str | None = None
    job_id: str | None = None
    # Set on a `preempted` cause: the policy's reason, as data.
    preemption: Preemption | None = None


class JobChanged(Message):
    kind: Literal["job"] = "job"
    record_id: str
    ts: float
    epoch: int = Field(ge=0)
    job: JobRecord
    previous: JobState | None
    cause: Cause


class NodeChanged(Message):
    kind: Literal["node"] = "node"
    record_id: str
    ts: float
    epoch: int = Field(ge=0)
    node: NodeRecord
    previous: NodeState | None
    cause: Cause


class NodeEventRecorded(Message):
    kind: Literal["node_event"] = "node_event"
    record_id: str
    ts: float
    epoch: int = Field(ge=0)
    event: NodeEvent


class BlacklistEntry(BaseModel):
    """An input no job may use: blacklisted after it broke `jobs`, or by an operator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(min_length=1, max_length=4096)
    reason: str
    jobs: tuple[str, ...] = ()
    added_at: float
    added_by: str


class BlamedFailure(BaseModel):
    """An infrastructure failure blamed on a node, as the black-hole rule keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float
    job_id: str
    reason: str


class BlacklistChanged(Message):
    """The whole input blacklist after a change (last entry wins, like job records)."""

    kind: Literal["blacklist"] = "blacklist"
    record_id: str
    ts: float
    epoch: int = Field(ge=0)
    entries: tuple[BlacklistEntry, ...]
    cause: Cause


class BrainSnapshot(Message):
    """The fold of the STATE log up to `last_seq`, so a brain need not replay it all."""

    last_seq: int = Field(ge=0)
    last_job_number: int = Field(ge=0)
    taken_at: float
    epoch: int = Field(ge=0)
    jobs: tuple[JobRecord, ...]
    nodes: tuple[NodeRecord, ...]
    blacklist: tuple[BlacklistEntry, ...] = ()
    # Distinct jobs that reported failing on each input not (yet) blacklisted.
    input_failures: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    # Attained GPU-seconds of the latest succeeded jobs, oldest first (the Gittins
    # order's samples; None in a snapshot from before they were kept: learned from
    # its jobs then).
    service_samples: tuple[float, ...] | None = None
    # The GPUs each of those jobs asked for, in the same order (None in a snapshot from
    # before they were kept: those samples then count for no size class).
    service_sample_gpus: tuple[int, ...] | None = None
    # Finished jobs in memory, in the order they finished; how many finished jobs left
    # memory, by final state; and their idempotency keys: (tenant, key, job id).
    finished: tuple[str, ...] = ()
    finished_away: dict[str, int] = Field(default_factory=dict)
    keys_away: tuple[tuple[str, str, str], ...] = ()
    # The latest infrastructure failures blamed on each node, oldest first (what the
    # black-hole rule reads; kept whether or not their jobs are still in memory). None
    # in a snapshot from before they were kept: rebuilt from its jobs then.
    node_failures: dict[str, tuple[BlamedFailure, ...]] | None = None


SNAPSHOT_ENCODING: Final = "jsonl+zlib"


class SnapshotManifest(Message):
    """Where a stored snapshot's body lies, written after every chunk of it is stored.

    The body, once its chunks are joined, matches `digest` (SHA-256, hex) and `size`;
    decompressed (`encoding`: zlib of JSON lines: the `BrainSnapshot` without its jobs,
    then the jobs in slices, each a JSON array) it is `raw_size` bytes, the fold of the
    STATE log up to `last_seq`.
    """

    last_seq: int = Field(ge=0)
    epoch: int = Field(ge=0)
    taken_at: float
    jobs: int = Field(ge=0)
    encoding: Literal["jsonl+zlib"]
    size: int = Field(ge=0)
    raw_size: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    # Stream sequences of the chunks in `SNAPSHOTS`, in body order.
    chunks: tuple[int, ...]


StateRecord = Annotated[
    JobChanged | NodeChanged | NodeEventRecorded | BlacklistChanged, Field(discriminator="kind")
]
STATE_RECORD: Final[TypeAdapter[StateRecord]] = TypeAdapter(StateRecord)


def record_job_id(record: StateRecord) -> str | None:
    if isinstance(record, JobChanged):
        return record.job.job_id
    if isinstance(record, NodeEventRecorded):
        return getattr(record.event, "job_id", None)
    return None


def record_node(record: StateRecord) -> str | None:
    if isinstance(record, NodeChanged):
        return record.node.name
    if isinstance(record, NodeEventRecorded):
        return record.event.node
    return None


def record_kind(record: StateRecord) -> str:
    """The kind `alnair events --kind` filters on: the cause, or the node event's kind."""
    if isinstance(record, NodeEventRecorded):
        return record.event.kind
    return record.cause.kind.value


def record_kinds() -> tuple[str, ...]:
    """Every kind `record_kind` can return, sorted."""
    members = get_args(get_args(NodeEvent)[0])
    events = {str(member.model_fields["kind"].default) for member in members}
    return tuple(sorted(events | {kind.value for kind in CauseKind}))
