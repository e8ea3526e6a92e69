"""`alnair up`: the one-machine cluster.

Starts the embedded nats-server, then a brain and the node agents as child processes,
as they would run across machines; forwards their output with a prefix, restarts a
child or a NATS server that dies, and takes everything down in order (agents, brain,
NATS) on Ctrl-C.
Writes the cluster file other `alnair` commands find it by.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from agents.gpu import open_backend, probe_nvml
from brain.core import DEFAULT_POLICY, Policy
from bus.server import EmbeddedCluster, EmbeddedNats, check_cluster_size, dies_with_parent
from cli.arguments import whole_number
from cli.config import ClusterInfo, TlsSettings, alnair_home, read_cluster, remove_cluster_file
from schemas.api import OPERATOR_TENANT
from schemas.errors import AlnairError, BusError

DEFAULT_SIM_GPUS = "sim:8xH100"
DEFAULT_HTTP = "127.0.0.1:8470"
# Copies of each stream in a cluster: survives one server's loss, and needs 2 for quorum.
CLUSTER_REPLICAS = 3


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """How a brain decides: `alnair brain`'s flags, which `alnair up` passes to its brains."""
    p.add_argument("--policy", default="fifo", help="queue order policy (default: fifo)")
    p.add_argument(
        "--share-placement",
        default="fgd",
        help="how jobs asking a share of a GPU, a GPU type, CPUs or memory are placed: fgd, "
        "fgd-paper, best-fit, dot-product, gpu-packing or random (default fgd; "
        "docs/sharing.md)",
    )
    p.add_argument(
        "--elasticity",
        default="marginal-gain",
        help="how elastic jobs are sized: marginal-gain (grow into idle GPUs by observed "
        "throughput, shrink when jobs wait), linear, or none (they keep the size they "
        "asked for; resize by hand); default marginal-gain",
    )
    p.add_argument(
        "--elastic-resize-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="resize running elastic jobs only in rounds this far apart (0, the default: "
        "at every scheduling pass); rounds pay when a resize costs more than the wait",
    )
    p.add_argument(
        "--elastic-payback",
        type=float,
        default=DEFAULT_POLICY.elastic_payback,
        metavar="K",
        help="move an elastic job again only after it ran K times as long as its last "
        f"resize took (default {DEFAULT_POLICY.elastic_payback:g}: a job flapped at the "
        "limit stands still at most 1/(K+1) of its time)",
    )
    p.add_argument(
        "--elastic-reprobe",
        type=float,
        default=DEFAULT_POLICY.elastic_reprobe_s,
        metavar="SECONDS",
        help="try an elastic job again at a size it left for lack of gain after this long "
        f"(default {DEFAULT_POLICY.elastic_reprobe_s:g}; 0: never)",
    )
    p.add_argument(
        "--elastic-one-node",
        action="store_true",
        help="keep each elastic job on the node it starts on (default: a job that asks "
        "for more than a node, or fills one, may span and grow across nodes)",
    )
    p.add_argument(
        "--queues",
        metavar="FILE",
        help="queue quotas (YAML: name, guaranteed_gpus, class build|train); see docs/policies.md",
    )
    p.add_argument(
        "--strict-queues",
        action="store_true",
        help="refuse a job for a queue the --queues file does not list (default: it runs "
        "as a train queue with no guarantee, so a mistyped name goes unnoticed)",
    )


def policy_of(args: argparse.Namespace) -> Policy:
    """The brain's policy from `add_policy_args`' flags; raises naming a bad one."""
    return Policy(
        order=args.policy,
        share_placement=args.share_placement,
        elasticity=args.elasticity,
        elastic_resize_interval_s=args.elastic_resize_interval,
        elastic_payback=args.elastic_payback,
        elastic_reprobe_s=args.elastic_reprobe,
        elastic_may_spread=not args.elastic_one_node,
    ).validate()


_at_least_one = whole_number(1, None, "a whole number of 1 or more")
_port = whole_number(0, 65535, "a port (0..65535; 0: a free one)")


def add_up_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="start the one-machine cluster: NATS, a brain, agents")
    p.add_argument(
        "--nodes",
        type=_at_least_one,
        default=None,
        help="simulated nodes to start (default 4; real GPUs: one node)",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="per node: 'nvml', or sim:<count>x<model> (default: nvml if this "
        f"machine has NVIDIA GPUs, else {DEFAULT_SIM_GPUS})",
    )
    p.add_argument(
        "--port",
        type=_port,
        default=0,
        help="NATS port (default: a free one); with --cluster, the first server's, the "
        "others' follow it",
    )
    p.add_argument(
        "--cluster",
        type=int,
        default=None,
        metavar="N",
        help="run N nats-servers (at least 3) as one JetStream cluster, with 3 copies of "
        "every stream; clients get every server's URL",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="NATS over TLS only: a new CA, server and client certificates in "
        "$ALNAIR_HOME/keys/tls; clients must present theirs (mutual TLS)",
    )
    add_policy_args(p)
    p.add_argument(
        "--brains",
        type=_at_least_one,
        default=1,
        help="brains to run: one leads, the others stand by to take over (default 1)",
    )
    p.add_argument(
        "--http",
        default=DEFAULT_HTTP,
        metavar="HOST:PORT",
        help=f"the brain's HTTP API and dashboard (default {DEFAULT_HTTP}, or a free port "
        "if that one is taken)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="run with per-component NATS identities (nkeys) and least-privilege "
        "permissions; as root, also run jobs as an unprivileged user per tenant, each in "
        "its own cgroup (docs/security.md)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="forget the previous cluster's jobs (empties the NATS store)",
    )
    p.set_defaults(fn=cmd_up)


@dataclass
class Child:
    name: str
    argv: list[str]
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    forwarder: asyncio.Task[None] | None = field(default=None, repr=False)


def node_name_for_host() -> str:
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:64]
    return name or "node-1"


def plan_agents(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The GPU spec and node names; says plainly when it falls back to simulation."""
    spec = args.gpus
    if spec is None:
        count, why = probe_nvml()
        if count:
            spec = "nvml"
            print(f"alnair up: found {count} NVIDIA GPU(s) through NVML; one node uses them")
        else:
            spec = DEFAULT_SIM_GPUS
            nodes = args.nodes or 4
            print(
                f"alnair up: no NVIDIA GPU here ({why}); starting {nodes} simulated "
                f"nodes of {spec[4:]} (change with --nodes, --gpus)"
            )
    if spec == "nvml":
        if args.nodes not in (None, 1):
            raise AlnairError("--gpus nvml runs one node: this machine's GPUs")
        if args.gpus is not None:
            count, why = probe_nvml()
            if not count:
                # Its agent could never start: refused before anything starts.
                raise AlnairError(
                    f"--gpus nvml: {why}; simulate GPUs with --gpus {DEFAULT_SIM_GPUS}"
                )
        return spec, [node_name_for_host()]
    open_backend(spec, node="node-1")  # a spec no agent could run, refused here
    return spec, [f"node-{i}" for i in range(1, (args.nodes or 4) + 1)]


async def _forward(child: Child) -> None:
    assert child.process is not None
    assert child.process.stdout is not None
    prefix = f"{child.name:>7} | "
    while line := await child.process.stdout.readline():
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()


async def _spawn(child: Child, env: dict[str, str]) -> None:
    child.process = await asyncio.create_subprocess_exec(
        *child.argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
        # A cluster whose `alnair up` died goes with it (agents stop their jobs on
        # SIGTERM), rather than run on half supervised beside the next one.
        preexec_fn=dies_with_parent(),
    )
    child.forwarder = asyncio.ensure_future(_forward(child))


async def _supervise(child: Child, env: dict[str, str], stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        await _spawn(child, env)
        assert child.process is not None
        code = await child.process.wait()
        if child.forwarder is not None:
            await child.forwarder
        if stopping.is_set():
            return
        child.restarts += 1
        delay = min(30.0, 2.0 ** min(child.restarts, 5))
        print(f"alnair up: {child.name} exited with {code}; restarting in {delay:.0f}s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=delay)


# How often `up` looks whether a NATS server it started has exited.
NATS_CHECK_S: Final = 1.0


async def _supervise_nats(servers: tuple[EmbeddedNats, ...], stopping: asyncio.Event) -> None:
    """Start again, on its port and store, a NATS server that exits, as a brain or an
    agent is (its clients reconnect; a cluster's member catches up with the others);
    with the same back-off between tries. Each server on its own: one waiting out its
    back-off, or slow to start, holds up no other."""
    await asyncio.gather(*(_supervise_server(server, stopping) for server in servers))


async def _supervise_server(server: EmbeddedNats, stopping: asyncio.Event) -> None:
    name = server.name or "nats-server"
    restarts = 0
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=NATS_CHECK_S)
        code = server.exited()
        if code is None or stopping.is_set():
            continue
        restarts += 1
        delay = min(30.0, 2.0 ** min(restarts, 5))
        print(f"alnair up: {name} exited with {code}; restarting in {delay:.0f}s", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=delay)
        if stopping.is_set():
            return
        try:
            await server.restart()
        except BusError as error:
            print(f"alnair up: {name} did not start again: {error}", flush=True)
        else:
            print(f"alnair up: {name} is back on {server.url}", flush=True)


async def _terminate(children: list[Child], timeout_s: float) -> None:
    for child in children:
        if child.process is not None and child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    for child in children:
        if child.process is None:
            continue
        try:
            await asyncio.wait_for(child.process.wait(), timeout=timeout_s)
        except TimeoutError:
            child.process.kill()
            await child.process.wait()


async def _wait_ready(
    urls: tuple[str, ...],
    nodes: Sequence[str],
    *,
    nkey: str | None,
    tenant: str,
    tls: TlsSettings | None = None,
    timeout_s: float = 60.0,
) -> int:
    from cli.client import call, open_bus
    from schemas.api import NODES_RESULT, ListNodesRequest
    from schemas.nodes import NodeStatus

    bus = await open_bus(urls, name="alnair-up", credentials=None, nkey=nkey, tls=tls)
    try:
        deadline = time.monotonic() + timeout_s
        heard: list[NodeStatus] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(AlnairError):
                reply = await call(
                    bus,
                    tenant,
                    "nodes",
                    ListNodesRequest(),
                    NODES_RESULT,
                    timeout_s=2.0,
                    failover_s=0.0,  # this loop asks again, until its own deadline
                )
                # Its own nodes, heard by this brain: a record replayed from an earlier
                # cluster's log (its agent not started yet, or failing) does not count.
                heard = [
                    n
                    for n in reply.nodes
                    if n.record.name in nodes and n.last_seen_s_ago is not None
                ]
                if len(heard) == len(nodes):
                    return sum(len(n.record.gpus) for n in heard)
            await asyncio.sleep(0.3)
        missing = sorted(set(nodes) - {n.record.name for n in heard})
        raise AlnairError(
            f"only {len(heard)} of {len(nodes)} nodes joined within {timeout_s:.0f}s "
            f"(not heard: {', '.join(missing)}; their agents' lines above say why)"
        )
    finally:
        await bus.close()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


async def _wait_listening(address: str, timeout_s: float = 30.0) -> None:
    """The leader listens on the HTTP address once it leads: wait until it does."""
    from brain.http import parse_address

    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > deadline:
                waited = f"{timeout_s:.0f}s"
                raise AlnairError(f"no brain listened on {address} within {waited}") from None
            await asyncio.sleep(0.1)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


def _plan_http(address: str, home: Path) -> tuple[str, str, Path, str]:
    """The brain's HTTP address (a free port if the asked one is taken), its URL, and
    the tokens file, written with a tenant and an operator token if missing."""
    from brain.http import ensure_tokens_file, parse_address

    host, port = parse_address(address)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            probe.bind((host, 0))
            print(f"alnair up: {address} is taken; the HTTP API uses port {probe.getsockname()[1]}")
        # Port 0 means any free port: fix it now, since every brain must be given the same.
        port = int(probe.getsockname()[1])
    tokens_path = home / "http-tokens.json"
    operator = ensure_tokens_file(tokens_path).token_for(OPERATOR_TENANT, operator=True) or ""
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}", f"http://{shown}:{port}", tokens_path, operator


@dataclass(frozen=True)
class ClusterKeys:
    config: Path
    brains: list[str]
    nodes: dict[str, str]
    # The account seed brains sign jobs' NATS users with (auth callout).
    callout: str
    operator: str
    client: str
    # The tenant map (a user per tenant), when this process could make the users.
    tenant_users: Path | None


def _plan_keys(args: argparse.Namespace, home: Path, node_names: list[str]) -> ClusterKeys:
    """Fresh identities for every component, and the server config admitting them."""
    from bus.auth import CALLOUT_SEED_FILE, write_cluster_keys
    from cli.confine import ensure_tenant_users

    tenants = ["default"]
    identities, config = write_cluster_keys(
        home / "keys", nodes=node_names, tenants=tenants, brains=args.brains
    )
    by_role: dict[str, list[str]] = {}
    for identity in identities:
        by_role.setdefault(identity.role, []).append(str(identity.seed_path))
    print(f"alnair up: secure: NATS identities and permissions in {home / 'keys'}")
    return ClusterKeys(
        config=config,
        brains=by_role["brain"],
        nodes={i.name: str(i.seed_path) for i in identities if i.role == "node"},
        callout=str(home / "keys" / CALLOUT_SEED_FILE),
        operator=by_role["operator"][0],
        client=by_role["tenant"][0],
        tenant_users=ensure_tenant_users(tenants, home / "tenant-users.yaml"),
    )


def _plan_nats(
    args: argparse.Namespace, home: Path, keys: ClusterKeys | None
) -> tuple[EmbeddedNats | EmbeddedCluster, TlsSettings | None]:
    """One nats-server, or a cluster of `--cluster` (stores apart: a cluster cannot
    adopt a single server's store); with `--tls`, fresh certificates."""
    files = None
    if args.tls:
        from bus.tls import write_tls_files

        files = write_tls_files(home / "keys" / "tls")
        print(f"alnair up: TLS: CA and certificates in {home / 'keys' / 'tls'}")
    config = keys.config if keys else None
    server: EmbeddedNats | EmbeddedCluster
    if args.cluster is not None:
        server = EmbeddedCluster(
            data_dir=home / "nats-cluster",
            size=args.cluster,
            base_port=args.port,
            config_file=config,
            log_dir=home / "logs",
            tls=files,
            die_with_parent=True,
        )
    else:
        server = EmbeddedNats(
            data_dir=home / "nats",
            port=args.port,
            log_file=home / "logs" / "nats.log",
            config_file=config,
            tls=files,
            die_with_parent=True,
        )
    if files is None:
        return server, None
    return server, TlsSettings(str(files.ca), str(files.client_cert), str(files.client_key))


def _tls_env(tls: TlsSettings | None) -> dict[str, str]:
    """What the children (and their jobs' supervisors) read their TLS files from."""
    if tls is None:
        return {}
    return {
        "ALNAIR_TLS_CA": tls.ca,
        "ALNAIR_TLS_CERT": tls.cert or "",
        "ALNAIR_TLS_KEY": tls.key or "",
    }


def _job_tls_args(keys: ClusterKeys | None, tls: TlsSettings | None) -> list[str]:
    """Confined jobs under mutual TLS: each attempt's own certificate, signed by the
    job issuer next to the CA (bus/tls.py)."""
    if keys is None or keys.tenant_users is None or tls is None or tls.cert is None:
        return []
    from bus.tls import JobIssuer

    issuer = JobIssuer.in_dir(Path(tls.ca).parent)
    return ["--job-tls-issuer", f"{issuer.cert},{issuer.key}"]


def _queues_args(path: str | None, strict: bool) -> list[str]:
    """The brains' `--queues`, checked now rather than by brains that would restart."""
    if not path:
        if strict:
            raise AlnairError("--strict-queues needs --queues: the queues jobs may use")
        return []
    from brain.queues import load_queues

    load_queues(path)
    return ["--queues", str(Path(path).resolve()), *(["--strict-queues"] if strict else [])]


async def cmd_up(args: argparse.Namespace) -> int:
    home = alnair_home()
    running = read_cluster(home)
    if running is not None:
        raise AlnairError(
            f"a cluster is already running from {home} (pid {running.pid}, "
            f"NATS {', '.join(running.nats)}); stop it first"
        )
    # Everything a child would refuse, refused before anything starts.
    policy_of(args)
    spec, node_names = plan_agents(args)
    if args.cluster is not None:
        check_cluster_size(args.cluster)  # before anything is written
    queues = _queues_args(args.queues, args.strict_queues)
    if args.fresh:
        import shutil

        shutil.rmtree(home / "nats", ignore_errors=True)
        shutil.rmtree(home / "nats-cluster", ignore_errors=True)
        for old in (home / "brain").glob("history*.db*"):
            old.unlink(missing_ok=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    keys = _plan_keys(args, home, node_names) if args.secure else None
    server, tls = _plan_nats(args, home, keys)
    # From this (the main) thread, and so blocking, nothing else running yet: a server
    # started from a worker thread would be told to stop when that thread ends.
    server.start()
    nats_urls = ",".join(server.urls)
    ClusterInfo(
        nats=server.urls,
        pid=os.getpid(),
        started_at=time.time(),
        home=str(home),
        client_nkey=keys.client if keys else None,
        tls=tls,
    ).write(home)
    env = {
        **os.environ,
        "ALNAIR_HOME": str(home),
        "ALNAIR_NATS": nats_urls,
        "PYTHONUNBUFFERED": "1",
        # Jobs run with the agents' environment: `python` in a job's command is this
        # project's, with torch and Horovod, whether or not the submitter's shell had
        # the virtual environment activated.
        "PATH": os.pathsep.join(
            [str(Path(sys.executable).parent), *filter(None, [os.environ.get("PATH")])]
        ),
        **_tls_env(tls),
    }
    me = [sys.executable, "-m", "cli"]
    http, http_url, tokens_path, operator_token = _plan_http(args.http, home)
    brains = [
        Child(
            "brain" if i == 0 else f"brain-{i + 1}",
            [
                *[*me, "brain", "--nats", nats_urls, "--policy", args.policy, *queues],
                *["--elasticity", args.elasticity],
                *["--share-placement", args.share_placement],
                *["--elastic-resize-interval", str(args.elastic_resize_interval)],
                *["--elastic-payback", str(args.elastic_payback)],
                *["--elastic-reprobe", str(args.elastic_reprobe)],
                *(["--elastic-one-node"] if args.elastic_one_node else []),
                *(["--replicas", str(CLUSTER_REPLICAS)] if args.cluster else []),
                *["--history", str(home / "brain" / f"history-{i + 1}.db")],
                *(["--nkey", keys.brains[i], "--callout-seed", keys.callout] if keys else []),
                *(["--tenant-users", str(keys.tenant_users)] if keys and keys.tenant_users else []),
                # One HTTP address on this machine, served by whichever brain leads.
                *["--http", http, "--http-tokens", str(tokens_path), "--http-leader-only"],
            ],
        )
        for i in range(args.brains)
    ]
    agents = [
        Child(
            name,
            [
                *[*me, "agent", "--node", name, "--gpus", spec, "--nats", nats_urls],
                *(["--nkey", keys.nodes[name]] if keys else []),
                *(["--tenant-users", str(keys.tenant_users)] if keys and keys.tenant_users else []),
                *_job_tls_args(keys, tls),
            ],
        )
        for name in node_names
    ]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    supervisors = [asyncio.ensure_future(_supervise(c, env, stopping)) for c in (*brains, *agents)]
    nats_supervisor = asyncio.ensure_future(_supervise_nats(server.servers, stopping))
    try:
        gpus = await _wait_ready(
            server.urls,
            node_names,
            tls=tls,
            nkey=keys.operator if keys else None,
            tenant="operator" if keys else "default",
        )
        await _wait_listening(http)
        print(
            f"\nalnair up: ready. NATS {nats_urls}, {_count(len(brains), 'brain')} + "
            f"{_count(len(agents), 'node')}, {_count(gpus, 'GPU')} "
            f"({spec}). State and logs in {home}.\n"
            f"  HTTP API {http_url} (tokens in {tokens_path})\n"
            f"  dashboard: {http_url}/#token={operator_token}\n"
            "  try:  .venv/bin/alnair submit --gpus 2 -- python -c 'print(42)'\n"
            "        .venv/bin/alnair jobs;  .venv/bin/alnair events --follow\n"
            "  Ctrl-C stops the cluster.\n",
            flush=True,
        )
        await stopping.wait()
    finally:
        stopping.set()
        print("alnair up: stopping agents, brain, NATS", flush=True)
        await _terminate(agents, timeout_s=20.0)
        await _terminate(brains, timeout_s=10.0)
        for task in supervisors:
            with contextlib.suppress(Exception):
                await task
        # Not restarting a server while it is stopped.
        nats_supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await nats_supervisor
        await server.astop()
        remove_cluster_file(home, os.getpid())
    return 0
