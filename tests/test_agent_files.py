"""A node whose disk cannot take a launch's files (full, read-only, broken): the launch
fails as the node's fault, saying which file and why, and the job runs on another node;
an attempt the agent cannot record in its process ledger does not run on. And the
files an attempt has on its node do not outlive it. Real brain, agents, nats-server;
the broken file is a path that cannot be a directory, as on a disk gone wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from schemas.jobs import FailureClass, JobSpec, JobState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        ("blacklists", "cannot prepare it on node n1: "),
        ("logs", "cannot start it on node n1: "),
        ("processes", "cannot record it on node n1: "),
    ],
)
async def test_a_launch_a_nodes_files_fail_runs_on_another_node(
    brain_factory, agent_factory, tmp_path: Path, broken: str, says: str
) -> None:
    brain = await brain_factory()
    # n1 is placed on first: the fuller node that fits (one GPU).
    (tmp_path / "agents" / "n1").mkdir(parents=True)
    (tmp_path / "agents" / "n1" / broken).write_text("not a directory\n")
    n1 = await agent_factory("n1", gpus=1)
    n2 = await agent_factory("n2", gpus=4)
    await eventually(lambda: len(brain.state.nodes) == 2)
    marker = tmp_path / "ran-on"
    code = (
        f"import os, time\nopen({str(marker)!r}, 'a').write(os.environ['ALNAIR_NODE'] + ' ')\n"
        "time.sleep(600)"
    )
    job_id = await submit(
        brain.api, JobSpec(command=(sys.executable, "-c", code), gpus=1, cwd=str(tmp_path))
    )

    def running_on_n2() -> bool:
        job = brain.state.jobs[job_id]
        return job.state is JobState.RUNNING and [g.node for g in job.grants] == ["n2"]

    await eventually(running_on_n2, timeout_s=30)
    (failure,) = brain.state.jobs[job_id].failures
    assert failure.failure_class is FailureClass.INFRASTRUCTURE and failure.nodes == ("n1",)
    assert says in failure.reason, failure.reason
    await eventually(lambda: marker.is_file() and "n2" in marker.read_text())
    await eventually(lambda: not n1.launcher.running())  # nothing left on n1
    assert marker.read_text().split() in (["n2"], ["n1", "n2"])
    assert n2.launcher.find(job_id)


async def test_an_attempts_blacklist_copy_goes_with_it(
    brain_factory, agent_factory, tmp_path: Path
) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=1)
    stale = tmp_path / "agents" / "n1" / "blacklists" / "77-1.txt"
    await eventually(lambda: len(brain.state.nodes) == 1)
    job_id = await submit(brain.api, JobSpec(command=("true",), gpus=1, cwd=str(tmp_path)))
    await eventually(lambda: brain.state.jobs[job_id].state is JobState.SUCCEEDED)
    await eventually(lambda: not any((tmp_path / "agents" / "n1" / "blacklists").iterdir()))
    # One an agent that crashed left behind goes when the next agent starts.
    await agent.stop(stop_jobs=True)
    stale.write_text("s3://bucket/bad\n")
    await agent_factory("n1", gpus=1)
    assert not stale.exists()
