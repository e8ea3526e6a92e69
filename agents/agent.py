"""The node agent: inventory, telemetry, heartbeats, and the jobs the brain grants.

It owns this node's GPUs and job processes and nothing else: it never decides where
a job runs. Commands arrive on the node's own JetStream subject, are de-duplicated by
id and fenced by the brain's epoch; what happens to jobs goes back as events.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from agents.confine import ConfineError, Confinement
from agents.fence import CHECK_EVERY_S, ContactClock
from agents.gpu import GpuBackend, SimulatedGpus
from agents.health import (
    FaultReport,
    NvmlHealthWatcher,
    check_injection,
    simulated_fault,
    watch_nvml,
)
from agents.joblogs import (
    DEFAULT_KEEP_DAYS,
    DEFAULT_MAX_MIB,
    DEFAULT_MAX_TOTAL_SHARE,
    LogKeeper,
    filesystem_bytes,
)
from agents.launcher import ExitStatus, JobProcess, Launcher, LaunchError, LaunchRequest
from agents.logserve import LogServer
from agents.mps import MpsError, ShareEnforcer, ShareUser, enforcer_for, share_env
from agents.orphans import Leftover, ProcessLedger, stop_leftovers
from bus.client import Bus, Consumer
from bus.ping import round_trip
from schemas import subjects
from schemas.base import decode, encode
from schemas.commands import (
    NODE_COMMAND,
    InjectFault,
    InjectFaultReply,
    Launch,
    NodeCommand,
    Regrant,
    Stop,
)
from schemas.errors import InvalidMessage
from schemas.events import CommandRejected, GpuFault, JobExited, JobStarted, LaunchFailed
from schemas.jobs import BLACKLIST_FILE_ENV
from schemas.telemetry import (
    MAX_SHARE_SAMPLES,
    GpuShares,
    Heartbeat,
    RunningJob,
    ShareSample,
    ShareUse,
    TelemetryBatch,
)

log = logging.getLogger(__name__)

SEEN_COMMANDS: Final = 10_000


def host_cpu_milli() -> int:
    """The CPUs this process may run on, in thousandths."""
    return 1000 * len(os.sched_getaffinity(0))


def host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


PROBES_IN_FLIGHT: Final = 4
# How often confined jobs' TLS certificates are checked for renewal (agents/confine.py).
CERT_CHECK_S: Final = 60.0
# How often running attempts' logs are held to `job_log_max_mib`.
LOG_CHECK_S: Final = 1.0

AgentEvent = JobStarted | JobExited | LaunchFailed | CommandRejected | GpuFault


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node: str
    data_dir: Path
    heartbeat_s: float = 1.0
    telemetry_s: float = 1.0
    stop_grace_s: float = 10.0
    hostname: str = field(default_factory=socket.gethostname)
    nats_url: str | None = None
    # This agent's own nkey seed file. It never reaches a job: jobs get the node's
    # *job* identity (`job_nkey_seed`, bus/auth.py), which may not act as the node.
    nkey_seed: str | None = None
    # The seed file a job's supervisor and SDK reach NATS with under --secure
    # (ALNAIR_NKEY in the job's environment).
    job_nkey_seed: str | None = None
    # Run each job as its tenant's user, in its own cgroup (agents/confine.py).
    confinement: Confinement | None = None
    # Self-fencing (agents/fence.py): an attempt runs on at most this long after the
    # last heartbeat known to have reached NATS, then is stopped with `fence_grace_s`
    # between SIGTERM and SIGKILL. None: never fence. A launch may set its own period
    # (a job submitted with on_disconnect "keep"). The brain's node timeout plus its
    # fence margin must exceed both together (docs/operations.md, "Partitions").
    fence_after_s: float | None = 5.0
    fence_grace_s: float = 3.0
    # What jobs may reserve here (the brain places by it): CPUs (thousandths of a
    # core) and memory (MiB). None: what this machine has.
    cpu_milli: int | None = None
    memory_mib: int | None = None
    # Job logs' disk use (agents/joblogs.py): what one attempt's log may hold (its
    # oldest part is dropped past it), how long a log outlives its attempt, and what
    # all of them may hold together, in MiB or else as a share of their filesystem
    # (ended attempts' logs are removed, least recently written first, past it). None:
    # unbounded, kept for good, no bound together.
    job_log_max_mib: int | None = DEFAULT_MAX_MIB
    job_log_keep_days: float | None = DEFAULT_KEEP_DAYS
    job_logs_max_total_mib: int | None = None
    job_logs_max_total_share: float | None = DEFAULT_MAX_TOTAL_SHARE


class Agent:
    def __init__(
        self,
        bus: Bus,
        config: AgentConfig,
        backend: GpuBackend,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.config = config
        self.backend = backend
        self.clock = clock
        self.instance = uuid.uuid4().hex[:12]
        self.epoch = 0
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._heartbeat_seq = 0
        self.launcher = Launcher(
            config.data_dir / "logs",
            self._on_exit,
            clock=clock,
            confinement=config.confinement,
            gpu_memory_mib=self._gpu_memory_mib,
        )
        # Attempts started here whose exit is not yet stored: what a crash leaves behind.
        self.ledger = ProcessLedger(config.data_dir / "processes")
        self._loops: list[asyncio.Task[None]] = []
        self._command_lock = asyncio.Lock()
        # Events leave in order through one sender that retries until JetStream has
        # stored each: a job's exit must reach the brain even across a NATS restart.
        self._outbox: asyncio.Queue[AgentEvent] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._closing = False
        self._commands: Consumer | None = None
        self._health: NvmlHealthWatcher | None = None
        self._inject_sub: Subscription | None = None
        self.contact = ContactClock(time.monotonic)
        # Each attempt's own fence period, from its launch (None: never fenced).
        self._fence_after: dict[tuple[str, int], float | None] = {}
        # PINGs in flight after heartbeats (a few at most: one sent on a connection that
        # then broke is never answered, and must not hold the others back).
        self._probes: set[asyncio.Task[None]] = set()
        self._cpu_milli = host_cpu_milli() if config.cpu_milli is None else config.cpu_milli
        self._memory_mib = host_memory_mib() if config.memory_mib is None else config.memory_mib
        # GPUs the share enforcer was asked to prepare and has not released.
        self._shared_gpus: set[int] = set()
        # What runs shared GPUs' jobs: MPS daemons on real GPUs, accounting alone on
        # simulated ones (agents/mps.py). Confined, their pipes live beside the jobs'
        # private directories, which every job's user may pass through to.
        mps_root = (
            config.data_dir / "mps"
            if config.confinement is None
            else config.confinement.runtime_root / "mps"
        )
        self.shares: ShareEnforcer = enforcer_for(backend.kind, config.node, mps_root)
        log_dir = config.data_dir / "logs"
        if config.job_logs_max_total_mib is not None:
            max_total: int | None = config.job_logs_max_total_mib << 20
        elif config.job_logs_max_total_share is not None:
            max_total = int(filesystem_bytes(log_dir) * config.job_logs_max_total_share)
        else:
            max_total = None
        self.logs = LogServer(
            config.node,
            log_dir,
            lambda job_id, attempt: bool(self.launcher.find(job_id, attempt)),
            keep_days=config.job_log_keep_days,
            max_total=max_total,
        )
        self.log_keeper = LogKeeper(
            config.node,
            log_dir,
            max_bytes=None if config.job_log_max_mib is None else config.job_log_max_mib << 20,
            keep_s=None if config.job_log_keep_days is None else config.job_log_keep_days * 86_400,
            max_total=max_total,
            clock=clock,
        )

    @property
    def node(self) -> str:
        return self.config.node

    async def start(self) -> None:
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        if self.config.confinement is not None:
            self.config.confinement.check()
        leftovers = self.ledger.leftovers()  # before this agent launches anything
        # The blacklist copies of attempts an earlier agent left behind (it crashed):
        # none runs on for this agent but to be stopped.
        for stale in (self.config.data_dir / "blacklists").glob("*.txt"):
            with contextlib.suppress(OSError):
                stale.unlink()
        # Hear commands before announcing ourselves: a brain may place a job on the
        # first heartbeat, and the consumer takes only commands stored after it exists.
        await self._open_commands()
        await self.heartbeat()  # announce ourselves before anything else
        if leftovers:
            self._loops.append(self.bus.spawn(self._stop_leftovers(leftovers), name="leftovers"))
        self._loops.append(
            self.bus.spawn(self._every(self.config.heartbeat_s, self.heartbeat), name="heartbeat")
        )
        self._loops.append(
            self.bus.spawn(
                self._every(self.config.telemetry_s, self.publish_telemetry), name="telemetry"
            )
        )
        if self.config.confinement is not None and self.config.confinement.job_tls is not None:
            every_s = min(CERT_CHECK_S, self.config.confinement.job_cert_ttl_s / 4)
            self._loops.append(
                self.bus.spawn(self._every(every_s, self._renew_certificates), name="certificates")
            )
        if self._commands is None:
            self._loops.append(self.bus.spawn(self._consume_commands(), name="commands"))
        self._loops.append(self.bus.spawn(self._fence_forever(), name="fence"))
        self._loops.append(
            self.bus.spawn(self._every(self.config.telemetry_s, self.watch_shares), name="shares")
        )
        self._loops.append(self.bus.spawn(self._every(LOG_CHECK_S, self.keep_logs), name="logs"))
        self._sender = self.bus.spawn(self._send_events(), name="events")
        self._inject_sub = await self.bus.nc.subscribe(
            subjects.node(self.node, "inject"), cb=self._on_inject
        )
        await self.logs.serve(self.bus)
        if self.backend.kind == "nvml":
            loop = asyncio.get_running_loop()

            def from_thread(report: FaultReport) -> None:
                loop.call_soon_threadsafe(self._fault_seen, report)

            self._health, why = watch_nvml(self.backend, from_thread)
            if why:
                log.warning("%s: GPU health watch: %s", self.node, why)

    async def stop(self, *, stop_jobs: bool = True) -> None:
        self._closing = True
        await self.logs.close()
        await self._stop_health()
        for task in self._loops:
            task.cancel()
        if self._loops:
            await asyncio.wait(self._loops, timeout=3.0)
        self._loops.clear()
        if self._commands is not None:
            await self._commands.stop()
            self._commands = None
        if stop_jobs:
            await self.launcher.stop_all(
                reason="agent shutting down", grace_s=self.config.stop_grace_s
            )
            await self.launcher.wait_idle()
            await self.shares.close()
            if self.config.confinement is not None:
                self.config.confinement.close()
        if self._sender is not None:
            # Let the exits just reported reach the brain, within reason.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), timeout=10.0)
            self._sender.cancel()
            await asyncio.wait({self._sender}, timeout=3.0)
            self._sender = None

    async def _stop_leftovers(self, leftovers: list[Leftover]) -> None:
        confinement = self.config.confinement
        await stop_leftovers(
            leftovers,
            grace_s=self.config.stop_grace_s,
            node=self.node,
            cgroups=confinement.cgroups if confinement is not None else None,
        )

    async def crash(self) -> list[int]:
        """Stop talking at once and forget the jobs, leaving them running (tests, chaos)."""
        self._closing = True
        await self.logs.close()
        await self._stop_health()
        if self._commands is not None:
            self._commands.stopping.set()
        for task in [*self._loops, self._sender, *self._probes]:
            if task is not None:
                task.cancel()
        self._loops.clear()
        self._sender = None
        return list(self.launcher.abandon())

    # -- GPU health --------------------------------------------------------------------

    async def _stop_health(self) -> None:
        if self._inject_sub is not None:
            with contextlib.suppress(Exception):
                await self._inject_sub.unsubscribe()
            self._inject_sub = None
        if self._health is not None:
            await asyncio.to_thread(self._health.stop)
            self._health = None

    def _fault_seen(self, report: FaultReport) -> None:
        """A GPU fault, from the NVML watcher or an injection: tell the brain."""
        log.warning("%s: GPU %d fault %s %s", self.node, report.gpu, report.fault, report.detail)
        self._outbox.put_nowait(
            GpuFault(
                event_id=uuid.uuid4().hex,
                node=self.node,
                ts=self.clock(),
                gpu=report.gpu,
                fault=report.fault,
                xid=report.xid,
                detail=report.detail[:500],
            )
        )

    async def _on_inject(self, msg: Msg) -> None:
        reply = self.inject(msg.data)
        if msg.reply:
            await msg.respond(encode(reply))

    def inject(self, data: bytes) -> InjectFaultReply:
        """`alnair inject`: a simulated GPU suffers a fault; real GPUs refuse."""
        try:
            request = decode(data, InjectFault)
        except InvalidMessage as error:
            return InjectFaultReply(ok=False, detail=f"invalid inject request: {error.reason}")
        refusal = check_injection(request, self.backend.kind, len(self.backend.inventory()))
        if refusal is not None or not isinstance(self.backend, SimulatedGpus):
            return InjectFaultReply(ok=False, detail=refusal or "not a simulated backend")
        self.backend.suffer(request.gpu, request.fault)
        report = simulated_fault(request)
        self._fault_seen(report)
        return InjectFaultReply(ok=True, detail=f"GPU {report.gpu}: {report.detail}")

    # -- periodic --------------------------------------------------------------------

    async def _every(self, interval_s: float, fn: Callable[[], object]) -> None:
        while not self._closing:
            await asyncio.sleep(interval_s)
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("%s: periodic task failed", self.node)

    async def keep_logs(self) -> None:
        """Bound the job logs' disk use: cap the running attempts' logs, and now and
        then remove those of attempts long ended (agents/joblogs.py)."""
        running = [job.log_path for job in self.launcher.running()]
        self.log_keeper.cap(running)
        if self.log_keeper.prune_due():
            empty = await asyncio.to_thread(self.log_keeper.prune, running)
            self.log_keeper.remove_empty(empty)

    async def _renew_certificates(self) -> None:
        """Renew the TLS client certificates of confined attempts past half their life
        (agents/confine.py)."""
        now = time.time()
        for job in self.launcher.running():
            if job.confined is None:
                continue
            try:
                if await asyncio.to_thread(job.confined.renew_certificate, now):
                    log.info("%s: renewed the TLS certificate of job %s", self.node, job.job_id)
            except ConfineError as error:
                log.warning("%s: job %s: %s", self.node, job.job_id, error.reason)

    async def heartbeat(self) -> None:
        if self._commands is None:
            return  # deaf to commands (no COMMANDS stream yet): not ready to be given jobs
        self._heartbeat_seq += 1
        running = tuple(
            RunningJob(job_id=p.job_id, attempt=p.attempt, pid=p.pid, gpus=p.gpus)
            for p in self.launcher.running()
        )
        message = Heartbeat(
            node=self.node,
            ts=self.clock(),
            seq=self._heartbeat_seq,
            instance=self.instance,
            hostname=self.config.hostname,
            backend=self.backend.kind,
            interval_s=self.config.heartbeat_s,
            gpus=self.backend.inventory(),
            running=running,
            epoch_seen=self.epoch,
            fence_s=(
                self.config.fence_after_s + self.config.fence_grace_s
                if self.config.fence_after_s is not None
                else None
            ),
            cpu_milli=self._cpu_milli,
            memory_mib=self._memory_mib,
            shares=self.share_report(),
        )
        sent_at = time.monotonic()
        await self.bus.publish(subjects.node(self.node, "heartbeat"), message)
        # While the server does not answer, the contact clock stands still at the last
        # heartbeat it confirmed.
        if len(self._probes) < PROBES_IN_FLIGHT:
            probe = self.bus.spawn(self._confirm(sent_at), name="contact")
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

    async def _confirm(self, sent_at: float) -> None:
        """The PONG after a heartbeat: that heartbeat reached the server."""
        timeout_s = max(self.config.heartbeat_s, 1.0) * 3
        if await round_trip(self.bus.nc, timeout_s):
            self.contact.confirmed(sent_at)

    # -- self-fencing ------------------------------------------------------------------

    def _fence_period(self, job_id: str, attempt: int) -> float | None:
        return self._fence_after.get((job_id, attempt), self.config.fence_after_s)

    async def _fence_forever(self) -> None:
        while not self._closing:
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                self._fence_due()
            except Exception:
                # The fence is what keeps a cut-off node from running a job twice: a
                # check that failed is logged and the next one runs.
                log.exception("%s: fence check failed", self.node)

    def _fence_due(self) -> None:
        """Stop every job whose fence period without contact has passed."""
        running = [(p.job_id, p.attempt) for p in self.launcher.running()]
        for job_id, attempt, silent_s in self.contact.due(running, self._fence_period):
            reason = f"fenced: no contact with NATS for {silent_s:.1f}s"
            log.warning("%s: job %s attempt %d %s", self.node, job_id, attempt, reason)
            for process in self.launcher.find(job_id, attempt):
                process.stop_reason = process.stop_reason or reason
            self.bus.spawn(self._stop_fenced(job_id, attempt, reason), name=f"fence:{job_id}")

    async def _stop_fenced(self, job_id: str, attempt: int, reason: str) -> None:
        await self.launcher.stop(job_id, attempt, reason=reason, grace_s=self.config.fence_grace_s)

    # -- shared GPUs -------------------------------------------------------------------

    def share_report(self) -> tuple[GpuShares, ...]:
        """Each shared GPU's jobs: their shares, memory limits and use."""
        by_gpu: dict[int, list[ShareUse]] = {}
        for p in self.launcher.shares():
            for gpu in p.gpus:
                by_gpu.setdefault(gpu, []).append(
                    ShareUse(
                        job_id=p.job_id,
                        attempt=p.attempt,
                        gpu_milli=p.gpu_milli or 1000,
                        memory_limit_mib=p.gpu_memory_mib,
                        memory_used_mib=p.gpu_memory_used_mib,
                    )
                )
        return tuple(
            GpuShares(
                index=gpu,
                jobs=tuple(jobs),
                enforcement=self.shares.enforcement,
                mps_problem=self.shares.problem(gpu),
            )
            for gpu, jobs in sorted(by_gpu.items())
        )

    def _gpu_memory_of(self, process: JobProcess, read: dict[int, dict[int, float]]) -> float:
        """GPU memory (MiB) the job's processes (`JobProcess.owns`) use on its GPUs."""
        return sum(self._gpu_memory_on(process, gpu, read) for gpu in process.gpus)

    def _gpu_memory_on(
        self, process: JobProcess, gpu: int, read: dict[int, dict[int, float]]
    ) -> float:
        """What the job's processes use of one GPU's memory (MiB); `read` keeps each
        GPU's processes as read (`GpuBackend.process_memory`) for the next job."""
        on_gpu = read.get(gpu)
        if on_gpu is None:
            on_gpu = read[gpu] = self.backend.process_memory(gpu)
        return sum(on_gpu[pid] for pid in process.owns(on_gpu))

    async def watch_shares(self) -> None:
        """Restart MPS daemons that died; stop a share over its GPU memory limit; let
        daemons of GPUs no share runs on any more go."""
        await self.shares.check()
        read: dict[int, dict[int, float]] = {}  # each GPU's processes, read once
        for process in self.launcher.shares():
            used = self._gpu_memory_of(process, read)
            process.gpu_memory_used_mib = used
            limit = process.gpu_memory_mib
            if limit is None or used <= limit or process.stop_reason is not None:
                continue
            reason = f"GPU memory {used:.0f} MiB is over its limit of {limit} MiB"
            log.warning("%s: job %s: %s; stopping it", self.node, process.job_id, reason)
            process.gpu_over = (used, limit)
            process.stop_reason = reason
            self.bus.spawn(self._stop_over(process, reason), name=f"gpu-memory:{process.job_id}")
        async with self._command_lock:
            await self._release_unshared(self._shared_gpus)

    async def _release_unshared(self, gpus: set[int]) -> None:
        """Let the MPS daemons of these GPUs go where no share runs any more."""
        shared = {gpu for p in self.launcher.shares() for gpu in p.gpus}
        for gpu in (self._shared_gpus & gpus) - shared:
            await self.shares.release(gpu)
            self._shared_gpus.discard(gpu)

    async def _stop_over(self, process: JobProcess, reason: str) -> None:
        await self.launcher.stop(
            process.job_id, process.attempt, reason=reason, grace_s=self.config.stop_grace_s
        )

    async def _share_env(self, command: Launch) -> tuple[dict[str, str], str | None]:
        """A share's environment (MPS limits; the daemon's pipe), and how it names its
        GPU. Raises MpsError when the GPU's daemon cannot run, serves another user's
        shares or is out of the share's user's reach; ConfineError when the tenant has
        no user here."""
        assert command.gpu_milli is not None
        gpu = command.gpus[0]
        uuid_ = next((g.uuid for g in self.backend.inventory() if g.index == gpu), str(gpu))
        env = share_env(command.gpu_milli, command.gpu_memory_mib)
        user = None
        if self.config.confinement is not None:
            job_user = self.config.confinement.user_for(command.tenant)
            user = ShareUser(job_user.name, job_user.uid, job_user.gid)
        alone = not any(gpu in p.gpus for p in self.launcher.shares())
        env.update(await self.shares.prepare(gpu, uuid_, user, alone=alone))
        self._shared_gpus.add(gpu)
        return env, env.pop("CUDA_VISIBLE_DEVICES", None)

    async def publish_telemetry(self) -> None:
        self.backend.set_busy(self.launcher.busy_gpus())
        samples = self.backend.sample()
        # Each share's own use, read with the samples: the brain takes it off the GPU's
        # for the job beside it (brain/profiles.py), so it must be of the same instant.
        read: dict[int, dict[int, float]] = {}  # each GPU's processes, read once
        shares = [
            ShareSample(
                index=gpu,
                job_id=process.job_id,
                memory_used_mib=self._gpu_memory_on(process, gpu, read),
            )
            for process in self.launcher.shares()
            for gpu in process.gpus
        ]
        batch = TelemetryBatch(
            node=self.node,
            ts=self.clock(),
            samples=samples,
            # More than a batch carries: none, and the brain reads the heartbeat's.
            shares=tuple(shares) if len(shares) <= MAX_SHARE_SAMPLES else None,
        )
        await self.bus.publish(subjects.node(self.node, "telemetry"), batch)

    # -- commands --------------------------------------------------------------------

    async def _consume_commands(self) -> None:
        # `start` tried once. The brain creates the streams; until it has, try again.
        while not self._closing:
            await asyncio.sleep(1.0)
            if await self._open_commands():
                return

    async def _open_commands(self) -> bool:
        try:
            self._commands = await self.bus.consume(
                subjects.STREAM_COMMANDS,
                f"agent-{self.node}",
                subjects.node(self.node, "cmd"),
                NODE_COMMAND,
                self._on_command,
                deliver_new=True,
            )
        except (
            # No COMMANDS stream yet (404), or a JetStream cluster still settling: one
            # electing a leader answers late, or refuses (503) or cannot handle it (500).
            nats.js.errors.APIError,
            TimeoutError,
        ) as error:
            # Said each time: a refusal that does not pass (a 400) must not go unseen.
            if isinstance(error, nats.js.errors.NotFoundError):
                why = f"no {subjects.STREAM_COMMANDS} stream yet (a leading brain makes it)"
            else:
                why = repr(error)
            log.info("%s: waiting to hear commands: %s", self.node, why)
            return False
        return True

    async def _on_command(self, command: NodeCommand, msg: Msg) -> None:
        async with self._command_lock:
            await self.handle_command(command)

    async def handle_command(self, command: NodeCommand) -> None:
        if command.command_id in self._seen:
            return
        self._remember(command.command_id)
        if command.epoch < self.epoch:
            await self._reject(command, f"stale epoch {command.epoch} < {self.epoch}")
            return
        self.epoch = command.epoch
        if isinstance(command, Launch):
            await self._launch(command)
        elif isinstance(command, Stop):
            # Mark the processes as stopping now, not when the stop task first runs: a
            # launch right behind this stop (a preemption) may then wait for their GPUs.
            for process in self.launcher.find(command.job_id, command.attempt):
                process.stop_reason = process.stop_reason or command.reason
            # Not awaited inside the command loop: a stop waits out its grace period,
            # and other commands must not queue behind it.
            self.bus.spawn(self._stop(command), name=f"stop:{command.job_id}")
        elif isinstance(command, Regrant):
            if self.launcher.regrant(command.job_id, command.attempt, command.gpus):
                self.backend.set_busy(self.launcher.busy_gpus())
            else:
                log.info(
                    "%s: regrant of job %s attempt %d ignored: it does not run here",
                    self.node,
                    command.job_id,
                    command.attempt,
                )

    def _remember(self, command_id: str) -> None:
        self._seen[command_id] = None
        while len(self._seen) > SEEN_COMMANDS:
            self._seen.popitem(last=False)

    async def _reject(self, command: NodeCommand, reason: str) -> None:
        log.warning("%s: rejected command %s: %s", self.node, command.command_id, reason)
        await self._event(
            CommandRejected(
                event_id=uuid.uuid4().hex,
                node=self.node,
                ts=self.clock(),
                command_id=command.command_id,
                job_id=getattr(command, "job_id", None),
                reason=reason,
            )
        )

    async def _launch(self, command: Launch) -> None:
        late = self.clock() - command.expires_at
        if late > 0:
            # By this node's clock: the brain sets it from the node's heartbeats.
            await self._reject(
                command, f"launch expired {late:.1f} s before it reached node {self.node}"
            )
            return
        env = dict(command.env)
        env.update(
            ALNAIR_JOB_ID=command.job_id,
            ALNAIR_ATTEMPT=str(command.attempt),
            ALNAIR_NODE=self.node,
            ALNAIR_NODE_RANK=str(command.node_rank),
            ALNAIR_NUM_NODES=str(max(1, len(command.nodes))),
            ALNAIR_NODES=",".join(command.nodes or (self.node,)),
        )
        if self.config.nats_url:
            env["ALNAIR_NATS"] = self.config.nats_url
        if self.config.job_nkey_seed:
            env["ALNAIR_NKEY"] = self.config.job_nkey_seed
        try:
            env[BLACKLIST_FILE_ENV] = str(self._write_blacklist(command))
        except OSError as error:  # a full disk, most likely: another node may run it
            await self._launch_failed(command, self._cannot("prepare", error), retryable=True)
            return
        if command.prerun:
            env["ALNAIR_PRERUN"] = "1"
        env.update(self.backend.job_env(command.gpus))
        visible = None
        if command.gpu_milli is not None:
            try:
                share, visible = await self._share_env(command)
            except MpsError as error:
                await self._launch_failed(command, str(error), retryable=True)
                return
            except ConfineError as error:
                await self._launch_failed(command, error.reason, retryable=error.retryable)
                return
            env.update(share)
        self._fence_after[(command.job_id, command.attempt)] = (
            command.fence_after_s
            if command.fence_after_s is not None
            else self.config.fence_after_s
        )
        request = LaunchRequest(
            job_id=command.job_id,
            attempt=command.attempt,
            gpus=command.gpus,
            command=command.command,
            env=env,
            cwd=command.cwd,
            tenant=command.tenant,
            memory_mb=command.memory_mb,
            cpus=command.cpus,
            gpu_milli=command.gpu_milli,
            gpu_memory_mib=command.gpu_memory_mib,
            visible_devices=visible,
            shareable=command.shareable,
        )
        # Whole GPUs whose shares were stopped for this job (preempted to make room):
        # their MPS daemon goes before it starts, not at the next watch, or its server
        # would hold the GPU beside the job (memory, and in EXCLUSIVE_PROCESS mode the
        # job's own CUDA context).
        before_start = (
            functools.partial(self._release_unshared, set(command.gpus))
            if command.gpu_milli is None
            else None
        )
        try:
            job = await self.launcher.launch(request, before_start=before_start)
        except (LaunchError, OSError) as error:
            self._fence_after.pop((command.job_id, command.attempt), None)
            if isinstance(error, LaunchError):
                await self._launch_failed(command, error.reason, retryable=error.retryable)
            else:  # its log cannot be made (a full disk): another node may run it
                await self._launch_failed(command, self._cannot("start", error), retryable=True)
            return
        try:
            self.ledger.record(job.job_id, job.attempt, job.pid, job.launch_id)
        except OSError as error:
            # Unrecorded, it would run on unseen past a crash of this agent, beside its
            # retry elsewhere: it does not run. The launch's failure goes out first, so
            # its exit is of an attempt the brain has moved past (not a stop by its
            # node, which would run it here again).
            reason = self._cannot("record", error)
            log.error("%s: job %s attempt %d: %s", self.node, job.job_id, job.attempt, reason)
            await self._launch_failed(command, reason, retryable=True)
            await self.launcher.stop(
                job.job_id, job.attempt, reason=reason, grace_s=self.config.fence_grace_s
            )
            return
        log.info(
            "%s: started job %s attempt %d pid %d", self.node, job.job_id, job.attempt, job.pid
        )
        await self._event(
            JobStarted(
                event_id=f"{self.node}-{job.job_id}-{job.attempt}-started",
                node=self.node,
                ts=job.started_at,
                job_id=job.job_id,
                attempt=job.attempt,
                pid=job.pid,
                gpus=job.gpus,
                log_path=str(job.log_path),
                limits_enforced=self.config.confinement is not None,
            )
        )
        self.backend.set_busy(self.launcher.busy_gpus())

    def _blacklist_file(self, job_id: str, attempt: int) -> Path:
        """Where an attempt's copy of the cluster's input blacklist is, while it runs."""
        return self.config.data_dir / "blacklists" / f"{job_id}-{attempt}.txt"

    def _write_blacklist(self, command: Launch) -> Path:
        """The cluster's input blacklist for this attempt, one URI per line."""
        path = self._blacklist_file(command.job_id, command.attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{uri}\n" for uri in command.blacklist))
        return path

    def _cannot(self, what: str, error: OSError) -> str:
        """A launch this node's files failed: `cannot start it on node n1: No space...`."""
        where = f" ({error.filename})" if error.filename else ""
        return f"cannot {what} it on node {self.node}: {error.strerror or error}{where}"

    async def _stop(self, command: Stop) -> None:
        await self.launcher.stop(
            command.job_id, command.attempt, reason=command.reason, grace_s=command.grace_s
        )

    def _gpu_memory_mib(self, index: int) -> int | None:
        """The memory of this node's GPU `index` (None: no such GPU)."""
        return next((g.memory_mib for g in self.backend.inventory() if g.index == index), None)

    async def _on_exit(self, job: JobProcess, status: ExitStatus) -> None:
        how = f"code {status.exit_code}" if status.signal is None else f"signal {status.signal}"
        log.info("%s: job %s attempt %d exited with %s", self.node, job.job_id, job.attempt, how)
        await self._event(
            JobExited(
                event_id=f"{self.node}-{job.job_id}-{job.attempt}-exited",
                node=self.node,
                ts=self.clock(),
                job_id=job.job_id,
                attempt=job.attempt,
                exit_code=status.exit_code,
                signal=status.signal,
                # Stopped for its own GPU memory: its fault, not the node's.
                stopped=job.stop_reason is not None and job.gpu_over is None,
                runtime_s=status.runtime_s,
                log_tail=status.log_tail,
                oom_limit_mb=status.oom_limit_mb,
                gpu_memory_limit_mib=job.gpu_over[1] if job.gpu_over is not None else None,
                gpu_memory_used_mib=job.gpu_over[0] if job.gpu_over is not None else None,
            )
        )
        self._fence_after.pop((job.job_id, job.attempt), None)
        self.contact.forget(job.job_id, job.attempt)
        self.backend.set_busy(self.launcher.busy_gpus())
        with contextlib.suppress(OSError):
            self._blacklist_file(job.job_id, job.attempt).unlink(missing_ok=True)

    async def _launch_failed(self, command: Launch, reason: str, *, retryable: bool) -> None:
        with contextlib.suppress(OSError):
            self._blacklist_file(command.job_id, command.attempt).unlink(missing_ok=True)
        await self._event(
            LaunchFailed(
                event_id=uuid.uuid4().hex,
                node=self.node,
                ts=self.clock(),
                job_id=command.job_id,
                attempt=command.attempt,
                reason=reason,
                retryable=retryable,
            )
        )

    async def _event(self, event: AgentEvent) -> None:
        await self._outbox.put(event)

    async def _send_events(self) -> None:
        # Until cancelled: `stop` waits for the outbox to empty first. Ending on an
        # empty outbox once closing lost the exits of jobs still stopping.
        while True:
            event = await self._outbox.get()
            subject = subjects.node(self.node, "event")
            while True:
                try:
                    await self.bus.publish_durable(subject, event, msg_id=event.event_id)
                except Exception as error:  # whatever it is, the sender goes on
                    # Not stored (cut off, or refused by the stream): kept, and tried
                    # again, with the events behind it waiting in order.
                    log.warning(
                        "%s: event %s not stored yet (%s); retrying",
                        self.node,
                        event.event_id,
                        error,
                    )
                    await asyncio.sleep(1.0)
                    continue
                if isinstance(event, JobExited):
                    self._forget(event.job_id, event.attempt)
                break
            self._outbox.task_done()

    def _forget(self, job_id: str, attempt: int) -> None:
        """Strike a stored exit's attempt from the process ledger. One that cannot be
        struck (the disk gone bad) is stopped again by the next agent, and is gone."""
        try:
            self.ledger.forget(job_id, attempt)
        except OSError as error:
            log.warning(
                "%s: job %s attempt %d ended, but stays in the process ledger: %s",
                self.node,
                job_id,
                attempt,
                error,
            )
