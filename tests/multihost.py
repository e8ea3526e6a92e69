"""Many hosts on one machine: network namespaces on a bridge, each with its own address,
hostname (a UTS namespace), /etc/hosts naming every host (a mount namespace) and
ALNAIR_HOME, running a real Alnair cluster.

Hosts `nats-1..3` run one JetStream cluster (R3 streams), `brain-1..2` a leader and a
standby, `node-1..N` an agent each (simulated GPUs). The test process stays in the root
namespace and reaches every host through an address of its own on the bridge. A
partition is a host's link set down (this kernel has no `tc netem`): the host is cut
from every other host, the NATS servers included; `heal` sets it up again.

Everything made is named after a tag unique to the run (`aln<tag>-<host>` namespaces,
`alb<tag>` bridge, `alv<tag><i>` links) and removed by `close()`, which kills every
process left in the namespaces first. Only private addresses (10.231.x.0/24) on the
bridge it made are used. `unavailable()` says why namespaces cannot be made here, for a
test to skip with.

Used by tests/test_multihost.py, infra/multihost.py (by hand) and bench/partition.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from bus.server import EmbeddedNats, Routes, new_route_secret, route_url

REPO: Final = Path(__file__).resolve().parent.parent
CLIENT_PORT: Final = 14222  # never 4222: not the default a stray client would find
ROUTE_PORT: Final = 16222
MONITOR_PORT: Final = 18222
SUBNET_PREFIX: Final = "10.231"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed"
    probe = f"alnprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str
    link: str  # the root namespace's end of its veth pair, on the bridge
    home: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[IO[bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Timings:
    """The cluster's timeouts (small, for tests): see docs/operations.md, Partitions."""

    heartbeat_s: float = 0.5
    node_timeout_s: float = 2.0
    fence_margin_s: float = 2.0
    fence_after_s: float = 1.5
    fence_grace_s: float = 1.0
    lease_ttl_s: float = 3.0
    keep_disconnected_s: float = 30.0


class MultiHost:
    def __init__(
        self,
        workdir: Path,
        *,
        agents: int = 3,
        brains: int = 2,
        gpus: str = "sim:2xA100",
        timings: Timings | None = None,
        tag: str | None = None,
        agent_env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.agent_count = agents
        self.brain_count = brains
        self.gpus = gpus
        self.timings = timings or Timings()
        self.tag = tag or f"{os.getpid() % 100000}"
        self.bridge = f"alb{self.tag}"
        self.subnet = f"{SUBNET_PREFIX}.{self._free_octet()}"
        self.hosts: dict[str, Host] = {}
        # The NATS servers' route password (bus/server.py, ROUTE_USER).
        self.route_secret = new_route_secret()
        # Added to each agent's environment (and so its jobs'): e.g. the interface
        # elastic jobs' workers reach each other on, eth0 on every host here.
        self.agent_env = {"ALNAIR_NETWORK_INTERFACE": "eth0", **(agent_env or {})}
        # Brains and agents that exit are started again, as `alnair up` does (a brain
        # whose first stream creation times out while the cluster settles, say).
        self._supervised: dict[tuple[str, str], tuple[list[str], dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts: list[tuple[str, str, int | None]] = []

    # -- the network --------------------------------------------------------------------

    def _free_octet(self) -> int:
        used = _ip("-o", "addr").stdout
        start = int(self.tag) % 250
        for i in range(250):
            octet = (start + i) % 250 + 1
            if f"{SUBNET_PREFIX}.{octet}." not in used:
                return octet
        raise RuntimeError(f"no free {SUBNET_PREFIX}.x.0/24 subnet")

    @property
    def gateway(self) -> str:
        """The root namespace's own address on the bridge (the test's client)."""
        return f"{self.subnet}.1"

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 2
        host = Host(
            name=name,
            netns=f"aln{self.tag}-{name}",
            address=f"{self.subnet}.{index}",
            link=f"alv{self.tag}x{index}",
            home=self.workdir / name,
        )
        self.hosts[name] = host  # before making it, so close() removes a half-made one
        host.home.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.link, "master", self.bridge, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        return host

    def partition(self, name: str) -> None:
        """Cut a host off from every other (its link down)."""
        _ip("link", "set", self.hosts[name].link, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].link, "up")

    def isolate_nats(self, name: str) -> None:
        """Cut one NATS server off from the other two (and from its clients, which move
        to the others): its host's link down."""
        self.partition(name)

    # -- processes ------------------------------------------------------------------------

    def spawn(
        self,
        host_name: str,
        role: str,
        argv: list[str],
        *,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Run `argv` on a host: in its namespace, under its own hostname."""
        host = self.hosts[host_name]
        log = (host.home / f"{role}.log").open("ab")
        host.logs.append(log)
        env = {
            **os.environ,
            "ALNAIR_HOME": str(host.home),
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        env.pop("ALNAIR_NATS", None)
        process = subprocess.Popen(
            self._on_host(host, argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )
        host.processes[role] = process
        return process

    @property
    def hosts_file(self) -> Path:
        """Every host's name and address: each host's /etc/hosts (its own mount
        namespace), so that names resolve as on a real network (Horovod's workers
        resolve their own)."""
        return self.workdir / "etc-hosts"

    def _write_hosts_file(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values()]
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def _on_host(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` in the host's network namespace, under its hostname (a UTS namespace)
        and with the cluster's hosts file (a mount namespace: the machine's own
        /etc/hosts is untouched)."""
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            *("ip", "netns", "exec", host.netns),
            *("unshare", "--uts", "--mount", "--"),
            *("sh", "-c", script, host.name, str(self.hosts_file), *argv),
        ]

    def run_on(
        self, host_name: str, argv: list[str], *, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command to completion on a host (its namespace, hostname and
        ALNAIR_HOME) and return what it printed."""
        host = self.hosts[host_name]
        env = {**os.environ, "ALNAIR_HOME": str(host.home), "PYTHONPATH": str(REPO)}
        env.pop("ALNAIR_NATS", None)
        return subprocess.run(
            self._on_host(host, argv),
            capture_output=True,
            text=True,
            env=env,
            cwd=str(REPO),
            timeout=timeout_s,
            check=False,
        )

    def supervise(
        self, host_name: str, role: str, argv: list[str], *, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with self._lock:
            self._supervised[(host_name, role)] = (argv, extra_env or {})
            return self.spawn(host_name, role, argv, extra_env=extra_env)

    def _supervise_forever(self) -> None:
        while not self._closing.wait(1.0):
            with self._lock:
                for (host_name, role), (argv, env) in self._supervised.items():
                    process = self.hosts[host_name].processes[role]
                    if process.poll() is not None and not self._closing.is_set():
                        self.restarts.append((host_name, role, process.returncode))
                        self.spawn(host_name, role, argv, extra_env=env)

    def kill(self, host_name: str, role: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop a process for good (not restarted)."""
        with self._lock:
            self._supervised.pop((host_name, role), None)
            process = self.hosts[host_name].processes[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        process.wait(timeout=30)

    def alnair(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli", *args]

    # -- the cluster ------------------------------------------------------------------------

    @property
    def nats_hosts(self) -> list[str]:
        return [f"nats-{i + 1}" for i in range(3)]

    @property
    def brain_hosts(self) -> list[str]:
        return [f"brain-{i + 1}" for i in range(self.brain_count)]

    @property
    def agent_hosts(self) -> list[str]:
        return [f"node-{i + 1}" for i in range(self.agent_count)]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(f"nats://{self.hosts[n].address}:{CLIENT_PORT}" for n in self.nats_hosts)

    def start(self, *, timeout_s: float = 120.0) -> None:
        """Make every host and start NATS, the brains and the agents on them; returns once
        NATS is healthy (the caller waits for a leader and the nodes, over the bus)."""
        self._make_bridge()
        for name in [*self.nats_hosts, *self.brain_hosts, *self.agent_hosts]:
            self.add_host(name)
        self._write_hosts_file()
        self._start_nats(timeout_s)
        for name in self.brain_hosts:
            self.start_brain(name)
        for name in self.agent_hosts:
            self.start_agent(name)
        self._supervisor = threading.Thread(target=self._supervise_forever, daemon=True)
        self._supervisor.start()

    def _nats_server(self, name: str) -> EmbeddedNats:
        host = self.hosts[name]
        routes = tuple(
            route_url(self.hosts[n].address, ROUTE_PORT, self.route_secret) for n in self.nats_hosts
        )
        return EmbeddedNats(
            data_dir=host.home / "nats",
            host=host.address,
            port=CLIENT_PORT,
            name=name,
            cluster=Routes("alnair", ROUTE_PORT, routes, self.route_secret),
            sync_always=True,
            monitor_port=MONITOR_PORT,
        )

    def _start_nats(self, timeout_s: float) -> None:
        servers = [self._nats_server(name) for name in self.nats_hosts]
        for name, server in zip(self.nats_hosts, servers, strict=True):
            server.data_dir.mkdir(parents=True, exist_ok=True)
            config = server.generated_config
            assert config is not None
            config.write_text(server.render_config())
            self.spawn(name, "nats", server.command())
        deadline = time.monotonic() + timeout_s
        for name in self.nats_hosts:
            while not self.nats_healthy(name):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"NATS on {name} not healthy in {timeout_s:.0f}s "
                        f"(log {self.hosts[name].home / 'nats.log'})"
                    )
                time.sleep(0.2)

    def nats_healthy(self, name: str) -> bool:
        url = f"http://{self.hosts[name].address}:{MONITOR_PORT}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(json.loads(response.read()).get("status") == "ok")
        except (OSError, ValueError):
            return False

    def start_brain(self, name: str) -> subprocess.Popen[bytes]:
        t = self.timings
        return self.supervise(
            name,
            "brain",
            self.alnair(
                "brain",
                "--nats",
                ",".join(self.urls),
                "--replicas",
                "3",
                "--node-timeout",
                str(t.node_timeout_s),
                "--fence-margin",
                str(t.fence_margin_s),
                "--keep-disconnected",
                str(t.keep_disconnected_s),
                "--lease-ttl",
                str(t.lease_ttl_s),
                "--launch-ttl",
                "30",
                "--backoff",
                "0.2",
                "--backoff-max",
                "1",
            ),
        )

    def start_agent(self, name: str) -> subprocess.Popen[bytes]:
        t = self.timings
        return self.supervise(
            name,
            "agent",
            self.alnair(
                "agent",
                "--nats",
                ",".join(self.urls),
                "--node",
                name,
                "--gpus",
                self.gpus,
                "--heartbeat",
                str(t.heartbeat_s),
                "--fence-after",
                str(t.fence_after_s),
                "--fence-grace",
                str(t.fence_grace_s),
            ),
            extra_env=self.agent_env,
        )

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process on every host, then remove the hosts and the bridge; safe
        to call on a half-made cluster, and more than once."""
        self._closing.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for host in self.hosts.values():
            self._stop_all(host, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(self._pids(h) for h in self.hosts.values()):
            time.sleep(0.2)
        for host in self.hosts.values():
            self._stop_all(host, signal.SIGKILL)
            for process in host.processes.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
            for log in host.logs:
                log.close()
            host.logs.clear()
            _ip("link", "del", host.link, check=False)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)

    @staticmethod
    def _pids(host: Host) -> list[int]:
        listed = _ip("netns", "pids", host.netns, check=False)
        return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []

    def _stop_all(self, host: Host, sig: signal.Signals) -> None:
        """Every process in the host's namespace: agents, brains, servers, and the jobs
        the agents started (each in a session of its own)."""
        for process in host.processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        for pid in self._pids(host):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
