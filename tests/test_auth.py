"""Identities and permissions enforced by a real nats-server: the cluster works under
them, and nobody can use another's subjects."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import nats.js.errors
import pytest

from agents.agent import Agent, AgentConfig
from agents.confine import Confinement
from agents.gpu import SimulatedGpus
from brain import secrets
from brain.credentials import DEFAULT_TTL_S
from brain.service import Brain, BrainConfig
from bus.auth import CALLOUT_SEED_FILE, Identity, write_cluster_keys
from bus.client import Bus, ConnectOptions
from bus.logs import LogUnavailable, read_chunk
from bus.server import EmbeddedNats
from bus.tls import TlsFiles
from cli.client import call, submit
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    JOBS_RESULT,
    STATUS_RESULT,
    ListJobsRequest,
    ResizeRequest,
    StatusRequest,
)
from schemas.errors import BusError
from schemas.jobs import JobRecord, JobSpec, JobState
from schemas.logs import LogRequest
from tests.conftest import elastic_train_spec, eventually

REPO = Path(__file__).resolve().parent.parent
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[dict[str, Identity], Path]:
    identities, config = write_cluster_keys(
        tmp_path / "keys", nodes=["n1", "n2"], tenants=["a", "b"]
    )
    return {f"{i.role}:{i.name}": i for i in identities}, config


@pytest.fixture
def secure_server(tmp_path: Path, keys) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(data_dir=tmp_path / "nats", config_file=keys[1])
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def open_as(server: EmbeddedNats, identity: Identity, tls: TlsFiles | None = None) -> Bus:
    return await Bus.connect(
        ConnectOptions(
            servers=(server.url,),
            name=f"{identity.role}:{identity.name}",
            nkey_seed=str(identity.seed_path),
            inbox_prefix=identity.inbox_prefix,
            tls_ca=str(tls.ca) if tls else None,
            tls_cert=str(tls.client_cert) if tls else None,
            tls_key=str(tls.client_key) if tls else None,
        )
    )


async def raw_as(server: EmbeddedNats, identity: Identity, errors: list[str]) -> nats.NATS:
    async def on_error(error: Exception) -> None:
        errors.append(str(error))

    return await nats.connect(
        server.url,
        nkeys_seed=str(identity.seed_path),
        error_cb=on_error,
        inbox_prefix=identity.inbox_prefix or "_INBOX",
        allow_reconnect=False,
    )


async def test_cluster_runs_under_least_privilege(secure_server, keys, tmp_path) -> None:
    ids = keys[0]
    opened: list[Bus] = []
    brain = agent = None
    try:
        brain_bus = await open_as(secure_server, ids["brain:brain-1"])
        opened.append(brain_bus)
        brain = Brain(
            brain_bus, BrainConfig(lease_ttl_s=2.0, tick_s=0.2, history_path=tmp_path / "h.db")
        )
        await brain.start()
        await asyncio.wait_for(brain.leading.wait(), timeout=30)
        agent_bus = await open_as(secure_server, ids["node:n1"])
        opened.append(agent_bus)
        agent = Agent(
            agent_bus,
            AgentConfig(node="n1", data_dir=tmp_path / "n1", heartbeat_s=0.2),
            SimulatedGpus("n1", 2, "A100"),
        )
        await agent.start()
        await eventually(lambda: brain.state.nodes)
        tenant = await open_as(secure_server, ids["tenant:a"])
        opened.append(tenant)
        job = await submit(tenant, "a", JobSpec(command=(sys.executable, "-c", "pass"), gpus=1))
        await eventually(lambda: brain.state.jobs[job.job_id].state is JobState.SUCCEEDED)

        # The operator reads every tenant's jobs...
        operator = await open_as(secure_server, ids["operator:operator"])
        opened.append(operator)
        status = await call(operator, "operator", "status", StatusRequest(), STATUS_RESULT)
        assert status.epoch == brain.epoch
        # ...and tenant b sees none of a's.
        other = await open_as(secure_server, ids["tenant:b"])
        opened.append(other)
        seen = await call(other, "b", "jobs", ListJobsRequest(), JOBS_RESULT)
        assert seen.jobs == ()
    finally:
        if agent is not None:
            await agent.stop()
        if brain is not None:
            await brain.stop()
        for bus in opened:
            with contextlib.suppress(Exception):
                await bus.close()


@contextlib.asynccontextmanager
async def secure_cluster(
    server: EmbeddedNats,
    ids: dict[str, Identity],
    data: Path,
    gpus: dict[str, int],
    *,
    tenants: frozenset[str] | None = None,
    confinement: Callable[[str], Confinement] | None = None,
    callout: bool = True,
    tls: TlsFiles | None = None,
    credential_ttl_s: float | None = DEFAULT_TTL_S,
    on_agent: Callable[[Agent], None] | None = None,
) -> AsyncIterator[tuple[Brain, Bus]]:
    """A brain and an agent per node of `gpus`, each with its own identity, and tenant
    a's connection. The brain answers the auth callout, so each job attempt reaches NATS
    with its own token (ALNAIR_JOB_TOKEN); without `callout`, agents give their jobs the
    node's job identity (ALNAIR_NKEY) instead, never their own seed. With `confinement`,
    each node's jobs run confined by it. With `tls`, everyone connects over it with
    the cluster's client certificate. `on_agent` sees each agent before it starts."""
    opened: list[Bus] = []
    agents: list[Agent] = []
    brain = None
    try:
        brain_bus = await open_as(server, ids["brain:brain-1"], tls)
        opened.append(brain_bus)
        seed = ids["brain:brain-1"].seed_path.parent / CALLOUT_SEED_FILE
        config = BrainConfig(
            lease_ttl_s=2.0,
            tick_s=0.2,
            history_path=data / "h.db",
            tenants=tenants,
            callout_seed=seed if callout else None,
            job_credential_ttl_s=credential_ttl_s,
        )
        brain = Brain(brain_bus, config)
        await brain.start()
        await asyncio.wait_for(brain.leading.wait(), timeout=30)
        for node, count in gpus.items():
            agent_bus = await open_as(server, ids[f"node:{node}"], tls)
            opened.append(agent_bus)
            config = AgentConfig(
                node=node,
                data_dir=data / node,
                heartbeat_s=0.2,
                stop_grace_s=3.0,
                nats_url=server.url,
                nkey_seed=str(ids[f"node:{node}"].seed_path),
                job_nkey_seed=None if callout else str(ids[f"job:{node}"].seed_path),
                confinement=confinement(node) if confinement is not None else None,
            )
            agents.append(Agent(agent_bus, config, SimulatedGpus(node, count, "A100")))
            if on_agent is not None:
                on_agent(agents[-1])
            await agents[-1].start()
        await eventually(lambda: len(brain.state.nodes) == len(gpus))
        tenant = await open_as(server, ids["tenant:a"], tls)
        opened.append(tenant)
        yield brain, tenant
    finally:
        for agent in agents:
            await agent.stop(stop_jobs=True)
        if brain is not None:
            await brain.stop()
        for bus in opened:
            with contextlib.suppress(Exception):
                await bus.close()


async def test_a_brain_that_admits_jobs_reads_the_cluster_key_as_it_begins_leading(
    secure_server, keys, tmp_path
) -> None:
    """Every launch of a brain with the auth callout carries a token under the cluster
    key: the brain reads (here: makes) it when its tenure begins, not in the pass that
    places the first job, which would hold every unit meanwhile."""
    async with secure_cluster(secure_server, keys[0], tmp_path, {}) as (brain, _):

        async def stored() -> bool:
            try:
                bucket = await brain.bus.js.key_value(secrets.SECRETS_BUCKET)
                return (await bucket.get(secrets.EXEC_KEY)).value is not None
            except nats.js.errors.NotFoundError:  # no bucket yet, or no key in it
                return False

        assert await eventually(stored)
        assert not brain.state.jobs


async def grows_to_two_and_ends(brain: Brain, tenant: Bus, job: JobRecord, stop: Path) -> JobRecord:
    """Resize a 1-worker elastic job to 2 through the API, wait for the commit and for
    its workers to step at 2, then stop it and see it succeed; the grown record."""
    reply = await call(tenant, "a", "resize", ResizeRequest(job_id=job.job_id, gpus=2), JOB_RESULT)
    assert reply.job.resize is not None
    grown = await eventually(
        lambda: (j := brain.state.jobs[job.job_id]).resize is None and j, timeout_s=90
    )
    assert grown.gpu_count == 2, grown.reason
    await eventually(lambda: brain.progress.world_size(job.job_id) == 2, timeout_s=30)
    stop.touch()
    done = await eventually(
        lambda: (j := brain.state.jobs[job.job_id]).state.terminal and j, timeout_s=60
    )
    assert done.state is JobState.SUCCEEDED, done.reason
    return grown


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(180)
async def test_an_elastic_job_runs_and_resizes_under_least_privilege(
    secure_server, keys, tmp_path
) -> None:
    """The supervisor reaches NATS with its node's job identity (ALNAIR_NKEY), not the
    node's: it hears the brain's Resize, reports progress and the outcome, and the job ends."""
    stop_file = tmp_path / "stop"
    try:
        async with secure_cluster(secure_server, keys[0], tmp_path, {"n1": 4}) as (brain, tenant):
            job = await submit(tenant, "a", elastic_train_spec(1, stop_file, max_gpus=2))
            await eventually(lambda: brain.progress.world_size(job.job_id) == 1, timeout_s=90)
            grown = await grows_to_two_and_ends(brain, tenant, job, stop_file)
            assert (grown.reason or "").startswith("resized 1 -> 2")
    finally:
        stop_file.touch()


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(180)
async def test_an_elastic_job_resizes_while_its_nats_users_expire_and_are_renewed(
    secure_server, keys, tmp_path
) -> None:
    """Users that live 10 s: the supervisor's connection renews its user every 5 s
    (a reconnection each time) through start, a resize and the end of the job."""
    stop_file = tmp_path / "stop"
    try:
        async with secure_cluster(
            secure_server, keys[0], tmp_path, {"n1": 4}, credential_ttl_s=10.0
        ) as (brain, tenant):
            job = await submit(tenant, "a", elastic_train_spec(1, stop_file, max_gpus=2))
            await eventually(lambda: brain.progress.world_size(job.job_id) == 1, timeout_s=90)
            assert brain.credentials is not None
            admitted = brain.credentials.admitted
            # Past a whole lifetime of the first users: renewed, and still reporting.
            await eventually(lambda: brain.credentials.admitted >= admitted + 2, timeout_s=60)
            await grows_to_two_and_ends(brain, tenant, job, stop_file)
    finally:
        stop_file.touch()


@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(180)
async def test_an_elastic_job_across_nodes_runs_under_least_privilege(
    secure_server, keys, tmp_path
) -> None:
    """Across two nodes: the supervisor's signed worker start reaches the other node's
    worker host, whose relay reaches the supervisor, under the nodes' identities."""
    stop_file = tmp_path / "stop"
    nodes = {"n1": 2, "n2": 2}
    try:
        async with secure_cluster(secure_server, keys[0], tmp_path, nodes) as (brain, tenant):
            job = await submit(tenant, "a", elastic_train_spec(3, stop_file, max_gpus=4))
            await eventually(lambda: brain.progress.world_size(job.job_id) == 3, timeout_s=120)
            assert len(set(brain.state.jobs[job.job_id].nodes)) == 2
            stop_file.touch()
            done = await eventually(
                lambda: (j := brain.state.jobs[job.job_id]).state.terminal and j, timeout_s=90
            )
            assert done.state is JobState.SUCCEEDED, done.reason
    finally:
        stop_file.touch()


async def test_server_refuses_other_identities_subjects(secure_server, keys) -> None:
    ids = keys[0]
    brain_errors: list[str] = []
    brain = await raw_as(secure_server, ids["brain:brain-1"], brain_errors)
    received: list[str] = []

    async def record(msg) -> None:
        received.append(msg.subject)

    await brain.subscribe("alnair.>", cb=record)
    await brain.flush()

    n1_errors: list[str] = []
    n1 = await raw_as(secure_server, ids["node:n1"], n1_errors)
    await n1.publish(subjects.node("n2", "heartbeat"), b"{}")  # another node's subject
    await n1.publish(subjects.node("n1", "cmd"), b"{}")  # commands come only from the brain
    await n1.publish(subjects.api("a", "submit"), b"{}")  # nodes are not tenants
    await n1.subscribe(subjects.node("n2", "cmd"))  # another node's commands
    # Its jobs' supervisors may have job commands pushed to them, but nobody's node
    # commands, and may pull from no consumer but the agent's own.
    await n1.publish(f"$JS.API.CONSUMER.CREATE.COMMANDS.x.{subjects.node('n2', 'cmd')}", b"{}")
    await n1.publish("$JS.API.CONSUMER.MSG.NEXT.COMMANDS.agent-n2", b"{}")
    await n1.publish(subjects.node("n1", "heartbeat"), b"{}")  # its own: allowed
    await n1.flush()

    tenant_errors: list[str] = []
    tenant = await raw_as(secure_server, ids["tenant:a"], tenant_errors)
    await tenant.publish(subjects.api("b", "cancel"), b"{}")  # another tenant
    await tenant.subscribe("alnair.state.>")  # the log shows every tenant's jobs
    await tenant.flush()

    operator_errors: list[str] = []
    operator = await raw_as(secure_server, ids["operator:operator"], operator_errors)
    await operator.publish(subjects.api("operator", "submit"), b"{}")  # read-only
    await operator.publish(subjects.node("n1", "cmd"), b"{}")
    await operator.flush()

    await eventually(
        lambda: len(n1_errors) >= 6 and len(tenant_errors) >= 2 and len(operator_errors) >= 2
    )
    assert all("permissions violation" in e.lower() for e in n1_errors + tenant_errors)
    assert received == [subjects.node("n1", "heartbeat")]
    for conn in (n1, tenant, operator, brain):
        await conn.close()


# nats-py leaves the refused connection's transport for the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_unknown_key_cannot_connect(secure_server, tmp_path) -> None:
    from bus.auth import create_identity

    stranger = create_identity("node", "n9", tmp_path / "elsewhere")
    errors: list[str] = []

    async def on_error(error: Exception) -> None:
        errors.append(str(error))

    # A key the server does not know goes to the auth callout; with no brain to answer,
    # the server refuses it after its auth timeout (about 2 s): wait longer than that.
    with pytest.raises(Exception) as refused:  # noqa: PT011 - nats-py raises its own kinds
        await nats.connect(
            secure_server.url,
            nkeys_seed=str(stranger.seed_path),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=10,
            error_cb=on_error,
        )
    said = " ".join([*errors, str(refused.value), repr(refused.value)]).lower()
    del refused
    gc.collect()  # collect the refused transport here, under this test's filters
    assert "authorization" in said or "noservers" in said.replace(" ", ""), said


async def test_keys_made_again_keep_every_identity_already_there(tmp_path: Path) -> None:
    """Adding a node with `alnair keys` leaves every other host's seed valid; an identity
    not listed any more is no longer admitted; --rotate makes every one anew."""
    from bus.auth import unlisted_seeds

    directory = tmp_path / "keys"
    first, _ = write_cluster_keys(directory, nodes=["n1"], tenants=["a", "b"], keep=True)
    again, config = write_cluster_keys(directory, nodes=["n1", "n2"], tenants=["a"], keep=True)
    before = {(i.role, i.name): i.public_key for i in first}
    kept = {(i.role, i.name): i.kept for i in again}
    assert kept[("node", "n1")] and kept[("brain", "brain-1")] and kept[("operator", "operator")]
    assert not kept[("node", "n2")]
    assert all(before[(i.role, i.name)] == i.public_key for i in again if i.kept)
    assert unlisted_seeds(directory, again) == [directory / "tenant-b.nk"]

    server = EmbeddedNats(data_dir=tmp_path / "nats", config_file=config)
    server.start()
    try:
        by_name = {(i.role, i.name): i for i in again}
        for who in (("node", "n1"), ("node", "n2")):  # the kept seed and the new one
            bus = await open_as(server, by_name[who])
            await bus.close()
    finally:
        server.stop()

    rotated, _ = write_cluster_keys(directory, nodes=["n1", "n2"], tenants=["a"])
    assert not any(i.kept for i in rotated)
    assert all(before.get((i.role, i.name)) != i.public_key for i in rotated)


def test_keys_refuse_a_seed_file_they_cannot_read_and_a_tenant_named_operator(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "keys"
    write_cluster_keys(directory, nodes=["n1"], tenants=["a"], keep=True)
    (directory / "node-n1.nk").write_text("not a seed\n")
    with pytest.raises(BusError, match=r"node-n1\.nk: not a user nkey seed"):
        write_cluster_keys(directory, nodes=["n1"], tenants=["a"], keep=True)
    with pytest.raises(BusError, match="'operator' is the operator's identity"):
        write_cluster_keys(tmp_path / "other", nodes=[], tenants=["operator"])
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(
    ("who", "tenant", "verb", "says"),
    [
        ("tenant:a", "b", "submit", "it is not tenant b's; connect with that tenant's seed"),
        ("tenant:a", "operator", "jobs", "it is not the operator's"),
        ("operator:operator", "operator", "drain", "over NATS the operator only reads"),
    ],
)
async def test_a_request_nats_refuses_is_said_at_once_not_timed_out(
    secure_server, keys, who: str, tenant: str, verb: str, says: str
) -> None:
    bus = await open_as(secure_server, keys[0][who])
    try:
        # Far longer than the server takes to refuse: a timeout would say "no answer".
        with pytest.raises(BusError, match="NATS refused this identity publishing to") as error:
            await call(bus, tenant, verb, StatusRequest(), STATUS_RESULT, timeout_s=60)
        assert says in str(error.value)
    finally:
        await bus.close()


async def test_a_refused_publish_is_logged_once(
    secure_server, keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="bus.client")
    bus = await open_as(secure_server, keys[0]["node:n1"])
    try:
        for _ in range(3):
            await bus.nc.publish(subjects.node("n2", "heartbeat"), b"{}")
        await bus.nc.flush()
        refused = f"node:n1: NATS refused to let it publish to {subjects.node('n2', 'heartbeat')}"
        await eventually(lambda: refused in caplog.text)
        await bus.nc.flush()
        assert caplog.text.count(refused) == 1
    finally:
        await bus.close()


async def test_a_tenant_asking_a_node_for_logs_is_told_at_once_where_to_read_them(
    secure_server, keys
) -> None:
    # Under --secure only the operator and the brain ask nodes for logs. A tenant's
    # `alnair logs` waited out the 5-s timeout and logged a warning before.
    bus = await open_as(secure_server, keys[0]["tenant:a"])
    try:
        request = LogRequest(job_id="1", attempt=1, offset=0, max_bytes=1024)
        with pytest.raises(LogUnavailable) as refused:
            await read_chunk(bus, "n1", request, timeout_s=60)
        assert refused.value.reason.startswith("this identity may not ask node n1 for logs")
        assert "GET /v1/jobs/{id}/logs" in refused.value.reason
    finally:
        await bus.close()
