"""An elastic job's process on a node other than its supervisor's: its workers' host.

horovodrun runs on the supervisor's node and starts every worker itself; for a host
that is not local Alnair's launcher (`workloads/hvdrun.py`) sends the worker's command
here instead of over ssh (`workloads/remote_exec.py`, request/reply on
`alnair.job.<job>.exec`). The node's agent launches this process like any rank of a
multi-node job, so its GPUs, log, stop and exit are the agent's as usual. It

- starts each worker as a process group of its own, with one of this node's GPUs to
  claim (`ALNAIR_GPU_DIR`, workloads/devices.py) and its own progress address;
- keeps that node's GPU list as the supervisor sets it when the job grows or shrinks
  here (`devices`), and says which GPUs its workers hold;
- answers polls and signals for its workers, and reports each one's exit;
- writes each worker's output to its own (the node's job log) and relays it to the
  `remote_exec` that started it, which prints it for horovodrun as ssh would;
- relays its workers' progress datagrams to the supervisor (`alnair.job.<job>.workers`);
- on SIGTERM (the agent stopping the job) stops its workers and exits.

It imports neither torch nor horovod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg

from bus.client import Bus
from schemas import subjects
from schemas.base import encode
from schemas.workers import EXEC_SECRET_ENV, ExecRequest, ExecState, WorkerRelay
from workloads import devices
from workloads.progress import WorkerReport, worker_env
from workloads.sdk import job_connect_options

log = logging.getLogger(__name__)

STOP_GRACE_S: Final = 10.0


class _Relay(asyncio.DatagramProtocol):
    def __init__(self, host: WorkerHost) -> None:
        self._host = host

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        self._host.relay(data)


@dataclass
class WorkerHost:
    job_id: str
    node: str
    bus: Bus
    work_dir: Path
    gpus: tuple[int, ...] = ()
    # The attempt's secret: only requests signed with it are obeyed.
    secret: str = ""
    _workers: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    # The pids that reported progress, by the process group (the started command's
    # pid) they run in: the supervisor knows a worker by the pid in its reports.
    _reporters: dict[int, set[int]] = field(default_factory=dict)
    _progress_addr: str = ""
    _transport: asyncio.DatagramTransport | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def gpu_dir(self) -> Path:
        return self.work_dir / "gpus"

    async def start(self) -> None:
        if self.gpus:
            devices.write_devices(self.gpu_dir, self.gpus)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Relay(self), local_addr=("127.0.0.1", 0)
        )
        self._transport = transport
        host, port = transport.get_extra_info("sockname")[:2]
        self._progress_addr = f"{host}:{port}"
        await self.bus.subscribe(subjects.job(self.job_id, "exec"), ExecRequest, self._on_request)
        log.info("worker host for job %s on %s ready", self.job_id, self.node)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def relay(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        self._note_reporter(data)
        self._spawn(self._publish(WorkerRelay(node=self.node, report=text[:8192])))

    def _note_reporter(self, data: bytes) -> None:
        try:
            pid = WorkerReport.decode(data).pid
            group = os.getpgid(pid)
        except (ValueError, KeyError, TypeError, OSError):
            return  # malformed, or gone already: the supervisor drops it too
        if group in self._reporters:  # one of the commands this host started
            self._reporters[group].add(pid)

    async def _publish(self, relay: WorkerRelay) -> None:
        with contextlib.suppress(Exception):  # progress may be lost; the next replaces it
            await self.bus.publish(subjects.job(self.job_id, "workers"), relay)

    # -- requests ------------------------------------------------------------------

    async def _on_request(self, request: ExecRequest, msg: Msg) -> None:
        if request.node != self.node:
            return  # for the worker host of another node
        if not request.signed_by(self.secret):
            log.warning("refused an unsigned %s request %s", request.op, request.exec_id)
            state = self._state(request.exec_id, None, error="not signed by this job's supervisor")
        elif request.op == "start":
            state = await self._start(request)
        elif request.op == "devices":
            state = self._devices(request)
        else:
            process = self._workers.get(request.exec_id)
            if process is None:
                state = self._state(request.exec_id, None, error="no such worker here")
            else:
                if request.op == "signal" and process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, request.signal or signal.SIGTERM)
                state = self._state(request.exec_id, process)
        if msg.reply:
            await msg.respond(encode(state))

    def _devices(self, request: ExecRequest) -> ExecState:
        """Set the node's GPUs for workers yet to start (a grow's, which claim the
        added ones; after a shrink, those still held); answer which are held."""
        if not self.gpus:  # no device map: workers see what the launch gave them
            return ExecState(exec_id=request.exec_id, node=self.node)
        known = devices.read_devices(self.gpu_dir)
        if request.gpus:
            devices.write_devices(self.gpu_dir, request.gpus)
        held = devices.claimed(self.gpu_dir, (*known, *(g for g in request.gpus if g not in known)))
        return ExecState(exec_id=request.exec_id, node=self.node, held=held)

    async def _start(self, request: ExecRequest) -> ExecState:
        known = self._workers.get(request.exec_id)
        if known is not None:  # the same start again (its reply was lost): no second worker
            return self._state(request.exec_id, known)
        env = worker_env(self._progress_addr, self.gpu_dir if self.gpus else None)
        try:
            process = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                request.command,
                env=env,
                start_new_session=True,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as error:
            return self._state(request.exec_id, None, error=f"cannot start: {error}")
        self._workers[request.exec_id] = process
        self._reporters[process.pid] = set()
        self._spawn(self._watch(request.exec_id, process))
        log.info("started worker %s (pid %d)", request.exec_id, process.pid)
        return self._state(request.exec_id, process)

    async def _watch(self, exec_id: str, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        out = sys.stdout.buffer
        while line := await process.stdout.readline():
            out.write(line)
            out.flush()
            text = line.decode("utf-8", "replace")[:8192]
            await self._publish(WorkerRelay(node=self.node, exec_id=exec_id, output=text))
        await process.wait()
        # The command's shell and every worker that reported from its process group.
        for pid in sorted({process.pid, *self._reporters.pop(process.pid, ())}):
            await self._publish(WorkerRelay(node=self.node, gone_pid=pid))

    def _state(
        self, exec_id: str, process: asyncio.subprocess.Process | None, *, error: str = ""
    ) -> ExecState:
        if process is None:
            return ExecState(exec_id=exec_id, node=self.node, running=False, error=error)
        code = process.returncode
        if code is not None and code < 0:
            code = 128 - code  # killed by a signal: the shell's convention
        return ExecState(
            exec_id=exec_id,
            node=self.node,
            pid=process.pid,
            running=process.returncode is None,
            exit_code=code,
        )

    # -- stopping ------------------------------------------------------------------

    async def stop(self) -> None:
        running = [p for p in self._workers.values() if p.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        if running:
            waiting = asyncio.gather(*(p.wait() for p in running))
            try:
                await asyncio.wait_for(waiting, timeout=STOP_GRACE_S)
            except TimeoutError:
                for process in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
        if self._transport is not None:
            self._transport.close()
        for task in list(self._tasks):
            task.cancel()


async def run() -> int:
    env = os.environ
    job_id, node, servers = env.get("ALNAIR_JOB_ID"), env.get("ALNAIR_NODE"), env.get("ALNAIR_NATS")
    if not (job_id and node and servers):
        print(
            "worker host: ALNAIR_JOB_ID, ALNAIR_NODE and ALNAIR_NATS must be set "
            "(the agent sets them)",
            file=sys.stderr,
        )
        return 2
    gpus = devices.launch_gpus()
    bus = await Bus.connect(job_connect_options(servers, f"worker-host:{job_id}:{node}"))
    work_dir = Path(tempfile.mkdtemp(prefix=f"alnair-{job_id}-{node}-"))
    secret = env.get(EXEC_SECRET_ENV, "")
    if not secret:
        log.warning("no %s: every worker start will be refused", EXEC_SECRET_ENV)
    host = WorkerHost(job_id, node, bus, work_dir, gpus, secret)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await host.start()
        await stopping.wait()
    finally:
        await host.stop()
        with contextlib.suppress(Exception):
            await bus.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker-host %(message)s")
    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
