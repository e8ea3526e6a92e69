"""The in-job supervisor of an elastic Horovod job.

It owns one job's `horovodrun --gloo` process in elastic mode, the host list that
horovodrun's discovery script prints, and the job's command subject
(`alnair.job.<job>.cmd`). It obeys Resize commands (fenced by epoch, de-duplicated by
id), forwards the workers' progress reports to `alnair.job.<job>.progress`, and
reports each resize's outcome and duration as a `ResizeCompleted` node event.

It never kills a worker to shrink: it removes slots from the host list and waits for
Horovod to retire the workers on them (they exit with 134, "removed from elastic job");
only then does it report their GPUs released. It imports neither torch nor horovod;
only its child processes do.

Each worker may claim one of the job's GPUs (workloads/devices.py): the supervisor
keeps the job's GPU list in `ALNAIR_GPU_DIR`, adds a grow's GPUs to it before the new
workers start, and after a resize reports the GPUs its workers hold.

Workers on other nodes: horovodrun runs through `workloads.hvdrun`, which starts them
through each node's worker host (`workloads/worker_host.py`, the job's process there,
which that node's agent launched) instead of ssh; their progress and exits come back on
`alnair.job.<job>.workers`. A job starts with slots on other nodes (`--remote
NODE=SLOTS`), or a Resize's placement gives it some: the supervisor tells the node's
worker host the GPUs its new workers claim (`devices`, request/reply on
`alnair.job.<job>.exec`, waiting for a worker host the brain has just launched), then
adds the slots. A shrink removes a node's slots like local ones; the worker host of a
node left with none idles there until a grow comes back. The supervisor's own node
always keeps a slot: Horovod carries the state over from a host of the old world.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.client import Bus
from schemas import subjects
from schemas.commands import JOB_COMMAND, JobCommand, Resize
from schemas.errors import BusError
from schemas.events import ResizeCompleted
from schemas.jobs import NodeGpus
from schemas.progress import Progress, WorkerProgress
from schemas.workers import ExecRequest, WorkerRelay
from workloads import devices, remote_exec
from workloads.progress import WorkerReport, worker_env
from workloads.sdk import job_connect_options

log = logging.getLogger(__name__)

SEEN_COMMANDS: Final = 1000
# A worker host's answer to one `devices` request; it is asked again until the resize's
# deadline (one the brain has just launched may not listen yet).
DEVICES_ASK_S: Final = 2.0
# Exit code of a worker Horovod retired from the job: a shrink, not a failure.
REMOVED_WORKER_EXIT_CODE: Final = 134
# A worker's exception as horovodrun relays it: "[1]<stderr>:ValueError: bad lr".
WORKER_ERROR: Final = re.compile(
    r"^\[(?P<rank>\d+)\]<std(?:err|out)>:\s*(?P<error>[A-Za-z_][\w.]*(?:Error|Exception)\b.*)$"
)


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    job_id: str
    command: tuple[str, ...]
    min_np: int
    max_np: int
    np: int
    work_dir: Path
    nats_url: str | None = None
    node: str = "local"
    # The job's attempt (ALNAIR_ATTEMPT), stamped on progress reports.
    attempt: int | None = None
    # Names under which horovodrun sees this one node. Horovod blacklists a host whose
    # worker failed, and stops the job when every host is blacklisted; spreading the
    # slots over two local names lets the job survive a killed worker on one host.
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
    network_interface: str = "lo"
    # Slots on other nodes, whose workers start through those nodes' worker hosts.
    remote: tuple[tuple[str, int], ...] = ()
    progress_interval_s: float = 1.0
    resize_timeout_s: float = 120.0
    # Horovod blacklists a host whose worker failed; on one host that would strand the
    # job, so the host comes back after this many seconds (lower, upper).
    blacklist_cooldown_s: tuple[int, int] = (1, 2)
    stop_grace_s: float = 10.0
    # The job's GPUs at launch (the agent's CUDA_VISIBLE_DEVICES); empty: no device
    # map, workers see whatever the environment says.
    gpus: tuple[int, ...] = ()
    # `work_dir` was made for this supervisor (no `--work-dir`): removed when it ends.
    own_work_dir: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_np <= self.np <= self.max_np:
            raise ValueError(
                f"need 1 <= min_np ({self.min_np}) <= np ({self.np}) <= max_np ({self.max_np})"
            )
        if not self.command:
            raise ValueError("no training command given")
        if self.np - sum(slots for _, slots in self.remote) < 1:
            raise ValueError(f"np ({self.np}) leaves no slot on this node beside {self.remote}")


# A worker: its node (None: this one) and its pid there.
_Key = tuple[str | None, int]


@dataclass(slots=True)
class _Seen:
    report: WorkerReport
    received: float  # supervisor's monotonic clock: worker clocks are not trusted


class _Superseded(Exception):
    """The resize under way gives way to one off more lost nodes."""


@dataclass(frozen=True, slots=True)
class ResizeOutcome:
    from_size: int
    to_size: int
    ok: bool
    duration_s: float
    released: int
    reason: str = ""
    # The GPUs the workers hold after it, per node, when every worker claimed one.
    placement: tuple[NodeGpus, ...] = ()

    @classmethod
    def refused(cls, size: int, reason: str) -> ResizeOutcome:
        """Not tried: the job stays at `size`."""
        return cls(size, size, False, 0.0, 0, reason)


def host_slots(hosts: Sequence[str], slots: int) -> list[tuple[str, int]]:
    """Deal `slots` round-robin over `hosts`, the first host always non-empty.

    The first host keeps at least one slot in every update: Horovod needs one host of
    the old world in the new one to carry the state over.
    """
    counts = [0] * len(hosts)
    for slot in range(slots):
        counts[slot % len(hosts)] += 1
    return [(host, count) for host, count in zip(hosts, counts, strict=True) if count]


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie counts as exited: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    # Field 3, after the parenthesised command name (which may hold spaces).
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


class _ReportProtocol(asyncio.DatagramProtocol):
    def __init__(self, on_report: Callable[[WorkerReport], None]) -> None:
        self._on_report = on_report

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        try:
            report = WorkerReport.decode(data)
        except (ValueError, KeyError, TypeError) as error:
            log.warning("ignoring a malformed progress report: %s", error)
            return
        self._on_report(report)


@dataclass
class Supervisor:
    config: SupervisorConfig
    bus: Bus | None = None
    slots: int = 0
    epoch: int = 0
    outcomes: list[ResizeOutcome] = field(default_factory=list)
    # Slots on other nodes now (a resize's placement changes them).
    remote: dict[str, int] = field(default_factory=dict)
    _seen_commands: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _workers: dict[_Key, _Seen] = field(default_factory=dict)
    _resize_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _process: asyncio.subprocess.Process | None = None
    _relay: asyncio.Task[None] | None = None
    # The first exception a worker printed, "worker N: ...": the job's failure reason.
    first_error: str | None = None
    _consumer: Subscription | None = None
    _transport: asyncio.DatagramTransport | None = None
    _last_published: float = 0.0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Workers on other nodes that have exited, as their worker hosts reported.
    _remote_gone: set[tuple[str, int]] = field(default_factory=set)
    # Nodes the brain found lost: their workers count as gone (none will say so).
    _lost: set[str] = field(default_factory=set)
    # Resizes off lost nodes received so far: a resize commanded before the latest
    # gives up (it may wait for workers on a node now lost, who will never step at its
    # size), and that shed runs instead.
    _sheds: int = 0
    _workers_sub: Subscription | None = None

    # -- the host list horovodrun discovers -----------------------------------------

    @property
    def hosts_path(self) -> Path:
        return self.config.work_dir / "hosts"

    @property
    def discovery_script(self) -> Path:
        return self.config.work_dir / "discover-hosts.sh"

    def write_hosts(self, local: int, remote: dict[str, int]) -> None:
        """Replace the host list atomically: discovery must never read half a file."""
        temporary = self.hosts_path.with_suffix(".tmp")
        listed = [*host_slots(self.config.hosts, local), *((n, k) for n, k in remote.items() if k)]
        temporary.write_text("".join(f"{h}:{n}\n" for h, n in listed))
        os.replace(temporary, self.hosts_path)
        self.remote = {n: k for n, k in remote.items() if k}
        self.slots = local + sum(self.remote.values())

    @property
    def lost_path(self) -> Path:
        return self.config.work_dir / "lost-nodes"

    def write_lost(self) -> None:
        """The nodes found lost, for `remote_exec` (its `LOST_NODES_ENV`) to give their
        workers up; after the host list, so that Horovod no longer counts them."""
        temporary = self.lost_path.with_suffix(".tmp")
        temporary.write_text("".join(f"{node}\n" for node in sorted(self._lost)))
        os.replace(temporary, self.lost_path)

    # -- the job's GPUs, one per worker (workloads/devices.py) -------------------------

    @property
    def gpu_dir(self) -> Path:
        return self.config.work_dir / "gpus"

    @property
    def devices(self) -> tuple[int, ...]:
        """The job's GPUs as its workers see them now; () without a device map."""
        if not self.config.gpus:
            return ()
        return devices.read_devices(self.gpu_dir)

    def held_gpus(self) -> tuple[int, ...]:
        return devices.claimed(self.gpu_dir, self.devices) if self.config.gpus else ()

    def _prepare(self) -> None:
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        if self.config.gpus:
            devices.write_devices(self.gpu_dir, self.config.gpus)
        remote = dict(self.config.remote)
        self.write_hosts(self.config.np - sum(remote.values()), remote)
        self.discovery_script.write_text(f"#!/bin/sh\nexec cat '{self.hosts_path}'\n")
        self.discovery_script.chmod(0o755)

    def horovodrun_command(self) -> list[str]:
        # horovodrun, starting the workers of other nodes through their worker hosts:
        # a grow may add a node at any time.
        low, high = self.config.blacklist_cooldown_s
        return [
            sys.executable,
            "-m",
            "workloads.hvdrun",
            "--gloo",
            "-np",
            str(self.config.np),
            "--min-np",
            str(self.config.min_np),
            "--max-np",
            str(self.config.max_np),
            "--host-discovery-script",
            str(self.discovery_script),
            # On one host the driver otherwise waits for a second host's interface.
            "--network-interface",
            self.config.network_interface,
            "--blacklist-cooldown-range",
            str(low),
            str(high),
            *self.config.command,
        ]

    # -- worker reports --------------------------------------------------------------

    def _on_report(self, report: WorkerReport, node: str | None = None) -> None:
        now = time.monotonic()
        self._workers[(node, report.pid)] = _Seen(report, now)
        self._changed.set()
        if report.rank == 0 and now - self._last_published >= self.config.progress_interval_s:
            self._last_published = now
            self._spawn(self._publish_progress(report))

    def pids_at(self, world_size: int, *, since: float = 0.0) -> set[_Key]:
        """Workers whose latest report (received after `since`) was at `world_size`."""
        return {
            key
            for key, seen in self._workers.items()
            if seen.report.world_size == world_size and seen.received >= since
        }

    def progress(self, report: WorkerReport) -> Progress:
        # A retired worker's last report would otherwise count at its old size for ever
        # (and again once the job returns to that size).
        for key in [k for k in self._workers if k[1] != report.pid and self._gone(k)]:
            del self._workers[key]
        current = sorted(
            (s.report for s in self._workers.values() if s.report.world_size == report.world_size),
            key=lambda r: r.rank,
        )
        return Progress(
            job_id=self.config.job_id,
            ts=time.time(),
            step=report.step,
            world_size=report.world_size,
            samples_per_s=report.samples_per_s,
            loss=report.loss,
            slots=self.slots,
            total_steps=report.total_steps,
            attempt=self.config.attempt,
            batch_size=None if report.batch_size is None else report.batch_size * report.world_size,
            goodput=report.goodput,
            workers=tuple(
                WorkerProgress(
                    rank=r.rank,
                    pid=r.pid,
                    step=r.step,
                    world_size=r.world_size,
                    param_digest=r.param_digest,
                    gpu=r.gpu,
                    batch_size=r.batch_size,
                )
                for r in current
            ),
        )

    async def _publish_progress(self, report: WorkerReport) -> None:
        if self.bus is None:
            return
        with contextlib.suppress(Exception):  # progress may be lost; the next replaces it
            await self.bus.publish(
                subjects.job(self.config.job_id, "progress"), self.progress(report)
            )

    # -- resize ----------------------------------------------------------------------

    def _converged(self, target: int, since: float, old: set[_Key]) -> bool:
        current = self.pids_at(target, since=since)
        if len(current) < target:
            return False
        # Shrink: the GPUs are free only once the removed workers have gone.
        return all(self._gone(key) for key in old - current)

    def _gone(self, key: _Key) -> bool:
        node, pid = key
        if node is not None:
            return node in self._lost or (node, pid) in self._remote_gone
        return process_gone(pid)

    async def _on_relay(self, relay: WorkerRelay, msg: Msg) -> None:
        """A worker on another node: its progress, or its exit."""
        if relay.gone_pid is not None:
            self._remote_gone.add((relay.node, relay.gone_pid))
            self._changed.set()
        if relay.report:
            try:
                report = WorkerReport.decode(relay.report.encode())
            except (ValueError, KeyError, TypeError) as error:
                log.warning("ignoring a malformed report from %s: %s", relay.node, error)
                return
            self._on_report(report, relay.node)

    async def resize(
        self,
        target: int,
        placement: Sequence[NodeGpus] = (),
        lost: Collection[str] = (),
        *,
        sheds_seen: int | None = None,
    ) -> ResizeOutcome:
        """Run at `target` workers; return when every worker steps at that size.

        `placement` is the brain's list of the job's GPUs per node at the new size: the
        slots of each node, and the GPUs a grow's workers claim there. Without it the
        other nodes keep their slots. `lost`: nodes the brain found lost, whose workers
        are not waited for (they cannot say they retired). `sheds_seen`: how many sheds
        of lost nodes had been received when this resize was commanded (default: when
        it starts); one received later supersedes it. The outcome names the GPUs held
        afterwards when every worker holds one (after a shrink, those of the workers
        Horovod kept)."""
        async with self._resize_lock:
            seen = self._sheds if sheds_seen is None else sheds_seen
            started = time.monotonic()
            from_size = self.slots
            low, high = self.config.min_np, self.config.max_np
            if not low <= target <= high:
                why = f"size {target} is outside {low}..{high}"
                return self._record(ResizeOutcome.refused(from_size, why))
            mine = sorted(set(lost) & {self.config.node, *(p.node for p in placement)})
            if mine:
                why = f"lost node(s) {mine} cannot keep workers (placement {placement})"
                return self._record(ResizeOutcome.refused(from_size, why))
            if lost:
                log.warning("nodes %s were lost: going on without their workers", sorted(lost))
                self._lost.update(lost)
            parts = {part.node: part.gpus for part in placement}
            gpus = parts.pop(self.config.node, ())
            remote = {n: len(g) for n, g in parts.items()} if placement else dict(self.remote)
            local = target - sum(remote.values())
            if local < 1:
                why = (
                    f"size {target} leaves no worker on node {self.config.node}, where the "
                    f"supervisor runs (placement {placement})"
                )
                return self._record(ResizeOutcome.refused(from_size, why))
            grown = [n for n, k in remote.items() if k > self.remote.get(n, 0)]
            shrunk = {n for n, k in self.remote.items() if remote.get(n, 0) < k}
            old = self.pids_at(from_size)
            before = self.devices
            if before and gpus:
                # Added GPUs go after the held ones: survivors keep theirs.
                devices.write_devices(
                    self.gpu_dir, (*before, *(g for g in gpus if g not in before))
                )
            deadline = started + self.config.resize_timeout_s
            for node in grown:
                # The node's new workers claim its added GPUs; a node new to the job
                # has a worker host the brain has just launched.
                answer = await self._ask_devices(node, parts[node], deadline)
                if isinstance(answer, str):
                    if before and gpus:
                        # Refused without moving: this node's workers keep the GPUs they
                        # had, and none claims one the brain is about to give back.
                        devices.write_devices(self.gpu_dir, before)
                    return self._record(ResizeOutcome.refused(from_size, answer))
            self.write_hosts(local, remote)
            if lost:
                self.write_lost()
            try:
                await self._wait_for(lambda: self._converged(target, started, old), seen)
            except _Superseded:
                why = "superseded by a resize off more lost nodes"
                return self._record(
                    ResizeOutcome(from_size, target, False, time.monotonic() - started, 0, why)
                )
            except TimeoutError:
                return self._record(
                    ResizeOutcome(
                        from_size,
                        target,
                        False,
                        time.monotonic() - started,
                        0,
                        f"workers not stepping at size {target} "
                        f"within {self.config.resize_timeout_s}s",
                    )
                )
            duration = time.monotonic() - started
            held = await self._held_after(local, gpus or before, before, shrunk)
            return self._record(
                ResizeOutcome(
                    from_size, target, True, duration, max(0, from_size - target), placement=held
                )
            )

    async def _held_after(
        self, local: int, wanted: Sequence[int], before: Sequence[int], shrunk: Collection[str]
    ) -> tuple[NodeGpus, ...]:
        """The GPUs the workers hold after a resize, per node; a node that shrank has its
        list set to them (its released GPUs are not claimed again). () unless every
        worker of every node holds one."""
        placement: list[NodeGpus] = []
        if before:
            mine = self.held_gpus()
            known = len(mine) == local
            devices.write_devices(self.gpu_dir, mine if known else wanted)
            if known:
                placement.append(NodeGpus(node=self.config.node, gpus=mine))
        deadline = time.monotonic() + DEVICES_ASK_S
        for node, slots in self.remote.items():
            answer = await self._ask_devices(node, (), deadline)
            if isinstance(answer, tuple) and len(answer) == slots:
                placement.append(NodeGpus(node=node, gpus=answer))
                if node in shrunk:
                    await self._ask_devices(node, answer, deadline)
        return tuple(placement) if len(placement) == 1 + len(self.remote) else ()

    async def _ask_devices(
        self, node: str, gpus: Sequence[int], deadline: float
    ) -> tuple[int, ...] | str:
        """Set the GPUs of `node`'s worker host (none: only ask), until `deadline`;
        the GPUs its workers hold, or why not."""
        if self.bus is None:
            return f"no bus to reach node {node}'s worker host"
        request = ExecRequest(op="devices", exec_id=uuid.uuid4().hex, node=node, gpus=tuple(gpus))
        while True:
            try:
                state = await remote_exec.ask(
                    self.bus, self.config.job_id, request, timeout_s=DEVICES_ASK_S
                )
            except BusError as error:
                if time.monotonic() + DEVICES_ASK_S > deadline:
                    return f"no answer from the worker host on node {node}: {error}"
                await asyncio.sleep(0.5)  # nobody listens yet: its launch is on its way
                continue
            if state.error:
                return f"the worker host on node {node}: {state.error}"
            return state.held

    def _record(self, outcome: ResizeOutcome) -> ResizeOutcome:
        self.outcomes.append(outcome)
        log.info("resize %s", outcome)
        return outcome

    async def _wait_for(self, condition: Callable[[], bool], sheds_seen: int) -> None:
        deadline = time.monotonic() + self.config.resize_timeout_s
        while not condition():
            if self._sheds > sheds_seen:
                raise _Superseded
            if self._process is not None and self._process.returncode is not None:
                raise TimeoutError("horovodrun exited during the resize")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._changed.clear()
            # Reports wake us; the timeout re-checks exits of removed workers.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(0.1, remaining))

    # -- commands --------------------------------------------------------------------

    async def _on_command(self, command: JobCommand, msg: Msg) -> None:
        if command.command_id in self._seen_commands:
            return
        self._seen_commands[command.command_id] = None
        while len(self._seen_commands) > SEEN_COMMANDS:
            self._seen_commands.popitem(last=False)
        if command.epoch < self.epoch:
            await self._report(
                command,
                ResizeOutcome.refused(self.slots, f"stale epoch {command.epoch} < {self.epoch}"),
            )
            return
        self.epoch = command.epoch
        if isinstance(command, Resize):
            self._sheds += 1 if command.lost else 0
            # Not awaited here: a resize takes seconds and the consumer must keep
            # acknowledging; the resize lock keeps them in arrival order.
            self._spawn(self._apply(command, self._sheds))

    async def _apply(self, command: Resize, sheds_seen: int) -> None:
        outcome = await self.resize(
            command.world_size, command.placement, command.lost, sheds_seen=sheds_seen
        )
        await self._report(command, outcome)

    async def _report(self, command: JobCommand, outcome: ResizeOutcome) -> None:
        if self.bus is None:
            return
        event = ResizeCompleted(
            event_id=uuid.uuid4().hex,
            node=self.config.node,
            ts=time.time(),
            job_id=self.config.job_id,
            command_id=command.command_id,
            from_size=outcome.from_size,
            to_size=outcome.to_size,
            ok=outcome.ok,
            duration_s=outcome.duration_s,
            released_gpus=outcome.released,
            reason=outcome.reason,
            placement=outcome.placement,
        )
        try:
            await self.bus.publish_durable(
                subjects.job(self.config.job_id, "event"), event, msg_id=event.event_id
            )
        except BusError as error:
            log.error("resize outcome for %s not stored: %s", command.command_id, error)

    async def _listen(self) -> None:
        if self.bus is None:
            return
        # Workers of other nodes, there from the start or added by a grow.
        self._workers_sub = await self.bus.subscribe(
            subjects.job(self.config.job_id, "workers"), WorkerRelay, self._on_relay
        )
        # Pushed, from now on: a new attempt must not replay the last attempt's resizes,
        # and a node's identity (which the supervisor has under --secure) may create
        # such a consumer for job commands, not pull from one. A command lost in a
        # disconnect is re-sent by a new leader or rolled back by the brain's timeout.
        self._consumer = await self.bus.follow_new(
            subjects.STREAM_COMMANDS,
            f"supervisor-{self.config.job_id}-{uuid.uuid4().hex[:8]}",
            subjects.job(self.config.job_id, "cmd"),
            JOB_COMMAND,
            self._on_command,
        )

    # -- lifecycle -------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        self._prepare()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _ReportProtocol(self._on_report), local_addr=("127.0.0.1", 0)
        )
        self._transport = transport
        host, port = transport.get_extra_info("sockname")[:2]
        await self._listen()
        gpu_dir = self.gpu_dir if self.config.gpus else None
        env = worker_env(f"{host}:{port}", gpu_dir)
        env[remote_exec.LOST_NODES_ENV] = str(self.lost_path)
        self._process = await asyncio.create_subprocess_exec(
            *self.horovodrun_command(),
            env=env,
            start_new_session=True,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._relay = asyncio.ensure_future(self._relay_output(self._process))
        log.info("horovodrun started, pid %d", self._process.pid)

    async def _relay_output(self, process: asyncio.subprocess.Process) -> None:
        """Pass horovodrun's output on to the job's log, noting the first worker error."""
        assert process.stdout is not None
        out = sys.stdout.buffer
        while line := await process.stdout.readline():
            out.write(line)
            out.flush()
            if self.first_error is None:
                found = WORKER_ERROR.match(line.decode("utf-8", "replace").rstrip())
                if found is not None:
                    self.first_error = f"worker {found['rank']}: {found['error'][:500]}"

    async def wait(self) -> int:
        if self._process is None:
            raise RuntimeError("supervisor not started")
        code = await self._process.wait()
        if self._relay is not None:
            # The pipe closes with the workers: what is left is in it already.
            await asyncio.wait({self._relay}, timeout=5.0)
        return code

    async def terminate(self) -> None:
        """Stop horovodrun and its workers: SIGTERM to the group, SIGKILL after grace."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=self.config.stop_grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def close(self) -> None:
        for sub in (self._consumer, self._workers_sub):
            if sub is not None:
                # The consumer itself goes once nobody listens (its inactive threshold).
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._consumer = self._workers_sub = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        for task in list(self._tasks):
            task.cancel()


def parse_args(argv: Sequence[str]) -> SupervisorConfig:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.supervisor",
        description="Run an elastic Horovod job and obey Alnair resize commands.",
    )
    parser.add_argument("--job-id", default=os.environ.get("ALNAIR_JOB_ID"))
    parser.add_argument("--nats", default=os.environ.get("ALNAIR_NATS"))
    parser.add_argument("--node", default=os.environ.get("ALNAIR_NODE", "local"))
    attempt = os.environ.get("ALNAIR_ATTEMPT", "")
    known = attempt.isdigit() and int(attempt) >= 1
    parser.add_argument("--attempt", type=int, default=int(attempt) if known else None)
    parser.add_argument("--min-np", type=int, required=True)
    parser.add_argument("--max-np", type=int, required=True)
    parser.add_argument("--np", type=int, required=True, help="workers to start with")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--progress-interval", type=float, default=1.0)
    parser.add_argument(
        "--network-interface",
        default=os.environ.get("ALNAIR_NETWORK_INTERFACE", "lo"),
        help="the interface workers reach each other on (lo on one host; the cluster "
        "network's across nodes; default: $ALNAIR_NETWORK_INTERFACE or lo)",
    )
    parser.add_argument(
        "--remote",
        action="append",
        default=[],
        metavar="NODE=SLOTS",
        help="slots on another node, started through its worker host (repeatable)",
    )
    parser.add_argument(
        "--hosts", default="localhost,127.0.0.1", help="local names of this node, comma-separated"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    remote: list[tuple[str, int]] = []
    for item in args.remote:
        node, _, slots = item.partition("=")
        if not node or not slots.isdigit() or int(slots) < 1:
            parser.error(f"--remote {item!r}: expected NODE=SLOTS with SLOTS >= 1")
        remote.append((node, int(slots)))
    if not args.job_id:
        parser.error("--job-id (or ALNAIR_JOB_ID) is required")
    # Job ids repeat across clusters (and a retried attempt may overlap a dying one):
    # a fresh directory per supervisor, never one named by the job id alone.
    own_work_dir = args.work_dir is None
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix=f"alnair-{args.job_id}-"))
    return SupervisorConfig(
        job_id=args.job_id,
        command=command,
        min_np=args.min_np,
        max_np=args.max_np,
        np=args.np,
        work_dir=work_dir,
        nats_url=args.nats,
        node=args.node,
        attempt=args.attempt,
        network_interface=args.network_interface,
        hosts=tuple(h for h in args.hosts.split(",") if h),
        progress_interval_s=args.progress_interval,
        gpus=devices.launch_gpus(),
        remote=tuple(remote),
        own_work_dir=own_work_dir,
    )


async def run(config: SupervisorConfig) -> int:
    bus = None
    if config.nats_url:
        # Every server of a cluster, and the identity and TLS files the agent passed on.
        bus = await Bus.connect(job_connect_options(config.nats_url, f"supervisor:{config.job_id}"))
    supervisor = Supervisor(config, bus)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await supervisor.start()
        waiter = asyncio.ensure_future(supervisor.wait())
        stopper = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            await supervisor.terminate()
        code = await waiter
    finally:
        await supervisor.close()
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        if config.own_work_dir:
            shutil.rmtree(config.work_dir, ignore_errors=True)
    if code != 0 and supervisor.first_error is not None:
        # The log's last line is what the brain shows as the failure's reason.
        print(
            f"alnair supervisor: horovodrun exited with {code}; first error: "
            f"{supervisor.first_error}",
            file=sys.stderr,
            flush=True,
        )
    return code


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(message)s")
    config = parse_args(sys.argv[1:] if argv is None else argv)
    sys.exit(asyncio.run(run(config)))


if __name__ == "__main__":
    main()
