"""Self-fencing on one host: the contact clock, an agent that loses its NATS server
stops its jobs (but keeps an on_disconnect "keep" one), and a brain that holds a lost
node's jobs for the fence margin before running them elsewhere.

The multi-host version, with partitions and the no-overlap check, is
tests/test_multihost.py.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import pytest

from agents.agent import Agent, AgentConfig
from agents.fence import ContactClock
from agents.gpu import SimulatedGpus
from brain.hearing import Hearing
from bus.client import Bus, ConnectOptions
from bus.server import EmbeddedNats, free_port
from schemas.commands import Launch
from schemas.jobs import JobSpec, JobState
from schemas.nodes import NodeState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit

SLEEP: tuple[str, ...] = (sys.executable, "-c", "import time; time.sleep(600)")


def test_contact_clock_fences_each_attempt_once_after_its_own_period() -> None:
    now = [100.0]
    clock = ContactClock(lambda: now[0])
    periods = {("a", 1): 2.0, ("keep", 1): 60.0, ("never", 1): None}
    running = list(periods)
    now[0] = 101.5
    assert clock.due(running, lambda j, a: periods[(j, a)]) == []
    clock.confirmed(101.0)  # a heartbeat sent at 101 reached the server
    now[0] = 103.5
    assert clock.due(running, lambda j, a: periods[(j, a)]) == [("a", 1, 2.5)]
    now[0] = 200.0
    assert clock.due(running, lambda j, a: periods[(j, a)]) == [("keep", 1, 99.0)]
    assert clock.due(running, lambda j, a: periods[(j, a)]) == []
    clock.confirmed(50.0)  # an old confirmation does not move the clock back
    assert clock.last_contact == 101.0


def _launch(job_id: str, *, fence_after_s: float | None = None) -> Launch:
    return Launch(
        command_id=f"launch-{job_id}",
        epoch=1,
        issued_at=time.time(),
        job_id=job_id,
        attempt=1,
        gpus=(0,) if job_id == "fenced" else (1,),
        command=SLEEP,
        expires_at=time.time() + 60,
        fence_after_s=fence_after_s,
    )


async def test_agent_without_nats_stops_its_jobs_but_keeps_a_keep_job(
    connect, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    config = AgentConfig(
        node="n1",
        data_dir=tmp_path / "n1",
        heartbeat_s=0.2,
        telemetry_s=0.5,
        fence_after_s=1.0,
        fence_grace_s=1.0,
    )
    bus = await connect("agent:n1")
    await bus.ensure_streams()  # what a brain would have done
    agent = Agent(bus, config, SimulatedGpus("n1", 2, "A100"))
    await agent.start()
    try:
        await agent.handle_command(_launch("fenced"))
        await agent.handle_command(_launch("kept", fence_after_s=600.0))
        (fenced,) = agent.launcher.find("fenced")
        (kept,) = agent.launcher.find("kept")
        # Contact is confirmed while the server is there: nothing is fenced.
        before = agent.contact.last_contact
        await eventually(lambda: agent.contact.last_contact > before)
        assert fenced.stop_reason is None
        nats_server.stop()
        await eventually(lambda: fenced.exited.is_set(), timeout_s=30)
        assert fenced.stop_reason is not None
        assert fenced.stop_reason.startswith("fenced: no contact with NATS")
        assert not kept.exited.is_set() and kept.stop_reason is None
    finally:
        await agent.stop(stop_jobs=True)


async def test_brain_runs_a_lost_nodes_job_elsewhere_only_after_the_margin(
    brain_factory, agent_factory
) -> None:
    brain = await brain_factory(node_timeout_s=1.0, fence_margin_s=2.0)
    first = await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)
    stop_job = await submit(brain.api, JobSpec(command=SLEEP, gpus=1))
    keep_job = await submit(brain.api, JobSpec(command=SLEEP, gpus=1, on_disconnect="keep"))
    await eventually(lambda: first.launcher.find(stop_job) and first.launcher.find(keep_job))
    second = await agent_factory("n2", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 2)
    # Silent, its processes left running: what a partition looks like from the brain.
    agent_factory.orphans.extend(await first.crash())
    await eventually(lambda: brain.state.nodes["n1"].state is NodeState.LOST)
    # Lost, but within the margin: the job still belongs to n1, nowhere else.
    job = brain.state.jobs[stop_job]
    assert (job.state, job.nodes, job.attempt) == (JobState.RUNNING, ("n1",), 1)
    await eventually(lambda: second.launcher.find(stop_job), timeout_s=30)
    failure = brain.state.jobs[stop_job].failures[-1]
    assert "margin 2s" in failure.reason
    # The keep job waits for its node (or keep_disconnected_s, 300 s here).
    kept = brain.state.jobs[keep_job]
    assert (kept.state, kept.nodes, kept.attempt) == (JobState.RUNNING, ("n1",), 1)
    assert not second.launcher.find(keep_job)


async def test_brain_hearing_goes_deaf_when_its_connection_does(
    connect, nats_server: EmbeddedNats
) -> None:
    hearing = Hearing(time.monotonic)
    bus = await connect("brain:ingest")
    watching = asyncio.ensure_future(hearing.watch(bus, every_s=0.1, timeout_s=0.5))
    try:
        await asyncio.sleep(0.5)
        assert not hearing.deaf_within(60.0)  # it answered every PING so far
        nats_server.stop()
        await eventually(lambda: hearing.deaf_within(1.0), timeout_s=30)
    finally:
        watching.cancel()


async def test_a_lost_connection_is_logged_and_a_closed_one_is_not(
    connect, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bus.client")
    closed = await connect("closed-on-purpose")
    await closed.close()
    await connect("lost")
    nats_server.stop()
    await eventually(lambda: "lost: disconnected from NATS" in caplog.text, timeout_s=30)
    assert "closed-on-purpose: disconnected" not in caplog.text


async def test_a_component_that_cannot_reach_nats_says_so_while_it_keeps_trying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="bus.client")
    url = f"nats://127.0.0.1:{free_port()}"  # nobody listens there
    options = ConnectOptions(servers=(url,), name="agent:early")
    connecting = asyncio.ensure_future(Bus.connect(options))
    try:
        await eventually(lambda: "cannot reach NATS" in caplog.text, timeout_s=30)
        assert f"agent:early: cannot reach NATS at {url}" in caplog.text
        assert "still trying" in caplog.text and not connecting.done()
    finally:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)


async def test_brain_warns_of_an_agent_that_fences_too_late(
    brain_factory, agent_factory, caplog
) -> None:
    brain = await brain_factory(node_timeout_s=1.0, fence_margin_s=2.0)
    await agent_factory("n1", gpus=1)  # fences after 5 s + 3 s of grace: too late here
    await eventually(lambda: "n1" in brain.state.nodes)
    assert any(
        "node n1 stops its jobs 8s after losing NATS" in r.getMessage()
        and "node timeout + fence margin = 3s" in r.getMessage()
        for r in caplog.records
    )


async def test_a_fence_check_that_fails_does_not_end_the_fence(
    connect, tmp_path: Path, caplog
) -> None:
    """The fence is what stops a cut-off node's jobs: one check that raises is logged,
    and the checks go on."""
    config = AgentConfig(node="n1", data_dir=tmp_path / "n1", heartbeat_s=0.2, telemetry_s=0.5)
    bus = await connect("agent:n1")
    await bus.ensure_streams()
    agent = Agent(bus, config, SimulatedGpus("n1", 1, "A100"))
    calls: list[int] = []
    due = agent.contact.due

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("clock trouble")
        return due(*args, **kwargs)

    agent.contact.due = flaky  # type: ignore[method-assign]
    await agent.start()
    try:
        await eventually(lambda: len(calls) >= 3)
        assert "n1: fence check failed" in caplog.text
    finally:
        await agent.stop(stop_jobs=True)
