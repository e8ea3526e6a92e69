"""The NATS part of `alnair status`: every server, whether it answers, and which one
leads the STATE log (in a cluster) with how its copies keep up."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlparse

from bus.client import Bus
from schemas import subjects

PROBE_TIMEOUT_S = 1.0
# A copy the leader has not heard from for this long is said to be silent: the server
# marks it offline only later (about a minute after it stopped answering).
SILENT_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class ServerState:
    url: str
    reachable: bool
    connected: bool


@dataclass(frozen=True, slots=True)
class ReplicaState:
    server: str
    role: str  # "leader", "current", "behind" or "offline"
    lag: int | None = None
    # Seconds since the leader last heard from it (None: the leader, or not said).
    silent_s: float | None = None

    def describe(self) -> str:
        lag = f" lag {self.lag}" if self.lag else ""
        silent = self.silent_s
        quiet = f", silent {silent:.0f}s" if silent is not None and silent >= SILENT_AFTER_S else ""
        return f"{self.server} {self.role}{lag}{quiet}"

    @classmethod
    def of_peer(cls, peer: Any) -> ReplicaState:
        """From JetStream's view of a follower (`PeerInfo`: `active` in nanoseconds)."""
        role = "offline" if peer.offline else "current" if peer.current else "behind"
        silent = None if peer.active is None else peer.active / 1e9
        return cls(peer.name or "?", role, peer.lag, silent)


@dataclass(frozen=True, slots=True)
class NatsReport:
    servers: tuple[ServerState, ...]
    # None when the STATE stream has one copy, or this identity may not look.
    state_replicas: tuple[ReplicaState, ...] | None

    def as_json(self) -> dict[str, Any]:
        return {
            "nats_servers": [asdict(s) for s in self.servers],
            "state_replicas": (
                None if self.state_replicas is None else [asdict(r) for r in self.state_replicas]
            ),
        }

    def lines(self) -> list[str]:
        shown = []
        for server in self.servers:
            mark = "connected" if server.connected else "up" if server.reachable else "DOWN"
            shown.append(f"{server.url} ({mark})")
        out = [f"nats:    {', '.join(shown)}"]
        if self.state_replicas:
            parts = [replica.describe() for replica in self.state_replicas]
            out.append(f"STATE:   {len(self.state_replicas)} copies: {', '.join(parts)}")
        return out


async def _reachable(url: str) -> bool:
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parsed.hostname, parsed.port or 4222), PROBE_TIMEOUT_S
        )
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _same_server(url: str, connected: Any) -> bool:
    if connected is None:
        return False
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    return bool(parsed.hostname == connected.hostname and parsed.port == connected.port)


async def nats_report(bus: Bus, servers: tuple[str, ...]) -> NatsReport:
    reachable = await asyncio.gather(*(_reachable(url) for url in servers))
    connected = bus.nc.connected_url
    states = tuple(
        ServerState(url, up, _same_server(url, connected))
        for url, up in zip(servers, reachable, strict=True)
    )
    replicas: tuple[ReplicaState, ...] | None = None
    # An identity without the right to look (a tenant under --secure) gets no answer.
    with contextlib.suppress(Exception):
        cluster = await bus.stream_cluster(subjects.STREAM_STATE, timeout_s=PROBE_TIMEOUT_S)
        if cluster is not None and cluster.replicas:  # one copy: nothing to tell
            found = [ReplicaState(cluster.leader or "?", "leader")]
            found += [ReplicaState.of_peer(peer) for peer in cluster.replicas or []]
            replicas = tuple(found)
    return NatsReport(states, replicas)
