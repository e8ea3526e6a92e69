"""The in-job SDK: how a training process tells its supervisor how it is doing.

Workers send one small UDP datagram per report to the address the supervisor put in
`ALNAIR_PROGRESS_ADDR`. UDP because a report must never block or fail a training step:
a lost datagram only delays the next progress message. This module imports neither
torch nor horovod, so any framework can use it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from workloads.devices import GPU_DIR_ENV, held_gpu

PROGRESS_ADDR_ENV: Final = "ALNAIR_PROGRESS_ADDR"
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
MAX_DATAGRAM_BYTES: Final = 8192


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's state after one step."""

    rank: int
    pid: int
    step: int
    world_size: int
    samples_per_s: float
    loss: float
    # A digest of the model parameters: equal across ranks when they are in sync.
    param_digest: str = ""
    ts: float = 0.0
    # The steps the job means to take in all, if it knows.
    total_steps: int | None = None
    # The GPU this worker claimed (workloads.devices.claim_gpu), if it did.
    gpu: int | None = None
    # This worker's batch in the step (samples), if it says.
    batch_size: int | None = None
    # Samples/s of the whole job at its base batch's worth (workloads/goodput.py), for
    # a job that adapts its batch: what the brain sizes it by instead of samples/s.
    goodput: float | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerReport:
        """Parse a datagram; raise ValueError naming what is wrong."""
        if len(data) > MAX_DATAGRAM_BYTES:
            raise ValueError(f"progress datagram of {len(data)} bytes is too big")
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("progress datagram is not a JSON object")
        return cls(
            rank=int(raw["rank"]),
            pid=int(raw["pid"]),
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            samples_per_s=_rate(raw["samples_per_s"]) or 0.0,
            loss=float(raw["loss"]),
            param_digest=str(raw.get("param_digest", "")),
            ts=float(raw.get("ts", 0.0)),
            total_steps=int(raw["total_steps"]) if raw.get("total_steps") else None,
            gpu=int(raw["gpu"]) if raw.get("gpu") is not None else None,
            batch_size=_positive(raw.get("batch_size")),
            goodput=_rate(raw.get("goodput")),
        )


def _positive(value: object) -> int | None:
    """A count a worker sent, or None when it is missing or not positive."""
    count = None if value is None else int(value)  # type: ignore[call-overload]
    return count if count is not None and count >= 1 else None


def _rate(value: object) -> float | None:
    """A rate a worker sent, or None when it is missing, negative or not finite (a
    report must never stop the supervisor's progress messages)."""
    if value is None:
        return None
    rate = float(value)  # type: ignore[arg-type]
    return rate if math.isfinite(rate) and rate >= 0 else None


def worker_env(progress_addr: str, gpu_dir: Path | None) -> dict[str, str]:
    """The environment a job's workers start with (from the supervisor, or from a
    worker host on another node): where to report progress, which GPUs to claim
    (workloads/devices.py; None: no device map), and this project on the path."""
    env = dict(os.environ)
    env[PROGRESS_ADDR_ENV] = progress_addr
    if gpu_dir is not None:
        env[GPU_DIR_ENV] = str(gpu_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


class ProgressReporter:
    """Sends WorkerReports to the supervisor; does nothing outside a supervised job."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get(PROGRESS_ADDR_ENV)
        self._target: tuple[str, int] | None = None
        self._socket: socket.socket | None = None
        if address:
            host, _, port = address.rpartition(":")
            self._target = (host, int(port))
            self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    @property
    def enabled(self) -> bool:
        return self._target is not None

    def report(
        self,
        *,
        rank: int,
        step: int,
        world_size: int,
        samples_per_s: float,
        loss: float,
        param_digest: str = "",
        total_steps: int | None = None,
        batch_size: int | None = None,
        goodput: float | None = None,
    ) -> None:
        if self._socket is None or self._target is None:
            return
        message = WorkerReport(
            rank=rank,
            pid=os.getpid(),
            step=step,
            world_size=world_size,
            samples_per_s=samples_per_s,
            loss=loss,
            param_digest=param_digest,
            ts=time.time(),
            total_steps=total_steps,
            gpu=held_gpu(),
            batch_size=batch_size,
            goodput=goodput,
        )
        # The supervisor may be gone or busy; training goes on regardless.
        with contextlib.suppress(OSError):
            self._socket.sendto(message.encode(), self._target)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
