"""Shared GPUs end to end with simulated GPUs: a real nats-server, a brain, simulated
agents and real processes. Two half-GPU jobs share one GPU and get their MPS limits;
a GPU type no node has is refused at submission, and one larger than a node
runs on several; a share over its GPU memory limit is
stopped by its agent and classified as its own failure. (No MPS daemon runs here:
simulated GPUs account for shares and say nothing is enforced.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agents.mps import NOT_ENFORCED
from brain.core.decide import Policy
from schemas.api import (
    ErrorReply,
    GetJobRequest,
    JobReply,
    SubmitRequest,
    WhyReply,
    WhyRequest,
)
from schemas.jobs import AttemptFailure, FailureClass, JobSpec, JobState
from schemas.state import CauseKind, JobChanged, StateRecord
from schemas.telemetry import TelemetryBatch
from tests.conftest import eventually
from tests.test_cluster_e2e import submit

SHOW_ENV = (
    "import json, os, sys, time\n"
    "names = ('CUDA_VISIBLE_DEVICES', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE',\n"
    "         'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', 'ALNAIR_GPU_SHARE',\n"
    "         'ALNAIR_GPU_SHARE_ENFORCED')\n"
    "open(sys.argv[1], 'w').write(json.dumps({n: os.environ.get(n) for n in names}))\n"
    "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n"
)


def half_gpu_job(out: Path, stop: Path, memory_mib: int | None = 20480) -> JobSpec:
    return JobSpec(
        command=(sys.executable, "-c", SHOW_ENV, str(out), str(stop)),
        gpus=1,
        gpu_milli=500,
        gpu_memory_mib=memory_mib,
    )


async def test_two_half_gpu_jobs_share_one_gpu_with_mps_limits(
    brain_factory, agent_factory, tmp_path, caplog
) -> None:
    """The second asks no memory limit: it is given its share of the GPU's memory, so
    that the first's limit holds beside it."""
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=1, model="H100")
    await eventually(lambda: "n1" in brain.state.nodes)
    half = brain.state.nodes["n1"].gpus[0].memory_mib // 2
    stop = tmp_path / "stop"
    first = await submit(brain.api, half_gpu_job(tmp_path / "a.json", stop))
    second = await submit(brain.api, half_gpu_job(tmp_path / "b.json", stop, memory_mib=None))
    await eventually(lambda: (tmp_path / "a.json").exists() and (tmp_path / "b.json").exists())
    for job_id in (first, second):
        job = brain.state.jobs[job_id]
        assert job.state is JobState.RUNNING
        assert [(g.node, g.gpus) for g in job.grants] == [("n1", (0,))]
        assert job.reason is not None and "a 0.5 share of its GPU" in job.reason
    for name, limit in (("a.json", 20480), ("b.json", half)):
        env = json.loads((tmp_path / name).read_text())
        assert env == {
            "CUDA_VISIBLE_DEVICES": "0",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={limit}M",
            "ALNAIR_GPU_SHARE": "0.5",
            "ALNAIR_GPU_SHARE_ENFORCED": "0",
        }
    assert NOT_ENFORCED in caplog.text
    # `alnair job` shows the limit each is held to, the one it asked or its part.
    for job_id, limit in ((first, 20480), (second, half)):
        reply = await brain.api.handle("default", GetJobRequest(job_id=job_id))
        assert isinstance(reply, JobReply) and reply.gpu_memory_limit_mib == limit
    (shared,) = agent.share_report()
    assert shared.index == 0 and shared.enforcement == "accounted"
    assert sorted(u.job_id for u in shared.jobs) == sorted((first, second))
    assert sum(u.gpu_milli for u in shared.jobs) == 1000
    # The brain hears it in the heartbeat, as `alnair nodes` and /metrics show it, and
    # each share's use with the telemetry (what profiles take off the GPU's).
    await eventually(lambda: len(brain.shares("n1")) == 1 and len(brain.shares("n1")[0].jobs) == 2)
    batches: list[TelemetryBatch] = []
    brain.telemetry_observers.append(batches.append)
    batch = await eventually(lambda: next((b for b in batches if b.node == "n1"), None))
    assert batch.shares is not None
    assert sorted((s.index, s.job_id) for s in batch.shares) == sorted([(0, first), (0, second)])
    # A whole-GPU job waits: the GPU is shared.
    whole = await submit(brain.api, JobSpec(command=(sys.executable, "-c", "pass"), gpus=1))
    await eventually(lambda: brain.state.jobs[whole].reason not in (None, "submitted"))
    assert brain.state.jobs[whole].state is JobState.PENDING
    stop.touch()
    await eventually(lambda: brain.state.jobs[whole].state is JobState.SUCCEEDED)
    for job_id in (first, second):
        done = brain.state.jobs[job_id]
        assert done.state is JobState.SUCCEEDED
        # Service is its share of a GPU for as long as it ran (what LAS ranks by).
        assert done.executed_seconds > 0
        assert done.attained_gpu_seconds == pytest.approx(0.5 * done.executed_seconds)


async def test_a_type_no_node_has_is_refused_at_submit(brain_factory, agent_factory) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2, model="A100")
    await eventually(lambda: "n1" in brain.state.nodes)
    spec = JobSpec(command=("true",), gpus=1, gpu_types=("H100",))
    reply = await brain.api.handle("default", SubmitRequest(spec=spec))
    assert isinstance(reply, ErrorReply)
    assert reply.code == "invalid"
    assert "gpu_types: no node has GPUs of type H100" in reply.error
    too_much = JobSpec(command=("true",), gpus=1, gpu_memory_mib=200_000)
    reply = await brain.api.handle("default", SubmitRequest(spec=too_much))
    assert isinstance(reply, ErrorReply) and "gpu_memory_mib" in reply.error
    # The type it has is accepted, and placed on it.
    job_id = await submit(
        brain.api, JobSpec(command=("true",), gpus=1, gpu_types=("A100",), cpus=1.0)
    )
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.SUCCEEDED
    # Whole GPUs of a type, more than one node has, asking no CPUs or memory: on as many
    # nodes of the type as it takes.
    await agent_factory("n2", gpus=2, model="A100")
    await eventually(lambda: "n2" in brain.state.nodes)
    job_id = await submit(brain.api, JobSpec(command=("true",), gpus=4, gpu_types=("A100",)))
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.SUCCEEDED
    assert sorted((g.node, g.gpus) for g in job.grants) == [("n1", (0, 1)), ("n2", (0, 1))]


async def test_an_unconfined_agent_says_the_memory_and_cpus_it_does_not_enforce(
    brain_factory, agent_factory
) -> None:
    # Seen: a job with --memory 64MiB allocated 500 MB and succeeded, and nothing said
    # the limit was only a reservation on an agent that does not confine jobs.
    brain = await brain_factory()
    await agent_factory("n1", gpus=1)
    await eventually(lambda: "n1" in brain.state.nodes)
    job_id = await submit(brain.api, JobSpec(command=("true",), gpus=1, memory_mib=64, cpus=1.0))
    await eventually(lambda: brain.state.jobs[job_id].state.terminal)
    reply = await brain.api.handle("default", WhyRequest(job_id=job_id, limit=100))
    assert isinstance(reply, WhyReply)
    started = [d.cause.message for d in reply.decisions if d.cause.kind is CauseKind.STARTED]
    assert started == [
        f"process {brain.state.jobs[job_id].grants[0].pid} started on n1; its limits are "
        "not enforced there: memory 64 MiB, 1 CPU (its agent does not confine jobs: "
        "docs/security.md)"
    ]
    # A job that asked for neither is not told of the defaults a confining agent applies.
    plain = await submit(brain.api, JobSpec(command=("true",), gpus=1))
    await eventually(lambda: brain.state.jobs[plain].state.terminal)
    reply = await brain.api.handle("default", WhyRequest(job_id=plain, limit=100))
    assert isinstance(reply, WhyReply)
    started = [d.cause.message for d in reply.decisions if d.cause.kind is CauseKind.STARTED]
    assert len(started) == 1 and "not enforced" not in started[0]


async def failed_share(brain_factory, agent_factory, code: str) -> AttemptFailure:
    """Runs `code` as a quarter share with a 20,000 MiB limit; the failure it ends in."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=1, model="A100")
    await eventually(lambda: "n1" in brain.state.nodes)
    spec = JobSpec(
        command=(sys.executable, "-c", code), gpus=1, gpu_milli=250, gpu_memory_mib=20000
    )
    job_id = await submit(brain.api, spec)
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.FAILED
    (failure,) = job.failures
    return failure


async def test_a_share_over_its_gpu_memory_is_stopped_and_classified(
    brain_factory, agent_factory
) -> None:
    # A simulated GPU allocates nothing: the job says what it would use.
    greedy = (
        "import os, time\n"
        "path = os.path.join(os.environ['ALNAIR_SIM_GPU_MEMORY_DIR'], str(os.getpid()))\n"
        "open(path, 'w').write('30000')\n"
        "time.sleep(60)\n"
    )
    failure = await failed_share(brain_factory, agent_factory, greedy)
    assert failure.failure_class is FailureClass.USER
    assert "out of GPU memory: used 30000 MiB, over its limit of 20000 MiB" in failure.reason


# The parent declares 12,000 MiB and starts a child in a session of its own (out of the
# job's process group) that declares 12,000 more; the child goes when the parent does.
TWO_PROCESSES = (
    "import os, subprocess, sys, time\n"
    "declare = os.path.join(os.environ['ALNAIR_SIM_GPU_MEMORY_DIR'], '{}')\n"
    "child = ('import os, time\\n'\n"
    "         f'parent = {os.getpid()}\\n'\n"
    '         f\'open({declare!r}.format(os.getpid()), "w").write("12000")\\n\'\n'
    "         'while os.path.exists(f\"/proc/{parent}\"): time.sleep(0.05)\\n')\n"
    "subprocess.Popen([sys.executable, '-c', child], start_new_session=True)\n"
    "open(declare.format(os.getpid()), 'w').write('12000')\n"
    "time.sleep(60)\n"
)


async def test_a_share_is_charged_for_a_process_that_left_its_group(
    brain_factory, agent_factory
) -> None:
    # MPS would give each process its own 20,000 MiB: only the agent's sum stops it.
    failure = await failed_share(brain_factory, agent_factory, TWO_PROCESSES)
    assert "out of GPU memory: used 24000 MiB, over its limit of 20000 MiB" in failure.reason


PLAY = (
    "import os, sys, time\n"
    "path = os.path.join(os.environ['ALNAIR_SIM_GPU_MEMORY_DIR'], str(os.getpid()))\n"
    "open(path, 'w').write(sys.argv[1] + ' 20')\n"
    "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n"
    "open(path, 'w').write(sys.argv[3] + ' 20')\n"
    "time.sleep(120)\n"
)


async def test_colocation_moves_a_share_before_its_neighbour_runs_out_of_memory(
    brain_factory, agent_factory, tmp_path
) -> None:
    brain = await brain_factory()
    records: list[StateRecord] = []
    brain.record_observers.append(lambda record, seq: records.append(record))
    await agent_factory("n1", gpus=1, model="H100")
    await eventually(lambda: "n1" in brain.state.nodes)
    grow = tmp_path / "grow"
    # A shareable job that uses 20 % of its GPU and 16,000 MiB, until told to grow to
    # 76,000 MiB of the H100's 81,559.
    host = await submit(
        brain.api,
        JobSpec(
            command=(sys.executable, "-c", PLAY, "16000", str(grow), "76000"),
            gpus=1,
            shareable=True,
        ),
    )
    await eventually(lambda: host in brain.profiles.current(), timeout_s=30)
    guest = await submit(
        brain.api,
        JobSpec(command=("sleep", "120"), gpus=1, gpu_milli=250, gpu_memory_mib=20000),
    )
    placed = await eventually(
        lambda: (j := brain.state.jobs[guest]).state is JobState.RUNNING and j
    )
    assert [(g.node, g.gpus) for g in placed.grants] == [("n1", (0,))]
    assert placed.reason is not None and f"co-located with job {host}" in placed.reason
    # Another node joins; the host's memory grows toward its GPU's.
    await agent_factory("n2", gpus=1, model="H100")
    await eventually(lambda: "n2" in brain.state.nodes)
    grow.touch()
    moved = await eventually(
        lambda: (j := brain.state.jobs[guest]).attempt == 2 and j.state is JobState.RUNNING and j,
        timeout_s=40,
    )
    assert [g.node for g in moved.grants] == ["n2"]
    assert brain.state.jobs[host].state is JobState.RUNNING
    (pressure,) = [
        r.cause
        for r in records
        if isinstance(r, JobChanged) and r.job.job_id == guest and r.cause.preemption is not None
    ]
    assert pressure.preemption is not None
    assert pressure.preemption.reason == "memory_pressure"
    assert pressure.preemption.for_job == host
    assert pressure.message.startswith(f"memory pressure: GPU 0 of n1, shared with job {host}")


async def test_shares_of_two_tenants_take_turns_on_one_gpu(
    brain_factory, agent_factory, tmp_path
) -> None:
    """A shared GPU serves one tenant (an MPS daemon serves one Unix user, and confined
    tenants are users of their own): b's share waits, saying why, until a's has ended."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=1, model="H100")
    await eventually(lambda: "n1" in brain.state.nodes)
    stop = tmp_path / "stop"
    first = await submit(brain.api, half_gpu_job(tmp_path / "a.json", stop), tenant="a")
    await eventually(lambda: (tmp_path / "a.json").exists())
    second = await submit(brain.api, half_gpu_job(tmp_path / "b.json", stop), tenant="b")
    reason = await eventually(
        lambda: (r := brain.state.jobs[second].reason) and "open to tenant b" in r and r
    )
    assert "the GPUs with room serve other tenants' shares" in reason
    assert brain.state.jobs[second].state is JobState.PENDING
    assert brain.state.jobs[first].state is JobState.RUNNING
    stop.touch()
    await eventually(lambda: brain.state.jobs[second].state is JobState.SUCCEEDED)
    assert brain.state.jobs[first].state is JobState.SUCCEEDED


async def test_shares_make_room_for_a_better_ranked_whole_gpu_job(
    brain_factory, agent_factory, tmp_path
) -> None:
    """Under `priority`, a 2-GPU job of higher priority is not kept waiting by shares
    holding both GPUs: they are preempted, saying by whom, and it runs."""
    brain = await brain_factory(policy=Policy(order="priority"))
    records: list[StateRecord] = []
    brain.record_observers.append(lambda record, seq: records.append(record))
    await agent_factory("n1", gpus=2, model="H100")
    await eventually(lambda: "n1" in brain.state.nodes)
    shares = []
    for milli in (700, 700):  # one GPU each
        spec = JobSpec(command=("sleep", "120"), gpus=1, gpu_milli=milli, priority=0)
        shares.append(await submit(brain.api, spec))
    await eventually(lambda: all(brain.state.jobs[s].state is JobState.RUNNING for s in shares))
    done = tmp_path / "done"
    big = await submit(
        brain.api,
        JobSpec(command=(sys.executable, "-c", f"open({str(done)!r}, 'w')"), gpus=2, priority=10),
    )
    await eventually(lambda: done.exists(), timeout_s=30)
    assert sorted(g.node for g in brain.state.jobs[big].grants) == ["n1"]
    preempted = {
        r.job.job_id: r.cause
        for r in records
        if isinstance(r, JobChanged) and r.cause.kind is CauseKind.PREEMPTED
    }
    assert sorted(preempted) == sorted(shares)
    for cause in preempted.values():
        assert cause.preemption is not None and cause.preemption.for_job == big
        assert (
            cause.message
            == f"outranked by job {big} under priority: priority 10 ahead of priority 0"
        )
