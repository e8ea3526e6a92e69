"""The brain at scale, beside raw nats-py baselines from the same run: not a test.

    .venv/bin/python bench/brain_scale.py [--modes submit latency nodes restart]
        [--nodes 1000] [--pending 1000] [--clients 64] [--submit-s 10] [--probes 100]
        [--flood-nodes 1000 3000] [--flood-s 30] [--scrape-every S] [--finished 5000]
        [--profile-restart]

Each world is a fresh nats-server (free port, never 4222) and a brain started as a real
process (`python -m cli brain`, policy `priority`); synthetic nodes and clients run in
this process and speak to it over the bus only:

- nodes: one connection publishes, per node and per second, an 8-GPU telemetry batch and
  a heartbeat (encoded once, re-encoded when the node's processes change), spread over
  the second; one core subscription on every node's command subject answers each
  Launch with JobStarted (and, for probe jobs, JobExited 50 ms later) on EVENTS. The
  `nodes` mode's nodes, which run no jobs, are a separate process writing raw protocol
  (bench/raw_nodes.py: agents' bytes, clock and sequence advanced at every beat), so
  that tens of thousands of them cost the machine a few per cent of a core.
- `submit`, `latency`: N nodes, all but 4 running an 8-GPU job of priority 10, and P
  pending 64-GPU jobs of priority 0 (which cannot fit, and wait without blocking
  others), appended to the log before the brain starts (tests/statelog.py).
  `submit`: 64 clients submit more 64-GPU jobs (which pend) for a while: submissions/s.
  `latency`: one client submits 1-GPU jobs one at a time: submit -> Launch at a node.
  Baseline: a fenced JetStream append of a ~930-byte record (Nats-Expected-Last-Sequence,
  one writer), its rate and latency, on a stream of its own on the same server.
- `nodes`: F nodes join and beat at 1 Hz for a while: live nodes the brain declared
  LOST, whether it kept the lease, `status` p99 meanwhile, the brain's RSS and CPU.
  Baseline: a bare nats-py core subscriber (a process) on the same subjects: received
  and its CPU. `--scrape-every S` also scrapes the brain's `/metrics` (every GPU's
  series) every S seconds meanwhile, as Prometheus would, one at a time and given up
  after 10 s: how long the scrapes took, and `status` p99 with them.
- `restart`: a log of K finished jobs (3 entries each) appended; a brain started over it
  (cold: no snapshot), then, once it has stored a snapshot, stopped and a new brain
  started over the same history, then one with a new (empty) history: process start to
  leading, each. Baseline: nats-py
  reading the whole log raw. `--profile-restart` runs the restart brain under cProfile
  and prints where its time went.

Prints a table; writes bench/results/brain_scale-<stamp>.json and .csv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nats.aio.msg import Msg  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig  # noqa: E402

from bench.recording import record  # noqa: E402
from brain.snapshots import SnapshotStore  # noqa: E402
from bus.client import Bus, ConnectOptions  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from cli.client import call  # noqa: E402
from schemas import subjects  # noqa: E402
from schemas.api import JOB_RESULT, STATUS_RESULT, StatusRequest, SubmitRequest  # noqa: E402
from schemas.base import decode, encode  # noqa: E402
from schemas.commands import NODE_COMMAND, Launch  # noqa: E402
from schemas.errors import InvalidMessage  # noqa: E402
from schemas.events import JobExited, JobStarted  # noqa: E402
from schemas.jobs import JobSpec  # noqa: E402
from schemas.state import STATE_RECORD, CauseKind, NodeChanged  # noqa: E402
from schemas.telemetry import GpuSample, Heartbeat, RunningJob, TelemetryBatch  # noqa: E402
from tests.statelog import (  # noqa: E402
    append_records,
    fake_gpus,
    fake_instance,
    finished_job_records,
    live_job_record,
    node_record,
)

GPUS_PER_NODE = 8
# Nodes left idle in the busy world (where probes run), and the size of the jobs that
# wait there: more GPUs than those nodes have, so they wait without blocking others.
FREE_NODES = 4
WIDE_GPUS = 64
PROBE_NAME = "probe"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


# -- processes -----------------------------------------------------------------------


@dataclass
class BrainProc:
    url: str
    home: Path
    name: str
    profile: Path | None = None
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    # HOST:PORT for its HTTP API and /metrics; None: none.
    http: str | None = None

    @property
    def log(self) -> Path:
        return self.home / f"{self.name}.log"

    async def start(self, history: Path) -> None:
        env = {**os.environ, "ALNAIR_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
        prefix = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        args = [*prefix, "-m", "cli", "brain", "--nats", self.url, "--history", str(history)]
        args += ["--policy", "priority", "--node-timeout", "5", "--lease-ttl", "5"]
        if self.http is not None:
            args += ["--http", self.http]
        with self.log.open("ab") as out:
            self.started_at = time.monotonic()
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                *args,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def rss_mib(self) -> float:
        return process_rss_mib(self.pid)

    def cpu_s(self) -> float:
        return process_cpu_s(self.pid)

    def children(self) -> list[int]:
        """The processes the brain started (its /metrics renderer among them)."""
        found: list[int] = []
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    found += [int(p) for p in (task / "children").read_text().split()]
        return found

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), timeout=30)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


def process_rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def process_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def connect(url: str, name: str) -> Bus:
    return await Bus.connect(ConnectOptions(servers=(url,), name=name))


async def wait_leading(bus: Bus, brain: BrainProc, timeout_s: float = 600.0) -> float:
    """Seconds from the brain process's start until it answers as the leader."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            status = await call(
                bus, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=2
            )
            if status.brain_pid == brain.pid:
                return time.monotonic() - brain.started_at
        if brain.process is not None and brain.process.returncode is not None:
            raise RuntimeError(f"{brain.name} exited; see {brain.log}")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{brain.name} did not lead within {timeout_s}s; see {brain.log}")


# -- synthetic nodes -----------------------------------------------------------------


def heartbeat_bytes(node: str, running: tuple[RunningJob, ...] = ()) -> bytes:
    """A synthetic node's heartbeat, as its agent encodes it."""
    beat = Heartbeat(
        node=node,
        ts=time.time(),
        seq=0,
        instance=fake_instance(node),
        hostname=node,
        backend="sim",
        interval_s=1.0,
        gpus=fake_gpus(node, GPUS_PER_NODE),
        running=running,
    )
    return encode(beat)


def telemetry_bytes(node: str) -> bytes:
    """A synthetic node's 8-GPU telemetry batch, as its agent encodes it."""
    sample = dict(util_gpu_pct=50.0, util_mem_pct=40.0, mem_used_mib=40_000.0)
    sample |= dict(mem_total_mib=81_559.0, power_w=400.0, temp_c=60.0)
    samples = tuple(
        GpuSample(index=i, sm_clock_mhz=1_980.0, mem_clock_mhz=2_619.0, **sample)
        for i in range(GPUS_PER_NODE)
    )
    return encode(TelemetryBatch(node=node, ts=time.time(), samples=samples))


@dataclass
class FakeNodes:
    """Nodes that beat at 1 Hz and answer launches, all over one connection."""

    bus: Bus
    names: list[str]
    running: dict[str, dict[tuple[str, int], RunningJob]] = field(default_factory=dict)
    launched_at: dict[str, float] = field(default_factory=dict)
    sent: int = 0
    _beats: dict[str, bytes] = field(default_factory=dict)
    _telemetry: dict[str, bytes] = field(default_factory=dict)
    _seq: int = 0
    # Probe exits in flight (kept referenced until done).
    _exits: set[asyncio.Future[None]] = field(default_factory=set)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        await self.bus.nc.subscribe(subjects.ALL_NODE_COMMANDS, cb=self._on_command)
        self._tasks.append(asyncio.ensure_future(self._beat_forever()))

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _beat(self, node: str) -> bytes:
        if node not in self._beats:
            self._beats[node] = heartbeat_bytes(node, tuple(self.running.get(node, {}).values()))
        return self._beats[node]

    def _samples(self, node: str) -> bytes:
        if node not in self._telemetry:
            self._telemetry[node] = telemetry_bytes(node)
        return self._telemetry[node]

    async def _beat_forever(self) -> None:
        slices = 20  # spread each second's messages over 50 ms slices
        while not self._stopping.is_set():
            began = time.monotonic()
            for part in range(slices):
                for node in self.names[part::slices]:
                    await self.bus.nc.publish(subjects.node(node, "heartbeat"), self._beat(node))
                    await self.bus.nc.publish(subjects.node(node, "telemetry"), self._samples(node))
                    self.sent += 2
                await asyncio.sleep(max(0.0, began + (part + 1) / slices - time.monotonic()))

    async def _on_command(self, msg: Msg) -> None:
        at = time.monotonic()
        try:
            command = decode(msg.data, NODE_COMMAND)
        except InvalidMessage:
            return
        if not isinstance(command, Launch):
            return
        node = msg.subject.split(".")[2]
        self.launched_at.setdefault(command.job_id, at)
        job = RunningJob(
            job_id=command.job_id,
            attempt=command.attempt,
            pid=20_000 + len(self.launched_at),
            gpus=command.gpus,
        )
        self.running.setdefault(node, {})[(job.job_id, job.attempt)] = job
        self._beats.pop(node, None)
        started = JobStarted(
            event_id=f"{command.command_id}-started"[:64],
            node=node,
            ts=time.time(),
            job_id=job.job_id,
            attempt=job.attempt,
            pid=job.pid,
            gpus=job.gpus,
            log_path="/dev/null",
        )
        await self._event(node, started)
        if command.command[0] == PROBE_NAME:
            # Not in this callback: nats-py runs a subscription's callbacks one at a
            # time, and the next Launch (its arrival time) would wait behind the sleep.
            done = asyncio.ensure_future(self._probe_exits(node, job, command))
            self._exits.add(done)
            done.add_done_callback(self._exits.discard)

    async def _probe_exits(self, node: str, job: RunningJob, command: Launch) -> None:
        await asyncio.sleep(0.05)
        self.running[node].pop((job.job_id, job.attempt), None)
        self._beats.pop(node, None)
        exited = JobExited(
            event_id=f"{command.command_id}-exited"[:64],
            node=node,
            ts=time.time(),
            job_id=job.job_id,
            attempt=job.attempt,
            exit_code=0,
            runtime_s=0.05,
        )
        await self._event(node, exited)

    async def _event(self, node: str, event: JobStarted | JobExited) -> None:
        with contextlib.suppress(Exception):
            await self.bus.js.publish(
                subjects.node(node, "event"),
                encode(event),
                headers={"Nats-Msg-Id": event.event_id},
            )


# -- baselines -----------------------------------------------------------------------


async def fenced_append_baseline(bus: Bus, seconds: float = 3.0) -> dict[str, float]:
    """One writer appending a ~930-byte record with Nats-Expected-Last-Sequence."""
    await bus.js.add_stream(StreamConfig(name="BENCHRAW", subjects=["bench.raw.>"]))
    payload = b"x" * 930
    last = 0
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.monotonic()
        ack = await bus.js.publish(
            f"bench.raw.{last % 64}",
            payload,
            headers={"Nats-Expected-Last-Sequence": str(last), "Nats-Msg-Id": f"raw-{last}"},
        )
        times.append(time.monotonic() - began)
        last = int(ack.seq)
    await bus.js.delete_stream("BENCHRAW")
    return {"rate": len(times) / seconds, "p50": pct(times, 0.5), "p99": pct(times, 0.99)}


BARE_SUBSCRIBER = """
import asyncio, os, sys, time, nats
async def main():
    nc = await nats.connect(sys.argv[1]); count = 0
    async def cb(msg):
        nonlocal count; count += 1
    await nc.subscribe("alnair.node.*.heartbeat", cb=cb)
    await nc.subscribe("alnair.node.*.telemetry", cb=cb)
    await asyncio.sleep(float(sys.argv[2]))
    t = os.times(); print(count, t.user + t.system, flush=True); await nc.close()
asyncio.run(main())
"""


async def raw_log_read(bus: Bus) -> float:
    """Seconds nats-py takes to fetch the whole STATE log, undecoded."""
    began = time.monotonic()
    until = await bus.last_seq(subjects.STREAM_STATE)
    config = ConsumerConfig(ack_policy=AckPolicy.NONE)
    psub = await bus.js.pull_subscribe(
        ">", durable=None, stream=subjects.STREAM_STATE, config=config
    )
    seen = 0
    while seen < until:
        msgs = await psub.fetch(512, timeout=5)
        seen = max([seen, *(int(m.metadata.sequence.stream) for m in msgs)])
    await psub.unsubscribe()
    return time.monotonic() - began


# -- worlds --------------------------------------------------------------------------


@dataclass
class World:
    home: Path
    server: EmbeddedNats
    brain: BrainProc
    client: Bus
    nodes: FakeNodes | None = None
    buses: list[Bus] = field(default_factory=list)

    async def close(self) -> None:
        if self.nodes is not None:
            await self.nodes.stop()
        await self.brain.stop()
        for bus in [*self.buses, self.client]:
            with contextlib.suppress(Exception):
                await bus.close()
        self.server.stop()


async def busy_world(home: Path, nodes: int, pending: int, *, profile: bool = False) -> World:
    """`nodes` nodes, all but FREE_NODES running an 8-GPU job of priority 10; `pending`
    jobs of WIDE_GPUS GPUs (more than are free) at priority 0 waiting; one leader."""
    server = EmbeddedNats(data_dir=home / "nats")
    server.start()
    client = await connect(server.url, "bench")
    names = [f"n{i:05d}" for i in range(nodes)]
    busy = names[FREE_NODES:]
    records: list[Any] = [node_record(n, GPUS_PER_NODE) for n in names]
    records += [
        live_job_record(i + 1, gpus=GPUS_PER_NODE, node=n, priority=10) for i, n in enumerate(busy)
    ]
    records += [live_job_record(len(busy) + 1 + i, gpus=WIDE_GPUS) for i in range(pending)]
    await append_records(client, records)
    fake = FakeNodes(await connect(server.url, "nodes"), names)
    for i, node in enumerate(busy):
        job = RunningJob(
            job_id=str(i + 1), attempt=1, pid=10_001 + i, gpus=tuple(range(GPUS_PER_NODE))
        )
        fake.running[node] = {(job.job_id, 1): job}
    await fake.start()
    brain = BrainProc(server.url, home, "brain", profile=home / "brain.prof" if profile else None)
    await brain.start(home / "history.db")
    world = World(home, server, brain, client, fake, [fake.bus])
    try:
        await wait_leading(client, brain)
    except BaseException:
        await world.close()
        raise
    return world


async def submit_rate(world: World, clients: int, seconds: float) -> dict[str, Any]:
    buses = [await connect(world.server.url, f"client-{i}") for i in range(4)]
    world.buses += buses
    spec = JobSpec(name="wide", command=("sleep", "infinity"), gpus=WIDE_GPUS)
    done: list[float] = []
    failed = 0
    deadline = time.monotonic() + seconds

    async def client(index: int) -> None:
        nonlocal failed
        bus = buses[index % len(buses)]
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                await call(
                    bus, "default", "submit", SubmitRequest(spec=spec), JOB_RESULT, timeout_s=30
                )
                done.append(time.monotonic() - began)
            except Exception:
                failed += 1

    began = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.monotonic() - began
    return {
        "rate": len(done) / elapsed,
        "p50": pct(done, 0.5),
        "p99": pct(done, 0.99),
        "failed": failed,
    }


async def launch_latency(world: World, probes: int) -> dict[str, Any]:
    assert world.nodes is not None
    spec = JobSpec(name="probe", command=(PROBE_NAME,), gpus=1)
    times: list[float] = []
    # submit -> its reply (the submission stored): the rest of the time is the pass's.
    replies: list[float] = []
    missed = 0
    for _ in range(probes):
        began = time.monotonic()
        reply = await call(
            world.client, "default", "submit", SubmitRequest(spec=spec), JOB_RESULT, timeout_s=30
        )
        replies.append(time.monotonic() - began)
        job_id = reply.job.job_id
        deadline = began + 10.0
        while job_id not in world.nodes.launched_at and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.0005)
        if job_id in world.nodes.launched_at:
            times.append(world.nodes.launched_at[job_id] - began)
        else:
            missed += 1
        await asyncio.sleep(0.02)
    return {
        "p50": pct(times, 0.5),
        "p99": pct(times, 0.99),
        "reply_p50": pct(replies, 0.5),
        "reply_p99": pct(replies, 0.99),
        "missed": missed,
    }


# -- modes ---------------------------------------------------------------------------


Row = dict[str, Any]


async def mode_submit_latency(args: argparse.Namespace, home: Path, modes: set[str]) -> list[Row]:
    rows: list[Row] = []
    for pending in sorted({0, args.pending}):
        world = await busy_world(
            home / f"busy-{pending}", args.nodes, pending, profile=args.profile_submit
        )
        try:
            raw = await fenced_append_baseline(world.client)
            where = f"{args.nodes} nodes, {pending} pending"
            if "latency" in modes:
                cpu0, began = world.brain.cpu_s(), time.monotonic()
                latency = await launch_latency(world, args.probes)
                busy = (world.brain.cpu_s() - cpu0) / (time.monotonic() - began)
                rows.append(
                    row(
                        "submit -> Launch p50 (ms)",
                        where,
                        ms(latency["p50"]),
                        "fenced append p50",
                        ms(raw["p50"]),
                    )
                )
                rows.append(
                    row(
                        "submit -> Launch p99 (ms)",
                        where,
                        ms(latency["p99"]),
                        "fenced append p99",
                        ms(raw["p99"]),
                        note=f"{latency['missed']} probes never launched; reply (stored) "
                        f"p50 {ms(latency['reply_p50'])} ms, p99 {ms(latency['reply_p99'])} ms; "
                        f"brain CPU {100 * busy:.0f}% of a core",
                    )
                )
            if "submit" in modes:
                cpu0, began = world.brain.cpu_s(), time.monotonic()
                rate = await submit_rate(world, args.clients, args.submit_s)
                busy = (world.brain.cpu_s() - cpu0) / (time.monotonic() - began)
                rows.append(
                    row(
                        f"submissions/s, {args.clients} clients",
                        where,
                        round(rate["rate"], 1),
                        "fenced appends/s, 1 writer",
                        round(raw["rate"], 1),
                        note=f"reply p99 {ms(rate['p99'])} ms, {rate['failed']} failed; "
                        f"brain CPU {100 * busy:.0f}% of a core",
                    )
                )
        finally:
            await world.close()
    return rows


async def mode_nodes(args: argparse.Namespace, home: Path) -> list[Row]:
    rows: list[Row] = []
    for count in args.flood_nodes:
        work = home / f"flood-{count}"
        server = EmbeddedNats(data_dir=work / "nats")
        server.start()
        client = await connect(server.url, "bench")
        await client.ensure_streams()
        profiled = work / "brain.prof" if args.profile_nodes else None
        brain = BrainProc(server.url, work, "brain", profile=profiled)
        if args.scrape_every:
            brain.http = f"127.0.0.1:{free_port()}"
        await brain.start(work / "history.db")
        world = World(work, server, brain, client)
        scrapes = Scrapes()
        try:
            await wait_leading(client, brain)
            epoch = (await call(client, "default", "status", StatusRequest(), STATUS_RESULT)).epoch
            lost: set[str] = set()

            async def on_state(msg: Msg, lost: set[str] = lost) -> None:
                with contextlib.suppress(InvalidMessage):
                    item = decode(msg.data, STATE_RECORD)
                    if isinstance(item, NodeChanged) and item.cause.kind is CauseKind.NODE_LOST:
                        lost.add(item.node.name)

            await client.nc.subscribe("alnair.state.node.>", cb=on_state)
            bare = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                BARE_SUBSCRIBER,
                server.url,
                str(args.flood_s + 1),
                stdout=asyncio.subprocess.PIPE,
            )
            cpu0 = brain.cpu_s()
            # The nodes: a process writing raw protocol (bench/raw_nodes.py), so that
            # the load generator leaves the cores to the brain.
            publisher = await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "bench" / "raw_nodes.py"),
                server.url,
                str(count),
                str(args.flood_s),
                stdout=asyncio.subprocess.PIPE,
            )
            scrapes.start(brain, args.scrape_every)
            api: list[float] = []
            joined_api: list[float] = []  # once every node is known: past the mass join
            api_failed = 0
            rss = child_rss = 0.0
            child_cpu: dict[int, float] = {}  # the brain's processes: CPU seconds, last read
            began = time.monotonic()
            joined_s: float | None = None
            while time.monotonic() - began < args.flood_s:
                t = time.monotonic()
                try:
                    answer = await call(
                        client, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=5
                    )
                    api.append(time.monotonic() - t)
                    if joined_s is not None:
                        joined_api.append(api[-1])
                    elif answer.nodes == count:
                        joined_s = time.monotonic() - began
                except Exception:
                    api_failed += 1
                rss = max(rss, brain.rss_mib())
                children = brain.children()
                child_rss = max(child_rss, sum(process_rss_mib(p) for p in children))
                child_cpu = {**child_cpu, **{p: process_cpu_s(p) for p in children}}
                await asyncio.sleep(max(0.0, 0.25 - (time.monotonic() - t)))
            brain_cpu = brain.cpu_s() - cpu0
            scrapes.stop()
            published, _ = await publisher.communicate()
            if publisher.returncode:
                raise RuntimeError(f"the synthetic nodes failed (exit {publisher.returncode})")
            sent_text, publisher_cpu = published.split()
            sent = int(sent_text)
            out, _ = await bare.communicate()
            bare_count, bare_cpu = (float(x) for x in out.split())
            elapsed = time.monotonic() - began
            known: object = "?"
            try:
                final = await call(
                    client, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=10
                )
                kept = final.epoch == epoch and final.brain_pid == brain.pid
                known = final.nodes
            except Exception as error:  # no leader answering at all
                kept = False
                known = f"? ({type(error).__name__})"
            stepped_down = "stops leading" in brain.log.read_text()
            kept = kept and not stepped_down
            rows.append(
                row(
                    "live nodes declared LOST",
                    f"{count} nodes x 1 Hz, {args.flood_s:g} s",
                    len(lost),
                    "bare subscriber received/sent",
                    f"{int(bare_count)}/{sent}",
                    note=f"nodes known {known}; lease kept: {kept}",
                )
            )
            rows.append(
                row(
                    "status p99 (ms)",
                    f"{count} nodes x 1 Hz",
                    ms(pct(api, 0.99)),
                    "status p50 (ms)",
                    ms(pct(api, 0.5)),
                    note=f"{api_failed} failed",
                )
            )
            rows.append(
                row(
                    "status p99 once all joined (ms)",
                    f"{count} nodes x 1 Hz",
                    ms(pct(joined_api, 0.99)) if joined_api else "-",
                    "status p50 once all joined (ms)",
                    ms(pct(joined_api, 0.5)) if joined_api else "-",
                    note=(
                        f"all {count} known {joined_s:.0f} s into the flood"
                        if joined_s is not None
                        else "never all known"
                    ),
                )
            )
            rows.append(
                row(
                    "brain CPU (% of a core)",
                    f"{count} nodes x 1 Hz",
                    round(100 * brain_cpu / elapsed, 1),
                    "bare subscriber CPU (%)",
                    round(100 * bare_cpu / (args.flood_s + 1), 1),
                    note=(
                        f"brain RSS max {rss:.0f} MiB; synthetic nodes' CPU "
                        f"{100 * float(publisher_cpu) / args.flood_s:.0f} %; the brain's "
                        f"own processes: CPU {100 * sum(child_cpu.values()) / elapsed:.1f} %, "
                        f"RSS max {child_rss:.0f} MiB"
                    ),
                )
            )
            rows += scrapes.rows(f"{count} nodes, every {args.scrape_every:g} s")
        finally:
            scrapes.stop()
            await world.close()
        if profiled is not None:
            import pstats

            print(f"\nwhere the brain's time went at {count} nodes (internal, top 30):")
            pstats.Stats(str(profiled)).sort_stats("tottime").print_stats(30)
    return rows


# Prometheus' default scrape timeout.
SCRAPE_TIMEOUT_S = 10.0


@dataclass
class Scrapes:
    """The brain's /metrics scraped every so often, as Prometheus would (one at a time,
    given up after SCRAPE_TIMEOUT_S): how long each took, or why it failed."""

    took: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def start(self, brain: BrainProc, every_s: float) -> None:
        if brain.http is not None:
            self.task = asyncio.create_task(self._forever(brain, every_s))

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def rows(self, setting: str) -> list[Row]:
        if self.task is None:
            return []
        took, failed = self.took, self.failed
        return [
            row(
                "/metrics scrape, longest (s)",
                setting,
                round(max(took), 2) if took else "-",
                "median (s)",
                round(statistics.median(took), 2) if took else "-",
                note=(
                    f"{len(took)} answered within {SCRAPE_TIMEOUT_S:g} s, {len(failed)} not"
                    f" ({', '.join(sorted(set(failed))) or 'none'})"
                ),
            )
        ]

    async def _forever(self, brain: BrainProc, every_s: float) -> None:
        import aiohttp

        tokens = json.loads((brain.home / "http-tokens.json").read_text())["tokens"]
        token = next(t["token"] for t in tokens if t.get("operator"))
        headers = {"Authorization": f"Bearer {token}"}
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            while True:
                started = time.monotonic()
                try:
                    async with session.get(f"http://{brain.http}/metrics") as response:
                        await response.read()
                        if response.status != 200:
                            self.failed.append(f"HTTP {response.status}")
                        else:
                            self.took.append(time.monotonic() - started)
                except (TimeoutError, aiohttp.ClientError) as error:
                    self.failed.append(type(error).__name__)
                await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def mode_restart(args: argparse.Namespace, home: Path) -> list[Row]:
    work = home / "restart"
    server = EmbeddedNats(data_dir=work / "nats")
    server.start()
    client = await connect(server.url, "bench")
    buses = [client]
    brains: list[BrainProc] = []
    rows: list[Row] = []
    try:
        began = time.monotonic()
        end = await append_records(client, finished_job_records(args.finished))
        built = time.monotonic() - began
        raw = await raw_log_read(client)
        where = f"{args.finished} finished jobs, {end} entries"
        cold = BrainProc(server.url, work, "cold")
        brains.append(cold)
        await cold.start(work / "history.db")
        cold_s = await wait_leading(client, cold)
        store = SnapshotStore(client)
        deadline = time.monotonic() + 120
        manifest = await store.latest_manifest()
        while (manifest is None or manifest.last_seq < end) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            manifest = await store.latest_manifest()
        cold_rss = cold.rss_mib()
        await cold.stop()
        rows.append(
            row(
                "start to leading, no snapshot (s)",
                where,
                round(cold_s, 2),
                "raw read of the log (s)",
                round(raw, 2),
                note=f"log built in {built:.1f} s; RSS {cold_rss:.0f} MiB",
            )
        )
        warm_times: list[float] = []
        for attempt in range(args.restarts):
            profiled = args.profile_restart and attempt == 0
            warm = BrainProc(
                server.url,
                work,
                f"warm-{attempt}",
                profile=work / "restart.prof" if profiled else None,
            )
            brains.append(warm)
            await warm.start(work / "history.db")
            warm_times.append(await wait_leading(client, warm))
            warm_rss = warm.rss_mib()
            await warm.stop()
        warm_s = statistics.median(warm_times)
        size = (
            f"{manifest.size / 1e6:.1f} MB ({manifest.raw_size / 1e6:.0f} MB raw)"
            if manifest
            else "no snapshot"
        )
        loaded = [line for line in warm.log.read_text().splitlines() if "entries replayed" in line]
        replayed = loaded[-1].split(": ", 1)[-1] if loaded else ""
        rows.append(
            row(
                f"restart to leading, snapshot (s, median of {args.restarts})",
                where,
                round(warm_s, 2),
                "raw read of the log (s)",
                round(raw, 2),
                note=f"max {max(warm_times):.2f} s; snapshot {size}; RSS {warm_rss:.0f} MiB; "
                f"{replayed}",
            )
        )
        fresh = BrainProc(server.url, work, "fresh")
        brains.append(fresh)
        await fresh.start(work / "history-new.db")
        fresh_s = await wait_leading(client, fresh)
        await fresh.stop()
        rows.append(
            row(
                "restart to leading, snapshot, history lost (s)",
                where,
                round(fresh_s, 2),
                "raw read of the log (s)",
                round(raw, 2),
                note="state from the snapshot; the whole log replayed into a new sqlite history",
            )
        )
        if args.profile_restart:
            import pstats

            print("\nwhere the restart's time went (cumulative, top 25):")
            pstats.Stats(str(work / "restart.prof")).sort_stats("cumulative").print_stats(25)
    finally:
        for brain in brains:
            await brain.stop()
        for bus in buses:
            await bus.close()
        server.stop()
    return rows


def row(
    measure: str, setting: str, brain: Any, baseline_name: str, baseline: Any, *, note: str = ""
) -> Row:
    ratio = ""
    if isinstance(brain, int | float) and isinstance(baseline, int | float) and baseline:
        ratio = f"{brain / baseline:.3g}"
    return {
        "measure": measure,
        "setting": setting,
        "brain": brain,
        "baseline": baseline_name,
        "baseline_value": baseline,
        "ratio": ratio,
        "note": note,
    }


async def run(args: argparse.Namespace) -> list[Row]:
    modes = set(args.modes)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.keep) if args.keep else Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        steps: list[tuple[str, Callable[[], Awaitable[list[Row]]]]] = []
        if modes & {"submit", "latency"}:
            steps.append(("submit/latency", lambda: mode_submit_latency(args, home, modes)))
        if "nodes" in modes:
            steps.append(("nodes", lambda: mode_nodes(args, home)))
        if "restart" in modes:
            steps.append(("restart", lambda: mode_restart(args, home)))
        for name, step in steps:
            began = time.monotonic()
            new = await step()
            rows += new
            print(f"[{name}: {time.monotonic() - began:.0f} s]", flush=True)
            for r in new:
                said = f"{r['baseline']}: {r['baseline_value']}"
                print(f"  {r['measure']}: {r['brain']} ({r['setting']}); {said} {r['note']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["submit", "latency", "nodes", "restart"],
        choices=["submit", "latency", "nodes", "restart"],
    )
    parser.add_argument("--nodes", type=int, default=1000, help="nodes for submit/latency")
    parser.add_argument("--pending", type=int, default=1000, help="pending jobs for the busy world")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--submit-s", type=float, default=10.0)
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--flood-nodes", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument(
        "--scrape-every",
        type=float,
        default=0.0,
        metavar="S",
        help="during the node flood, scrape the brain's /metrics every S seconds (0: never)",
    )
    parser.add_argument("--finished", type=int, default=5000, help="finished jobs for restart")
    parser.add_argument("--restarts", type=int, default=3, help="restarts over the snapshot")
    parser.add_argument("--profile-restart", action="store_true")
    parser.add_argument(
        "--profile-submit",
        action="store_true",
        help="run the submit/latency brains under cProfile (busy-*/brain.prof, with --keep)",
    )
    parser.add_argument(
        "--profile-nodes", action="store_true", help="run the nodes mode's brain under cProfile"
    )
    parser.add_argument("--keep", metavar="DIR", help="keep servers' data and brains' logs here")
    args = parser.parse_args()
    for name in ("nodes", "pending", "clients", "probes", "finished", "restarts"):
        if getattr(args, name) < (0 if name in ("pending", "finished") else 1):
            parser.error(f"--{name} must be positive, not {getattr(args, name)}")
    if args.submit_s <= 0 or args.flood_s <= 0 or min(args.flood_nodes) < 1:
        parser.error("--submit-s and --flood-s must be > 0, --flood-nodes at least 1")
    began = time.monotonic()
    rows = asyncio.run(run(args))
    keys = ["measure", "setting", "brain", "baseline", "baseline_value", "ratio"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys} if rows else {}
    print("\n" + "  ".join(f"{k:<{widths[k]}}" for k in keys))
    for r in rows:
        print("  ".join(f"{r[k]!s:<{widths[k]}}" for k in keys))
    settings = {k: v for k, v in vars(args).items()}
    notes = "brain: a `python -m cli brain` process (policy priority); cores shared with the bench"
    json_path, _ = record(
        "brain_scale",
        {"settings": settings, "notes": notes, "seconds": round(time.monotonic() - began)},
        rows,
    )
    print(f"\nwritten {json_path}")


if __name__ == "__main__":
    main()
