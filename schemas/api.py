"""The request/reply API on `alnair.api.<tenant>.<verb>`.

The tenant is the subject's token, never a payload field: NATS permissions confine
an identity to its tenant's subjects, so the subject is the authenticated tenant.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
)

from schemas.base import Message, NodeName, QueueName
from schemas.jobs import (
    MAX_ARRAY_INDEX,
    MAX_GPUS_PER_JOB,
    ArrayName,
    FailureClass,
    JobRecord,
    JobSpec,
    JobState,
    NodeGrant,
    unlaunchable,
)
from schemas.nodes import NodeStatus
from schemas.profiles import JobProfile
from schemas.state import BlacklistEntry, Cause

ApiVerb = Literal[
    "submit",
    "cancel",
    "jobs",
    "job",
    "nodes",
    "status",
    "drain",
    "resume",
    "history",
    "blacklist",
    "why",
    "resize",
    "queues",
]
API_VERBS: Final[tuple[str, ...]] = get_args(ApiVerb)
# Requests on `alnair.api.operator.>` are an operator's: they may read every tenant's
# jobs and drain or resume nodes. NATS permissions must grant that subject to operators
# only (the HTTP API maps its operator tokens to the same role).
OPERATOR_TENANT: Final = "operator"


class SubmitRequest(Message):
    spec: JobSpec
    # A retry with the same key returns the job the first try created, so a client
    # that lost the reply (a brain failing over) can retry without a duplicate.
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("spec")
    @classmethod
    def _launchable(cls, spec: JobSpec) -> JobSpec:
        problem = unlaunchable(spec)
        if problem is not None:
            raise ValueError(problem)
        return spec


class CancelRequest(Message):
    job_id: str = Field(min_length=1, max_length=64)


class ListJobsRequest(Message):
    states: tuple[JobState, ...] | None = None
    # Only jobs of these queues; None: every queue.
    queues: tuple[QueueName, ...] | None = Field(default=None, max_length=64)
    # Only jobs of these arrays (`JobSpec.array`, the caller's tenant's); None: any job.
    arrays: tuple[ArrayName, ...] | None = Field(default=None, max_length=64)
    limit: int = Field(default=1000, ge=1, le=100_000)
    # Only jobs listed before this one (by job id, the order the log took them in):
    # the next page, from a reply's `next_before`.
    before: str | None = Field(default=None, min_length=1, max_length=64)


class GetJobRequest(Message):
    job_id: str = Field(min_length=1, max_length=64)


class ListNodesRequest(Message):
    # Only nodes whose names sort after this one: the next page, from a reply's
    # `next_after`.
    after: NodeName | None = None
    # At most this many (the first by name): a dashboard's page.
    limit: int = Field(default=100_000, ge=1, le=100_000)
    # Only this node (`not_found` if the brain knows none of that name).
    name: NodeName | None = None


class StatusRequest(Message):
    pass


class ListQueuesRequest(Message):
    """Each queue's guarantee beside what its jobs hold and ask (`alnair queues`)."""


class DrainRequest(Message):
    """Take a node's GPUs out of scheduling; what runs there keeps running, unless
    `requeue` asks that it be stopped and go back to its queue."""

    node: NodeName
    reason: str = Field(default="drained by an operator", min_length=1, max_length=500)
    # One GPU of the node rather than all of it.
    gpu: int | None = Field(default=None, ge=0, le=255)
    # Stop the jobs running there (on that GPU) and put them back in their queues, as
    # a preemption does: not a failure, no retry spent (maintenance).
    requeue: bool = False


class ResumeRequest(Message):
    node: NodeName


class ResizeRequest(Message):
    """Pin an elastic job at `gpus` GPUs (`alnair resize JOB N`): the resize is staged
    now and committed when the job's supervisor has the workers stepping at that size,
    and the policy leaves the job at that size until `alnair resize JOB auto`."""

    job_id: str = Field(min_length=1, max_length=64)
    # A size pins the job there (the policy leaves it at that size, across attempts);
    # "auto" lifts the pin and hands the job's size back to the policy.
    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_JOB)] | Literal["auto"]

    @field_validator("gpus", mode="before")
    @classmethod
    def _size_or_auto(cls, value: Any) -> Any:
        # One message for the union, not one per branch that refused it.
        if value == "auto" or (
            isinstance(value, int)
            and not isinstance(value, bool)
            and 1 <= value <= MAX_GPUS_PER_JOB
        ):
            return value
        raise ValueError(
            f'a whole number of GPUs from 1 to {MAX_GPUS_PER_JOB}, or "auto"; not {value!r}'
        )


class HistoryRequest(Message):
    """Every attempt of one job (`alnair history JOB`), from the brain's history."""

    job_id: str = Field(min_length=1, max_length=64)


class WhyRequest(Message):
    """The latest decisions about one job, with their causes (`alnair why JOB`)."""

    job_id: str = Field(min_length=1, max_length=64)
    # At most this many, the newest; they come oldest first.
    limit: int = Field(default=20, ge=1, le=1000)


class BlacklistRequest(Message):
    """List the input blacklist, or (operators) add or remove an input."""

    action: Literal["list", "add", "remove"] = "list"
    uri: str | None = Field(default=None, min_length=1, max_length=4096)
    reason: str = Field(default="blacklisted by an operator", min_length=1, max_length=500)


ErrorCode = Literal[
    "invalid", "not_found", "conflict", "unavailable", "internal", "unauthorized", "forbidden"
]


class ErrorReply(Message):
    ok: Literal[False] = False
    code: ErrorCode
    error: str


class JobReply(Message):
    ok: Literal[True] = True
    job: JobRecord
    # Its GPU utilisation profile, once the brain has telemetry for it.
    profile: JobProfile | None = None
    # A share's GPU memory limit, which MPS holds it to: its own, or, without one, its
    # share of its node's GPU memory (None: a whole-GPU job, or a share without a limit
    # of its own not placed yet).
    gpu_memory_limit_mib: int | None = Field(default=None, ge=0)


class JobsReply(Message):
    ok: Literal[True] = True
    jobs: tuple[JobRecord, ...]
    # Profiles of the listed jobs that have one.
    profiles: tuple[JobProfile, ...] = ()
    # Older jobs match too, left out by `limit` or because one message holds no more:
    # ask again with `before` set to this (the oldest job listed) for the next page.
    next_before: str | None = None


class NodesReply(Message):
    ok: Literal[True] = True
    # By name.
    nodes: tuple[NodeStatus, ...]
    # More nodes follow, left out by `limit` or because one message holds no more: ask
    # again with `after` set to this (the last node listed) for the next page.
    next_after: str | None = None


class QueueStatus(BaseModel):
    """One queue: its quota (`alnair brain --queues`), and its jobs now. A share of a GPU
    counts as its share (0.25), as the policy charges it against the guarantee."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # False: not in the queues file, but jobs use it (a train queue with no guarantee).
    listed: bool
    job_class: Literal["build", "train"]
    guaranteed_gpus: int = Field(ge=0)
    running_jobs: int = Field(ge=0)
    running_gpus: float = Field(ge=0)
    pending_jobs: int = Field(ge=0)
    pending_gpus: float = Field(ge=0)

    @property
    def borrowed_gpus(self) -> float:
        """GPUs held beyond the guarantee: its jobs past it may be preempted for a queue
        owed its own (docs/policies.md). In thousandths, as shares are asked."""
        return max(0, round(self.running_gpus - self.guaranteed_gpus, 3))


class QueuesReply(Message):
    ok: Literal[True] = True
    queues: tuple[QueueStatus, ...]
    # The brain refuses jobs for a queue not listed (`--strict-queues`).
    strict: bool = False


class NodeReply(Message):
    ok: Literal[True] = True
    node: NodeStatus


class ThrottleRequest(Message):
    """An array's limit, changed while it runs (`alnair throttle ARRAY N`).

    As Slurm's `scontrol update ArrayTaskThrottle`: every job of the caller's array
    (`JobSpec.array`) that has not ended takes `limit` as its `array_limit`; None lifts
    the limit. Running jobs past a lowered limit run on: the next starts once fewer than
    `limit` hold GPUs."""

    array: ArrayName
    limit: int | None = Field(ge=1, le=MAX_ARRAY_INDEX)


class ThrottleReply(Message):
    ok: Literal[True] = True
    array: str
    limit: int | None
    # The array's jobs that have not ended, each now held to `limit`, by job id.
    jobs: tuple[str, ...]


class AttemptRow(BaseModel):
    """One attempt of a job as the history keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int
    nodes: str
    gpus: str
    started_at: float | None
    ended_at: float | None
    state: str
    exit_code: int | None = None
    signal: int | None = None
    failure_class: FailureClass | None = None
    reason: str | None = None


class HistoryReply(Message):
    ok: Literal[True] = True
    job: JobRecord
    attempts: tuple[AttemptRow, ...]


class WhyEntry(BaseModel):
    """One change of a job, from the STATE log: what it became and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int
    ts: float
    state: JobState
    previous: JobState | None
    cause: Cause
    attempt: int
    # The GPUs the job held after the change (where a placement put it).
    grants: tuple[NodeGrant, ...] = ()
    # Its LAS band after the change.
    service_level: int = 0


class WhyReply(Message):
    ok: Literal[True] = True
    job: JobRecord
    # Oldest first; `truncated` when older ones were left out.
    decisions: tuple[WhyEntry, ...]
    truncated: bool = False
    # The job's service when answered, the run in progress included (the record's
    # `attained_gpu_seconds` and `executed_seconds` count only what ended before it);
    # None from a brain that does not say.
    attained_gpu_seconds: float | None = None
    executed_seconds: float | None = None
    # The brain's queue order (`Policy.order`): whether the job's LAS band means
    # anything; None from a brain that does not say.
    order: str | None = None


class BlacklistReply(Message):
    ok: Literal[True] = True
    entries: tuple[BlacklistEntry, ...]
    # Inputs not blacklisted yet, with the distinct jobs that failed on each.
    suspects: dict[str, tuple[str, ...]] = Field(default_factory=dict)


class BrainInfo(BaseModel):
    """A running brain, as it announces itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    brain_id: str
    host: str
    pid: int
    since: float
    http: str | None = None
    leader: bool = False


# Utilisation buckets of `GpuCensus.utilisation`: [0, 10) %, [10, 20) %, ... [90, 100] %.
UTILISATION_BUCKETS: Final = 10


def utilisation_bucket(index: int) -> str:
    """A utilisation bucket's range in whole percent: "0-9", ..., "90-100"."""
    return f"{10 * index}-{10 * index + 9 if index < UTILISATION_BUCKETS - 1 else 100}"


class GpuCensus(BaseModel):
    """Every GPU of every node, counted by what it is doing: the cluster at a glance,
    however many nodes (a node's own GPUs are in `alnair nodes`). Each GPU is in exactly
    one of the first five counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    busy: int  # held whole by a running job
    shared: int  # holding shares of a GPU (jobs asking a fraction of one)
    free: int  # schedulable and holding nothing
    drained: int  # taken out of scheduling: drained (node or GPU) or unhealthy
    unavailable: int  # on nodes not heard from (LOST)
    # GPUs of READY nodes by their latest utilisation, in UTILISATION_BUCKETS buckets of
    # 10 %; `unreported`: READY nodes' GPUs with no telemetry sample yet.
    utilisation: tuple[int, ...] = Field(max_length=UTILISATION_BUCKETS)
    unreported: int
    nodes_by_state: dict[str, int]


class StatusReply(Message):
    ok: Literal[True] = True
    brains: tuple[BrainInfo, ...] = ()
    epoch: int
    brain_host: str
    brain_pid: int
    started_at: float
    policy: str
    jobs_by_state: dict[str, int]
    nodes: int
    gpus: int
    census: GpuCensus | None = None  # None from a brain older than it
    # Pending jobs by the kind of their wait (`JobRecord.wait_kind`; "unexplained": no
    # pass has said yet), most first.
    waiting: dict[str, int] = Field(default_factory=dict)
    # Commands whose records are stored, not yet taken by the command stream (the
    # journal's sender's queue): more than a pass's worth for long means the stream
    # is not taking them.
    commands_queued: int = 0


REQUEST_TYPES: Final[dict[str, type[Message]]] = {
    "submit": SubmitRequest,
    "cancel": CancelRequest,
    "jobs": ListJobsRequest,
    "job": GetJobRequest,
    "nodes": ListNodesRequest,
    "status": StatusRequest,
    "drain": DrainRequest,
    "resume": ResumeRequest,
    "history": HistoryRequest,
    "blacklist": BlacklistRequest,
    "why": WhyRequest,
    "resize": ResizeRequest,
    "queues": ListQueuesRequest,
    "throttle": ThrottleRequest,
}

_R = TypeVar("_R", bound=Message)


def _result(reply: type[_R]) -> TypeAdapter[ErrorReply | _R]:
    """An answer: `ErrorReply` or `reply`, told apart by `ok`, so that one that fails
    validation is reported against what it says it is, not against both (an older
    client reading a newer brain's reply names the field it does not know:
    "StatusReply.commands_queued: Extra inputs are not permitted")."""
    name = reply.__name__

    def which(value: Any) -> str:
        ok = value.get("ok") if isinstance(value, dict) else getattr(value, "ok", None)
        return "ErrorReply" if ok is False else name

    # A union built at run time, for each reply type: no static type to check.
    tagged: Any = Annotated[reply, Tag(name)]
    either: Any = Annotated[Annotated[ErrorReply, Tag("ErrorReply")] | tagged, Discriminator(which)]
    return TypeAdapter(either)


JOB_RESULT: Final = _result(JobReply)
JOBS_RESULT: Final = _result(JobsReply)
NODES_RESULT: Final = _result(NodesReply)
NODE_RESULT: Final = _result(NodeReply)
STATUS_RESULT: Final = _result(StatusReply)
HISTORY_RESULT: Final = _result(HistoryReply)
BLACKLIST_RESULT: Final = _result(BlacklistReply)
WHY_RESULT: Final = _result(WhyReply)
QUEUES_RESULT: Final = _result(QueuesReply)
THROTTLE_RESULT: Final = _result(ThrottleReply)
