"""A node whose clock is set apart from the brain's: launches expire by the node's own
clock (the brain reckons the offset from its heartbeats), and the brain says the clocks
differ. Real brain, agent and nats-server; the agent's clock is shifted, as a host's
without NTP drifts."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from brain.ingest import OFFSET_WINDOW_S, NodeIngest
from schemas.base import encode
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

    # Said at the brain's next tick after the offset moved, once.
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "n1's clock is" in r.getMessage()]

    await eventually(warnings)
    (said,) = warnings()
    where = "ahead of" if skew_s > 0 else "behind"
    assert said.startswith("node n1's clock is 120.") and f"s {where} this brain's" in said


def test_a_nodes_clock_offset_is_the_least_its_heartbeats_say_over_a_window() -> None:
    """Arrival less the time written is the offset plus the heartbeat's time in transit
    and queued: a brain seconds behind on heartbeats must not take its lag for a
    node's clock. Repeats, never decoded, count too (their time read from the bytes)."""
    ingest = NodeIngest(node_timeout_s=5.0)
    assert ingest.clock_offset("n1") == 0.0  # not heard from: taken as agreeing
    ingest.heartbeat(b := beat("n1", seq=0), 1.0, encode(b), wall=1030.5)  # written at 1000.0
    assert ingest.clock_offset("n1") == 30.5
    ingest.heartbeat(b := beat("n1", seq=1), 2.0, encode(b), wall=1001.25)
    assert ingest.clock_offset("n1") == 0.25
    assert ingest.clocks_moved == {"n1"}  # the brain looks at it (at its next tick)
    ingest.clocks_moved.clear()
    ingest.heartbeat(b := beat("n1", seq=2), 3.0, encode(b), wall=1009.0)  # queued for 7 s
    assert ingest.clock_offset("n1") == 0.25
    assert ingest.clocks_moved == set()  # not the least: nothing for the brain to look at
    ingest.heartbeat(b := beat("n1", seq=3), 4.0, encode(b))  # no wall clock given: kept
    assert ingest.clock_offset("n1") == 0.25
    assert ingest.repeat("n1", encode(beat("n1", seq=4)), 5.0, wall=1004.125)
    assert ingest.clock_offset("n1") == 0.125

    # The node's clock set back by 10 s: seen within two windows, not before.
    now = 5.0
    while now < 5.0 + 2 * OFFSET_WINDOW_S:
        now += 1.0
        seq = int(now)
        assert ingest.repeat("n1", encode(beat("n1", seq=seq)), now, wall=1000.0 + seq + 10.25)
        if now < 5.0 + OFFSET_WINDOW_S:
            assert ingest.clock_offset("n1") == 0.125
    assert ingest.clock_offset("n1") == 10.25
