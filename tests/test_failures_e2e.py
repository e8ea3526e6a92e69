"""The failure path end to end: a real nats-server, a brain, simulated agents, real
processes. Classification, retries with back-off away from the failed node, the retry
limit, node loss and a returning node, and the history of every attempt."""

from __future__ import annotations

import asyncio
import os
import sys
from asyncio.subprocess import DEVNULL, PIPE
from pathlib import Path

from brain.core.failures import FailurePolicy
from schemas.api import HistoryReply, HistoryRequest
from schemas.jobs import FailureClass, JobSpec, JobState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit

REPO = str(Path(__file__).resolve().parents[1])
FAST = FailurePolicy(backoff_base_s=0.1, backoff_max_s=0.5)


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


async def test_user_error_is_not_retried_and_says_why(brain_factory, agent_factory) -> None:
    brain = await brain_factory(failures=FAST)
    await agent_factory("n1")
    await agent_factory("n2")
    await eventually(lambda: len(brain.state.nodes) == 2)
    job_id = await submit(
        brain.api,
        JobSpec(command=python("print('loading'); raise ValueError('lr must be > 0')"), gpus=1),
    )
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.FAILED
    assert job.attempt == 1
    (failure,) = job.failures
    assert failure.failure_class is FailureClass.USER
    assert job.reason is not None and "ValueError: lr must be > 0" in job.reason
    assert "Traceback (most recent call last):" in failure.log_tail


async def test_lost_node_job_retried_elsewhere_as_attempt_2(brain_factory, agent_factory) -> None:
    brain = await brain_factory(node_timeout_s=1.0, failures=FAST)
    first = await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)
    job_id = await submit(
        brain.api, JobSpec(command=python("import time; time.sleep(600)"), gpus=2)
    )
    await eventually(lambda: first.launcher.find(job_id))
    second = await agent_factory("n2", gpus=2)
    agent_factory.orphans.extend(await first.crash())
    await eventually(lambda: second.launcher.find(job_id), timeout_s=30)
    job = brain.state.jobs[job_id]
    assert (job.state, job.nodes, job.attempt) == (JobState.RUNNING, ("n2",), 2)
    (failure,) = job.failures
    assert failure.failure_class is FailureClass.INFRASTRUCTURE
    assert "node n1 was lost" in failure.reason
    assert job.avoid_nodes == ("n1",)
    reply = await brain.api.handle("default", HistoryRequest(job_id=job_id))
    assert isinstance(reply, HistoryReply)
    assert [(a.attempt, a.nodes, a.failure_class) for a in reply.attempts] == [
        (1, "n1", FailureClass.INFRASTRUCTURE),
        (2, "n2", None),
    ]


async def test_retries_stop_at_the_limit_unsuccessful(brain_factory, agent_factory) -> None:
    policy = FailurePolicy(infrastructure_retries=2, backoff_base_s=0.05, backoff_max_s=0.1)
    brain = await brain_factory(failures=policy)
    for n in range(4):
        await agent_factory(f"n{n}", gpus=1)
    await eventually(lambda: len(brain.state.nodes) == 4)
    nccl = "print('[E ProcessGroupNCCL.cpp:1] Watchdog caught collective operation timeout')"
    job_id = await submit(
        brain.api, JobSpec(command=python(f"{nccl}; raise SystemExit(1)"), gpus=1)
    )
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert job.state is JobState.UNSUCCESSFUL
    assert job.attempt == 3
    assert [f.failure_class for f in job.failures] == [FailureClass.INFRASTRUCTURE] * 3
    # Never twice on a node it failed on.
    assert len({f.nodes for f in job.failures}) == 3


async def test_returning_node_stale_process_is_stopped(brain_factory, agent_factory) -> None:
    brain = await brain_factory(node_timeout_s=1.0, failures=FAST)
    first = await agent_factory("n1", gpus=1)
    await eventually(lambda: brain.state.nodes)
    job_id = await submit(
        brain.api, JobSpec(command=python("import time; time.sleep(600)"), gpus=1)
    )
    (stale,) = await eventually(lambda: first.launcher.find(job_id))
    second = await agent_factory("n2", gpus=1)
    # A partition: n1 neither heartbeats nor hears commands, but its job runs on.
    for task in first._loops:
        task.cancel()
    first._loops.clear()
    assert first._commands is not None
    await first._commands.stop()
    first._commands = None
    await eventually(lambda: second.launcher.find(job_id), timeout_s=30)
    assert stale.process.returncode is None
    # n1 comes back; the brain has given its job away, so n1's process must stop.
    first._closing = False
    first._loops.append(first.bus.spawn(first._every(0.2, first.heartbeat), name="heartbeat"))
    first._loops.append(first.bus.spawn(first._consume_commands(), name="commands"))
    await eventually(lambda: stale.exited.is_set(), timeout_s=30)
    job = brain.state.jobs[job_id]
    assert (job.state, job.nodes, job.attempt) == (JobState.RUNNING, ("n2",), 2)
    await asyncio.sleep(0)  # let the stop's exit event drain before teardown


PRERUN = FailurePolicy(prerun_queues=("big",), prerun_min_gpus=2, prerun_s=1.5)


async def test_prerun_fails_fast_on_one_gpu(brain_factory, agent_factory) -> None:
    """Philly's pre-run: a large job of a pre-run queue first runs on one GPU; a job
    that dies there fails before it ever holds its large allocation."""
    brain = await brain_factory(failures=PRERUN)
    await agent_factory("n1", gpus=4)
    await eventually(lambda: "n1" in brain.state.nodes)
    spec = JobSpec(command=python("raise ValueError('bad config')"), gpus=4, queue="big")
    job_id = await submit(brain.api, spec)
    job = await eventually(lambda: (j := brain.state.jobs[job_id]).state.terminal and j)
    assert (job.state, job.attempt, job.prerun) == (JobState.FAILED, 1, "running")
    assert job.gpu_count == 1
    (failure,) = job.failures
    assert failure.failure_class is FailureClass.USER
    assert "ValueError: bad config" in (job.reason or "")


async def test_prerun_passes_then_takes_the_full_allocation(brain_factory, agent_factory) -> None:
    brain = await brain_factory(failures=PRERUN)
    agent = await agent_factory("n1", gpus=4)
    await eventually(lambda: "n1" in brain.state.nodes)
    sizes: list[tuple[str | None, int]] = []
    brain.record_observers.append(
        lambda record, seq: (
            sizes.append((record.job.prerun, record.job.gpu_count))
            if getattr(record, "job", None) is not None
            and record.job.job_id == job_id
            and record.job.state is JobState.RUNNING
            else None
        )
    )
    sleeper = python("import time; time.sleep(3)")
    job_id = await submit(brain.api, JobSpec(command=sleeper, gpus=4, queue="big"))
    # Neither a small job of the queue nor a large job of another queue pre-runs.
    small = await submit(brain.api, JobSpec(command=python("pass"), gpus=1, queue="big"))
    other = await submit(brain.api, JobSpec(command=python("pass"), gpus=2))
    job = await eventually(
        lambda: (j := brain.state.jobs[job_id]).state.terminal and j, timeout_s=60
    )
    assert job.state is JobState.SUCCEEDED and job.prerun == "passed"
    assert sizes[0] == ("running", 1) and sizes[-1] == ("passed", 4)
    assert job.gpu_count == 4
    for plain in (small, other):
        done = await eventually(lambda p=plain: (j := brain.state.jobs[p]).state.terminal and j)
        assert done.state is JobState.SUCCEEDED and done.prerun is None
    # Every exit reached the brain: the node's process ledger is empty again.
    await eventually(lambda: not agent.ledger.leftovers())


async def test_a_process_gone_with_its_agent_is_retried_and_never_left_running(
    brain_factory, agent_factory
) -> None:
    """An agent dies and its node's next agent comes up before the node is missed: the
    old agent's process is stopped (nobody can follow it now), and the brain fails the
    attempt as an infrastructure failure and runs it elsewhere."""
    brain = await brain_factory(node_timeout_s=1.0, failures=FAST)
    agents = {name: await agent_factory(name, gpus=2) for name in ("n1", "n2")}
    await eventually(lambda: len(brain.state.nodes) == 2)
    job_id = await submit(
        brain.api, JobSpec(command=python("import time; time.sleep(600)"), gpus=2)
    )
    await eventually(lambda: any(g.pid for g in brain.state.jobs[job_id].grants))
    (node,) = brain.state.jobs[job_id].nodes
    (other,) = {"n1", "n2"} - {node}
    (orphan,) = await agents[node].crash()
    agent_factory.orphans.append(orphan)
    restarted = await agent_factory(node, gpus=2)  # the node's agent restarts at once

    await eventually(lambda: agents[other].launcher.find(job_id), timeout_s=30)
    job = brain.state.jobs[job_id]
    assert (job.state, job.attempt, job.nodes) == (JobState.RUNNING, 2, (other,))
    (failure,) = job.failures
    assert failure.failure_class is FailureClass.INFRASTRUCTURE
    assert f"the agent of node {node} restarted" in failure.reason
    assert brain.state.nodes[node].state.value == "READY"  # never missed: not lost

    def gone() -> bool:
        try:
            os.kill(orphan, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{orphan}/stat").read_text().rpartition(")")[2].split()[0] == "Z"

    await eventually(gone)
    await eventually(lambda: not restarted.ledger.leftovers())


async def test_drain_for_maintenance_requeues_and_waits_until_the_node_runs_nothing(
    brain_factory, agent_factory, nats_server, tmp_path: Path
) -> None:
    """`alnair drain NODE --requeue --wait` (a real CLI process): what ran there goes
    back to its queue and runs elsewhere, spending no retry; the command returns once the
    node runs nothing. Without --requeue, --wait gives up saying what still runs."""
    brain = await brain_factory()
    n1 = await agent_factory("n1", gpus=2)  # the fuller fit: the job goes there first
    await agent_factory("n2", gpus=4)
    await eventually(lambda: len(brain.state.nodes) == 2)
    job_id = await submit(brain.api, JobSpec(command=("sleep", "600"), gpus=1, cwd=str(tmp_path)))

    def running_on(node: str) -> bool:
        job = brain.state.jobs[job_id]
        return (
            job.state is JobState.RUNNING
            and [g.node for g in job.grants] == [node]
            and all(g.pid for g in job.grants)
        )

    await eventually(lambda: running_on("n1"))
    env = {"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin", "ALNAIR_HOME": str(tmp_path)}
    base = [sys.executable, "-m", "cli", "drain", "n1", "--nats", nats_server.url]

    async def drain(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *base, *args, env=env, stdout=PIPE, stderr=PIPE, stdin=DEVNULL
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    code, _, err = await drain("--reason", "BIOS update", "--wait", "2")
    assert code == 1 and f"node n1 still runs job {job_id} after 2s" in err, err
    assert running_on("n1")  # drained, not stopped

    code, out, err = await drain("--reason", "BIOS update", "--requeue", "--wait", "60")
    assert code == 0, err
    assert out.rstrip().endswith("node n1 runs nothing now"), out
    assert not n1.launcher.running()  # its process too has gone: the node may go down
    await eventually(lambda: running_on("n2"))
    job = brain.state.jobs[job_id]
    assert job.failures == () and job.attempt == 2
    changes, _ = await brain.history.read_job_changes(job_id, 20)
    assert any(
        record.cause.message == "requeued: n1 drained by operator: BIOS update"
        for _, record in changes
    )


async def test_a_job_that_runs_past_its_time_limit_is_stopped_and_not_retried(
    brain_factory, agent_factory, tmp_path: Path
) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=1)
    await eventually(lambda: len(brain.state.nodes) == 1)
    spec = JobSpec(command=("sleep", "600"), gpus=1, cwd=str(tmp_path), time_limit_s=2.0)
    job_id = await submit(brain.api, spec)
    await eventually(lambda: agent.launcher.find(job_id))
    await eventually(lambda: brain.state.jobs[job_id].state is JobState.FAILED, timeout_s=30)
    job = brain.state.jobs[job_id]
    assert job.reason == "time limit 0:02 reached" and job.attempt == 1
    await eventually(lambda: not agent.launcher.find(job_id))  # its process stopped
    await asyncio.sleep(1.0)
    assert brain.state.jobs[job_id].attempt == 1  # never retried
