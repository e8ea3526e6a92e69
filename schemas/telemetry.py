"""GPU inventory, telemetry samples and heartbeats (agent -> brain, core NATS)."""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.base import Message, NodeName


class GpuHealth(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # seen a critical fault; the agent still reports it
    LOST = "lost"  # fell off the bus / no longer answers NVML


class GpuInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=255)
    uuid: str = Field(min_length=1, max_length=128)
    model: str = Field(min_length=1, max_length=128)
    memory_mib: int = Field(ge=0)
    health: GpuHealth = GpuHealth.HEALTHY
    health_reason: str | None = None


class GpuSample(BaseModel):
    """One GPU at one instant, in dcgm-exporter's units."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=255)
    util_gpu_pct: float = Field(ge=0, le=100)
    util_mem_pct: float = Field(ge=0, le=100)
    mem_used_mib: float = Field(ge=0)
    mem_total_mib: float = Field(ge=0)
    power_w: float = Field(ge=0)
    temp_c: float
    sm_clock_mhz: float = Field(ge=0)
    mem_clock_mhz: float = Field(ge=0)
    # NVML's count is a 64-bit unsigned integer (and the brain packs it as one).
    ecc_dbe_total: int | None = Field(default=None, ge=0, le=2**64 - 1)


# The most share samples a batch carries (about 80 bytes each); an agent running more
# shares sends none, and the brain reads the heartbeat's instead.
MAX_SHARE_SAMPLES: Final = 1024


class ShareSample(BaseModel):
    """The GPU memory one share's processes use on a GPU, read with its batch's samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=255)
    job_id: str = Field(min_length=1, max_length=64)
    memory_used_mib: float = Field(ge=0)


class TelemetryBatch(Message):
    """Every GPU of one node at one instant: one message per node per interval."""

    node: NodeName
    ts: float
    samples: tuple[GpuSample, ...] = Field(max_length=256)
    # What each share on the node's shared GPUs uses of its GPU's memory, read at the
    # same instant (per process: NVML, or what simulated jobs declare): what a job's
    # profile takes off its GPU's for the shares beside it. None: an agent that does
    # not say (the brain then takes the heartbeat's `ShareUse.memory_used_mib`).
    shares: tuple[ShareSample, ...] | None = Field(default=None, max_length=MAX_SHARE_SAMPLES)


class RunningJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    pid: int = Field(ge=1)
    gpus: tuple[int, ...]


class ShareUse(BaseModel):
    """One job's share of one GPU on a node, and what it uses of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    gpu_milli: int = Field(ge=1, le=1000)
    # MPS' pinned device memory limit for the job (MiB); None: none set.
    memory_limit_mib: int | None = Field(default=None, ge=0)
    # GPU memory its processes use now (NVML per process; simulated: what the job
    # reports through the simulator); None: not known.
    memory_used_mib: float | None = Field(default=None, ge=0)


class GpuShares(BaseModel):
    """A GPU that jobs share: who holds which share, and whether it is enforced."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, le=255)
    jobs: tuple[ShareUse, ...] = Field(max_length=1000)
    # "mps": an MPS control daemon runs for this GPU and limits each job; "accounted":
    # simulated GPUs, where nothing is enforced.
    enforcement: Literal["mps", "accounted"]
    # The MPS daemon is not running (it died and is being restarted): why.
    mps_problem: str | None = None


class Heartbeat(Message):
    node: NodeName
    ts: float
    seq: int = Field(ge=0)
    # Changes each time the agent process starts: lets the brain tell a restart
    # from a network blip.
    instance: str = Field(min_length=1, max_length=64)
    hostname: str = Field(min_length=1, max_length=255)
    backend: Literal["nvml", "sim"]
    interval_s: float = Field(gt=0)
    gpus: tuple[GpuInfo, ...] = Field(max_length=256)
    running: tuple[RunningJob, ...] = ()
    # Highest brain epoch the agent has accepted commands from.
    epoch_seen: int = Field(default=0, ge=0)
    # The longest an attempt runs on here after the agent's last confirmed heartbeat:
    # its fence period plus grace (agents/fence.py). None: this agent does not fence.
    fence_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # What jobs may reserve here besides GPUs: CPUs (thousandths of a core) and memory
    # (MiB). None: an agent that does not say (placement then offers this node only to
    # jobs that ask neither).
    cpu_milli: int | None = Field(default=None, ge=0)
    memory_mib: int | None = Field(default=None, ge=0)
    # GPUs whose jobs share them (index -> the shares), per-process GPU memory and
    # whether the shares are enforced (CUDA MPS) or only accounted (simulated GPUs).
    shares: tuple[GpuShares, ...] = Field(default=(), max_length=256)
