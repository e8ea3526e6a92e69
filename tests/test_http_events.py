"""`/v1/events`: the STATE log streamed as NDJSON or SSE, live, resumable, filtered, and
confined to what the caller may see."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from brain.service import Brain
from tests.conftest import eventually
from tests.httpkit import Api, api_factory

__all__ = ["api_factory"]

SLEEPER = {"spec": {"name": "sleeper", "command": ["sleep", "60"], "gpus": 1}}


def _ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _sse(text: str) -> list[dict[str, str]]:
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                fields[name] = value
        if "data" in fields:
            events.append(fields)
    return events


async def _submit(api: Api, who: str) -> str:
    status, body = await api.call("POST", "/v1/jobs", who, json=SLEEPER)
    assert status == 201, body
    return str(body["job"]["job_id"])


async def test_tenants_see_their_own_jobs_and_the_nodes(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    api = await api_factory(brain)
    await eventually(lambda: "n1" in brain.state.nodes)
    alices, bobs = await _submit(api, "alice"), await _submit(api, "bob")

    def job_ids(lines: list[dict[str, Any]]) -> set[str]:
        return {line["job"]["job_id"] for line in lines if line["kind"] == "job"}

    seen = _ndjson((await api.call("GET", "/v1/events?follow=false", "alice"))[1])
    assert job_ids(seen) == {alices}
    assert any(line["kind"] == "node" and line["node"]["name"] == "n1" for line in seen)
    assert [line["seq"] for line in seen] == sorted(line["seq"] for line in seen)
    everything = _ndjson((await api.call("GET", "/v1/events?follow=false", "operator"))[1])
    assert job_ids(everything) == {alices, bobs}

    # Filters: by job, by kind; `tail` starts near the end of the log.
    only = _ndjson((await api.call("GET", f"/v1/events?follow=false&job={alices}", "alice"))[1])
    # A job's records, and the node events about it (its start, its exit).
    about = [line["job"] if line["kind"] == "job" else line["event"] for line in only]
    assert about and all(item["job_id"] == alices for item in about)
    submitted = _ndjson(
        (await api.call("GET", "/v1/events?follow=false&kind=submitted", "operator"))[1]
    )
    assert [line["job"]["job_id"] for line in submitted] == [alices, bobs]
    last = _ndjson((await api.call("GET", "/v1/events?follow=false&tail=1", "operator"))[1])
    assert [line["seq"] for line in last] == [brain.state.last_seq]


async def test_follow_streams_new_changes_with_heartbeats(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    api = await api_factory(brain, heartbeat_s=0.2)
    await eventually(lambda: "n1" in brain.state.nodes)
    job_id = await _submit(api, "alice")
    await eventually(lambda: any(g.pid for g in brain.state.jobs[job_id].grants))
    start = brain.state.last_seq + 1
    url = f"{api.url}/v1/events?job={job_id}&since={start}"
    async with api.session.get(url, headers=api.auth("alice")) as stream:
        assert stream.status == 200 and stream.content_type == "application/x-ndjson"
        # While nothing happens the server keeps the line alive.
        while json.loads(await stream.content.readline()) != {}:
            pass
        status, _ = await api.call("POST", f"/v1/jobs/{job_id}/cancel")
        assert status == 200
        states = []
        while "CANCELLED" not in states:
            line = json.loads(await stream.content.readline())
            if line:
                assert line["seq"] >= start
                if line["kind"] == "job":
                    assert line["job"]["job_id"] == job_id
                    states.append(line["job"]["state"])


async def test_server_sent_events_resume_after_the_last_event_id(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
) -> None:
    brain = await brain_factory()
    api = await api_factory(brain)
    ids = [await _submit(api, "alice") for _ in range(3)]
    status, text = await api.call(
        "GET", "/v1/events?format=sse&follow=false&kind=submitted", "alice"
    )
    assert status == 200
    events = _sse(text)
    assert [json.loads(e["data"])["job"]["job_id"] for e in events] == ids
    assert all(e["event"] == "job" for e in events)
    # A browser's EventSource reconnects with the last id it saw.
    first = events[0]["id"]
    status, text = await api.call(
        "GET",
        "/v1/events?follow=false&kind=submitted",
        "alice",
        headers={"Accept": "text/event-stream", "Last-Event-ID": first},
    )
    assert [e["id"] for e in _sse(text)] == [e["id"] for e in events[1:]]
