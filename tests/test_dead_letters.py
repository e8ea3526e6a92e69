"""Invalid messages on every inbound subject are dead-lettered; nothing stops serving."""

from __future__ import annotations

import asyncio
import sys

from schemas import subjects
from schemas.api import ErrorReply, JobReply, SubmitRequest
from schemas.base import decode, encode
from schemas.dlq import DeadLetter
from schemas.jobs import JobSpec, JobState
from schemas.telemetry import TelemetryBatch
from tests.conftest import eventually

GARBAGE = [b"", b"{", b"[1,2]", b'{"v": 1}', b'{"v": 99, "node": "n1"}', b"\xff\xfe" * 10]


async def test_every_inbound_subject_dead_letters(brain_factory, agent_factory, connect) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: brain.state.nodes)
    spy = await connect("spy")
    letters: list[DeadLetter] = []

    async def collect(msg) -> None:
        letters.append(decode(msg.data, DeadLetter))

    await spy.nc.subscribe(subjects.ALL_DLQ, cb=collect)
    await spy.nc.flush()
    state_before = dict(brain.state.jobs), dict(brain.state.nodes)

    for payload in GARBAGE:
        await spy.nc.publish(subjects.node("n1", "telemetry"), payload)
        await spy.nc.publish(subjects.node("n1", "heartbeat"), payload)
        await spy.js.publish(subjects.node("n1", "event"), payload)
        await spy.js.publish(subjects.node("n1", "cmd"), payload)
        reply = await spy.nc.request(subjects.api("default", "submit"), payload, timeout=5)
        assert decode(reply.data, ErrorReply).code == "invalid"
    # A well-formed message that speaks for another node is refused too.
    impostor = TelemetryBatch(node="n2", ts=0.0, samples=())
    await spy.nc.publish(subjects.node("n1", "telemetry"), encode(impostor))
    unknown_verb = await spy.nc.request("alnair.api.default.reboot", b"{}", timeout=5)
    assert "unknown API verb" in decode(unknown_verb.data, ErrorReply).error

    expected = {"node.telemetry", "node.heartbeat", "node.event", "node.cmd", "api.submit"}
    await eventually(lambda: {subjects.dlq_origin(d.subject) for d in letters} >= expected)
    await eventually(lambda: len(letters) >= len(GARBAGE) * 5 + 2)
    assert all(letter.reason for letter in letters)
    assert any("subject is 'n1'" in d.reason for d in letters)
    assert (dict(brain.state.jobs), dict(brain.state.nodes)) == state_before

    # ...and the brain still serves.
    reply = await brain.api.handle(
        "default", SubmitRequest(spec=JobSpec(command=(sys.executable, "-c", "pass"), gpus=1))
    )
    assert isinstance(reply, JobReply)
    await eventually(lambda: brain.state.jobs[reply.job.job_id].state is JobState.SUCCEEDED)
    assert brain.bus.dead_lettered["node.heartbeat"] == len(GARBAGE)
    await asyncio.sleep(0)
