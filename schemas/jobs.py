"""Jobs: what a user submits (JobSpec) and what the brain keeps (JobRecord)."""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.base import NodeName, QueueName, TenantName

MAX_GPUS_PER_JOB: Final = 4096
_ENV_NAME_CHARS: Final = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
)
# Set by the agent for every job; a spec may not override them.
RESERVED_ENV_PREFIXES: Final = ("ALNAIR_", "CUDA_VISIBLE_DEVICES")


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class JobSpec(BaseModel):
    """What a user asks for. Validated at the API edge; field errors name the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="job", min_length=1, max_length=128)
    command: tuple[str, ...] = Field(min_length=1, max_length=4096)
    gpus: int = Field(ge=1, le=MAX_GPUS_PER_JOB)
    queue: QueueName = "default"
    priority: int = Field(default=0, ge=-1000, le=1000)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    cwd: str | None = Field(default=None, max_length=4096)

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value[0].strip():
            raise ValueError("the program to run (first word of the command) is empty")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or name[0].isdigit() or not set(name) <= _ENV_NAME_CHARS:
                raise ValueError(f"invalid environment variable name {name!r}")
            if name.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"environment variable {name} is set by Alnair itself")
        return value


class NodeGrant(BaseModel):
    """The GPUs of one node given to one attempt of a job, and what became of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: NodeName
    gpus: tuple[int, ...]
    pid: int | None = None
    log_path: str | None = None
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None


class JobRecord(BaseModel):
    """The brain's whole view of one job; every STATE entry for a job carries it entire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    tenant: TenantName
    spec: JobSpec
    state: JobState
    attempt: int = Field(default=0, ge=0)
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    grants: tuple[NodeGrant, ...] = ()
    exit_code: int | None = None
    signal: int | None = None
    # Why the job is in its state: the last cause's message, or why it waits.
    reason: str | None = None
    idempotency_key: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(grant.node for grant in self.grants)

    @property
    def gpu_count(self) -> int:
        return sum(len(grant.gpus) for grant in self.grants)
