"""The agent's MPS supervision (agents/mps.py) and a share's MPS environment.

No GPU here, so no real `nvidia-cuda-mps-control`: the daemon's start, liveness probe,
restart and quit are exercised against a stand-in executable that speaks the same
command line (`-d`; `get_server_list` and `quit` on stdin) and keeps a `control` file
in the pipe directory as the real daemon keeps its pipe. What MPS itself enforces is
not tested here (it needs the lent GPU machine).

As root (as here and in CI; skipped, saying why, elsewhere): a GPU's pipe and log
directories are its share user's group's alone, a share of another user is refused
while the GPU's shares run, and a real unprivileged user reaches its own GPU's pipe and
not another's."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.agent import Agent, AgentConfig
from agents.gpu import SIM_GPU_MEMORY_ENV, SimulatedGpus, open_backend
from agents.mps import Accounted, MpsDaemons, MpsError, ShareUser, out_of_reach, share_env
from brain.core.decide import Policy
from cli.client import submit
from schemas.jobs import FailureClass, JobSpec, JobState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit as submit_spec
from tests.test_confine import (
    JOB_PYTHON,
    _finished,
    _log,
    _python,
    _why_no_users,
    _why_not,
    cgroup_parent,
    confined_cluster,
    keys,
    place,
    secure_server,
    users,
)

__all__ = ["cgroup_parent", "keys", "place", "secure_server", "users"]  # fixtures, by name

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to chown and switch users)")

STAND_IN = """#!PYTHON
import os, subprocess, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
control = os.path.join(pipe, "control")
pidfile = os.path.join(pipe, "daemon.pid")

def alive():
    try:  # a killed daemon nobody reaped is a zombie: dead
        return open(f"/proc/{int(open(pidfile).read())}/stat").read().split()[2] != "Z"
    except (OSError, ValueError):
        return False

if sys.argv[1:] == ["-d"]:
    if alive():
        sys.exit(1)
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    open(pidfile, "w").write(str(daemon.pid))
    open(control, "w").close()
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as log:
        log.write("started for " + os.environ.get("CUDA_VISIBLE_DEVICES", "") + "\\n")
    sys.exit(0)
command = sys.stdin.read().strip()
if not alive():
    sys.exit(1)
if command == "quit":
    os.kill(int(open(pidfile).read()), 9)
    os.remove(control)
sys.exit(0)
"""


def _daemon_pid(root: Path, gpu: int) -> int:
    return int((root / f"gpu{gpu}" / "pipe" / "daemon.pid").read_text())


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def test_a_share_gets_its_thread_percentage_and_memory_limit() -> None:
    assert share_env(500, 20480) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "ALNAIR_GPU_SHARE": "0.5",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
    }
    # MPS takes whole percents: a share is never rounded to nothing.
    assert share_env(1, None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    assert share_env(255, None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "26"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in share_env(250, None)


def _stand_in(directory: Path) -> Path:
    binary = directory / "nvidia-cuda-mps-control"
    binary.write_text(STAND_IN.replace("PYTHON", sys.executable, 1))
    binary.chmod(0o755)
    return binary


async def test_the_daemon_starts_per_gpu_is_restarted_and_quits(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    daemons = MpsDaemons(root, binary=str(_stand_in(tmp_path)))
    started: list[int] = []
    try:
        env = await daemons.prepare(0, "GPU-aaaa")
        started.append(_daemon_pid(root, 0))
        assert env == {
            "CUDA_MPS_PIPE_DIRECTORY": str(root / "gpu0" / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(root / "gpu0" / "log"),
            "CUDA_VISIBLE_DEVICES": "GPU-aaaa",
            "ALNAIR_GPU_SHARE_ENFORCED": "1",
        }
        # The daemon of GPU 0 serves its second share: not started again.
        await daemons.prepare(0, "GPU-aaaa")
        assert _daemon_pid(root, 0) == started[0]
        # Another GPU, another daemon, seeing only its GPU.
        await daemons.prepare(1, "GPU-bbbb")
        started.append(_daemon_pid(root, 1))
        assert (root / "gpu1" / "log" / "control.log").read_text() == "started for GPU-bbbb\n"
        # Unconfined, shares run as the agent's user: its directories are its alone.
        for directory in ("gpu1", "gpu1/pipe", "gpu1/log"):
            assert stat.S_IMODE((root / directory).stat().st_mode) == 0o700
        # The daemon of GPU 0 dies: the next check starts it again.
        _kill(started[0])
        await daemons.check()
        restarted = _daemon_pid(root, 0)
        started.append(restarted)
        assert restarted != started[0]
        assert daemons.problem(0) is None
        # No share left on GPU 1: its daemon is asked to quit.
        await daemons.release(1)
        assert not (root / "gpu1" / "pipe" / "control").exists()
        await daemons.close()
        assert not (root / "gpu0" / "pipe" / "control").exists()
        # Its directories go with it (a confined agent's runtime root can then go).
        assert not root.exists()
    finally:
        for pid in started:
            _kill(pid)


async def test_a_gpu_without_the_mps_binary_cannot_take_a_share(tmp_path: Path) -> None:
    daemons = MpsDaemons(tmp_path, binary=str(tmp_path / "no-such-binary"))
    with pytest.raises(MpsError, match="is not installed"):
        await daemons.prepare(0, "GPU-aaaa")


async def test_simulated_gpus_are_accounted_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    accounted = Accounted("n1")
    assert await accounted.prepare(0, "GPU-x") == {"ALNAIR_GPU_SHARE_ENFORCED": "0"}
    await accounted.prepare(0, "GPU-x")
    assert caplog.text.count("accounted, not enforced") == 1
    assert accounted.enforcement == "accounted" and accounted.problem(0) is None
    # One user per GPU, as under MPS.
    other = ShareUser("b", 60_002, 60_002)
    with pytest.raises(MpsError, match="one Unix user at a time"):
        await accounted.prepare(0, "GPU-x", other, alone=False)
    await accounted.prepare(0, "GPU-x", other, alone=True)


def test_simulated_gpus_leave_no_memory_directory_behind(tmp_path: Path) -> None:
    """Where simulated jobs say what memory they use: a temporary directory removed
    by `close`, or when a backend nobody closed is collected; or the agent's own,
    cleared of what a killed agent left there."""
    for closes in (True, False):
        gpus = SimulatedGpus("n1", 2, "H100")
        made = Path(gpus.job_env((0,))[SIM_GPU_MEMORY_ENV]).parent
        assert made.is_dir()
        if closes:
            gpus.close()
        del gpus
        gc.collect()
        assert not made.exists()

    own = tmp_path / "sim-gpu-memory"
    (own / "gpu0").mkdir(parents=True)
    (own / "gpu0" / "123456").write_text("500")  # a process gone with a killed agent
    gpus = open_backend("sim:2xH100", node="n1", data_dir=tmp_path)
    assert not own.exists()
    assert gpus.job_env((1,)) == {SIM_GPU_MEMORY_ENV: str(own / "gpu1")}
    gpus.close()
    assert not own.exists()


USER_A = ShareUser("a", 60_001, 60_001)
USER_B = ShareUser("b", 60_002, 60_002)


@pytest.fixture
def open_place() -> Iterator[Path]:
    """A directory every user may pass through (pytest's own are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="alnair-mps-"))
    try:
        base.chmod(0o711)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
async def test_a_confined_job_says_its_simulated_gpu_memory_and_no_one_elses(
    open_place: Path,
) -> None:
    """A job run as its tenant's user writes what its processes use on a simulated GPU;
    a file it writes for a process of another user (here this test's) counts for
    nothing, so no job can make another look over its memory limit."""
    gpus = SimulatedGpus("n1", 2, "H100", memory_dir=open_place / "sim-gpu-memory")
    where = gpus.job_env((1,))[SIM_GPU_MEMORY_ENV]
    script = f'echo 512 > "$D/$$"; echo 99999 > "$D/{os.getpid()}"; sleep 30'
    job = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", script, env={"D": where}, user=USER_A.uid, group=USER_A.gid
    )
    try:
        said = await eventually(lambda: gpus.declared(1).get(job.pid))
        assert said == (512.0, None)
        assert os.getpid() not in gpus.declared(1)
        assert sorted(os.listdir(where)) == [str(job.pid)]  # the forged file is gone
        # Others may write there, not list it; they pass through its parent, not list it.
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o1733
        assert stat.S_IMODE(os.stat(Path(where).parent).st_mode) == 0o711
    finally:
        job.kill()
        await job.wait()
        gpus.close()


@needs_root
def test_out_of_reach_names_the_directory_that_stops_a_user(open_place: Path) -> None:
    closed = open_place / "closed"
    (closed / "pipe").mkdir(parents=True)
    closed.chmod(0o700)
    assert out_of_reach(closed / "pipe", USER_A) == closed
    # Its group may pass; the directory itself must be usable (read, write, enter).
    os.chown(closed, 0, USER_A.gid)
    closed.chmod(0o710)
    assert out_of_reach(closed / "pipe", USER_A) == closed / "pipe"
    os.chown(closed / "pipe", 0, USER_A.gid)
    (closed / "pipe").chmod(0o770)
    assert out_of_reach(closed / "pipe", USER_A) is None
    assert out_of_reach(closed / "pipe", USER_B) == closed
    assert out_of_reach(open_place / "missing", USER_A) == open_place / "missing"


@needs_root
async def test_a_gpu_serves_one_user_who_alone_owns_its_pipe(open_place: Path) -> None:
    root = open_place / "mps"
    daemons = MpsDaemons(root, binary=str(_stand_in(open_place)))
    started: list[int] = []
    try:
        env = await daemons.prepare(0, "GPU-aaaa", USER_A)
        started.append(_daemon_pid(root, 0))
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu0" / "pipe")
        layout = {
            name: (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid)
            for name in ("", "gpu0", "gpu0/pipe", "gpu0/log")
            for info in [(root / name).stat()]
        }
        assert layout == {
            "": (0o711, 0, 0),
            "gpu0": (0o711, 0, 0),
            "gpu0/pipe": (0o700, USER_A.uid, USER_A.gid),
            "gpu0/log": (0o700, USER_A.uid, USER_A.gid),
        }
        # The control daemon starts the user's MPS server with the user's uid and
        # root's group (seen on an H200, driver 580): it must reach both as well.
        server = ShareUser("a's MPS server", USER_A.uid, 0)
        for directory in ("pipe", "log"):
            assert out_of_reach(root / "gpu0" / directory, server) is None
            assert out_of_reach(root / "gpu0" / directory, USER_B) == root / "gpu0" / directory
        # A's shares still run: B's share is refused, not left to wait behind them.
        with pytest.raises(MpsError, match="serves user a's shares; an MPS daemon serves one"):
            await daemons.prepare(0, "GPU-aaaa", USER_B, alone=False)
        # A's last share has ended: the daemon starts again for B, whose directories
        # hold nothing A's server left.
        (root / "gpu0" / "pipe" / "left-by-a").touch()
        await daemons.prepare(0, "GPU-aaaa", USER_B, alone=True)
        started.append(_daemon_pid(root, 0))
        assert started[1] != started[0]
        assert (root / "gpu0" / "pipe").stat().st_uid == USER_B.uid
        assert not (root / "gpu0" / "pipe" / "left-by-a").exists()
        await daemons.close()
    finally:
        for pid in started:
            _kill(pid)


@needs_root
async def test_a_share_whose_user_cannot_reach_the_pipe_is_refused_naming_it(
    open_place: Path,
) -> None:
    private = open_place / "private"
    private.mkdir(mode=0o700)
    root = private / "mps"
    daemons = MpsDaemons(root, binary=str(_stand_in(open_place)))
    try:
        with pytest.raises(MpsError) as refused:
            await daemons.prepare(0, "GPU-aaaa", USER_A)
        assert str(refused.value) == (
            f"GPU 0: MPS: {root / 'gpu0' / 'pipe'} is out of reach of user a "
            f"(uid 60001, gid 60001): it cannot pass through {private}"
        )
        assert not (root / "gpu0" / "pipe" / "daemon.pid").exists()  # refused before it
        await daemons.check()  # and not started behind the refusal's back
        assert not (root / "gpu0" / "pipe" / "daemon.pid").exists()
    finally:
        with contextlib.suppress(OSError, ValueError):
            _kill(_daemon_pid(root, 0))


@pytest.mark.skipif(_why_no_users() is not None, reason=_why_no_users() or "")
async def test_a_real_tenant_user_reaches_its_gpus_pipe_and_not_another(
    users: dict[str, pwd.struct_passwd], open_place: Path
) -> None:
    """What the share's MPS client and server do there, as the tenant's user with its
    one group (as confined jobs run): enter the pipe directory, open the control
    pipe, create files in the pipe and log directories."""
    a, b = (ShareUser(u.pw_name, u.pw_uid, u.pw_gid) for u in (users["a"], users["b"]))
    root = open_place / "mps"
    daemons = MpsDaemons(root, binary=str(_stand_in(open_place)))
    probe = (
        "import os, sys\n"
        "pipe, log = sys.argv[1:]\n"
        "open(os.path.join(pipe, 'control')).close()\n"
        "for d in (pipe, log):\n"
        "    open(os.path.join(d, f'by-{os.getuid()}'), 'w').close()\n"
        "print(os.getuid(), sorted(os.listdir(pipe)))\n"
    )
    started: list[int] = []
    try:
        env = await daemons.prepare(0, "GPU-aaaa", a)
        started.append(_daemon_pid(root, 0))
        dirs = [env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]]

        def run_as(user: ShareUser) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [JOB_PYTHON, "-c", probe, *dirs],
                user=user.uid,
                group=user.gid,
                extra_groups=[],
                capture_output=True,
                text=True,
                cwd="/",
                check=False,
            )

        done = run_as(a)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{a.uid} [") and "control" in done.stdout
        assert (Path(dirs[1]) / f"by-{a.uid}").exists()
        refused = run_as(b)
        assert refused.returncode != 0 and "PermissionError" in refused.stderr
        await daemons.close()
    finally:
        for pid in started:
            _kill(pid)


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
@pytest.mark.timeout(120)
async def test_a_confined_share_runs_as_its_tenant_and_reaches_its_gpus_pipe(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    """The agent's launch path: a share of tenant a, confined (its own user, private
    directory, cgroup), on a GPU whose MPS daemon is the stand-in; the job uses the
    pipe and log directories as an MPS client and server would."""
    binary = _stand_in(place)

    def with_mps(agent: Agent) -> None:
        confinement = agent.config.confinement
        assert confinement is not None
        agent.shares = MpsDaemons(confinement.runtime_root / "mps", binary=str(binary))

    probe = """
        import os
        pipe, log = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
        open(os.path.join(pipe, "control")).close()
        open(os.path.join(log, "server.log"), "w").close()
        print("uid", os.getuid())
        print("pipe", pipe)
        print("threads", os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
        print("enforced", os.environ["ALNAIR_GPU_SHARE_ENFORCED"])
        """
    ids = keys[0]
    async with confined_cluster(
        secure_server, ids, users, place, cgroup_parent, on_agent=with_mps
    ) as (brain, a):
        job = await submit(a, "a", JobSpec(command=_python(probe), gpus=1, gpu_milli=500))
        done = await _finished(brain, job)
        out = _log(done)
        assert done.state is JobState.SUCCEEDED, (done.reason, out)
        lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        gpu = done.grants[0].gpus[0]
        assert lines == {
            "uid": str(users["a"].pw_uid),
            "pipe": str(place / "run" / "n1" / "mps" / f"gpu{gpu}" / "pipe"),
            "threads": "50",
            "enforced": "1",
        }


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
@pytest.mark.timeout(120)
async def test_a_confined_share_whose_user_cannot_reach_the_pipe_is_refused_naming_it(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    """The agent refuses the launch, naming the directory, instead of starting a share
    whose MPS client could never reach its server."""
    binary = _stand_in(place)
    private = place / "private"
    private.mkdir(mode=0o700)

    def with_mps(agent: Agent) -> None:
        agent.shares = MpsDaemons(private / "mps", binary=str(binary))

    ids = keys[0]
    async with confined_cluster(
        secure_server, ids, users, place, cgroup_parent, on_agent=with_mps
    ) as (brain, a):
        job = await submit(a, "a", JobSpec(command=_python("print('ran')"), gpus=1, gpu_milli=500))
        (failure, *_) = await eventually(lambda: brain.state.jobs[job.job_id].failures)
        assert failure.reason == (
            f"launch failed on n1: GPU 0: MPS: {private / 'mps' / 'gpu0' / 'pipe'} is out of "
            f"reach of user {users['a'].pw_name} (uid {users['a'].pw_uid}, gid "
            f"{users['a'].pw_gid}): it cannot pass through {private}"
        )
        assert failure.failure_class is FailureClass.INFRASTRUCTURE  # another node may do
        assert brain.state.jobs[job.job_id].started_at is None
    # Refused before any daemon started.
    assert not list(private.glob("mps/gpu*/pipe/daemon.pid"))


@needs_root
async def test_a_daemon_left_by_an_earlier_agent_is_started_again_for_the_new_user(
    open_place: Path,
) -> None:
    """An agent killed while user a's share ran leaves a's daemon, answering on a pipe
    only a may enter. The next agent's first share there, user b's, gets a daemon and
    directories of b's own, instead of being refused for ever as out of reach."""
    root = open_place / "mps"
    binary = str(_stand_in(open_place))
    started: list[int] = []
    try:
        await MpsDaemons(root, binary=binary).prepare(0, "GPU-aaaa", USER_A)
        started.append(_daemon_pid(root, 0))  # the first agent dies here, daemon and all

        after = MpsDaemons(root, binary=binary)
        env = await after.prepare(0, "GPU-aaaa", USER_B)
        started.append(_daemon_pid(root, 0))
        assert started[1] != started[0]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "gpu0" / "pipe")
        assert (root / "gpu0" / "pipe").stat().st_uid == USER_B.uid
        assert out_of_reach(root / "gpu0" / "pipe", USER_B) is None
        await after.close()
    finally:
        for pid in started:
            _kill(pid)


@pytest.mark.timeout(120)
async def test_a_whole_gpu_job_starts_after_its_gpus_shares_daemon_has_quit(
    brain_factory, connect, nats_server, tmp_path: Path
) -> None:
    """A share preempted for a whole-GPU job: the GPU's MPS daemon quits before the job
    starts (its server would hold the GPU beside a job that is no MPS client), not at
    the agent's next watch. The agent here watches once a minute; the job looks for
    the daemon's pipe as it starts."""
    brain = await brain_factory(policy=Policy(order="priority"))
    config = AgentConfig(
        node="n1",
        data_dir=tmp_path / "agents" / "n1",
        heartbeat_s=0.2,
        telemetry_s=60.0,  # the watch that lets idle daemons go
        stop_grace_s=3.0,
        nats_url=nats_server.url,
    )
    agent = Agent(await connect("agent:n1"), config, SimulatedGpus("n1", 1, "H100"))
    root = tmp_path / "mps"
    agent.shares = MpsDaemons(root, binary=str(_stand_in(tmp_path)))
    await agent.start()
    daemon: int | None = None
    try:
        await eventually(lambda: "n1" in brain.state.nodes)
        share = await submit_spec(
            brain.api, JobSpec(command=("sleep", "120"), gpus=1, gpu_milli=500, priority=0)
        )
        # RUNNING once placed; the agent starts the daemon (which writes its pid, then
        # makes its pipe) as it launches the share.
        pipe = root / "gpu0" / "pipe" / "control"
        await eventually(lambda: brain.state.jobs[share].state is JobState.RUNNING)
        await eventually(pipe.exists)
        daemon = _daemon_pid(root, 0)
        seen = tmp_path / "seen"
        probe = f"import os; open({str(seen)!r}, 'w').write(str(os.path.exists({str(pipe)!r})))"
        whole = await submit_spec(
            brain.api, JobSpec(command=(sys.executable, "-c", probe), gpus=1, priority=10)
        )
        await eventually(lambda: brain.state.jobs[whole].state is JobState.SUCCEEDED)
        assert seen.read_text() == "False"
    finally:
        await agent.stop(stop_jobs=True)
        if daemon is not None:
            _kill(daemon)
