"""The agent's MPS supervision (agents/mps.py) and a share's MPS environment.

No GPU here, so no real `nvidia-cuda-mps-control`: the daemon's start, liveness probe,
restart and quit are exercised against a stand-in executable that speaks the same
command line (`-d`; `get_server_list` and `quit` on stdin) and keeps a `control` file
in the pipe directory as the real daemon keeps its pipe. What MPS itself enforces is
not tested here (it needs the lent GPU machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from agents.mps import Accounted, MpsDaemons, MpsError, share_env

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


async def test_the_daemon_starts_per_gpu_is_restarted_and_quits(tmp_path: Path) -> None:
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(STAND_IN.replace("PYTHON", sys.executable, 1))
    binary.chmod(0o755)
    root = tmp_path / "mps"
    daemons = MpsDaemons(root, binary=str(binary))
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
