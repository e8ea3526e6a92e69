"""The bus under abuse: a NATS server killed mid-run, and a flood of bad messages."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas import subjects
from tests.chaos_harness import burst, wait_all_finished
from tests.conftest import eventually

# Minutes of killed servers and brains: `-m "not slow"` leaves them out.
pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_nats_killed_and_restarted_mid_burst(
    nats_server, connect, brain_factory, agent_factory
) -> None:
    brain = await brain_factory()
    for n in range(2):
        await agent_factory(f"n{n}", gpus=8)
    await eventually(lambda: len(brain.state.nodes) == 2)
    client = await connect("burst")
    killed = asyncio.Event()

    def kill_once(acked: int) -> None:
        if acked >= 60 and not killed.is_set():
            killed.set()
            nats_server.kill()  # SIGKILL: no shutdown, no flush

    submitting = asyncio.ensure_future(burst(client, 200, concurrency=8, on_progress=kill_once))
    await killed.wait()
    await asyncio.sleep(1.0)
    await nats_server.astart()  # the same port and store
    result = await submitting
    result = await wait_all_finished(client, result, timeout_s=200)
    print(
        f"\nnats restart: acknowledged {len(result.acknowledged)}, failed {len(result.failed)}, "
        f"lost {result.lost}, duplicated {result.duplicated}, unfinished {result.unfinished}"
    )
    assert not result.failed
    assert result.lost == 0
    assert result.duplicated == 0
    assert result.unfinished == 0


MALFORMED = 10_000


def _bad_payloads() -> list[bytes]:
    wrong_types = json.dumps({"v": 1, "node": "n0", "ts": "yesterday", "samples": "many"})
    too_many_gpus = json.dumps(
        {"v": 1, "node": "n0", "ts": 1.0, "samples": [{"index": i} for i in range(300)]}
    )
    oversized = b'{"v": 1, "pad": "' + b"x" * 900_000 + b'"}'
    return [
        b"",
        b"not json",
        b"[]",
        b"{}",
        wrong_types.encode(),
        too_many_gpus.encode(),
        oversized,
        b'{"v": 7}',
        b"\x00\xff" * 64,
        b'{"v": 1, "node": "n0.x"}',
    ]


@pytest.mark.timeout(300)
async def test_ten_thousand_malformed_messages(brain_factory, agent_factory, connect) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n0", gpus=2)
    await eventually(lambda: brain.state.nodes)
    spammer = await connect("spammer")
    before = (dict(brain.state.jobs), dict(brain.state.nodes), brain.state.last_seq)
    payloads = _bad_payloads()
    targets = [
        ("core", subjects.node("n0", "telemetry")),
        ("core", subjects.node("n0", "heartbeat")),
        ("js", subjects.node("n0", "event")),
        ("js", subjects.node("n0", "cmd")),
        ("request", subjects.api("default", "submit")),
    ]
    sent = 0
    for i in range(MALFORMED):
        kind, subject = targets[i % len(targets)]
        payload = payloads[(i // len(targets)) % len(payloads)]
        if kind == "core":
            await spammer.nc.publish(subject, payload)
        elif kind == "js":
            await spammer.js.publish(subject, payload)
        else:
            await spammer.nc.request(subject, payload, timeout=10)
        sent += 1

    def dead_lettered() -> int:
        return sum(brain.bus.dead_lettered.values()) + sum(agent.bus.dead_lettered.values())

    await eventually(lambda: dead_lettered() >= MALFORMED, timeout_s=120, interval_s=0.2)
    print(
        f"\nmalformed: sent {sent}, dead-lettered {dead_lettered()}: "
        f"{dict(brain.bus.dead_lettered)} + agent {dict(agent.bus.dead_lettered)}"
    )
    assert dead_lettered() == MALFORMED
    assert (dict(brain.state.jobs), dict(brain.state.nodes), brain.state.last_seq) == before
    # ...and it still serves.
    from cli.client import submit
    from schemas.jobs import JobSpec, JobState

    job = await submit(spammer, "default", JobSpec(command=("true",), gpus=1))
    await eventually(lambda: brain.state.jobs[job.job_id].state is JobState.SUCCEEDED)
