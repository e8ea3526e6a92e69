"""Commands (brain -> agent / supervisor, JetStream COMMANDS).

Every command carries an id, used as `Nats-Msg-Id` and de-duplicated by the receiver,
and the brain's leader epoch: receivers refuse a command from an older epoch than the
newest they have obeyed (fencing a deposed brain).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter, model_validator

from schemas.base import Message, NodeName, TenantName
from schemas.jobs import NodeGpus, placement_size


class _Command(Message):
    command_id: str = Field(min_length=1, max_length=128)
    epoch: int = Field(ge=1)
    issued_at: float


class Launch(_Command):
    kind: Literal["launch"] = "launch"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    gpus: tuple[int, ...] = Field(min_length=1)
    command: tuple[str, ...] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    # A launch that reaches an agent after this (by the node's clock, as the brain
    # reckons it from the node's heartbeats) is refused: the node was away, and the
    # brain has since given the job elsewhere.
    expires_at: float
    node_rank: int = Field(default=0, ge=0)
    nodes: tuple[NodeName, ...] = ()
    # The cluster's input blacklist; the agent writes it to a file named by
    # ALNAIR_BLACKLIST_FILE in the job's environment.
    blacklist: tuple[str, ...] = ()
    # Set for a pre-run (one GPU, for a short trial); the job sees ALNAIR_PRERUN=1.
    prerun: bool = False
    # Whose job it is: a confining agent runs it as that tenant's Unix user (see
    # docs/security.md), within these limits (schemas.jobs.job_limits; None: the
    # agent applies the defaults to the GPUs of this launch).
    tenant: TenantName | None = None
    memory_mb: int | None = Field(default=None, ge=16)
    cpus: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # How long the agent lets this attempt run on without NATS before stopping it
    # (self-fencing); None: the agent's own fence period. The brain sets it for a job
    # submitted with on_disconnect "keep", and runs the job elsewhere only after it
    # plus the fence margin (docs/operations.md, "Partitions").
    fence_after_s: float | None = Field(default=None, gt=0, le=7 * 86400, allow_inf_nan=False)
    # A share of its one GPU (thousandths) and its GPU memory limit (MiB): the agent
    # runs it under that GPU's MPS daemon with these limits (docs/sharing.md).
    gpu_milli: int | None = Field(default=None, ge=1, lt=1000)
    gpu_memory_mib: int | None = Field(default=None, ge=1)
    # A whole-GPU job that lets shares run beside it (the brain decides when).
    shareable: bool = False


class Stop(_Command):
    kind: Literal["stop"] = "stop"
    job_id: str = Field(min_length=1, max_length=64)
    # None stops every attempt of the job the node runs.
    attempt: int | None = Field(default=None, ge=1)
    reason: str
    grace_s: float = Field(default=10.0, ge=0, le=3600)


class Regrant(_Command):
    """The GPUs a running attempt holds on this node changed (an elastic job resized):
    a grow's added GPUs are the job's from now on, a shrink's released ones no longer
    are. The agent updates its books (what it reports, which launches would collide);
    the processes are untouched. None: the job's worker host here holds no GPU (the
    job's resizes left the node; the worker host idles until a grow comes back)."""

    kind: Literal["regrant"] = "regrant"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    gpus: tuple[int, ...] = Field(max_length=4096)
    reason: str = Field(default="", max_length=1000)


class InjectFault(Message):
    """`alnair inject`: make a simulated GPU suffer a fault (request/reply on
    `alnair.node.<node>.inject`). An agent with real GPUs refuses it."""

    gpu: int = Field(ge=0, le=255)
    fault: Literal["xid", "ecc_dbe", "retired_pages", "row_remap_failure", "lost"]
    xid: int | None = Field(default=None, ge=1, le=1000)
    detail: str = Field(default="", max_length=500)


class InjectFaultReply(Message):
    ok: bool
    detail: str


class Resize(_Command):
    """Brain -> an elastic job's supervisor (`alnair.job.<job>.cmd`): run at this size.

    The supervisor grows by adding slots and shrinks by removing slots and waiting for
    the removed workers to exit; it answers with a ResizeCompleted event.
    """

    kind: Literal["resize"] = "resize"
    job_id: str = Field(min_length=1, max_length=64)
    world_size: int = Field(ge=1, le=4096)
    cause: str = Field(default="", max_length=1000)
    # The job's GPUs per node at the new size (physical indices), when the brain says:
    # the supervisor's slots on each node, and the GPUs a grow's new workers claim
    # there (workloads/devices.py). A node not listed has no workers any more (its
    # worker host is stopped by the brain once the shrink is done). For a shrink
    # Horovod picks the workers to retire, so the supervisor reports which GPUs its
    # workers still hold rather than obey these lists. Empty: `world_size` workers,
    # the other nodes' slots unchanged.
    placement: tuple[NodeGpus, ...] = Field(default=(), max_length=1024)
    # Nodes the brain found lost (silent past its node timeout, their agents fenced):
    # the job's workers there are gone, or going, without a word, so the shrink off them
    # does not wait to hear them retire. Never in `placement`.
    lost: tuple[NodeName, ...] = Field(default=(), max_length=1024)

    @model_validator(mode="after")
    def _sized(self) -> Resize:
        nodes = [part.node for part in self.placement]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"placement names a node twice: {nodes}")
        kept = sorted(set(nodes) & set(self.lost))
        if kept:
            raise ValueError(f"lost node(s) {kept} are in the placement")
        if self.placement and placement_size(self.placement) != self.world_size:
            raise ValueError(
                f"placement holds {placement_size(self.placement)} GPUs, "
                f"world_size is {self.world_size}"
            )
        return self


JobCommand = Annotated[Resize, Field(discriminator="kind")]
JOB_COMMAND: Final[TypeAdapter[JobCommand]] = TypeAdapter(JobCommand)


NodeCommand = Annotated[Launch | Stop | Regrant, Field(discriminator="kind")]
NODE_COMMAND: Final[TypeAdapter[NodeCommand]] = TypeAdapter(NodeCommand)
