"""A node whose clock is set apart from the brain's: launches expire by the node's own
clock (the brain reckons the offset from its heartbeats), and the brain says the clocks
differ. Real brain, agent and nats-server; the agent's clock is shifted, as a host's
without NTP drifts."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from brain.ingest import NodeIngest
from schemas.jobs import JobSpec, JobState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit
from tests.test_ingest import beat


@pytest.mark.parametrize("skew_s", [120.0, -120.0])
async def test_a_node_whose_clock_is_off_by_more_than_a_launchs_life_runs_its_jobs(
    brain_factory, agent_factory, tmp_path: Path, caplog: pytest.LogCaptureFixture, skew_s: float
) -> None:
    # 120 s ahead, every launch (60 s to live, by the brain's clock) came expired; 120 s
    # behind, a launch 3 minutes late would still have run.
    caplog.set_level(logging.INFO, "brain.service")
    brain = await brain_factory()
    await agent_factory("n1", gpus=1, clock=lambda: time.time() + skew_s)
    await eventually(lambda: len(brain.state.nodes) == 1)
    job_id = await submit(brain.api, JobSpec(command=("true",), gpus=1, cwd=str(tmp_path)))
    await eventually(lambda: brain.state.jobs[job_id].state is JobState.SUCCEEDED)
    assert brain.state.jobs[job_id].attempt == 1
    assert brain.ingest.clock_offset("n1") == pytest.approx(-skew_s, abs=2)
    (said,) = [r.getMessage() for r in caplog.records if "n1's clock is" in r.getMessage()]
    where = "ahead of" if skew_s > 0 else "behind"
    assert said.startswith("node n1's clock is 120.") and f"s {where} this brain's" in said


def test_a_nodes_clock_offset_is_from_its_last_heartbeat_decoded() -> None:
    ingest = NodeIngest(node_timeout_s=5.0)
    assert ingest.clock_offset("n1") == 0.0  # not heard from: taken as agreeing
    ingest.heartbeat(beat("n1", seq=0), now=1.0, wall=1030.5)  # written at 1000.0
    assert ingest.clock_offset("n1") == 30.5
    ingest.heartbeat(beat("n1", seq=1), now=2.0, wall=1001.25)
    assert ingest.clock_offset("n1") == 0.25
    ingest.heartbeat(beat("n1", seq=2), now=3.0)  # no wall clock given: kept
    assert ingest.clock_offset("n1") == 0.25
