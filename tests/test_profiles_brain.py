"""A running job's profile, computed by a real brain from a real agent's telemetry, reaches
the policy core's snapshot, the API (NATS and HTTP) and `alnair job`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from brain.core.model import ClusterSnapshot
from brain.service import Brain
from brain.state import BrainState
from bus.server import EmbeddedNats
from cli.main import main
from tests.conftest import eventually
from tests.httpkit import Api, api_factory

__all__ = ["api_factory"]


async def test_profile_reaches_snapshot_api_and_cli(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    nats_server: EmbeddedNats,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # What `decide` is given: every snapshot the brain takes.
    seen: list[ClusterSnapshot] = []
    take = BrainState.snapshot

    def spy(self: BrainState, **kwargs: Any) -> ClusterSnapshot:
        snapshot = take(self, **kwargs)
        seen.append(snapshot)
        return snapshot

    monkeypatch.setattr(BrainState, "snapshot", spy)
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    api = await api_factory(brain)
    await eventually(lambda: "n1" in brain.state.nodes)
    spec = {"spec": {"name": "trainer", "command": ["sleep", "60"], "gpus": 2}}
    status, body = await api.call("POST", "/v1/jobs", json=spec)
    assert status == 201
    job_id = body["job"]["job_id"]

    def profiled_in_a_snapshot() -> bool:
        return any(v.job_id == job_id and v.profile for s in seen[-5:] for v in s.running)

    await eventually(profiled_in_a_snapshot, timeout_s=30)
    view = next(v for s in reversed(seen) for v in s.running if v.job_id == job_id)
    assert view.profile is not None
    # The simulated GPUs run a job at 70-98 %: busy, not underused.
    assert 60 <= view.profile.mean_util_pct <= 100 and not view.profile.underused

    status, body = await api.call("GET", f"/v1/jobs/{job_id}")
    profile = body["profile"]
    assert status == 200 and profile["job_id"] == job_id and profile["gpus"] == 2
    assert profile["samples"] >= 2 and profile["horizon_s"] > 0
    status, body = await api.call("GET", "/v1/jobs?state=RUNNING")
    assert [p["job_id"] for p in body["profiles"]] == [job_id]

    args = ["job", job_id, "--nats", nats_server.url, "--tenant", "alice"]
    code = await asyncio.to_thread(main, args)
    shown = json.loads(capsys.readouterr().out)
    assert code == 0
    assert shown["profile"]["job_id"] == job_id
    assert shown["profile"]["mean_util_pct"] > 50
