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
from schemas import subjects
from schemas.api import STATUS_RESULT, StatusRequest
from schemas.jobs import JobRecord, JobSpec, JobState
from schemas.state import STATE_RECORD, JobChanged


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


async def leading_brain(bus: Bus, brains: list[BrainProcess]) -> BrainProcess:
    """The brain process that holds the lease now, by the pid its status reports.

    Brains started together race for the lease: the first one started need not lead,
    and killing a standby tests nothing."""
    from schemas.api import STATUS_RESULT, StatusRequest

    status = await call(bus, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=10)
    for brain in brains:
        if brain.process is not None and brain.process.pid == status.brain_pid:
            return brain
    raise AssertionError(f"the leader (pid {status.brain_pid}) is none of these brains")


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
    """Wait until the brain counts no job pending or running, then take every job from
    the STATE log itself: a list of thousands is over NATS's message size."""
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            status = await call(
                bus, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=10
            )
            counts = status.jobs_by_state
            busy = counts.get(JobState.PENDING.value, 0) + counts.get(JobState.RUNNING.value, 0)
            if busy == 0 and sum(counts.values()) >= len(result.acknowledged):
                break
        await asyncio.sleep(0.5)
    result.jobs = await jobs_in_log(bus)
    result.finish_seconds = time.monotonic() - started
    return result


async def jobs_in_log(bus: Bus) -> list[JobRecord]:
    """Every job as its last STATE record has it (the brain's own fold). Unfiltered, so
    the read ends at the log's last entry, not at the first slow fetch."""
    jobs: dict[str, JobRecord] = {}
    async for item, _seq, _subject in bus.read(subjects.STREAM_STATE, STATE_RECORD):
        if isinstance(item, JobChanged):
            jobs[item.job.job_id] = item.job
    return list(jobs.values())
