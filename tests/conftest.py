"""Fixtures: a real nats-server on a free port, and factories for brains and agents.

Nothing here mocks the bus. Every server, brain and agent is torn down in `finally`,
and job processes left behind by a test are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent, AgentConfig
from agents.gpu import SimulatedGpus
from brain.service import Brain, BrainConfig
from bus.client import Bus, ConnectOptions
from bus.server import EmbeddedNats
from bus.tls import TlsFiles
from schemas.jobs import JobSpec


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(data_dir=tmp_path / "nats")
    server.start()
    assert server.port != 4222
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_server(tmp_path: Path, tls_files: TlsFiles) -> Iterator[EmbeddedNats]:
    """A server requiring mutual TLS with the requesting module's `tls_files`."""
    server = EmbeddedNats(data_dir=tmp_path / "nats", tls=tls_files)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_urls(nats_server: EmbeddedNats) -> tuple[str, ...]:
    """Every server a client is given (a cluster's module overrides it)."""
    return (nats_server.url,)


@pytest.fixture
def stream_replicas() -> int:
    """Copies of each JetStream stream (3 in a cluster's module)."""
    return 1


@pytest.fixture
async def connect(
    nats_urls: tuple[str, ...], stream_replicas: int
) -> AsyncIterator[Callable[[str], Awaitable[Bus]]]:
    opened: list[Bus] = []

    async def make(name: str) -> Bus:
        options = ConnectOptions(servers=nats_urls, name=name)
        bus = await Bus.connect(options, replicas=stream_replicas)
        opened.append(bus)
        return bus

    try:
        yield make
    finally:
        for bus in reversed(opened):
            with contextlib.suppress(Exception):
                await bus.close()


@pytest.fixture
async def brain_factory(
    connect: Callable[[str], Awaitable[Bus]], tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Brain]]]:
    brains: list[Brain] = []

    async def make(*, lead: bool = True, **overrides: Any) -> Brain:
        options: dict[str, Any] = {
            "node_timeout_s": 2.0,
            "tick_s": 0.2,
            "stop_grace_s": 3.0,
            "lease_ttl_s": 2.0,
            "history_path": tmp_path / f"history-{len(brains)}.db",
        }
        options.update(overrides)
        brain = Brain(await connect("brain"), BrainConfig(**options))
        await brain.start()
        brains.append(brain)
        if lead:
            await asyncio.wait_for(brain.leading.wait(), timeout=30)
        return brain

    try:
        yield make
    finally:
        for brain in reversed(brains):
            with contextlib.suppress(Exception):
                await brain.stop()


@pytest.fixture
async def agent_factory(
    connect: Callable[[str], Awaitable[Bus]], tmp_path: Path, nats_server: EmbeddedNats
) -> AsyncIterator[Callable[..., Awaitable[Agent]]]:
    agents: list[Agent] = []
    orphans: list[int] = []

    async def make(
        node: str,
        gpus: int = 4,
        model: str = "A100",
        clock: Callable[[], float] = time.time,
        **config_fields: Any,
    ) -> Agent:
        config = AgentConfig(
            node=node,
            data_dir=tmp_path / "agents" / node,
            heartbeat_s=0.2,
            telemetry_s=0.5,
            stop_grace_s=3.0,
            nats_url=nats_server.url,
            **config_fields,
        )
        bus = await connect(f"agent:{node}")
        agent = Agent(bus, config, SimulatedGpus(node, gpus, model), clock=clock)
        await agent.start()
        agents.append(agent)
        return agent

    make.orphans = orphans  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for agent in reversed(agents):
            with contextlib.suppress(Exception):
                await agent.stop(stop_jobs=True)
            agent.backend.close()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def eventually(
    condition: Callable[[], Any], *, timeout_s: float = 20.0, interval_s: float = 0.05
) -> Any:
    """Poll until `condition()` is truthy, with a deadline; return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)


def pids_running(needle: str) -> list[str]:
    """PIDs of processes whose command line holds `needle` (a path unique to this test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if needle in cmdline:
                    found.append(entry.name)
    return found


REPO = Path(__file__).resolve().parent.parent


def open_ended_training(stop_file: Path, *extra: str) -> tuple[str, ...]:
    """workloads/examples/elastic_train.py stepping every ~20 ms with a commit every 5
    steps, until `stop_file` exists (then it ends at its next commit)."""
    return (
        sys.executable,
        "-m",
        "workloads.examples.elastic_train",
        "--steps=1000000",
        "--step-delay=0.02",
        "--commit-every=5",
        f"--stop-file={stop_file}",
        *extra,
    )


def elastic_train_spec(
    gpus: int, stop_file: Path, *, max_gpus: int, name: str = "elastic"
) -> JobSpec:
    """workloads/examples/elastic_train.py as an elastic job that trains until
    `stop_file` exists (then ends at its next commit); the supervisor's files go beside
    it (TMPDIR)."""
    return JobSpec(
        name=name,
        command=open_ended_training(stop_file),
        gpus=gpus,
        elastic=True,
        min_gpus=1,
        max_gpus=max_gpus,
        cwd=str(REPO),
        env={"TMPDIR": str(stop_file.parent)},
    )
