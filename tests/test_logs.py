"""Logs from anywhere: the agent's log server (chunks, bounds, names), and a job's log
read through NATS by `alnair logs` (a real CLI process) and over HTTP, tenant-confined.

The multi-host version (the CLI on another host) is in tests/test_multihost.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from agents.logserve import LogServer
from bus.logs import LogUnavailable, attempt_nodes
from schemas.jobs import JobSpec, JobState
from schemas.logs import LogChunk, LogMissing, LogRequest
from tests.conftest import REPO, eventually
from tests.httpkit import Api, api_factory
from tests.test_cluster_e2e import submit

__all__ = ["api_factory"]


def test_log_server_reads_bounded_chunks_by_offset(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "j1" / "attempt-2.log"
    path.parent.mkdir(parents=True)
    path.write_bytes("héllo\n".encode() * 4)  # 7 bytes a line: é is two
    server = LogServer("n1", tmp_path / "logs", lambda job, attempt: attempt == 2)
    first = server.read(LogRequest(job_id="j1", attempt=2, max_bytes=3))
    # "hé" is 3 bytes; a cut inside é would have been moved back to before it.
    assert isinstance(first, LogChunk)
    assert (first.data, first.offset, first.next_offset, first.size) == ("hé", 0, 3, 28)
    assert first.running
    split = server.read(LogRequest(job_id="j1", attempt=2, max_bytes=2))
    assert isinstance(split, LogChunk) and (split.data, split.next_offset) == ("h", 1)
    tail = server.read(LogRequest(job_id="j1", attempt=2, offset=-7))
    assert isinstance(tail, LogChunk) and (tail.data, tail.offset) == ("héllo\n", 21)
    end = server.read(LogRequest(job_id="j1", attempt=2, offset=100))
    assert isinstance(end, LogChunk) and (end.data, end.next_offset) == ("", 28)
    missing = server.read(LogRequest(job_id="j1", attempt=1))
    assert isinstance(missing, LogMissing) and "no log of job j1 attempt 1" in missing.error
    escape = server.read(LogRequest(job_id="..", attempt=2))
    assert isinstance(escape, LogMissing) and "invalid job id" in escape.error
    bad = server.read_request(b'{"v": 1, "job_id": "j1", "attempt": 0}')
    assert isinstance(bad, LogMissing) and "attempt" in bad.error


def test_attempt_nodes_from_history() -> None:
    rows = [(1, "n1"), (2, "n2,n3")]
    assert attempt_nodes(rows, (2, ("n2", "n3")), None) == (2, ("n2", "n3"))
    assert attempt_nodes(rows, (2, ()), 1) == (1, ("n1",))
    with pytest.raises(LogUnavailable, match="attempt 5 never ran on any node"):
        attempt_nodes(rows, (2, ()), 5)


async def test_logs_of_a_job_through_nats_and_http(
    brain_factory, agent_factory, nats_server, api_factory, tmp_path: Path
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=1)
    await eventually(lambda: len(brain.state.nodes) == 1)
    code = "import time\nfor i in range(3): print('line', i, flush=True)\ntime.sleep(600)"
    job_id = await submit(
        brain.api,
        JobSpec(command=(sys.executable, "-c", code), gpus=1, cwd=str(tmp_path)),
        tenant="alice",
    )
    await eventually(
        lambda: (
            (j := brain.state.jobs[job_id]).state is JobState.RUNNING
            and all(g.pid for g in j.grants)
        )
    )
    # The CLI, a process of its own, with nothing on this disk to fall back on (its
    # ALNAIR_HOME is empty): the log comes from the agent over NATS.
    argv = [sys.executable, "-m", "cli", "logs", job_id, "--nats", nats_server.url]
    env = {"ALNAIR_HOME": str(tmp_path / "elsewhere"), "PYTHONPATH": str(REPO), "PATH": "/usr/bin"}

    def cli_output() -> str | None:
        done = subprocess.run(
            [*argv, "--tenant", "alice"], capture_output=True, text=True, env=env, timeout=60
        )
        return done.stdout if "line 2" in done.stdout else None

    out = await eventually(lambda: asyncio.to_thread(cli_output), timeout_s=60, interval_s=0.5)
    assert out.splitlines()[:3] == ["line 0", "line 1", "line 2"]
    api: Api = await api_factory(brain)
    status, body = await api.call("GET", f"/v1/jobs/{job_id}/logs?offset=-7", who="alice")
    assert status == 200, body
    assert (body["node"], body["attempt"], body["data"], body["running"]) == (
        "n1",
        1,
        "line 2\n",
        True,
    )
    status, body = await api.call("GET", f"/v1/jobs/{job_id}/logs", who="bob")
    assert status == 404, body  # not bob's job
    status, body = await api.call("GET", f"/v1/jobs/{job_id}/logs?attempt=3", who="alice")
    assert (status, body["error"]) == (404, "attempt 3 never ran on any node")
    status, body = await api.call("GET", f"/v1/jobs/{job_id}/logs?max_bytes=0", who="alice")
    assert status == 400 and "max_bytes" in body["error"], body
