"""The brain's state is a fold of the STATE log; epochs fence an older brain."""

from __future__ import annotations

import sys

from brain.service import Brain
from schemas.api import JobReply, SubmitRequest
from schemas.commands import Launch
from schemas.jobs import JobSpec, JobState
from tests.conftest import eventually


async def test_restarted_brain_rebuilds_from_the_log(
    brain_factory, agent_factory, tmp_path
) -> None:
    first: Brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: first.state.nodes)
    done = await first.api.handle(
        "default", SubmitRequest(spec=JobSpec(command=(sys.executable, "-c", "pass"), gpus=1))
    )
    assert isinstance(done, JobReply)
    await eventually(lambda: first.state.jobs[done.job.job_id].state is JobState.SUCCEEDED)
    waiting = await first.api.handle(
        "default", SubmitRequest(spec=JobSpec(command=("true",), gpus=2, queue="q2"))
    )
    assert isinstance(waiting, JobReply)
    await first.stop()
    jobs_before = dict(first.state.jobs)

    (tmp_path / "history-1.db").unlink(missing_ok=True)  # history is rebuilt from the log
    second: Brain = await brain_factory()
    assert second.epoch > first.epoch
    assert set(second.state.jobs) >= set(jobs_before)
    assert second.state.jobs[done.job.job_id] == jobs_before[done.job.job_id]
    assert second.state.next_job_id() == str(int(waiting.job.job_id) + 1)
    rows = second.history.job_events(done.job.job_id)
    assert [r["state"] for r in rows if r["state"]][-1] == "SUCCEEDED"


async def test_agent_refuses_commands_from_an_older_epoch(agent_factory, connect) -> None:
    await (await connect("setup")).ensure_streams()
    agent = await agent_factory("n1", gpus=1)

    def launch(command_id: str, epoch: int, job_id: str) -> Launch:
        return Launch(
            command_id=command_id,
            epoch=epoch,
            issued_at=0.0,
            job_id=job_id,
            attempt=1,
            gpus=(0,),
            command=(sys.executable, "-c", "import time; time.sleep(30)"),
            expires_at=agent.clock() + 60,
        )

    await agent.handle_command(launch("c1", 5, "a"))
    assert agent.epoch == 5
    assert agent.launcher.find("a")
    await agent.handle_command(launch("c1", 5, "a"))  # a duplicate: ignored
    assert len(agent.launcher.running()) == 1
    await agent.launcher.stop("a", None, reason="test", grace_s=2)
    await agent.handle_command(launch("c2", 4, "b"))  # a deposed brain
    assert not agent.launcher.find("b")
    assert agent.epoch == 5


async def test_expired_launch_is_refused(agent_factory, connect) -> None:
    await (await connect("setup")).ensure_streams()
    agent = await agent_factory("n1", gpus=1)
    await agent.handle_command(
        Launch(
            command_id="c1",
            epoch=1,
            issued_at=0.0,
            job_id="x",
            attempt=1,
            gpus=(0,),
            command=("true",),
            expires_at=agent.clock() - 1,
        )
    )
    assert not agent.launcher.find("x")
