"""Nodes as the brain keeps them."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.base import NodeName
from schemas.telemetry import GpuInfo, GpuSample, GpuShares, RunningJob


class NodeState(StrEnum):
    READY = "READY"
    LOST = "LOST"  # stopped heartbeating; its jobs were taken back
    # Taken out of scheduling by an operator (`drain_reason` says why); its running
    # jobs go on, and `resume` gives its GPUs back.
    DRAINED = "DRAINED"


class DrainedGpu(BaseModel):
    """One GPU taken out of scheduling while its node stays up (a fault, or an operator)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=255)
    reason: str
    at: float


class NodeRecord(BaseModel):
    """What the STATE log keeps about a node: identity and inventory, not liveness.

    Liveness (the last heartbeat) changes every second and is kept only in memory;
    a brain rebuilding from the log gives every node a fresh grace period.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NodeName
    state: NodeState
    hostname: str
    backend: Literal["nvml", "sim"]
    instance: str
    gpus: tuple[GpuInfo, ...]
    joined_at: float
    # Set while drained, whatever the liveness: a drained node that is lost and
    # returns is still drained.
    drain_reason: str | None = None
    # GPUs drained one by one (a critical XID, an operator's `drain --gpu`); they stay
    # drained until the node is resumed.
    drained_gpus: tuple[DrainedGpu, ...] = ()
    # When an operator last resumed it: jobs that failed here before may run here again
    # (`avoid_nodes` forgives it; docs/failures.md).
    resumed_at: float | None = None
    # CPUs (thousandths of a core) and memory (MiB) jobs may reserve here; None: the
    # agent did not say.
    cpu_milli: int | None = Field(default=None, ge=0)
    memory_mib: int | None = Field(default=None, ge=0)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


class NodeStatus(BaseModel):
    """A node as `alnair nodes` shows it: the record plus what is live right now."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    record: NodeRecord
    allocated_gpus: tuple[int, ...]
    jobs: tuple[str, ...]
    # Since its last heartbeat; None: not heard by this brain (known from the log only).
    last_seen_s_ago: float | None
    latest: tuple[GpuSample, ...] = ()
    # Shared GPUs as the agent last reported them (shares, memory limits and use).
    shares: tuple[GpuShares, ...] = ()
    # The processes its agent's latest heartbeat reports running: `jobs` is what the
    # brain gives the node, this what still runs there (a stopped job's process until it
    # has exited). Empty for a node not heard from.
    running: tuple[RunningJob, ...] = ()
