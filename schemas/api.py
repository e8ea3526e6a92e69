"""The request/reply API on `alnair.api.<tenant>.<verb>`.

The tenant is the subject's token, never a payload field: NATS permissions confine
an identity to its tenant's subjects, so the subject is the authenticated tenant.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, TypeAdapter

from schemas.base import Message
from schemas.jobs import JobRecord, JobSpec, JobState
from schemas.nodes import NodeStatus

ApiVerb = Literal["submit", "cancel", "jobs", "job", "nodes", "status"]
API_VERBS: Final[tuple[str, ...]] = ("submit", "cancel", "jobs", "job", "nodes", "status")


class SubmitRequest(Message):
    spec: JobSpec


class CancelRequest(Message):
    job_id: str = Field(min_length=1, max_length=64)


class ListJobsRequest(Message):
    states: tuple[JobState, ...] | None = None
    limit: int = Field(default=1000, ge=1, le=100_000)


class GetJobRequest(Message):
    job_id: str = Field(min_length=1, max_length=64)


class ListNodesRequest(Message):
    pass


class StatusRequest(Message):
    pass


ErrorCode = Literal["invalid", "not_found", "conflict", "unavailable", "internal"]


class ErrorReply(Message):
    ok: Literal[False] = False
    code: ErrorCode
    error: str


class JobReply(Message):
    ok: Literal[True] = True
    job: JobRecord


class JobsReply(Message):
    ok: Literal[True] = True
    jobs: tuple[JobRecord, ...]


class NodesReply(Message):
    ok: Literal[True] = True
    nodes: tuple[NodeStatus, ...]


class StatusReply(Message):
    ok: Literal[True] = True
    epoch: int
    brain_host: str
    brain_pid: int
    started_at: float
    policy: str
    jobs_by_state: dict[str, int]
    nodes: int
    gpus: int


REQUEST_TYPES: Final[dict[str, type[Message]]] = {
    "submit": SubmitRequest,
    "cancel": CancelRequest,
    "jobs": ListJobsRequest,
    "job": GetJobRequest,
    "nodes": ListNodesRequest,
    "status": StatusRequest,
}

JOB_RESULT: Final = TypeAdapter(ErrorReply | JobReply)
JOBS_RESULT: Final = TypeAdapter(ErrorReply | JobsReply)
NODES_RESULT: Final = TypeAdapter(ErrorReply | NodesReply)
STATUS_RESULT: Final = TypeAdapter(ErrorReply | StatusReply)
