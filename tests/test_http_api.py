"""The HTTP API against a real brain on a real nats-server: the NATS API's semantics and
errors, tenants confined to their own jobs, operators, drain/resume, standbys."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from brain.http import HttpServer, TokenTable
from brain.http.auth import TokenFileError
from brain.service import Brain
from bus.client import Bus
from cli.client import call
from cli.main import main
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    JOBS_RESULT,
    NODE_RESULT,
    NODES_RESULT,
    ErrorReply,
    GetJobRequest,
    ListJobsRequest,
    ListNodesRequest,
    ResumeRequest,
)
from schemas.base import decode, encode
from schemas.jobs import JobSpec
from schemas.telemetry import GpuSample, TelemetryBatch
from tests.conftest import eventually
from tests.httpkit import TOKENS, Api, api_factory, write_tokens
from tests.parts import heartbeat
from tests.test_cluster_e2e import submit

__all__ = ["api_factory"]

SLEEPER = {"spec": {"name": "sleeper", "command": ["sleep", "60"], "gpus": 1}}


async def _job_state(api: Api, job_id: str, who: str = "alice") -> str | None:
    status, body = await api.call("GET", f"/v1/jobs/{job_id}", who)
    return body["job"]["state"] if status == 200 else None


async def test_submit_show_list_cancel_as_over_nats(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    api = await api_factory(brain)
    await eventually(lambda: "n1" in brain.state.nodes)

    status, body = await api.call("POST", "/v1/jobs", json=SLEEPER)
    assert status == 201, body
    job_id = body["job"]["job_id"]
    assert body["job"]["tenant"] == "alice" and body["job"]["state"] == "PENDING"

    async def running() -> bool:
        return await _job_state(api, job_id) == "RUNNING"

    await eventually(running)
    status, body = await api.call("GET", "/v1/jobs?state=RUNNING")
    assert status == 200 and [j["job_id"] for j in body["jobs"]] == [job_id]
    status, body = await api.call("GET", "/v1/jobs?array=sweep&array=other")
    assert status == 200 and body["jobs"] == []  # it is of no array
    throttle = {"array": "sweep", "limit": 2}
    status, body = await api.call("POST", "/v1/arrays/throttle", json=throttle)
    assert status == 404 and "tenant alice has no job of array sweep" in body["error"]

    # Another tenant neither sees nor touches it, and is told so in the NATS API's words.
    status, http_refusal = await api.call("GET", f"/v1/jobs/{job_id}", "bob")
    assert status == 404 and http_refusal["code"] == "not_found"
    bus = await connect("nats-client")
    nats_refusal = await bus.request(
        subjects.api("bob", "job"), GetJobRequest(job_id=job_id), JOB_RESULT
    )
    assert isinstance(nats_refusal, ErrorReply)
    assert http_refusal["error"] == nats_refusal.error == f"no job {job_id} for tenant bob"
    status, body = await api.call("GET", "/v1/jobs", "bob")
    assert status == 200 and body["jobs"] == []
    status, _ = await api.call("POST", f"/v1/jobs/{job_id}/cancel", "bob")
    assert status == 404
    status, _ = await api.call("DELETE", f"/v1/jobs/{job_id}", "bob")
    assert status == 404

    # An operator reads every tenant's jobs.
    status, body = await api.call("GET", "/v1/jobs", "operator")
    assert status == 200 and [j["job_id"] for j in body["jobs"]] == [job_id]
    assert (await api.call("GET", f"/v1/jobs/{job_id}", "operator"))[0] == 200

    status, body = await api.call("DELETE", f"/v1/jobs/{job_id}")
    assert status == 200 and body["job"]["state"] == "CANCELLED"
    # Again (a retry whose answer was lost): the same cancelled job.
    status, again = await api.call("POST", f"/v1/jobs/{job_id}/cancel")
    assert status == 200 and again["job"] == body["job"]

    # An operator cancels any tenant's job, and the record says who did.
    status, body = await api.call("POST", "/v1/jobs", json=SLEEPER)
    assert status == 201, body
    other = body["job"]["job_id"]
    status, body = await api.call("POST", f"/v1/jobs/{other}/cancel", "operator")
    assert status == 200 and body["job"]["tenant"] == "alice"
    assert body["job"]["state"] == "CANCELLED"
    assert body["job"]["reason"] == "cancelled by an operator"


async def test_tokens_are_required_and_name_the_tenant(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
) -> None:
    api = await api_factory(await brain_factory())
    for who, expected in (("alice", "alice"), ("operator", "operator")):
        status, body = await api.call("GET", "/v1/whoami", who)
        assert status == 200 and body["tenant"] == expected
    status, body = await api.call("GET", "/v1/jobs", None)
    assert status == 401 and body["code"] == "unauthorized" and "Bearer" in body["error"]
    status, _ = await api.call("GET", "/v1/jobs", None, headers={"Authorization": "Bearer nope"})
    assert status == 401
    # EventSource cannot send headers: the token may come in the query.
    status, _ = await api.call("GET", f"/v1/whoami?access_token={TOKENS['bob']}", None)
    assert status == 200
    # A tenant in the payload is no field of the API at all.
    spec = {"spec": {**SLEEPER["spec"]}, "tenant": "bob"}
    status, body = await api.call("POST", "/v1/jobs", json=spec)
    assert status == 400 and "tenant" in body["error"]
    # /metrics is an operator's.
    assert (await api.call("GET", "/metrics", "alice"))[0] == 403


async def test_invalid_requests_get_the_nats_apis_errors(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    api = await api_factory(await brain_factory())
    bad = {"spec": {"command": [], "gpus": 0}}
    status, http_refusal = await api.call("POST", "/v1/jobs", json=bad)
    assert status == 400 and http_refusal["code"] == "invalid"
    bus = await connect("nats-client")
    reply = await bus.nc.request(subjects.api("alice", "submit"), encode_json(bad), timeout=5)
    nats_refusal = decode(reply.data, JOB_RESULT)
    assert isinstance(nats_refusal, ErrorReply)
    assert http_refusal["error"] == nats_refusal.error
    assert "spec.command" in http_refusal["error"] and "spec.gpus" in http_refusal["error"]

    cases: list[tuple[str, str, int, str]] = [
        ("GET", "/v1/jobs?limit=0", 400, "limit"),
        ("GET", "/v1/jobs?limit=ten", 400, "limit"),
        # Digits to `str.isdigit`, not to `int`; and more than `int` reads from text.
        ("GET", "/v1/jobs?limit=%C2%B2", 400, "limit"),
        ("GET", "/v1/jobs?limit=" + "9" * 5000, 400, "limit"),
        ("GET", "/v1/nodes?limit=%C2%B2", 400, "limit"),
        ("GET", "/v1/jobs/1/why?limit=%C2%B2", 400, "limit"),
        ("GET", "/v1/jobs/1/logs?attempt=%C2%B2", 400, "attempt"),
        ("GET", "/v1/jobs?state=SLEEPING", 400, "states"),
        ("GET", "/v1/jobs?array=", 400, "arrays"),
        ("POST", "/v1/arrays/throttle", 400, "invalid throttle request"),  # no body
        ("POST", "/v1/jobs", 400, "invalid submit request"),  # no body
        ("GET", "/v1/events?since=0", 400, "since"),
        ("GET", "/v1/events?kind=node_drained&kind=bogus", 400, "no kind 'bogus'"),
        ("GET", "/v1/nowhere", 404, "Not Found"),
        ("DELETE", "/v1/jobs", 405, "Not Allowed"),
    ]
    for method, path, expected, words in cases:
        status, body = await api.call(method, path)
        assert (status, words in body["error"]) == (expected, True), (path, body)


def encode_json(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


async def test_drain_takes_gpus_out_of_scheduling_until_resumed(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await agent_factory("n2", gpus=1)
    api = await api_factory(brain)
    await eventually(lambda: {"n1", "n2"} <= set(brain.state.nodes))

    status, body = await api.call("POST", "/v1/nodes/n1/drain", "alice", json={"reason": "x"})
    assert status == 403 and body["code"] == "forbidden"
    assert (await api.call("POST", "/v1/nodes/n9/drain", "operator"))[0] == 404
    assert (await api.call("POST", "/v1/nodes/n1/resume", "operator"))[0] == 409

    status, body = await api.call(
        "POST", "/v1/nodes/n1/drain", "operator", json={"reason": "replacing a fan"}
    )
    assert status == 200, body
    assert body["node"]["record"]["state"] == "DRAINED"
    assert body["node"]["record"]["drain_reason"] == "replacing a fan"
    drained_at = brain.monotonic()
    # Heartbeats after the drain do not undo it.
    await eventually(lambda: brain.monotonic() - (brain.last_seen_ago("n1") or 1e9) > drained_at)
    assert brain.state.nodes["n1"].state.value == "DRAINED"
    assert brain.state.capacity() == 1

    # n2's one GPU takes the first job; the second finds no GPU while n1 is drained.
    first = (await api.call("POST", "/v1/jobs", json=SLEEPER))[1]["job"]["job_id"]
    await eventually(lambda: brain.state.jobs[first].nodes == ("n2",))
    status, body = await api.call("POST", "/v1/jobs", json=SLEEPER)
    job_id = body["job"]["job_id"]
    await eventually(lambda: brain.state.jobs[job_id].reason != "submitted")
    assert brain.state.jobs[job_id].state.value == "PENDING"

    # The NATS API does the same for an operator's subject, and refuses a tenant's.
    bus = await connect("nats-client")
    refused = await bus.request(
        subjects.api("alice", "resume"), ResumeRequest(node="n1"), NODE_RESULT
    )
    assert isinstance(refused, ErrorReply) and refused.code == "forbidden"
    status, body = await api.call("POST", "/v1/nodes/n1/resume", "operator")
    assert status == 200 and body["node"]["record"]["state"] == "READY"

    await eventually(lambda: brain.state.jobs[job_id].nodes == ("n1",))
    status, body = await api.call(
        "GET", "/v1/events?follow=false&node=n1&kind=node_drained&kind=node_resumed"
    )
    kinds = [line["cause"]["kind"] for line in _ndjson(body)]
    assert kinds == ["node_drained", "node_resumed"]


def _ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_a_standby_points_to_the_leader(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
) -> None:
    leader = await brain_factory()
    leader_api = await api_factory(leader)
    leader.config = dataclasses.replace(leader.config, http_address=leader_api.url)
    standby = await brain_factory(lead=False)
    standby_api = await api_factory(standby)

    async def points_to_leader() -> bool:
        status, body = await standby_api.call("GET", "/v1/jobs")
        return status == 503 and leader_api.url in body["error"]

    await eventually(points_to_leader)
    assert (await leader_api.call("GET", "/v1/jobs"))[0] == 200


async def test_one_address_follows_the_lease_across_failover(
    brain_factory: Callable[..., Awaitable[Brain]], tmp_path: Path
) -> None:
    """`alnair up --brains 2`: both brains are given one address and only the leader
    listens on it, so the address keeps answering after the leader dies."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    tokens = TokenTable.load(write_tokens(tmp_path / "shared-tokens.json"))
    stopping = asyncio.Event()
    first = await brain_factory()
    second = await brain_factory(lead=False)
    servers = [HttpServer(b, tokens=tokens, host="127.0.0.1", port=port) for b in (first, second)]
    followers = [asyncio.ensure_future(s.follow_leadership(stopping)) for s in servers]
    url = f"http://127.0.0.1:{port}/v1/status"
    headers = Api.auth("operator")

    async def leader_answers(brain: Brain) -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
                body = await r.json()
        except aiohttp.ClientError:
            return False
        return r.status == 200 and body["brains"][0]["brain_id"] == brain.instance

    try:
        await eventually(lambda: leader_answers(first))
        assert servers[0].listening and not servers[1].listening
        assert first.info().http == f"http://127.0.0.1:{port}" and second.info().http is None
        await first.stop()  # the leader dies; the standby takes the lease and the port
        await eventually(lambda: leader_answers(second), timeout_s=30)
        assert not servers[0].listening
    finally:
        stopping.set()
        await asyncio.wait(followers, timeout=10)


async def test_both_apis_refuse_the_same_coercions(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    brain = await brain_factory()
    api = await api_factory(brain)
    bus = await connect("nats-client")
    for body in ({"limit": "2"}, {"limit": 2.5}, {"limit": True}):
        raw = await bus.nc.request(subjects.api("alice", "jobs"), json.dumps(body).encode(), 5)
        nats_refusal = json.loads(raw.data)
        assert nats_refusal["ok"] is False and nats_refusal["code"] == "invalid", nats_refusal
        assert "limit" in nats_refusal["error"]
    spec = {"spec": {"command": ["true"], "gpus": "1"}}
    status, http_refusal = await api.call("POST", "/v1/jobs", json=spec)
    raw = await bus.nc.request(subjects.api("alice", "submit"), json.dumps(spec).encode(), 5)
    assert status == 400 and json.loads(raw.data)["error"] == http_refusal["error"]
    assert "spec.gpus" in http_refusal["error"]
    assert not brain.state.jobs


async def test_a_listing_too_big_for_one_message_comes_in_pages(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
    nats_server: Any,
    capsys: Any,
) -> None:
    """Fifteen jobs with a 100 KB environment each do not fit one NATS message (1 MiB):
    the NATS answer holds the newest that fit and says where the next page starts,
    `alnair jobs` pages through to its --limit, and HTTP pages by `before` alike. A
    listing whose answer outgrew the message used to be refused whole."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=1)
    await eventually(lambda: "n1" in brain.state.nodes)
    spec = JobSpec(command=("sleep", "60"), gpus=1, env={"BLOB": "x" * 100_000})
    ids = [await submit(brain.api, spec, "alice") for _ in range(15)]

    bus = await connect("client:alice")
    first = await call(bus, "alice", "jobs", ListJobsRequest(), JOBS_RESULT)
    count = len(first.jobs)
    assert 1 < count < 15 and [j.job_id for j in first.jobs] == ids[-count:]
    assert first.next_before == ids[-count]
    rest = await call(bus, "alice", "jobs", ListJobsRequest(before=first.next_before), JOBS_RESULT)
    assert [j.job_id for j in rest.jobs] == ids[-count - len(rest.jobs) : -count]

    args = ["jobs", "--nats", nats_server.url, "--tenant", "alice", "--json", "--limit", "14"]
    assert await asyncio.to_thread(main, args) == 0
    assert [j["job_id"] for j in json.loads(capsys.readouterr().out)] == ids[1:]

    api = await api_factory(brain)
    status, body = await api.call("GET", "/v1/jobs?limit=5")
    assert status == 200 and [j["job_id"] for j in body["jobs"]] == ids[-5:]
    assert body["next_before"] == ids[-5]
    status, body = await api.call("GET", f"/v1/jobs?before={ids[-5]}")
    assert status == 200 and [j["job_id"] for j in body["jobs"]] == ids[:-5]
    assert body["next_before"] is None


async def test_a_node_listing_too_big_for_one_message_comes_in_pages(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
    nats_server: Any,
    capsys: Any,
) -> None:
    """600 8-GPU nodes with their latest telemetry are about 1.8 MB of statuses: the NATS
    answer holds the first that fit and says where the next page starts, and `alnair
    nodes` lists them all. The answer used to be refused whole from about 340 nodes."""
    brain = await brain_factory(node_timeout_s=600.0)
    bus = await connect("nodes")
    names = [f"n{i:03d}" for i in range(600)]
    samples = tuple(
        GpuSample(
            index=i,
            util_gpu_pct=50.0,
            util_mem_pct=40.0,
            mem_used_mib=40_000.0,
            mem_total_mib=81_559.0,
            power_w=400.0,
            temp_c=60.0,
            sm_clock_mhz=1_980.0,
            mem_clock_mhz=2_619.0,
        )
        for i in range(8)
    )
    for name in names:
        await bus.nc.publish(subjects.node(name, "heartbeat"), encode(heartbeat(name)))
        batch = TelemetryBatch(node=name, ts=time.time(), samples=samples)
        await bus.nc.publish(subjects.node(name, "telemetry"), encode(batch))
    await eventually(lambda: len(brain.state.nodes) == 600 and len(brain.telemetry) == 600)

    first = await call(bus, "alice", "nodes", ListNodesRequest(), NODES_RESULT)
    count = len(first.nodes)
    assert 1 < count < 600 and [n.record.name for n in first.nodes] == names[:count]
    assert first.next_after == names[count - 1]
    rest = await call(bus, "alice", "nodes", ListNodesRequest(after=first.next_after), NODES_RESULT)
    assert [n.record.name for n in rest.nodes] == names[count : count + len(rest.nodes)]

    args = ["nodes", "--nats", nats_server.url, "--tenant", "alice", "--json"]
    assert await asyncio.to_thread(main, args) == 0
    assert [n["record"]["name"] for n in json.loads(capsys.readouterr().out)] == names

    # HTTP answers whole, or a page of `limit` (the dashboard's), then `after` it.
    api = await api_factory(brain)
    status, body = await api.call("GET", "/v1/nodes")
    assert status == 200 and len(body["nodes"]) == 600 and body["next_after"] is None
    status, body = await api.call("GET", "/v1/nodes?limit=256")
    assert [n["record"]["name"] for n in body["nodes"]] == names[:256]
    assert body["next_after"] == names[255]
    for rest in (344, 1000):  # exactly the rest, or more: no page follows
        status, body = await api.call("GET", f"/v1/nodes?after={names[255]}&limit={rest}")
        assert [n["record"]["name"] for n in body["nodes"]] == names[256:]
        assert body["next_after"] is None
    status, body = await api.call("GET", "/v1/nodes?limit=0")
    assert status == 400 and "limit" in body["error"]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        # The second list would have replaced the first, and tenant a lost its access.
        (
            b"tokens:\n  - {token: aaaaaaaaaaaaaaaaaaaa, tenant: a}\n"
            b"tokens:\n  - {token: bbbbbbbbbbbbbbbbbbbb, tenant: b}\n",
            "key 'tokens' is given twice (first on line 1)",
        ),
        # The entry that failed, not also a list "with no item" that it left.
        (b"tokens:\n  - {token: short, tenant: a}\n", "tokens.0.token: String should have"),
        (b"\xff\xfe", "cannot read it: not UTF-8 text"),
    ],
)
def test_a_bad_tokens_file_says_what_is_wrong(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_bytes(content)
    with pytest.raises(TokenFileError) as refused:
        TokenTable.load(path)
    assert says in str(refused.value)
    assert "Tuple should have at least 1 item" not in str(refused.value)
