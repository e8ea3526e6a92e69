"""Elastic resize latency: a command until every worker steps at the new size.

    .venv/bin/python bench/resize_latency.py [--sizes 2,3,1,2,3,1] [--modes ...]

Runs workloads/examples/elastic_train.py under `horovodrun --gloo` on this machine's CPUs
and resizes it through a sequence of world sizes, three ways:

- bare:       horovodrun alone; the bench rewrites the host-discovery output by hand
              (the same two local host names and slot dealing as the supervisor);
- supervisor: the Alnair supervisor, sent `Resize` commands over NATS as the brain
              sends them; it answers with `ResizeCompleted`;
- brain:      the whole control plane: a brain and an agent (4 simulated GPUs) in this
              process, the job submitted elastic and resized with the API's `resize`,
              which stages, commands and commits;
- brain-2node: the same on two agents of 2 GPUs each (both on this machine, `lo`
              between them), sizes 2,3,4,2,3,2 by default: the first grow launches
              the job's worker host on the second node through its agent; the shrink
              to 2 leaves that node (its workers retire, the worker host idles); the
              grow back to 3 goes through the same worker host.

For each resize it measures, from the moment the command is given (the host file
written, the command published, the API called):
- stepping: every worker of the new world has reported a step at the new size;
- released: a shrink's removed workers have all exited (their GPUs are free);
- ack:      the supervisor's `ResizeCompleted` arrived (supervisor), or the brain
            committed the resize (brain).

Workers report each step over UDP (workloads/progress.py); in the supervisor and brain
modes the bench reads the supervisor's `Progress` messages instead. The bench's own
supervisor publishes every report; the one the agent launches in brain mode publishes
once a second (its production setting), so there `stepping` is coarse, and `ack` (the
commit, which follows the supervisor's own check that every worker steps at the new
size) is the number to read. Prints a table and writes
bench/results/resize-latency-<stamp>.json. Numbers, not a test; on a shared machine
they move with its load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.client import Bus, ConnectOptions  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas import subjects  # noqa: E402
from schemas.base import decode  # noqa: E402
from schemas.commands import Resize  # noqa: E402
from schemas.events import NODE_EVENT, ResizeCompleted  # noqa: E402
from schemas.progress import Progress  # noqa: E402
from workloads.progress import PROGRESS_ADDR_ENV, WorkerReport  # noqa: E402
from workloads.supervisor import host_slots, process_gone  # noqa: E402

HOROVODRUN = Path(sys.executable).parent / "horovodrun"
HOSTS = ("localhost", "127.0.0.1")
RESULTS = ROOT / "bench" / "results"


def train_command(stop_file: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "workloads.examples.elastic_train",
        "--steps=100000000",
        "--step-delay=0.02",
        "--commit-every=5",
        f"--stop-file={stop_file}",
    ]


@dataclass
class Sample:
    mode: str
    from_size: int
    to_size: int
    stepping_s: float
    released_s: float | None = None
    ack_s: float | None = None
    # What the supervisor itself measured (ResizeCompleted.duration_s).
    supervisor_s: float | None = None

    @property
    def kind(self) -> str:
        return "grow" if self.to_size > self.from_size else "shrink"


@dataclass
class Workers:
    """Each worker's latest report: (world size, step, when the bench received it)."""

    latest: dict[int, tuple[int, int, float]] = field(default_factory=dict)

    def saw(self, pid: int, world_size: int, step: int) -> None:
        self.latest[pid] = (world_size, step, time.monotonic())

    def at(self, size: int, *, since: float) -> set[int]:
        return {
            pid
            for pid, (world, _, when) in self.latest.items()
            if world == size and when >= since and not process_gone(pid)
        }


async def until(condition: Callable[[], object], timeout_s: float = 180.0) -> float:
    """Poll every 5 ms; the monotonic time at which `condition()` first held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)
    return time.monotonic()


async def measure(
    mode: str,
    workers: Workers,
    from_size: int,
    to_size: int,
    command: Callable[[], Awaitable[None]],
    acked: Callable[[], object] | None = None,
    timeout_s: float = 180.0,
) -> Sample:
    """Give the command, then note when each condition first holds (polled together,
    every 5 ms)."""
    before = workers.at(from_size, since=0.0)
    started = time.monotonic()
    await command()
    conditions: dict[str, Callable[[], object]] = {
        "stepping": lambda: len(workers.at(to_size, since=started)) >= to_size
    }
    if to_size < from_size:
        gone = from_size - to_size
        conditions["released"] = lambda: sum(process_gone(p) for p in before) >= gone
    if acked is not None:
        conditions["ack"] = acked
    seen: dict[str, float] = {}
    while len(seen) < len(conditions):
        now = time.monotonic()
        if now - started > timeout_s:
            missing = sorted(set(conditions) - set(seen))
            raise TimeoutError(f"{mode} {from_size}->{to_size}: no {missing} in {timeout_s}s")
        for name, condition in conditions.items():
            if name not in seen and condition():
                seen[name] = now - started
        await asyncio.sleep(0.005)
    return Sample(
        mode,
        from_size,
        to_size,
        seen["stepping"],
        released_s=seen.get("released"),
        ack_s=seen.get("ack"),
    )


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            report = WorkerReport.decode(data)
            self.workers.saw(report.pid, report.world_size, report.step)


async def stop_group(process: asyncio.subprocess.Process, stop_file: Path) -> None:
    stop_file.touch()
    try:
        await asyncio.wait_for(process.wait(), timeout=60)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


async def run_bare(sizes: list[int], work: Path) -> list[Sample]:
    """horovodrun alone; the host list rewritten by hand, as an operator would."""
    workers = Workers()
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Udp(workers), local_addr=("127.0.0.1", 0)
    )
    port = transport.get_extra_info("sockname")[1]
    hosts = work / "hosts"
    script = work / "discover.sh"

    def write_hosts(slots: int) -> None:
        temporary = hosts.with_suffix(".tmp")
        temporary.write_text("".join(f"{h}:{n}\n" for h, n in host_slots(HOSTS, slots)))
        os.replace(temporary, hosts)

    write_hosts(sizes[0])
    script.write_text(f"#!/bin/sh\nexec cat '{hosts}'\n")
    script.chmod(0o755)
    stop_file = work / "stop-bare"
    env = {**os.environ, PROGRESS_ADDR_ENV: f"127.0.0.1:{port}", "PYTHONPATH": str(ROOT)}
    process = await asyncio.create_subprocess_exec(
        str(HOROVODRUN),
        "--gloo",
        "-np",
        str(sizes[0]),
        "--min-np",
        "1",
        "--max-np",
        str(max(sizes)),
        "--host-discovery-script",
        str(script),
        "--network-interface",
        "lo",
        "--blacklist-cooldown-range",
        "1",
        "2",
        *train_command(stop_file),
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=(work / "bare.log").open("wb"),
        stderr=asyncio.subprocess.STDOUT,
    )
    samples: list[Sample] = []
    try:
        await until(lambda: len(workers.at(sizes[0], since=0.0)) >= sizes[0])
        for before, after in itertools.pairwise(sizes):

            async def command(n: int = after) -> None:
                write_hosts(n)

            samples.append(await measure("bare", workers, before, after, command))
    finally:
        await stop_group(process, stop_file)
        transport.close()
    return samples


@dataclass
class BusWatch:
    """The job's Progress and ResizeCompleted messages, as they arrive."""

    workers: Workers = field(default_factory=Workers)
    answers: dict[str, ResizeCompleted] = field(default_factory=dict)

    async def attach(self, bus: Bus) -> None:
        async def on_progress(message: Progress, msg: object) -> None:
            for worker in message.workers:
                self.workers.saw(worker.pid, worker.world_size, worker.step)

        async def on_event(msg: Any) -> None:
            event = decode(msg.data, NODE_EVENT)
            if isinstance(event, ResizeCompleted):
                self.answers[event.command_id] = event

        await bus.subscribe(subjects.ALL_JOB_PROGRESS, Progress, on_progress)
        # The supervisor answers on its job's event subject (docs/elastic.md).
        await bus.nc.subscribe(subjects.ALL_JOB_EVENTS, cb=on_event)


async def run_supervisor(sizes: list[int], work: Path, server: EmbeddedNats) -> list[Sample]:
    """The supervisor alone, sent Resize commands over NATS as the brain sends them."""
    bus = await Bus.connect(ConnectOptions(servers=(server.url,), name="bench"))
    await bus.ensure_streams()
    watch = BusWatch()
    await watch.attach(bus)
    job_id = f"bench{uuid.uuid4().hex[:6]}"
    stop_file = work / "stop-supervisor"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workloads.supervisor",
        f"--job-id={job_id}",
        f"--nats={server.url}",
        "--node=n1",
        "--min-np=1",
        f"--max-np={max(sizes)}",
        f"--np={sizes[0]}",
        "--progress-interval=0",
        f"--work-dir={work / job_id}",
        "--",
        *train_command(stop_file),
        cwd=ROOT,
        start_new_session=True,
        stdout=(work / "supervisor.log").open("wb"),
        stderr=asyncio.subprocess.STDOUT,
    )
    samples: list[Sample] = []
    try:
        await until(lambda: len(watch.workers.at(sizes[0], since=0.0)) >= sizes[0])
        for before, after in itertools.pairwise(sizes):
            resize = Resize(
                command_id=uuid.uuid4().hex,
                epoch=1,
                issued_at=time.time(),
                job_id=job_id,
                world_size=after,
                cause="bench",
            )

            async def command(r: Resize = resize) -> None:
                await bus.publish_durable(subjects.job(job_id, "cmd"), r, msg_id=r.command_id)

            sample = await measure(
                "supervisor",
                watch.workers,
                before,
                after,
                command,
                acked=functools.partial(watch.answers.__contains__, resize.command_id),
            )
            answer = watch.answers[resize.command_id]
            if not answer.ok:
                raise RuntimeError(f"resize to {after} refused: {answer.reason}")
            sample.supervisor_s = answer.duration_s
            samples.append(sample)
    finally:
        await stop_group(process, stop_file)
        await bus.close()
    return samples


async def run_brain(
    sizes: list[int], work: Path, server: EmbeddedNats, *, nodes: int = 1
) -> list[Sample]:
    """The whole control plane: the API's `resize` on a job the brain placed, on one
    4-GPU node or on `nodes` nodes of 2."""
    from agents.agent import Agent, AgentConfig
    from agents.gpu import SimulatedGpus
    from brain.service import Brain, BrainConfig
    from schemas.api import JobReply, ResizeRequest, SubmitRequest
    from schemas.jobs import JobSpec, JobState

    if max(sizes) > 4:
        raise SystemExit("brain modes run 4 GPUs: sizes must be at most 4")
    per_node = 4 // nodes
    options = ConnectOptions(servers=(server.url,), name="bench")
    brain = Brain(
        await Bus.connect(options),
        BrainConfig(tick_s=0.2, lease_ttl_s=2.0, history_path=work / "history.db"),
    )
    await brain.start()
    await asyncio.wait_for(brain.leading.wait(), timeout=30)
    agents = []
    for name in (f"n{i + 1}" for i in range(nodes)):
        agent = Agent(
            await Bus.connect(options),
            AgentConfig(node=name, data_dir=work / name, heartbeat_s=0.2, nats_url=server.url),
            SimulatedGpus(name, per_node, "A100"),
        )
        await agent.start()
        agents.append(agent)
    bus = await Bus.connect(options)
    watch = BusWatch()
    await watch.attach(bus)
    stop_file = work / "stop-brain"
    spec = JobSpec(
        name="bench",
        command=tuple(train_command(stop_file)),
        gpus=sizes[0],
        elastic=True,
        min_gpus=1,
        max_gpus=max(sizes),
        cwd=str(ROOT),
        env={"TMPDIR": str(work)},
    )
    samples: list[Sample] = []
    try:
        await until(lambda: len(brain.state.nodes) == nodes, timeout_s=30)
        reply = await brain.api.handle("bench", SubmitRequest(spec=spec))
        assert isinstance(reply, JobReply), reply
        job_id = reply.job.job_id
        await until(lambda: len(watch.workers.at(sizes[0], since=0.0)) >= sizes[0])
        await until(lambda: brain.progress.heard_from(job_id))
        for before, after in itertools.pairwise(sizes):
            staged: list[str] = []

            async def command(n: int = after, staged: list[str] = staged) -> None:
                answer = await brain.api.handle("bench", ResizeRequest(job_id=job_id, gpus=n))
                if not isinstance(answer, JobReply) or answer.job.resize is None:
                    raise RuntimeError(f"resize to {n} refused: {answer}")
                staged.append(answer.job.resize.command_id)

            def committed(n: int = after) -> bool:
                job = brain.state.jobs[job_id]
                return job.resize is None and job.gpu_count == n

            mode = "brain" if nodes == 1 else f"brain-{nodes}node"
            sample = await measure(mode, watch.workers, before, after, command, committed)
            sample.supervisor_s = watch.answers[staged[0]].duration_s
            samples.append(sample)
        stop_file.touch()
        await until(lambda: brain.state.jobs[job_id].state is JobState.SUCCEEDED, 60)
    finally:
        stop_file.touch()
        for agent in agents:
            await agent.stop(stop_jobs=True)
        await brain.stop()
        for agent in agents:
            await agent.bus.close()
        await brain.bus.close()
        await bus.close()
    return samples


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(samples: list[Sample]) -> str:
    lines = [
        f"{'mode':<13}{'resize':<9}{'kind':<8}{'stepping ms':>12}{'released ms':>13}"
        f"{'ack ms':>9}{'supervisor ms':>15}"
    ]
    for s in samples:
        lines.append(
            f"{s.mode:<13}{f'{s.from_size}->{s.to_size}':<9}{s.kind:<8}{_ms(s.stepping_s):>12}"
            f"{_ms(s.released_s):>13}{_ms(s.ack_s):>9}{_ms(s.supervisor_s):>15}"
        )
    lines.append("")
    lines.append(f"{'mode':<13}{'kind':<8}{'n':>3}{'stepping median ms':>20}{'max ms':>9}")
    for mode in dict.fromkeys(s.mode for s in samples):
        for kind in ("grow", "shrink"):
            values = [s.stepping_s for s in samples if s.mode == mode and s.kind == kind]
            if values:
                lines.append(
                    f"{mode:<13}{kind:<8}{len(values):>3}"
                    f"{_ms(statistics.median(values)):>20}{_ms(max(values)):>9}"
                )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    sizes = [int(n) for n in args.sizes.split(",")]
    if len(sizes) < 2 or min(sizes) < 1:
        raise SystemExit("--sizes takes a start size and at least one more, e.g. 2,3,1")
    two_node = [int(n) for n in args.two_node_sizes.split(",")]
    if len(two_node) < 2 or min(two_node) < 1 or two_node[0] > 2:
        raise SystemExit("--two-node-sizes starts at 1 or 2 (one node) and has one more size")
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="alnair-resize-bench-") as tmp:
        work = Path(tmp)
        server = EmbeddedNats(data_dir=work / "nats")
        server.start()
        try:
            for mode in args.modes:
                print(f"running {mode} ...", flush=True)
                mode_dir = work / mode
                mode_dir.mkdir()
                if mode == "bare":
                    samples += await run_bare(sizes, mode_dir)
                elif mode == "supervisor":
                    samples += await run_supervisor(sizes, mode_dir, server)
                elif mode == "brain":
                    samples += await run_brain(sizes, mode_dir, server)
                else:
                    samples += await run_brain(two_node, mode_dir, server, nodes=2)
        finally:
            server.stop()
    print(table(samples))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"resize-latency-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "bench": "resize_latency",
                "at": stamp,
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "sizes": sizes,
                "two_node_sizes": two_node,
                "workload": " ".join(train_command(Path("STOP"))[1:]),
                "samples": [{**asdict(s), "kind": s.kind} for s in samples],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,3,1,2,3,1", help="world sizes, the first the start")
    parser.add_argument(
        "--two-node-sizes",
        default="2,3,4,2,3,2",
        help="world sizes of the brain-2node mode (nodes of 2 GPUs), the first the start",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("bare", "supervisor", "brain", "brain-2node"),
        default=["bare", "supervisor", "brain", "brain-2node"],
    )
    args = parser.parse_args()
    if not HOROVODRUN.exists():
        raise SystemExit(f"{HOROVODRUN} not found: build the venv with Horovod (make test)")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
