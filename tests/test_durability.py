"""The brain's state is a fold of the STATE log; epochs fence an older brain."""

from __future__ import annotations

import asyncio
import sys

from nats.js.api import DiscardPolicy

from agents.agent import Agent
from brain.service import Brain
from schemas import subjects
from schemas.api import JobReply, SubmitRequest
from schemas.commands import Launch
from schemas.events import NODE_EVENT
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


def _true(agent: Agent, *, expires_in_s: float) -> Launch:
    """Job x's first attempt, `true` on GPU 0."""
    return Launch(
        command_id="c1",
        epoch=1,
        issued_at=0.0,
        job_id="x",
        attempt=1,
        gpus=(0,),
        command=("true",),
        expires_at=agent.clock() + expires_in_s,
    )


async def test_expired_launch_is_refused(agent_factory, connect) -> None:
    await (await connect("setup")).ensure_streams()
    agent = await agent_factory("n1", gpus=1)
    await agent.handle_command(_true(agent, expires_in_s=-1))
    assert not agent.launcher.find("x")


async def test_an_event_the_stream_refuses_for_a_while_is_sent_once_it_takes_it(
    agent_factory, connect
) -> None:
    """JetStream may refuse a publish with an error rather than time out (a 503 while a
    cluster settles, a store that is full): the agent's event sender keeps the event
    and goes on trying, and the events after it follow. Here the EVENTS stream is made
    full, with new messages refused, while a job starts and exits."""
    setup = await connect("setup")
    await setup.ensure_streams()

    async def stored() -> list[str]:
        read = setup.read(
            subjects.STREAM_EVENTS, NODE_EVENT, filter_subject=subjects.node("n1", "event")
        )
        return [type(event).__name__ async for event, _, _ in read]

    agent = await agent_factory("n1", gpus=1)
    config = await setup.js.stream_info(subjects.STREAM_EVENTS)
    full = config.config.evolve(max_msgs=config.state.messages + 1, discard=DiscardPolicy.NEW)
    await setup.js.update_stream(full)
    await setup.js.publish(subjects.node("other", "event"), b"{}")  # fills it
    await agent.handle_command(_true(agent, expires_in_s=60))
    (process,) = agent.launcher.find("x")
    await eventually(lambda: process.exited.is_set())
    await asyncio.sleep(3.0)  # refused meanwhile, more than once
    assert await stored() == []
    await setup.js.update_stream(config.config.evolve(max_msgs=-1, discard=DiscardPolicy.OLD))

    async def both() -> bool:
        return await stored() == ["JobStarted", "JobExited"]

    await eventually(both, timeout_s=40, interval_s=0.5)


async def test_a_spawned_loop_that_dies_says_so(connect, caplog) -> None:
    bus = await connect("loops")

    async def breaks() -> None:
        raise RuntimeError("out of luck")

    task = bus.spawn(breaks(), name="sender")
    await asyncio.wait([task])
    await asyncio.sleep(0)  # done callbacks run on the next turn
    assert "task sender died: RuntimeError('out of luck')" in caplog.text


def _slow_to_stop(agent: Agent, job_id: str, gpu: int, linger_s: float) -> Launch:
    """A job that, told to stop, takes `linger_s` to exit."""
    script = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (time.sleep({linger_s}), sys.exit(0)))\n"
        "time.sleep(600)\n"
    )
    return Launch(
        command_id=f"c-{job_id}",
        epoch=1,
        issued_at=0.0,
        job_id=job_id,
        attempt=1,
        gpus=(gpu,),
        command=(sys.executable, "-c", script),
        expires_at=agent.clock() + 60,
    )


async def test_an_agent_shutting_down_reports_every_exit_of_the_jobs_it_stops(
    agent_factory, connect
) -> None:
    """Stopping, the agent stops its jobs and sends each exit before it goes. Its event
    sender used to end as soon as its queue was empty once the agent was closing: the
    exit of a job that took longer to stop than the one before it was never sent (and
    the agent waited out its 10 s for it)."""
    setup = await connect("setup")
    await setup.ensure_streams()
    agent = await agent_factory("n1", gpus=3)
    for gpu, linger_s in enumerate((0.0, 0.6, 1.2)):
        await agent.handle_command(_slow_to_stop(agent, f"j{gpu}", gpu, linger_s))
        await eventually(lambda gpu=gpu: agent.launcher.find(f"j{gpu}"))  # type: ignore[misc]
    # The starts are sent: the queue is empty when it closes (what ended the sender).
    await eventually(agent._outbox.empty)
    await agent.stop(stop_jobs=True)
    read = setup.read(
        subjects.STREAM_EVENTS, NODE_EVENT, filter_subject=subjects.node("n1", "event")
    )
    exited = {event.job_id async for event, _, _ in read if type(event).__name__ == "JobExited"}
    assert exited == {"j0", "j1", "j2"}
