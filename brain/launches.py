"""Launches: the commands that start an attempt's processes on its nodes.

One `Launch` per node of the attempt that has not confirmed its start (a first
placement, a grow's new worker host, a leader's re-send after taking over). Each carries
what the agent needs to run its part alone: the GPUs, the command for its rank, the
environment with the attempt's secrets, the limits, and the blacklist. The command id is
the same every time (`launch_id`), so JetStream drops a re-send that was stored, and an
agent ignores a launch it has run. This builds and sends; it reads state and never
writes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from brain import elastic, secrets
from brain.attempts import launch_id
from brain.state import BrainState, share_memory_limit
from brain.writer import Clock, NodeCommands
from schemas.commands import Launch
from schemas.jobs import ARRAY_INDEX_ENV, JobRecord, job_limits
from schemas.workers import EXEC_SECRET_ENV


class LaunchSettings(Protocol):
    """brain.service.BrainConfig is one."""

    @property
    def launch_ttl_s(self) -> float: ...

    @property
    def keep_disconnected_s(self) -> float: ...


class JobTokens(Protocol):
    """Per-attempt NATS credentials (brain.credentials.JobCredentials is one)."""

    @property
    def renew_s(self) -> float | None: ...


class Launches:
    def __init__(
        self,
        state: Callable[[], BrainState],
        commands: NodeCommands,
        settings: LaunchSettings,
        *,
        clock: Clock,
        cluster_key: Callable[[], Awaitable[bytes]],
        tokens: JobTokens | None = None,
        clock_offset: Callable[[str], float] = lambda node: 0.0,
    ) -> None:
        """`clock_offset`: how far this brain's clock is ahead of a node's
        (`NodeIngest.clock_offset`), so that a launch expires by the node's clock."""
        self._state = state
        self._commands = commands
        self._settings = settings
        self._clock = clock
        self._cluster_key = cluster_key
        self._tokens = tokens
        self._clock_offset = clock_offset

    def _needs_key(self, job: JobRecord) -> bool:
        return job.spec.elastic or self._tokens is not None

    async def ready(self, job: JobRecord) -> None:
        """Have at hand what the job's launch needs from outside the state (the cluster
        key, read from JetStream the first time): raises if it cannot be had, before
        its placement is stored rather than after, when the launch could not go out."""
        if self._needs_key(job):
            await self._cluster_key()

    async def send(self, job: JobRecord) -> None:
        """Command every node of the job's attempt that has not confirmed its start."""
        now = self._clock()
        settings = self._settings
        nodes = job.nodes
        # An elastic job: the supervisor on the first node, worker hosts on the others
        # (there from its launch, or added by a grow), each told the attempt's secret
        # that signs the supervisor's worker starts.
        remote = tuple((g.node, len(g.gpus)) for g in job.grants[1:])
        env = dict(job.spec.env)
        if job.spec.array_index is not None:
            env[ARRAY_INDEX_ENV] = str(job.spec.array_index)
        key = await self._cluster_key() if self._needs_key(job) else b""
        if job.spec.elastic:
            env[EXEC_SECRET_ENV] = secrets.exec_secret(key, job.job_id, job.attempt)
        if self._tokens is not None:
            env[secrets.JOB_TOKEN_ENV] = secrets.job_token(key, job.job_id, job.attempt)
            if self._tokens.renew_s is not None:
                env[secrets.JOB_RENEW_ENV] = f"{self._tokens.renew_s:g}"
        state = self._state()
        blacklist = tuple(sorted(state.blacklist))
        for rank, grant in enumerate(job.grants):
            if grant.pid is not None or grant.exited:
                continue
            memory_mb, cpus = job_limits(job.spec, len(grant.gpus))
            node = state.nodes.get(grant.node)
            await self._commands.command(
                grant.node,
                Launch(
                    command_id=launch_id(job.job_id, job.attempt, grant.node),
                    epoch=self._commands.epoch,
                    issued_at=now,
                    job_id=job.job_id,
                    attempt=job.attempt,
                    gpus=grant.gpus,
                    command=elastic.launch_command(
                        job.spec, len(grant.gpus), rank=rank, remote=remote if rank == 0 else ()
                    ),
                    env=env,
                    cwd=job.spec.cwd,
                    # In the node's clock: one set apart from this brain's by more
                    # than the TTL would refuse, or keep, every launch.
                    expires_at=now + settings.launch_ttl_s - self._clock_offset(grant.node),
                    node_rank=rank,
                    nodes=nodes,
                    blacklist=blacklist,
                    prerun=job.prerun == "running",
                    tenant=job.tenant,
                    memory_mb=memory_mb,
                    cpus=cpus,
                    fence_after_s=settings.keep_disconnected_s
                    if job.spec.on_disconnect == "keep"
                    else None,
                    gpu_milli=job.spec.gpu_milli,
                    gpu_memory_mib=share_memory_limit(job, node),
                    shareable=job.spec.shareable,
                ),
            )
