"""Node events (agent -> brain, JetStream EVENTS): things that happened and must not be lost."""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter

from schemas.base import Message, NodeName
from schemas.jobs import NodeGpus

LOG_TAIL_LINES: Final = 20


class _NodeEvent(Message):
    event_id: str = Field(min_length=1, max_length=64)
    node: NodeName
    ts: float


class JobStarted(_NodeEvent):
    kind: Literal["job_started"] = "job_started"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    pid: int = Field(ge=1)
    gpus: tuple[int, ...]
    log_path: str
    # False: the agent does not confine jobs, so this one runs in no cgroup of its own
    # and the memory and CPUs it asked for are not enforced (docs/security.md).
    limits_enforced: bool = True


class JobExited(_NodeEvent):
    kind: Literal["job_exited"] = "job_exited"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    # Exactly one of exit_code / signal is set, as with waitpid.
    exit_code: int | None = None
    signal: int | None = None
    # True when the process ended because a stop command asked it to.
    stopped: bool = False
    runtime_s: float = Field(ge=0)
    log_tail: tuple[str, ...] = Field(default=(), max_length=LOG_TAIL_LINES)
    # Set when the job's cgroup killed it for exceeding its memory limit (MiB).
    oom_limit_mb: int | None = Field(default=None, ge=0)
    # Set when its agent stopped it for using more GPU memory (MiB) than its share's
    # limit: the limit, and what it used.
    gpu_memory_limit_mib: int | None = Field(default=None, ge=0)
    gpu_memory_used_mib: float | None = Field(default=None, ge=0)


class LaunchFailed(_NodeEvent):
    kind: Literal["launch_failed"] = "launch_failed"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    reason: str
    # False when the job itself is at fault (no such program, bad directory): running
    # it elsewhere would fail the same way.
    retryable: bool = False


class CommandRejected(_NodeEvent):
    kind: Literal["command_rejected"] = "command_rejected"
    command_id: str
    job_id: str | None = None
    reason: str


class GpuFault(_NodeEvent):
    kind: Literal["gpu_fault"] = "gpu_fault"
    gpu: int = Field(ge=0, le=255)
    fault: Literal["xid", "ecc_dbe", "retired_pages", "row_remap_failure", "lost"]
    xid: int | None = None
    detail: str = ""


class InputError(_NodeEvent):
    """A job says which input it failed on (the in-job SDK publishes it on its job's
    event subject; the brain records one for an exit 66 whose log marked the input);
    the brain counts distinct jobs per input to blacklist it."""

    kind: Literal["input_error"] = "input_error"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    uri: str = Field(min_length=1, max_length=4096)
    reason: str = Field(default="", max_length=1000)


class ResizeCompleted(_NodeEvent):
    """An elastic job's supervisor applied (or refused) a Resize; the brain commits the
    staged resize on `ok` and frees `released_gpus` only then."""

    kind: Literal["resize_completed"] = "resize_completed"
    job_id: str = Field(min_length=1, max_length=64)
    command_id: str = Field(min_length=1, max_length=128)
    from_size: int = Field(ge=0)
    to_size: int = Field(ge=0)
    ok: bool
    duration_s: float = Field(ge=0)
    # Slots whose workers have exited (shrink): safe to give to another job now.
    released_gpus: int = Field(default=0, ge=0)
    reason: str = Field(default="", max_length=1000)
    # The GPUs the job's workers hold after the resize, per node, when every worker
    # claimed one (workloads/devices.py); empty when unknown, and the brain keeps its
    # own target.
    placement: tuple[NodeGpus, ...] = Field(default=(), max_length=1024)


NodeEvent = Annotated[
    JobStarted
    | JobExited
    | LaunchFailed
    | CommandRejected
    | GpuFault
    | InputError
    | ResizeCompleted,
    Field(discriminator="kind"),
]
NODE_EVENT: Final[TypeAdapter[NodeEvent]] = TypeAdapter(NodeEvent)
