"""Partitions between real hosts (network namespaces, tests/multihost.py): 3 NATS
servers as one JetStream cluster, 2 brains, 3 agents, each on a host of its own.

The timings are small (node timeout 2 s, fence margin 2 s, the agents fence after
1.5 s plus 1 s of grace); no test asserts how long anything took, only what ran where
and when relative to what else ran. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from bus.client import Bus, ConnectOptions
from cli.client import call, submit
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    JOBS_RESULT,
    NODES_RESULT,
    STATUS_RESULT,
    CancelRequest,
    GetJobRequest,
    ListJobsRequest,
    ListNodesRequest,
    ResizeRequest,
    StatusReply,
    StatusRequest,
)
from schemas.commands import Stop
from schemas.errors import AlnairError
from schemas.jobs import JobRecord, JobSpec, JobState
from schemas.nodes import NodeState
from schemas.progress import Progress
from tests.conftest import elastic_train_spec, eventually
from tests.multihost import MultiHost, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TENANT = "default"

# The job notes its start, a tick every 50 ms and its stop (on SIGTERM) in a file all
# hosts share (namespaces share the file system and the clock).
RECORDER = r"""
import os, signal, sys, time
path, me = sys.argv[1], os.environ["ALNAIR_NODE"] + "/" + os.environ["ALNAIR_ATTEMPT"]
def note(what):
    with open(path, "a") as f:
        f.write(f"{me} {what} {time.time():.6f}\n")
def stop(*_):
    note("stop")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
note("start")
while True:
    time.sleep(0.05)
    note("tick")
"""
# An attempt killed without a stop line ended at most this long after its last tick.
TICK_SLACK_S = 0.5


@pytest.fixture
def multihost(tmp_path: Path) -> Iterator[MultiHost]:
    why = unavailable()
    if why:
        pytest.skip(f"no multi-host harness here: {why}")
    cluster = MultiHost(tmp_path / "hosts")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
async def client(multihost: MultiHost) -> AsyncIterator[Bus]:
    bus = await Bus.connect(ConnectOptions(servers=multihost.urls, name="test"), replicas=3)
    try:
        yield bus
    finally:
        await bus.close()


async def status(bus: Bus) -> StatusReply | None:
    try:
        return await call(bus, TENANT, "status", StatusRequest(), STATUS_RESULT, timeout_s=2.0)
    except (AlnairError, TimeoutError):
        return None


async def job(bus: Bus, job_id: str) -> JobRecord | None:
    try:
        reply = await call(bus, TENANT, "job", GetJobRequest(job_id=job_id), JOB_RESULT)
    except (AlnairError, TimeoutError):
        return None  # no leader right now
    return reply.job


async def node_states(bus: Bus) -> dict[str, NodeState]:
    try:
        reply = await call(bus, TENANT, "nodes", ListNodesRequest(), NODES_RESULT)
    except (AlnairError, TimeoutError):
        return {}
    return {n.record.name: n.record.state for n in reply.nodes}


async def ready(bus: Bus, cluster: MultiHost) -> None:
    """A brain leads and every agent's node is READY."""

    async def all_ready() -> bool:
        states = await node_states(bus)
        return all(states.get(n) is NodeState.READY for n in cluster.agent_hosts)

    await eventually(all_ready, timeout_s=120, interval_s=0.5)


async def running_started(bus: Bus, job_id: str, *, attempt: int) -> JobRecord:
    """The job's `attempt` runs and its process has started (its pid is known)."""

    async def started() -> JobRecord | None:
        record = await job(bus, job_id)
        if (
            record is not None
            and record.state is JobState.RUNNING
            and record.attempt == attempt
            and all(g.pid is not None for g in record.grants)
        ):
            return record
        return None

    found: JobRecord = await eventually(started, timeout_s=120, interval_s=0.2)
    return found


def recorder_spec(log: Path, **fields: object) -> JobSpec:
    return JobSpec(
        name="recorder",
        command=(sys.executable, "-c", RECORDER, str(log)),
        gpus=2,  # a whole node: the job is the only thing on it
        network_sensitive=True,  # never spread over two nodes' free GPUs
        cwd="/",
        **fields,
    )


def intervals(log: Path) -> dict[str, tuple[float, float, bool]]:
    """Each attempt's (start, end, stopped cleanly) from the shared file."""
    seen: dict[str, list[float]] = {}
    stopped: set[str] = set()
    for line in log.read_text().splitlines():
        who, what, at = line.split()
        seen.setdefault(who, []).append(float(at))
        if what == "stop":
            stopped.add(who)
    return {
        who: (min(times), max(times) + (0.0 if who in stopped else TICK_SLACK_S), who in stopped)
        for who, times in seen.items()
    }


def assert_never_two_at_once(log: Path) -> list[str]:
    spans = sorted(intervals(log).items(), key=lambda item: item[1][0])
    for (before, (_, end, _)), (after, (start, _, _)) in itertools.pairwise(spans):
        assert start >= end, f"{after} started at {start:.3f}, before {before} ended at {end:.3f}"
    return [who for who, _ in spans]


async def cancel(bus: Bus, job_id: str) -> None:
    await call(bus, TENANT, "cancel", CancelRequest(job_id=job_id), JOB_RESULT)

    async def ended() -> bool:
        record = await job(bus, job_id)
        return record is not None and record.state.terminal

    await eventually(ended, timeout_s=60, interval_s=0.2)


async def test_partitioned_node_job_runs_elsewhere_never_two_at_once(
    multihost: MultiHost, client: Bus, tmp_path: Path
) -> None:
    await ready(client, multihost)
    log = tmp_path / "recorder.log"
    job_id = (await submit(client, TENANT, recorder_spec(log))).job_id
    first = await running_started(client, job_id, attempt=1)
    (home,) = first.nodes
    multihost.partition(home)
    t = multihost.timings
    cut_for_s = 3 * t.node_timeout_s
    cut = asyncio.get_running_loop().time()
    second = await running_started(client, job_id, attempt=2)
    assert home not in second.nodes
    await asyncio.sleep(max(0.0, cut + cut_for_s - asyncio.get_running_loop().time()))
    multihost.heal(home)

    async def home_back() -> bool:
        return (await node_states(client)).get(home) is NodeState.READY

    await eventually(home_back, timeout_s=60, interval_s=0.5)
    # The healed node's first heartbeats and fenced exit have been through the brain.
    await asyncio.sleep(4 * t.heartbeat_s)
    now = await job(client, job_id)
    assert now is not None
    assert (now.state, now.attempt, now.nodes) == (JobState.RUNNING, 2, second.nodes)
    await cancel(client, job_id)
    await asyncio.sleep(1.0)  # the last stop line written
    order = assert_never_two_at_once(log)
    assert order == [f"{home}/1", f"{second.nodes[0]}/2"]
    spans = intervals(log)
    assert spans[f"{home}/1"][2], "the fenced attempt should have stopped on SIGTERM"


async def test_keep_job_survives_a_short_partition_and_is_not_run_elsewhere(
    multihost: MultiHost, client: Bus, tmp_path: Path
) -> None:
    await ready(client, multihost)
    keep_log = tmp_path / "keep.log"
    stop_log = tmp_path / "stop.log"
    keep_id = (await submit(client, TENANT, recorder_spec(keep_log, on_disconnect="keep"))).job_id
    kept = await running_started(client, keep_id, attempt=1)
    (home,) = kept.nodes
    # An ordinary job, cut off with it, measures "long enough": it runs elsewhere
    # (past node timeout and fence margin) while the keep job stays where it was.
    stop_id = (await submit(client, TENANT, recorder_spec(stop_log))).job_id
    other = await running_started(client, stop_id, attempt=1)
    cut = sorted({home, *other.nodes})
    for name in cut:
        multihost.partition(name)
    moved = await running_started(client, stop_id, attempt=2)
    assert not set(cut) & set(moved.nodes)
    still = await job(client, keep_id)
    assert still is not None
    assert (still.state, still.attempt, still.nodes) == (JobState.RUNNING, 1, (home,))
    for name in cut:
        multihost.heal(name)

    async def home_back() -> bool:
        return (await node_states(client)).get(home) is NodeState.READY

    await eventually(home_back, timeout_s=60, interval_s=0.5)
    await asyncio.sleep(4 * multihost.timings.heartbeat_s)
    after = await job(client, keep_id)
    assert after is not None
    assert (after.state, after.attempt, after.nodes) == (JobState.RUNNING, 1, (home,))
    spans = intervals(keep_log)
    assert list(spans) == [f"{home}/1"]
    assert not spans[f"{home}/1"][2], "the keep job was stopped through the partition"
    await cancel(client, keep_id)
    await cancel(client, stop_id)


async def listed(bus: Bus) -> list[JobRecord]:
    reply = await call(bus, TENANT, "jobs", ListJobsRequest(limit=10_000), JOBS_RESULT)
    return list(reply.jobs)


def assert_each_once(acknowledged: dict[str, str], jobs: list[JobRecord]) -> None:
    """Every acknowledged job (name -> id) is in the list exactly once, and no job of
    those names is there that was not acknowledged."""
    by_name: dict[str, list[str]] = {}
    for record in jobs:
        by_name.setdefault(record.spec.name, []).append(record.job_id)
    for name, job_id in acknowledged.items():
        assert by_name.get(name) == [job_id], f"{name}: acknowledged {job_id}, listed {by_name}"


async def test_partitioned_leader_is_replaced_and_its_epoch_fenced(
    multihost: MultiHost, client: Bus, tmp_path: Path
) -> None:
    await ready(client, multihost)
    before = await status(client)
    assert before is not None
    old_leader, old_epoch = before.brain_host, before.epoch
    assert old_leader in multihost.brain_hosts  # each brain runs under its host's name
    acknowledged: dict[str, str] = {}
    for i in range(5):
        spec = JobSpec(name=f"before-{i}", command=("true",), gpus=1, cwd="/")
        acknowledged[spec.name] = (await submit(client, TENANT, spec)).job_id
    multihost.partition(old_leader)

    async def new_leader() -> StatusReply | None:
        now = await status(client)
        return now if now is not None and now.brain_host != old_leader else None

    after: StatusReply = await eventually(new_leader, timeout_s=120, interval_s=0.5)
    assert after.epoch > old_epoch
    # Submissions go on under the new leader (submit retries through the failover
    # with one idempotency key each: never two jobs for one request).
    for i in range(5):
        spec = JobSpec(name=f"after-{i}", command=("true",), gpus=1, cwd="/")
        acknowledged[spec.name] = (await submit(client, TENANT, spec, retry_for_s=60)).job_id
    # A job the new leader launched; then a late Stop for it, stamped with the old
    # leader's epoch, as the old leader would send it: the agent refuses it.
    log = tmp_path / "fenced-epoch.log"
    running_id = (await submit(client, TENANT, recorder_spec(log))).job_id
    running = await running_started(client, running_id, attempt=1)
    (node,) = running.nodes
    rejections: list[bytes] = []

    async def heard(msg: Msg) -> None:
        rejections.append(msg.data)

    sub = await client.nc.subscribe(subjects.node(node, "event"), cb=heard)
    late = Stop(
        command_id=f"late-stop-{running_id}",
        epoch=old_epoch,
        issued_at=time.time(),
        job_id=running_id,
        reason="a late command from the deposed leader",
        grace_s=1.0,
    )
    await client.publish_durable(subjects.node(node, "cmd"), late, msg_id=late.command_id)

    def refused() -> bool:
        return any(
            late.command_id.encode() in data and b"stale epoch" in data for data in rejections
        )

    await eventually(refused, timeout_s=60, interval_s=0.2)
    await sub.unsubscribe()
    multihost.heal(old_leader)

    async def one_leader() -> bool:
        now = await status(client)
        return now is not None and sum(b.leader for b in now.brains) == 1 and len(now.brains) == 2

    await eventually(one_leader, timeout_s=120, interval_s=0.5)
    still = await job(client, running_id)
    assert still is not None
    assert (still.state, still.attempt) == (JobState.RUNNING, 1)
    assert list(intervals(log)) == [f"{node}/1"]
    assert not intervals(log)[f"{node}/1"][2], "the stale stop was obeyed"
    assert_each_once(acknowledged, await listed(client))
    await cancel(client, running_id)


async def test_nats_server_cut_off_while_submissions_flow(
    multihost: MultiHost, client: Bus
) -> None:
    await ready(client, multihost)
    state = await client.stream_cluster(subjects.STREAM_STATE)
    victim = state.leader if state is not None and state.leader else "nats-1"
    acknowledged: dict[str, str] = {}
    cut = False
    for i in range(40):
        if i == 10:
            multihost.isolate_nats(victim)  # the server leading STATE, mid-flow
            cut = True
        spec = JobSpec(name=f"flow-{i}", command=("true",), gpus=1, cwd="/")
        acknowledged[spec.name] = (await submit(client, TENANT, spec, retry_for_s=90)).job_id
    assert cut
    multihost.heal(victim)

    async def all_listed() -> list[JobRecord] | None:
        try:
            jobs = await listed(client)
        except (AlnairError, TimeoutError):
            return None
        names = {j.spec.name for j in jobs}
        return jobs if set(acknowledged) <= names else None

    jobs: list[JobRecord] = await eventually(all_listed, timeout_s=120, interval_s=0.5)
    assert_each_once(acknowledged, jobs)
    assert len({j.job_id for j in jobs}) == len(jobs)


async def test_logs_from_another_host(multihost: MultiHost, client: Bus, tmp_path: Path) -> None:
    await ready(client, multihost)
    code = (
        "import socket, time\n"
        "print('hello from', socket.gethostname(), flush=True)\n"
        "time.sleep(600)"
    )
    spec = JobSpec(name="hello", command=(sys.executable, "-c", code), gpus=1, cwd="/")
    job_id = (await submit(client, TENANT, spec)).job_id
    running = await running_started(client, job_id, attempt=1)
    (node,) = running.nodes
    elsewhere = next(h for h in multihost.agent_hosts if h != node)
    argv = multihost.alnair("logs", job_id, "--nats", ",".join(multihost.urls))

    def read() -> str | None:
        done = multihost.run_on(elsewhere, argv)
        return done.stdout if "hello from" in done.stdout else None

    out: str = await eventually(lambda: asyncio.to_thread(read), timeout_s=60, interval_s=0.5)
    # The job's own output, naming the host it ran on, read on another host.
    assert out.splitlines()[0] == f"hello from {node}"
    await cancel(client, job_id)


HOROVODRUN = Path(sys.executable).parent / "horovodrun"


@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(600)
async def test_elastic_job_across_hosts_grows_onto_a_third_and_shrinks_back(
    multihost: MultiHost, client: Bus, tmp_path: Path
) -> None:
    """An elastic Horovod job over two hosts (Gloo over the bridge, eth0), grown onto
    a third host and shrunk back, its workers stepping at each size."""
    await ready(client, multihost)
    reports: list[Progress] = []

    async def on_progress(report: Progress, msg: Msg) -> None:
        reports.append(report)

    await client.subscribe(subjects.ALL_JOB_PROGRESS, Progress, on_progress)

    def stepping_at(size: int) -> Progress | None:
        last = reports[-1] if reports else None
        return last if last and last.world_size == size and len(last.workers) == size else None

    stop_file = tmp_path / "stop"
    spec = elastic_train_spec(4, stop_file, max_gpus=6, name="wide")
    job_id = (await submit(client, TENANT, spec)).job_id
    await eventually(lambda: stepping_at(4), timeout_s=180, interval_s=0.5)
    started = await job(client, job_id)
    assert started is not None and len(started.nodes) == 2, started
    sizes = {}
    for size in (6, 4):
        await call(client, TENANT, "resize", ResizeRequest(job_id=job_id, gpus=size), JOB_RESULT)

        async def settled() -> JobRecord | None:
            record = await job(client, job_id)
            return record if record is not None and record.resize is None else None

        done: JobRecord = await eventually(settled, timeout_s=180, interval_s=0.5)
        await eventually(lambda s=size: stepping_at(s), timeout_s=120, interval_s=0.5)
        sizes[size] = {g.node: len(g.gpus) for g in done.grants if g.gpus}
    assert len(sizes[6]) == 3, sizes  # onto a third host
    assert sum(sizes[4].values()) == 4, sizes
    stop_file.touch()

    async def ended() -> JobRecord | None:
        record = await job(client, job_id)
        return record if record is not None and record.state.terminal else None

    final: JobRecord = await eventually(ended, timeout_s=120, interval_s=0.5)
    assert final.state is JobState.SUCCEEDED, final.reason


@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("hosts", [2, 3])
async def test_elastic_job_shrinks_off_lost_hosts_and_goes_on(
    multihost: MultiHost, client: Bus, tmp_path: Path, hosts: int
) -> None:
    """An elastic Horovod job over two (three) hosts loses every host but its
    supervisor's at once (their links down): the brain shrinks it off them instead of
    failing the attempt (with two lost, missed perhaps a tick apart, a second shed
    supersedes the first), the workers left go on stepping at the smaller size in the
    same attempt, and the hosts back again change nothing."""
    await ready(client, multihost)
    reports: list[Progress] = []

    async def on_progress(report: Progress, msg: Msg) -> None:
        reports.append(report)

    await client.subscribe(subjects.ALL_JOB_PROGRESS, Progress, on_progress)

    def stepping_at(size: int, after: int = 0) -> Progress | None:
        last = reports[-1] if len(reports) > after else None
        return last if last and last.world_size == size and len(last.workers) == size else None

    stop_file = tmp_path / "stop"
    size = 2 * hosts  # each agent has 2 GPUs
    spec = elastic_train_spec(size, stop_file, max_gpus=size, name="survivor")
    job_id = (await submit(client, TENANT, spec)).job_id
    await eventually(lambda: stepping_at(size), timeout_s=180, interval_s=0.5)
    started = await job(client, job_id)
    assert started is not None and len(started.nodes) == hosts, started
    first, *others = started.nodes
    step_before = reports[-1].step
    for other in others:
        multihost.partition(other)

    async def shrunk() -> JobRecord | None:
        record = await job(client, job_id)
        if record is None or record.resize is not None:
            return None
        return record if record.nodes == (first,) else None

    done: JobRecord = await eventually(shrunk, timeout_s=180, interval_s=0.5)
    attempt = started.attempt  # (a launch lost while the cluster came up may count)
    assert (done.state, done.attempt) == (JobState.RUNNING, attempt), done.reason
    # (The policy moves it again only once it has run 4x as long as this resize took.)
    assert [(g.node, len(g.gpus)) for g in done.grants] == [(first, 2)], done.grants
    assert set(others) <= set(done.failed_nodes)
    seen = len(reports)
    at_two: Progress = await eventually(lambda: stepping_at(2, seen), timeout_s=120, interval_s=0.5)
    # Trained on, not restarted: back at most to the last commit (every 5 steps).
    assert at_two.step >= step_before - 5
    for other in others:
        multihost.heal(other)

    async def others_back() -> bool:
        states = await node_states(client)
        return all(states.get(other) is NodeState.READY for other in others)

    await eventually(others_back, timeout_s=60, interval_s=0.5)
    # The healed node's heartbeats and its fenced worker host's exit are through.
    await asyncio.sleep(4 * multihost.timings.heartbeat_s)
    still = await job(client, job_id)
    assert still is not None
    assert (still.state, still.attempt) == (JobState.RUNNING, attempt), still.reason
    stop_file.touch()

    async def ended() -> JobRecord | None:
        record = await job(client, job_id)
        return record if record is not None and record.state.terminal else None

    final: JobRecord = await eventually(ended, timeout_s=120, interval_s=0.5)
    assert (final.state, final.attempt) == (JobState.SUCCEEDED, attempt), final.reason
