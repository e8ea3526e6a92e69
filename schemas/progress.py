"""Progress of a running job (supervisor -> brain, core NATS `alnair.job.<job>.progress`).

Loss is tolerated: each message carries the whole current picture, so the next one
replaces a lost one. The brain's elasticity policy learns throughput per world size
from these.
"""

from __future__ import annotations

from pydantic import Field

from schemas.base import Message


class WorkerProgress(Message):
    """One worker's last report."""

    rank: int = Field(ge=0)
    pid: int = Field(ge=1)
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    param_digest: str = Field(default="", max_length=64)
    # The GPU the worker claimed (workloads/devices.py), when it did.
    gpu: int | None = Field(default=None, ge=0)
    # The worker's batch in its last step (samples), when it says.
    batch_size: int | None = Field(default=None, ge=1)


class Progress(Message):
    """Where an elastic (or SDK-reporting) job stands, as rank 0 last reported it."""

    job_id: str = Field(min_length=1, max_length=64)
    ts: float
    step: int = Field(ge=0)
    world_size: int = Field(ge=1)
    samples_per_s: float = Field(ge=0)
    loss: float
    # The slots the supervisor runs now (the world size it is converging to).
    slots: int = Field(ge=0)
    workers: tuple[WorkerProgress, ...] = Field(default=(), max_length=4096)
    # The steps the job means to take in all, if it says: the brain then knows the
    # fraction done (`step / total_steps`) and how fast it grows.
    total_steps: int | None = Field(default=None, ge=1)
    # The attempt (run) of the job that reports, when known: a report from a run the
    # brain has already ended (a supervisor still stopping) is not the current run's.
    attempt: int | None = Field(default=None, ge=1)
    # The job's global batch in rank 0's last step (its batch x the world size), when
    # it says: it changes with the world size when the job keeps each worker's batch,
    # and by the job's own choice when it adapts the batch.
    batch_size: int | None = Field(default=None, ge=1)
    # Samples/s at the job's base batch's worth (workloads/goodput.py), from a job that
    # adapts its batch: the brain sizes the job by it instead of `samples_per_s`.
    goodput: float | None = Field(default=None, ge=0)
