"""The elastic supervisor against real `horovodrun --gloo` on CPU and a real nats-server.

Resize commands travel over NATS exactly as the brain sends them; the workers are real
Horovod processes running workloads/examples/elastic_train.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from bus.client import Bus
from schemas import subjects
from schemas.base import decode
from schemas.commands import Resize
from schemas.events import NODE_EVENT, NodeEvent, ResizeCompleted
from schemas.jobs import NodeGpus
from schemas.progress import Progress
from tests.conftest import eventually, open_ended_training

REPO = Path(__file__).resolve().parent.parent
EXEC_SECRET = "a-secret-only-this-job-knows"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed"),
    pytest.mark.timeout(150),
]


@dataclass
class Watch:
    """Everything the job said on the bus, in arrival order."""

    progress: list[Progress] = field(default_factory=list)
    resizes: dict[str, ResizeCompleted] = field(default_factory=dict)

    def latest(self) -> Progress | None:
        return self.progress[-1] if self.progress else None

    def stepping_at(self, size: int) -> Progress | None:
        """A report in which `size` distinct workers step at world size `size`."""
        last = self.latest()
        if last is None or last.world_size != size or len(last.workers) != size:
            return None
        return last if all(w.world_size == size for w in last.workers) else None

    def digests_by_step(self, since: int = 0) -> dict[int, set[str]]:
        seen: dict[int, set[str]] = {}
        for message in self.progress[since:]:
            for worker in message.workers:
                seen.setdefault(worker.step, set()).add(worker.param_digest)
        return seen

    def all_ranks_agree_at(self, size: int) -> bool:
        """Some step at which `size` distinct workers at that size reported the same digest."""
        pids_by_step: dict[int, set[int]] = {}
        for message in self.progress:
            for worker in message.workers:
                if worker.world_size == size:
                    pids_by_step.setdefault(worker.step, set()).add(worker.pid)
        return any(len(pids) >= size for pids in pids_by_step.values())


@dataclass
class Job:
    process: subprocess.Popen[bytes]
    stop_file: Path
    log_path: Path


@pytest.fixture
async def bus(connect: Callable[[str], Awaitable[Bus]]) -> Bus:
    bus = await connect("test")
    await bus.ensure_streams()
    return bus


@pytest.fixture
async def watch(bus: Bus) -> AsyncIterator[Watch]:
    seen = Watch()

    async def on_progress(message: Progress, msg: Msg) -> None:
        seen.progress.append(message)

    async def on_event(data: Msg) -> None:
        event: NodeEvent = decode(data.data, NODE_EVENT)
        if isinstance(event, ResizeCompleted):
            seen.resizes[event.command_id] = event

    await bus.subscribe(subjects.ALL_JOB_PROGRESS, Progress, on_progress)
    sub = await bus.nc.subscribe(subjects.ALL_JOB_EVENTS, cb=on_event)
    try:
        yield seen
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


@pytest.fixture
def start_job(nats_server: object, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(
        job_id: str,
        *,
        np: int,
        min_np: int = 1,
        max_np: int = 4,
        gpus: str | None = None,
        remote: tuple[str, ...] = (),
        train_args: tuple[str, ...] = (),
    ) -> Job:
        stop_file = tmp_path / f"{job_id}.stop"
        log_path = tmp_path / f"{job_id}.log"
        command = [
            sys.executable,
            "-m",
            "workloads.supervisor",
            f"--job-id={job_id}",
            f"--nats={nats_server.url}",  # type: ignore[attr-defined]
            "--node=n1",
            f"--min-np={min_np}",
            f"--max-np={max_np}",
            f"--np={np}",
            "--progress-interval=0",
            f"--work-dir={tmp_path / job_id}",
            *(f"--remote={r}" for r in remote),
            "--",
            *open_ended_training(stop_file, *train_args),
        ]
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        # As the agent sets it: remote_exec reaches the other nodes' worker hosts with it.
        env.update(ALNAIR_JOB_ID=job_id, ALNAIR_NATS=nats_server.url)  # type: ignore[attr-defined]
        if gpus is not None:  # as the agent sets it for the launch's GPUs
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if remote:  # the attempt's secret, which the brain gives each of its nodes
            env["ALNAIR_EXEC_SECRET"] = EXEC_SECRET
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        job = Job(process, stop_file, log_path)
        jobs.append(job)
        return job

    try:
        yield start
    finally:
        for job in jobs:
            if job.process.poll() is None:
                job.process.send_signal(signal.SIGTERM)
                try:
                    job.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(job.process.pid, signal.SIGKILL)
                    job.process.wait()


async def finish(job: Job) -> int:
    job.stop_file.touch()
    await eventually(lambda: job.process.poll() is not None, timeout_s=60)
    code = job.process.returncode
    assert code == 0, job.log_path.read_text()[-4000:]
    return code


async def resize(
    bus: Bus,
    watch: Watch,
    job_id: str,
    size: int,
    *,
    epoch: int = 1,
    gpus: tuple[int, ...] = (),
    placement: tuple[NodeGpus, ...] = (),
) -> ResizeCompleted:
    """Resize `job_id` as the brain would: `gpus`, its GPUs on n1 (its only node), or
    `placement`, its GPUs per node."""
    command = Resize(
        command_id=uuid.uuid4().hex,
        epoch=epoch,
        issued_at=time.time(),
        job_id=job_id,
        world_size=size,
        cause="test",
        placement=placement or ((NodeGpus(node="n1", gpus=gpus),) if gpus else ()),
    )
    await bus.publish_durable(subjects.job(job_id, "cmd"), command, msg_id=command.command_id)
    outcome: ResizeCompleted = await eventually(
        lambda: watch.resizes.get(command.command_id), timeout_s=60
    )
    assert outcome.ok, outcome.reason
    assert outcome.to_size == size
    return outcome


def assert_steps_never_go_back(watch: Watch) -> None:
    steps = [p.step for p in watch.progress]
    assert steps == sorted(steps), "the step counter went back"


def assert_params_identical(watch: Watch, *, since: int = 0) -> None:
    """Every step's parameters agree across ranks (in the progress messages from index
    `since` on: a failure rolls back to the last commit, and the steps redone after it
    may differ from those lost, legitimately)."""
    for step, digests in watch.digests_by_step(since).items():
        assert len(digests) == 1, f"ranks disagree on parameters at step {step}: {digests}"


async def test_resize_2_3_1_2_keeps_workers_and_state(
    bus: Bus, watch: Watch, start_job: Callable[..., Job]
) -> None:
    # The launch's GPUs are 4 and 6; each resize names the job's GPUs as the brain would.
    job = start_job("el1", np=2, gpus="4,6")
    start = await eventually(lambda: watch.stepping_at(2), timeout_s=60)
    pids = {w.pid for w in start.workers}
    gpu_of = {w.pid: w.gpu for w in start.workers}
    assert sorted(gpu_of.values()) == [4, 6]  # type: ignore[type-var]
    held = (4, 6)

    for size, added in ((3, (1,)), (1, ()), (2, (7,))):
        before = {w.pid for w in watch.latest().workers}  # type: ignore[union-attr]
        grant = (*held, *added) if added else held[:size]
        outcome = await resize(bus, watch, "el1", size, gpus=grant)
        now = await eventually(lambda s=size: watch.stepping_at(s), timeout_s=30)
        after = {w.pid for w in now.workers}
        # Survivors keep their processes: a grow adds, a shrink removes, none restarts.
        if size > len(before):
            assert before <= after
        else:
            assert after <= before
        # One GPU per worker, each survivor on the GPU it had; a grow's new workers on
        # the added GPUs; the outcome names what the workers hold (after a shrink, the
        # GPUs of the workers Horovod kept, not necessarily the brain's first ones).
        gpus = {w.pid: w.gpu for w in now.workers}
        assert len(set(gpus.values())) == size
        assert all(gpus[pid] == gpu_of[pid] for pid in after & before)
        (part,) = outcome.placement
        assert part.node == "n1" and set(part.gpus) == set(gpus.values())
        if added:
            assert set(part.gpus) == set(grant)
        gpu_of.update(gpus)
        held = tuple(sorted(part.gpus))
        await eventually(lambda s=size: watch.all_ranks_agree_at(s), timeout_s=30)
        assert_steps_never_go_back(watch)
        assert_params_identical(watch)
        pids |= after

    # The resize outcomes were reported once each, with a duration.
    assert len(watch.resizes) == 3
    assert all(r.duration_s > 0 for r in watch.resizes.values())
    assert [r.released_gpus for r in watch.resizes.values()] == [0, 2, 0]
    await finish(job)
    assert "removed from elastic job" in job.log_path.read_text()


async def test_adaptive_batch_follows_the_world_size_and_reports_goodput(
    bus: Bus, watch: Watch, start_job: Callable[..., Job]
) -> None:
    # Base batch 16 per worker; the job may pick 4..128 per worker, 512 in all.
    job = start_job("ad1", np=2, train_args=("--adaptive-batch",))

    def adapted(size: int) -> Progress | None:
        """A report at `size` workers with a batch the job chose (not 16 per worker)."""
        return next(
            (
                p
                for p in reversed(watch.progress)
                if p.world_size == size
                and len(p.workers) == size
                and p.goodput is not None
                and p.batch_size is not None
                and p.batch_size != 16 * size
            ),
            None,
        )

    first = await eventually(lambda: adapted(2), timeout_s=90)
    assert first.batch_size is not None and first.goodput is not None
    assert 2 * 4 <= first.batch_size <= 512
    # Goodput is samples/s at the base batch's (16's) worth: a sample of a bigger batch
    # is worth less, of a smaller one more.
    bigger = first.batch_size >= 16
    assert first.goodput > 0
    assert (first.goodput <= first.samples_per_s * 1.0001) == bigger, first

    await resize(bus, watch, "ad1", 3)
    after = await eventually(lambda: adapted(3), timeout_s=90)
    assert after.batch_size is not None and after.batch_size <= 512
    # The ranks step with the same batch (rank 0 decides), and stay in sync.
    by_step: dict[int, set[int | None]] = {}
    for message in watch.progress:
        for worker in message.workers:
            by_step.setdefault(worker.step, set()).add(worker.batch_size)
    assert all(len(batches) == 1 for batches in by_step.values()), by_step
    assert_steps_never_go_back(watch)
    assert_params_identical(watch)
    await finish(job)


async def test_stale_epoch_and_duplicate_commands_are_refused(
    bus: Bus, watch: Watch, start_job: Callable[..., Job]
) -> None:
    job = start_job("el2", np=1, max_np=2)
    await eventually(lambda: watch.stepping_at(1), timeout_s=60)
    await resize(bus, watch, "el2", 1, epoch=5)
    stale = Resize(command_id="stale", epoch=4, issued_at=time.time(), job_id="el2", world_size=2)
    await bus.publish_durable(subjects.job("el2", "cmd"), stale, msg_id="stale")
    refused: ResizeCompleted = await eventually(lambda: watch.resizes.get("stale"))
    assert not refused.ok
    assert "stale epoch" in refused.reason
    assert watch.stepping_at(1) is not None
    await finish(job)


async def test_sigkilled_worker_recovers_from_last_commit(
    bus: Bus, watch: Watch, start_job: Callable[..., Job]
) -> None:
    job = start_job("el3", np=2, gpus="0,1")
    first = await eventually(lambda: watch.stepping_at(2), timeout_s=60)
    await eventually(lambda: (watch.latest() or first).step >= first.step + 10)
    victim = max(first.workers, key=lambda w: w.rank)
    killed_at = watch.latest().step  # type: ignore[union-attr]
    before_kill = len(watch.progress)
    os.kill(victim.pid, signal.SIGKILL)

    def recovered() -> Progress | None:
        now = watch.stepping_at(2)
        if now is None or now.step <= killed_at + 5:
            return None
        return now if victim.pid not in {w.pid for w in now.workers} else None

    back = await eventually(recovered, timeout_s=40)
    # The kernel freed the killed worker's GPU; its replacement claimed that one.
    assert sorted(w.gpu for w in back.workers) == [0, 1]  # type: ignore[type-var]
    # The job itself never restarted: the same supervisor and horovodrun run on, from
    # the last commit (a commit every 5 steps), not from the start.
    assert job.process.poll() is None
    resumed = min(p.step for p in watch.progress[before_kill:])
    assert killed_at - 10 <= resumed <= killed_at + 5, (killed_at, resumed)
    assert_params_identical(watch, since=watch.progress.index(back))
    await finish(job)


def start_worker_host(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The job's process on another node, as that node's agent would start it."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "workloads.worker_host"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = parent_of(pid)
    return False


async def test_a_job_grows_onto_another_node_and_leaves_it_through_its_worker_host(
    nats_server: object, bus: Bus, watch: Watch, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    """A job on two nodes: horovodrun (through workloads.hvdrun) starts the other node's
    workers through that node's worker host, as the node's agent would run it, not ssh.
    One host stands in for both nodes; `n2` resolves nowhere, so Horovod treats it as
    remote. The job grows there (the worker host's new worker claims the added GPU) and
    shrinks off it (its workers retire; the supervisor's node keeps its own)."""
    env = {
        **os.environ,
        "ALNAIR_JOB_ID": "el4",
        "ALNAIR_NODE": "n2",
        "ALNAIR_NATS": nats_server.url,  # type: ignore[attr-defined]
        "CUDA_VISIBLE_DEVICES": "2,3",
        "ALNAIR_EXEC_SECRET": EXEC_SECRET,
    }
    host = start_worker_host(env, tmp_path / "n2.log")
    try:
        job = start_job("el4", np=3, max_np=4, gpus="0,1", remote=("n2=1",))
        running = await eventually(lambda: watch.stepping_at(3), timeout_s=90)
        remote = [w for w in running.workers if descends_from(w.pid, host.pid)]
        local = [w for w in running.workers if descends_from(w.pid, job.process.pid)]
        assert len(remote) == 1 and len(local) == 2, running.workers
        # Each node's worker claimed one of that node's GPUs.
        assert remote[0].gpu in (2, 3) and {w.gpu for w in local} == {0, 1}
        await eventually(lambda: watch.all_ranks_agree_at(3), timeout_s=30)
        assert_params_identical(watch)

        # Grow on n2: its worker host is told the node's GPUs, the new worker takes the
        # one not held.
        both = (NodeGpus(node="n1", gpus=(0, 1)), NodeGpus(node="n2", gpus=(2, 3)))
        grown = await resize(bus, watch, "el4", 4, placement=both)
        now = await eventually(lambda: watch.stepping_at(4), timeout_s=60)
        assert {w.pid for w in running.workers} <= {w.pid for w in now.workers}
        assert {w.gpu for w in now.workers} == {0, 1, 2, 3}
        assert {p.node: set(p.gpus) for p in grown.placement} == {"n1": {0, 1}, "n2": {2, 3}}
        await eventually(lambda: watch.all_ranks_agree_at(4), timeout_s=30)

        # Shrink off n2: both its workers retire, n1's keep stepping in the same process.
        home = (NodeGpus(node="n1", gpus=(0, 1)),)
        shrunk = await resize(bus, watch, "el4", 2, placement=home)
        assert shrunk.released_gpus == 2 and shrunk.placement == home
        left = await eventually(lambda: watch.stepping_at(2), timeout_s=60)
        assert {w.pid for w in left.workers} == {w.pid for w in local}
        await eventually(lambda: watch.all_ranks_agree_at(2), timeout_s=30)
        assert_steps_never_go_back(watch)
        assert_params_identical(watch)
        # A placement without a worker on the supervisor's node is refused.
        command = Resize(
            command_id="away",
            epoch=1,
            issued_at=time.time(),
            job_id="el4",
            world_size=2,
            placement=(NodeGpus(node="n2", gpus=(2, 3)),),
        )
        await bus.publish_durable(subjects.job("el4", "cmd"), command, msg_id="away")
        outcome: ResizeCompleted = await eventually(lambda: watch.resizes.get("away"))
        assert not outcome.ok and "leaves no worker on node n1" in outcome.reason
        await finish(job)
        # horovodrun saw the remote workers end as it would an ssh session.
        for worker in remote:
            await eventually(lambda w=worker: not Path(f"/proc/{w.pid}").exists(), timeout_s=30)
    finally:
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=30) == 0, (tmp_path / "n2.log").read_text()[-3000:]
