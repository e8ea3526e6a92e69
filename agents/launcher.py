"""Job processes on one node: start, watch, stop.

Each job attempt runs as its own process group with `CUDA_VISIBLE_DEVICES` set to its
granted GPUs and its stdout/stderr appended to a per-attempt log file. Given a
`Confinement` (agents/confine.py), each runs as its tenant's user, in its own cgroup,
with a clean environment; without one, as the agent's user with the agent's
environment. Stopping sends SIGTERM to the whole group, then SIGKILL after the grace
period, so a training launcher's workers go with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from agents import processes
from agents.cgroups import CgroupError
from agents.confine import Confined, ConfineError, Confinement, JobRequest
from agents.processes import ended, launched_as, signal_group
from schemas.errors import AlnairError
from schemas.events import LOG_TAIL_LINES
from schemas.jobs import LAUNCH_ID_ENV

log = logging.getLogger(__name__)

TAIL_BYTES: Final = 16 * 1024
FINISHED_REMEMBERED: Final = 10_000
# What an unconfined attempt left running when its first process ended gets this long
# after SIGTERM before SIGKILL (`Launcher._end_leftovers`).
LEFTOVER_GRACE_S: Final = 5.0
# How long a launch waits for the processes being stopped on its GPUs to exit.
GPU_WAIT_S: Final = 30.0


class LaunchError(AlnairError):
    def __init__(self, job_id: str, reason: str, *, retryable: bool = False) -> None:
        super().__init__(f"job {job_id}: {reason}")
        self.job_id = job_id
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    job_id: str
    attempt: int
    gpus: tuple[int, ...]
    command: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    tenant: str | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    # A share of its one GPU (thousandths) and its GPU memory limit (MiB): it may run
    # beside other shares of that GPU while their sum stays within the whole.
    gpu_milli: int | None = None
    gpu_memory_mib: int | None = None
    # How the job names its GPUs when not by index (under MPS: the GPU's UUID).
    visible_devices: str | None = None
    # A whole-GPU job that lets shares run beside it.
    shareable: bool = False


@dataclass
class JobProcess:
    job_id: str
    attempt: int
    gpus: tuple[int, ...]
    process: asyncio.subprocess.Process
    log_path: Path
    started_at: float
    started_monotonic: float
    stop_reason: str | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    confined: Confined | None = None
    gpu_milli: int | None = None
    gpu_memory_mib: int | None = None
    shareable: bool = False
    # GPU memory its processes used at the last watch (MiB; shares only).
    gpu_memory_used_mib: float | None = None
    # Stopped for using more GPU memory than its limit: (used MiB, limit MiB).
    gpu_over: tuple[float, int] | None = None
    # Its token (`ALNAIR_LAUNCH_ID`), which its processes inherit (agents/processes.py).
    launch_id: str | None = None
    # When a stop's grace runs out (monotonic): what it left running has no longer.
    stop_deadline: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def leftovers(self, among: Collection[int] | None = None) -> set[int]:
        """Its processes still running (of `among`, or of all) once its first process
        has ended (and been reaped: its pid may be another's by then)."""
        pids = processes.all_pids() if among is None else among
        return {pid for pid in self.owns(pids) - {self.pid} if not ended(pid)}

    def owns(self, pids: Iterable[int]) -> set[int]:
        """Which of these processes are this attempt's: its process group; when confined,
        its cgroup (which its user cannot leave); and any process started with its launch
        token in its environment, as its descendants are, also one that left the group with
        `setsid`. (MPS limits each client process, not the job: a share with two CUDA
        processes has twice its memory unless both are counted.)"""
        cgroup = self.confined.cgroup if self.confined is not None else None
        in_cgroup: set[int] | None = None
        mine: set[int] = set()
        for pid in pids:
            try:
                if pid == self.pid or os.getpgid(pid) == self.pid:
                    mine.add(pid)
                    continue
            except (ProcessLookupError, PermissionError):
                continue
            if cgroup is not None:
                if in_cgroup is None:
                    in_cgroup = cgroup.pids()
                if pid in in_cgroup:
                    mine.add(pid)
                    continue
            if self.launch_id is not None and launched_as(pid) == self.launch_id:
                mine.add(pid)
        return mine


@dataclass(frozen=True, slots=True)
class ExitStatus:
    exit_code: int | None
    signal: int | None
    runtime_s: float
    log_tail: tuple[str, ...]
    # The job's cgroup killed it at this memory limit (MiB).
    oom_limit_mb: int | None = None


ExitCallback = Callable[[JobProcess, ExitStatus], Awaitable[None]]


def read_tail(path: Path, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return ()
    text = data.decode("utf-8", "replace").splitlines()
    return tuple(line[:1000] for line in text[-lines:])


class Launcher:
    def __init__(
        self,
        log_dir: Path,
        on_exit: ExitCallback,
        *,
        base_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        confinement: Confinement | None = None,
        gpu_memory_mib: Callable[[int], int | None] | None = None,
    ) -> None:
        """`gpu_memory_mib`: a GPU's memory by index (None: not known), for the shares'
        memory limits on it."""
        self.log_dir = log_dir
        self._gpu_memory_mib = gpu_memory_mib
        self._confinement = confinement
        self._on_exit = on_exit
        self._base_env = dict(os.environ if base_env is None else base_env)
        # The agent's own NATS identity is never a job's (the agent sets the job's).
        self._base_env.pop("ALNAIR_NKEY", None)
        self._clock = clock
        self._procs: dict[tuple[str, int], JobProcess] = {}
        self._finished: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._watchers: set[asyncio.Task[None]] = set()

    def running(self) -> list[JobProcess]:
        return [p for p in self._procs.values() if not p.exited.is_set()]

    def find(self, job_id: str, attempt: int | None = None) -> list[JobProcess]:
        return [
            p
            for p in self.running()
            if p.job_id == job_id and (attempt is None or p.attempt == attempt)
        ]

    def busy_gpus(self) -> set[int]:
        return {gpu for p in self.running() for gpu in p.gpus}

    def regrant(self, job_id: str, attempt: int, gpus: tuple[int, ...]) -> bool:
        """An elastic attempt now holds `gpus` (the brain resized it); False if it does
        not run here. Its environment cannot change: the supervisor's workers see the
        GPUs of its launch (see docs/elastic.md)."""
        job = self._procs.get((job_id, attempt))
        if job is None or job.exited.is_set():
            return False
        job.gpus = gpus
        return True

    async def launch(
        self,
        request: LaunchRequest,
        *,
        gpu_wait_s: float = GPU_WAIT_S,
        before_start: Callable[[], Awaitable[None]] | None = None,
    ) -> JobProcess:
        """Start the job once what is being stopped on its GPUs has exited, and
        `before_start` has run (the agent lets the GPUs' share daemons go)."""
        existing = self._procs.get((request.job_id, request.attempt))
        if existing is not None and not existing.exited.is_set():
            return existing  # the same launch again: idempotent
        if (request.job_id, request.attempt) in self._finished:
            # A new brain re-sent a launch whose process already ran and exited: its
            # exit is on its way; running it twice would be wrong.
            raise LaunchError(request.job_id, f"attempt {request.attempt} already ran on this node")
        await self._wait_for_gpus(request, gpu_wait_s)
        if before_start is not None:
            await before_start()
        log_path = self.log_dir / request.job_id / f"attempt-{request.attempt}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        launch_id = secrets.token_hex(16)
        env = {**self._base_env, **request.env, LAUNCH_ID_ENV: launch_id}
        visible = request.visible_devices or ",".join(map(str, request.gpus))
        env["CUDA_VISIBLE_DEVICES"] = visible
        cwd = request.cwd
        if cwd is not None and not os.path.isdir(cwd):  # noqa: ASYNC240 - one stat
            raise LaunchError(request.job_id, f"working directory {cwd} does not exist")
        argv, confined = request.command, None
        if self._confinement is not None:
            confined = self._confine(self._confinement, request, log_path, launch_id)
            # The shim enters the working directory as the job's user.
            argv, env, cwd = confined.argv, confined.env, None
            env["CUDA_VISIBLE_DEVICES"] = visible
        with log_path.open("ab") as log_file:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            except (OSError, ValueError) as error:
                # ValueError: what the kernel cannot take (a NUL in an argument, the
                # environment or the directory), which no retry mends.
                if confined is not None:
                    await confined.finish()
                why = error.strerror if isinstance(error, OSError) else None
                raise LaunchError(
                    request.job_id, f"cannot start {request.command[0]!r}: {why or error}"
                ) from error
        job = JobProcess(
            job_id=request.job_id,
            attempt=request.attempt,
            gpus=request.gpus,
            process=process,
            log_path=log_path,
            started_at=self._clock(),
            started_monotonic=time.monotonic(),
            confined=confined,
            gpu_milli=request.gpu_milli,
            gpu_memory_mib=request.gpu_memory_mib,
            shareable=request.shareable,
            launch_id=launch_id,
        )
        self._procs[(request.job_id, request.attempt)] = job
        watcher = asyncio.ensure_future(self._watch(job))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return job

    @staticmethod
    def _confine(
        confinement: Confinement, request: LaunchRequest, log_path: Path, launch_id: str
    ) -> Confined:
        try:
            return confinement.prepare(
                JobRequest(
                    job_id=request.job_id,
                    attempt=request.attempt,
                    tenant=request.tenant,
                    gpus=request.gpus,
                    command=request.command,
                    env={**request.env, LAUNCH_ID_ENV: launch_id},
                    cwd=request.cwd,
                    memory_mb=request.memory_mb,
                    cpus=request.cpus,
                ),
                log_path,
            )
        except ConfineError as error:
            raise LaunchError(request.job_id, error.reason, retryable=error.retryable) from None
        except (CgroupError, OSError) as error:
            # The node cannot confine it (cgroup filesystem, disk): another node may.
            raise LaunchError(request.job_id, f"cannot confine: {error}", retryable=True) from None

    async def _wait_for_gpus(self, request: LaunchRequest, wait_s: float) -> None:
        """A GPU may still be held by a process being stopped: wait for it to go.

        A GPU held by a process nobody asked to stop means the brain and this node
        disagree; refuse rather than put two jobs on one GPU.
        """
        deadline = time.monotonic() + wait_s
        while True:
            holders = self._holders(request)
            if not holders:
                return
            live = [p for p in holders if p.stop_reason is None]
            if live or time.monotonic() >= deadline:
                who = ", ".join(f"job {p.job_id} attempt {p.attempt}" for p in holders)
                raise LaunchError(
                    request.job_id, f"GPUs {list(request.gpus)} are held by {who}", retryable=True
                )
            await asyncio.wait(
                [asyncio.ensure_future(p.exited.wait()) for p in holders],
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )

    def _holders(self, request: LaunchRequest) -> list[JobProcess]:
        """Running processes in the way of this launch: any on its GPUs, unless it is a
        share and they are shares that fit in one GPU with it, shares and memory limits
        alike, or a shareable job the brain put it beside."""
        holders = [p for p in self.running() if set(p.gpus) & set(request.gpus)]
        if request.gpu_milli is None or any(
            p.gpu_milli is None and not p.shareable for p in holders
        ):
            return holders
        if sum(p.gpu_milli or 0 for p in holders) + request.gpu_milli > 1000:
            return holders
        return [] if self._limits_fit(request, holders) else holders

    def _limits_fit(self, request: LaunchRequest, holders: list[JobProcess]) -> bool:
        """Whether the memory limits of the shares on this share's GPU, with its own,
        fit the GPU (MPS holds each to its limit; together they must not promise more
        than there is). The brain places by the same reckoning: this only catches a
        launch that came before the share it replaces has gone."""
        limit, known = request.gpu_memory_mib, self._gpu_memory_mib
        if limit is None or known is None:
            return True
        for gpu in request.gpus:
            total = known(gpu)
            shares = [p for p in holders if gpu in p.gpus and p.gpu_milli is not None]
            if total and sum(p.gpu_memory_mib or 0 for p in shares) + limit > total:
                return False
        return True

    def shares(self) -> list[JobProcess]:
        """Running jobs that hold a share of a GPU."""
        return [p for p in self.running() if p.gpu_milli is not None]

    async def _watch(self, job: JobProcess) -> None:
        returncode = await job.process.wait()
        oom_limit_mb = None
        if job.confined is None:
            await self._end_leftovers(job)
        else:
            try:
                oom_limit_mb = await job.confined.finish()
            except Exception:
                log.exception("job %s: cleaning up its confinement failed", job.job_id)
        status = ExitStatus(
            exit_code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            runtime_s=time.monotonic() - job.started_monotonic,
            log_tail=read_tail(job.log_path),
            oom_limit_mb=oom_limit_mb,
        )
        job.exited.set()
        try:
            await self._on_exit(job, status)
        except Exception:
            log.exception("exit handler failed for job %s", job.job_id)
        finally:
            self._procs.pop((job.job_id, job.attempt), None)
            self._finished[(job.job_id, job.attempt)] = None
            while len(self._finished) > FINISHED_REMEMBERED:
                self._finished.popitem(last=False)

    async def _end_leftovers(self, job: JobProcess) -> None:
        """End what an unconfined attempt left running once its first process ended:
        the rest of its process group, and what it started that left the group
        (`JobProcess.leftovers`), so that its GPUs are free when its exit is reported.
        SIGTERM, then SIGKILL for those still there after `LEFTOVER_GRACE_S` (a child
        may be writing a checkpoint), or once the grace of a stop under way runs out (a
        fenced node's jobs must be gone in time). A confined attempt's cgroup does this
        (`Confined.finish`)."""
        left = await asyncio.to_thread(job.leftovers)
        if not left:
            return
        log.warning(
            "job %s attempt %d: its first process ended and left %d running; ending them",
            job.job_id,
            job.attempt,
            len(left),
        )
        grace_s = LEFTOVER_GRACE_S
        if job.stop_deadline is not None:
            grace_s = min(grace_s, max(0.0, job.stop_deadline - time.monotonic()))
        left = await processes.end(job.leftovers, left, grace_s=grace_s)
        if left:
            log.error("job %s attempt %d: %d outlived SIGKILL", job.job_id, job.attempt, len(left))

    async def stop(
        self, job_id: str, attempt: int | None, *, reason: str, grace_s: float
    ) -> list[JobProcess]:
        targets = self.find(job_id, attempt)
        await asyncio.gather(*(self._stop_one(p, reason, grace_s) for p in targets))
        return targets

    async def _stop_one(self, job: JobProcess, reason: str, grace_s: float) -> None:
        if job.stop_reason is None:
            job.stop_reason = reason
        deadline = time.monotonic() + grace_s
        if job.stop_deadline is None or deadline < job.stop_deadline:
            job.stop_deadline = deadline
        signal_group(job.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(job.exited.wait(), timeout=grace_s)
        except TimeoutError:
            log.warning("job %s ignored SIGTERM for %.0fs; killing", job.job_id, grace_s)
            signal_group(job.pid, signal.SIGKILL)
            await job.exited.wait()

    async def stop_all(self, *, reason: str, grace_s: float) -> None:
        await asyncio.gather(*(self._stop_one(p, reason, grace_s) for p in self.running()))

    async def wait_idle(self) -> None:
        if self._watchers:
            await asyncio.gather(*list(self._watchers), return_exceptions=True)

    def abandon(self) -> Sequence[int]:
        """Forget every process without stopping it (an agent crash, for tests)."""
        pids = [p.pid for p in self.running()]
        for watcher in list(self._watchers):
            watcher.cancel()
        self._procs.clear()
        return pids
