"""A worker host obeys only requests signed with its attempt's secret (real processes,
a real nats-server): another node, which never saw the job's launches, cannot make it
run a command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from bus.client import Bus
from schemas import subjects
from schemas.workers import EXEC_SECRET_ENV, ExecRequest, ExecState
from tests.conftest import eventually
from workloads.remote_exec import LOST_NODES_ENV

REPO = Path(__file__).resolve().parent.parent
SECRET = "the-attempts-secret"


@pytest.fixture
def worker_host(nats_server: object, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    scratch = tmp_path / "tmp"  # where it makes its work directory
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "ALNAIR_JOB_ID": "wh1",
        "ALNAIR_NODE": "n2",
        "ALNAIR_NATS": nats_server.url,  # type: ignore[attr-defined]
        "CUDA_VISIBLE_DEVICES": "0",
        EXEC_SECRET_ENV: SECRET,
    }
    with (tmp_path / "host.log").open("wb") as log:
        host = subprocess.Popen(
            [sys.executable, "-m", "workloads.worker_host"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield host
    host.terminate()
    host.wait(timeout=30)
    if host.returncode == 0:  # stopped, not killed: its work directory went with it
        assert not list(scratch.iterdir())


async def ask(bus: Bus, request: ExecRequest) -> ExecState | None:
    try:
        return await bus.request(subjects.job("wh1", "exec"), request, ExecState, timeout_s=1.0)
    except Exception:
        return None  # not listening yet


async def test_only_signed_requests_start_a_worker(
    worker_host: subprocess.Popen[bytes],
    connect: Callable[[str], Awaitable[Bus]],
    tmp_path: Path,
) -> None:
    bus = await connect("other-node")
    marker = tmp_path / "ran"
    command = f"touch {marker}"

    def start(mac_secret: str | None) -> ExecRequest:
        request = ExecRequest(op="start", exec_id=uuid.uuid4().hex, node="n2", command=command)
        return request if mac_secret is None else request.signed(mac_secret)

    for forged in (start(None), start("a-guess")):  # unsigned; signed with another secret
        answer = await eventually(lambda f=forged: ask(bus, f), timeout_s=30)
        assert answer.error == "not signed by this job's supervisor" and answer.pid is None
    # A signed request whose command was changed in transit is refused too.
    tampered = start(SECRET).model_copy(update={"command": f"touch {marker}.evil"})
    answer = await eventually(lambda: ask(bus, tampered), timeout_s=30)
    assert "not signed" in answer.error
    assert not marker.exists() and not Path(f"{marker}.evil").exists()

    signed = start(SECRET)
    answer = await eventually(lambda: ask(bus, signed), timeout_s=30)
    assert answer.pid is not None and not answer.error
    await eventually(marker.exists)
    poll = ExecRequest(op="poll", exec_id=signed.exec_id, node="n2")
    done = await eventually(lambda: ask(bus, poll.signed(SECRET)))
    assert done.error == ""
    refused = await eventually(lambda: ask(bus, poll))  # a poll needs the secret too
    assert "not signed" in refused.error


def remote_exec(nats_url: str, command: str, secret: str = SECRET) -> subprocess.Popen[str]:
    """What horovodrun runs for a worker on n2 (through workloads.hvdrun)."""
    env = {**os.environ, "ALNAIR_JOB_ID": "wh1", "ALNAIR_NATS": nats_url, EXEC_SECRET_ENV: secret}
    return subprocess.Popen(
        [sys.executable, "-m", "workloads.remote_exec", "--host", "n2", "--", command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def test_remote_exec_behaves_like_an_ssh_session(
    worker_host: subprocess.Popen[bytes], nats_server: object, tmp_path: Path
) -> None:
    """The worker's output comes back, its exit code is the session's, and a SIGTERM to
    the session reaches the worker."""
    url = nats_server.url  # type: ignore[attr-defined]
    session = remote_exec(url, "echo hello-from-n2; echo $ALNAIR_GPU_DIR; exit 3")
    out, _ = await asyncio.to_thread(session.communicate, timeout=90)
    assert session.returncode == 3, out
    assert "hello-from-n2" in out
    assert "/gpus" in out  # the worker host's own GPU directory, not the supervisor's

    started = tmp_path / "started"
    session = remote_exec(url, f"touch {started}; exec sleep 60")
    await eventually(started.exists, timeout_s=60)
    session.send_signal(signal.SIGTERM)
    out, _ = await asyncio.to_thread(session.communicate, timeout=60)
    assert session.returncode == 128 + signal.SIGTERM, out

    # Without the attempt's secret nothing runs, and the session says why.
    session = remote_exec(url, f"touch {tmp_path / 'forged'}", secret="wrong")
    out, _ = await asyncio.to_thread(session.communicate, timeout=90)
    assert session.returncode == 255 and "not signed" in out
    assert not (tmp_path / "forged").exists()


async def test_remote_exec_gives_up_a_worker_on_a_node_the_brain_found_lost(
    worker_host: subprocess.Popen[bytes], nats_server: object, tmp_path: Path
) -> None:
    """Its worker host gone without a word, the session ends at the next poll once the
    supervisor lists the node as lost (not after LOST_AFTER_S): Horovod's driver waits
    for it before the job goes on without the node."""
    url = nats_server.url  # type: ignore[attr-defined]
    lost, pid_file = tmp_path / "lost-nodes", tmp_path / "worker.pid"
    os.environ[LOST_NODES_ENV] = str(lost)
    try:
        session = remote_exec(url, f"echo $$ > {pid_file}; exec sleep 300")
    finally:
        del os.environ[LOST_NODES_ENV]
    await eventually(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout_s=60)
    worker = int(pid_file.read_text())
    try:
        worker_host.kill()  # the node gone: nobody answers for it any more
        worker_host.wait(timeout=30)
        lost.write_text("n1\nn2\n")
        out, _ = await asyncio.to_thread(session.communicate, timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    assert session.returncode == 255, out
    assert "node n2 was lost (the brain says so)" in out, out
