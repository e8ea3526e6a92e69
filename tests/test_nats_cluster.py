"""A 3-node NATS cluster on this host: R3 streams survive the death of the server that
leads the brain's STATE log, in the middle of a burst of submissions.

This module runs conftest's brain and agent factories against the cluster: it
overrides `nats_urls` and `stream_replicas` (every Bus gets all three URLs and R3
streams) and `nats_server` (which agent_factory only reads a URL from).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.api import PeerInfo

from bus.client import Bus, ConnectOptions
from bus.server import EmbeddedCluster, EmbeddedNats
from cli.nats_status import NatsReport, ReplicaState
from schemas import subjects
from schemas.errors import BusError
from tests.chaos_harness import burst, wait_all_finished
from tests.conftest import eventually, pids_running

REPLICAS = 3


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(data_dir=tmp_path / "nats", size=3)
    cluster.start()
    assert all(node.port != 4222 for node in cluster.nodes)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def nats_server(nats_cluster: EmbeddedCluster) -> EmbeddedNats:
    return nats_cluster.nodes[0]


@pytest.fixture
def nats_urls(nats_cluster: EmbeddedCluster) -> tuple[str, ...]:
    return tuple(nats_cluster.urls)


@pytest.fixture
def stream_replicas() -> int:
    return REPLICAS


async def state_leader(bus: Bus) -> str:
    cluster = await bus.stream_cluster(subjects.STREAM_STATE)
    assert cluster is not None and cluster.leader, "STATE has no cluster leader"
    return cluster.leader


@pytest.mark.timeout(700)  # above the sum of its hang guards
async def test_state_leader_killed_mid_burst(
    nats_cluster: EmbeddedCluster, connect, brain_factory, agent_factory
) -> None:
    brain = await brain_factory()
    for n in range(2):
        await agent_factory(f"n{n}", gpus=8)
    await eventually(lambda: len(brain.state.nodes) == 2)
    client = await connect("burst")
    info = await client.js.stream_info(subjects.STREAM_STATE)
    assert info.config.num_replicas == REPLICAS
    kill_at = asyncio.Event()
    acked_at_kill: list[int] = []

    def kill_once(acked: int) -> None:
        if acked >= 60 and not kill_at.is_set():
            acked_at_kill.append(acked)
            kill_at.set()

    started = time.monotonic()
    submitting = asyncio.ensure_future(burst(client, 200, concurrency=8, on_progress=kill_once))
    # Each phase has a hang guard, far above its usual seconds (no speed is asserted),
    # so a hang says where it was; the test's own timeout would say nothing.
    try:
        await asyncio.wait_for(kill_at.wait(), timeout=180)
    except TimeoutError:
        submitting.cancel()
        raise AssertionError("hung before 60 submissions were acknowledged") from None
    leader = await state_leader(client)
    victim = nats_cluster.node(leader)
    brain_was_on_it = brain.bus.nc.connected_url.port == victim.port
    victim.kill()  # SIGKILL: no shutdown, no flush, no step-down
    killed_after = time.monotonic() - started

    async def new_leader() -> str | None:
        with contextlib.suppress(Exception):
            now = await state_leader(client)
            return now if now != leader else None
        return None

    successor = await eventually(new_leader, timeout_s=60, interval_s=0.2)
    try:
        result = await asyncio.wait_for(submitting, timeout=240)
    except TimeoutError:
        raise AssertionError(
            f"hung submitting after the kill of {leader} "
            f"(the brain was connected to it: {brain_was_on_it}; {successor} leads)"
        ) from None
    result = await wait_all_finished(client, result, timeout_s=200)
    print(
        f"\nSTATE leader {leader} SIGKILLed after {killed_after:.1f}s with "
        f"{acked_at_kill[0]} acknowledged (the brain was connected to it: {brain_was_on_it}); "
        f"{successor} leads now. "
        f"acknowledged {len(result.acknowledged)}, failed {len(result.failed)}, "
        f"lost {result.lost}, duplicated {result.duplicated}, unfinished {result.unfinished}; "
        f"acks in {result.ack_seconds:.1f}s, all finished {result.finish_seconds:.1f}s later; "
        f"{sum(1 for j in result.jobs if j.attempt > 1)} ran again (their node looked lost)"
    )
    assert not result.failed
    assert len(result.acknowledged) == result.submitted
    assert result.lost == 0
    assert result.duplicated == 0
    assert result.unfinished == 0
    assert len(result.jobs) == result.submitted


async def test_replicas_beyond_the_cluster_are_refused_by_name(nats_cluster) -> None:
    bus = await Bus.connect(ConnectOptions(servers=nats_cluster.urls, name="r5"), replicas=5)
    try:
        with pytest.raises(BusError, match="EVENTS with 5 replica"):
            await bus.ensure_streams()
    finally:
        await bus.close()
    with pytest.raises(BusError, match="replicas must be 1 to 5, not 7"):
        await Bus.connect(ConnectOptions(servers=nats_cluster.urls, name="r7"), replicas=7)


async def test_streams_wait_for_a_cluster_still_forming(tmp_path: Path) -> None:
    """A component started with its servers, before JetStream has a quorum, waits for
    it and then creates its streams (it used to fail and be restarted)."""
    cluster = EmbeddedCluster(data_dir=tmp_path)
    cluster._plan()
    first, *others = cluster.nodes
    try:
        await first.astart()
        bus = await Bus.connect(ConnectOptions(servers=(first.url,), name="early"), replicas=3)
        try:
            ensured = asyncio.create_task(bus.ensure_streams())
            await asyncio.sleep(1.0)
            assert not ensured.done()  # one server of three: no quorum, nothing to answer
            for node in others:
                await node.astart()
            await asyncio.wait_for(ensured, 120)
            info = await bus.js.stream_info(subjects.STREAM_STATE)
            assert info.config.num_replicas == 3
        finally:
            await bus.close()
    finally:
        await cluster.astop()


async def test_brains_starting_together_create_each_stream_once(tmp_path: Path) -> None:
    """Of components creating the same stream at once on a new cluster, one is never
    answered (nats-server answers the create that goes through); each asks again
    soon, and all end with the streams as wanted."""
    cluster = EmbeddedCluster(data_dir=tmp_path)
    await cluster.astart()
    buses = [
        await Bus.connect(ConnectOptions(servers=cluster.urls, name=f"b{i}"), replicas=3)
        for i in range(3)
    ]
    try:
        await asyncio.gather(*(bus.ensure_streams() for bus in buses))
        for name in (subjects.STREAM_STATE, subjects.STREAM_COMMANDS):
            info = await buses[0].js.stream_info(name)
            assert info.config.num_replicas == 3
    finally:
        for bus in buses:
            await bus.close()
        await cluster.astop()


async def test_a_stream_as_wanted_is_not_updated_and_one_that_differs_is(
    nats_cluster, monkeypatch
) -> None:
    """Every brain's start ensures the streams: one already as wanted costs no update
    (a proposal to the meta leader); one whose settings differ is brought in line."""
    bus = await Bus.connect(ConnectOptions(servers=nats_cluster.urls, name="b"), replicas=3)
    try:
        await bus.ensure_streams()
        updated: list[str] = []
        real = JetStreamContext.update_stream

        async def update_stream(self: Any, config: Any = None, **params: Any) -> Any:
            updated.append(config.name)
            return await real(self, config, **params)

        monkeypatch.setattr(JetStreamContext, "update_stream", update_stream)
        await bus.ensure_streams()
        assert updated == []

        info = await bus.js.stream_info(subjects.STREAM_COMMANDS)
        await real(bus.js, dataclasses.replace(info.config, max_age=3_600.0))
        await bus.ensure_streams()
        assert updated == [subjects.STREAM_COMMANDS]
        info = await bus.js.stream_info(subjects.STREAM_COMMANDS)
        assert info.config.max_age == 86_400
    finally:
        await bus.close()


async def test_the_route_port_admits_only_servers_with_the_route_password(nats_cluster) -> None:
    """Someone who reaches a route port (a job on a NATS host) and speaks the route
    protocol without the cluster's route password is refused, not made a server."""
    node = nats_cluster.nodes[0]
    assert node.cluster is not None and node.cluster.secret
    reader, writer = await asyncio.open_connection(node.host, node.cluster.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 10)
        assert info.startswith(b"INFO ")
        connect = {"verbose": False, "pedantic": False, "name": "intruder", "cluster": "alnair"}
        writer.write(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), 10)
        assert b"Authorization Violation" in answer, answer
    finally:
        writer.close()


def test_status_says_a_copy_the_leader_has_not_heard_from_is_silent() -> None:
    """Before the server marks a dead copy offline (about a minute), `alnair status`
    says how long the leader has not heard from it."""
    peers = [
        PeerInfo(name="nats-1", current=True, offline=False, active=400_000_000, lag=0),
        PeerInfo(name="nats-2", current=False, offline=False, active=14_200_000_000, lag=3),
        PeerInfo(name="nats-3", current=False, offline=True, active=90_000_000_000),
    ]
    report = NatsReport((), (ReplicaState("nats-0", "leader"), *map(ReplicaState.of_peer, peers)))
    assert report.lines()[1] == (
        "STATE:   4 copies: nats-0 leader, nats-1 current, nats-2 behind lag 3, silent 14s, "
        "nats-3 offline, silent 90s"
    )
    assert report.as_json()["state_replicas"][2]["silent_s"] == pytest.approx(14.2)


def test_a_cluster_of_two_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BusError, match="at least 3 servers, not 2"):
        EmbeddedCluster(data_dir=tmp_path, size=2)


@pytest.mark.timeout(240)
async def test_up_cluster_secure_tls_survives_a_server(tmp_path: Path) -> None:
    """`alnair up --cluster 3 --secure --tls`: every component has all three URLs, the
    CLI finds TLS and identities through cluster.json, `status` shows each server and
    the STATE copies, and jobs still run after the STATE leader's server is SIGKILLed."""
    from tests.test_cli import alnair, start_up

    # As root, `up --secure` makes a user for tenant default's jobs: remove it after if
    # this test made it.
    user_made = _no_user("alnair-default")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALNAIR_")}
    env.update(ALNAIR_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    home = tmp_path / "home"
    operator = ["--nkey", str(home / "keys" / "operator-operator.nk"), "--tenant", "operator"]
    up, output, reader = await start_up(
        env, "--cluster", "3", "--secure", "--tls", "--nodes", "1",
        "--gpus", "sim:2xA100", "--http", "127.0.0.1:0",
    )  # fmt: skip

    async def run_job(word: str) -> None:
        # The job runs as the tenant's user: in a directory it may enter (the default, the
        # submitter's, is a checkout that may be closed to others, as under `mktemp -d`).
        submit = ("submit", "--gpus", "1", "--cwd", "/", "--", "echo", word)
        code, out, err = await alnair(*submit, env=env)
        assert code == 0, err
        job_id = out.split()[2]

        async def succeeded() -> bool:
            _, out, _ = await alnair("job", job_id, "--json", env=env)
            return bool(out) and json.loads(out)["state"] == "SUCCEEDED"

        try:
            await eventually(succeeded, timeout_s=60, interval_s=0.5)
        except AssertionError:
            _, out, err = await alnair("job", job_id, "--json", env=env)
            _, why, _ = await alnair("why", job_id, env=env)
            failed = f"job {job_id} ({word}) did not succeed: {out}{err}{why}"
            raise AssertionError(failed) from None

    try:
        await eventually(lambda: any("ready." in line for line in output), timeout_s=90)
        cluster = json.loads((home / "cluster.json").read_text())
        assert len(cluster["nats"]) == 3 and all(u.startswith("tls://") for u in cluster["nats"])
        await run_job("before")
        code, out, err = await alnair("status", *operator, env=env)
        assert code == 0, err
        assert out.count("tls://127.0.0.1:") == 3 and "(connected)" in out
        leader = re.search(r"STATE:\s+3 copies: (nats-\d) leader", out)
        assert leader is not None, out
        conf = home / "nats-cluster" / leader.group(1) / "nats-server.conf"
        victims = [int(pid) for pid in pids_running(str(conf))]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        await run_job("after")

        # Losing the server that led the lease bucket's stream may cost the brain its
        # lease (a new stream leader can take longer than the lease's TTL on a slow
        # host): it steps down and takes it again. Ask until a leader answers.
        async def status() -> str | None:
            code, out, _ = await alnair("status", *operator, env=env)
            return out if code == 0 else None

        out = await eventually(status, timeout_s=60, interval_s=1.0)
        # `up` starts the killed server again, and it rejoins the cluster.
        name = leader.group(1)
        await eventually(lambda: any(f"{name} is back" in line for line in output), timeout_s=60)
        assert any(f"{name} exited with -9" in line for line in output)

        async def all_up() -> str | None:
            out = await status()
            return out if out is not None and "(DOWN)" not in out else None

        out = await eventually(all_up, timeout_s=60, interval_s=1.0)
        assert out.count("tls://127.0.0.1:") == 3, out
        await run_job("rejoined")
    except BaseException:
        # What the brain and agents said (they log to `up`'s output): pytest shows it.
        print("".join(output))
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            up.send_signal(signal.SIGINT)
        await asyncio.wait_for(up.wait(), timeout=60)
        await reader
        if user_made:
            _remove_user("alnair-default")
    assert up.returncode == 0, "".join(output[-30:])


def _remove_user(name: str) -> None:
    if not _no_user(name):
        subprocess.run(["userdel", name], check=False, capture_output=True)
        subprocess.run(["groupdel", name], check=False, capture_output=True)


def _no_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return True
    return False
