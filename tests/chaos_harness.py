"""A burst of submissions against brains running as real processes, with kill -9.

Used by tests/test_chaos_*.py (small bursts) and bench/burst.py (large ones). The
brains are `python -m cli brain` processes; agents run in this process with simulated
GPUs and run real (trivial) job processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bus.client import Bus
from cli.client import call, submit
from schemas.api import JOBS_RESULT, ListJobsRequest
from schemas.jobs import JobRecord, JobSpec, JobState


@dataclass
class BrainProcess:
    nats_url: str
    home: Path
    index: int
    lease_ttl_s: float = 2.0
    process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        log = (self.home / f"brain-{self.index}.log").open("ab")
        env = {**os.environ, "ALNAIR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cli",
            "brain",
            "--nats",
            self.nats_url,
            "--history",
            str(self.home / f"history-{self.index}.db"),
            "--lease-ttl",
            str(self.lease_ttl_s),
            "--launch-ttl",
            "20",
            "--node-timeout",
            "10",
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no lease release, replies in flight are lost."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), timeout=15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


@dataclass
class BurstResult:
    submitted: int
    acknowledged: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    ack_seconds: float = 0.0
    jobs: list[JobRecord] = field(default_factory=list)
    finish_seconds: float = 0.0

    @property
    def duplicated(self) -> int:
        """Submissions (by idempotency key) that created more than one job."""
        counts = Counter(j.idempotency_key for j in self.jobs if j.idempotency_key)
        return sum(n - 1 for n in counts.values() if n > 1)

    @property
    def lost(self) -> int:
        """Acknowledged jobs the cluster does not have."""
        have = {j.job_id for j in self.jobs}
        return sum(1 for job_id in self.acknowledged.values() if job_id not in have)

    @property
    def unfinished(self) -> int:
        return sum(1 for j in self.jobs if j.state is not JobState.SUCCEEDED)


async def burst(
    bus: Bus,
    count: int,
    *,
    concurrency: int = 16,
    on_progress: Callable[[int], None] | None = None,
    retry_for_s: float = 60.0,
) -> BurstResult:
    """Submit `count` one-GPU jobs, each with its own idempotency key, retrying through
    brain failures; returns which were acknowledged with which job id."""
    result = BurstResult(submitted=count)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    spec = JobSpec(name="burst", command=("true",), gpus=1)
    started = time.monotonic()

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            try:
                job = await submit(
                    bus, "default", spec, idempotency_key=f"burst-{i}", retry_for_s=retry_for_s
                )
            except Exception as error:
                result.failed[i] = repr(error)
                continue
            result.acknowledged[i] = job.job_id
            if on_progress is not None:
                on_progress(len(result.acknowledged))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.ack_seconds = time.monotonic() - started
    return result


async def wait_all_finished(
    bus: Bus, result: BurstResult, *, timeout_s: float = 300.0
) -> BurstResult:
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        with contextlib.suppress(Exception):
            reply = await call(
                bus, "default", "jobs", ListJobsRequest(limit=100_000), JOBS_RESULT, timeout_s=10
            )
            result.jobs = list(reply.jobs)
            if len(result.jobs) >= len(result.acknowledged) and result.unfinished == 0:
                break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    result.finish_seconds = time.monotonic() - started
    return result
