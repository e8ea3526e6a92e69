"""One GPU per elastic worker (workloads/devices.py): real processes, real flocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from workloads import devices

REPO = Path(__file__).resolve().parent.parent
# A worker as the example starts: claim, say which GPU it sees, then stay alive.
WORKER = (
    "import sys, time; from workloads.devices import claim_gpu; import os; "
    "gpu = claim_gpu(timeout_s=float(sys.argv[1])); "
    "print(gpu, os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); time.sleep(60)"
)


def start_worker(gpu_dir: Path, *, timeout_s: float = 5.0) -> subprocess.Popen[str]:
    env = {**os.environ, devices.GPU_DIR_ENV: str(gpu_dir), "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(timeout_s)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def seen(worker: subprocess.Popen[str]) -> tuple[int, str]:
    assert worker.stdout is not None
    gpu, visible = worker.stdout.readline().split()
    return int(gpu), visible


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for worker in started:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()  # reaps it and closes its pipes


async def test_workers_claim_distinct_gpus_and_a_killed_one_frees_its_own(
    tmp_path: Path, workers: list[subprocess.Popen[str]]
) -> None:
    gpu_dir = tmp_path / "gpus"
    devices.write_devices(gpu_dir, (2, 5))
    workers += [start_worker(gpu_dir), start_worker(gpu_dir)]
    claims = [seen(w) for w in workers]
    # Each sees its own GPU alone, whatever the launch's list said.
    assert sorted(claims) == [(2, "2"), (5, "5")]
    assert devices.claimed(gpu_dir, (2, 5)) == (2, 5)

    # A grow adds GPU 7: the new worker gets it, not one in use.
    devices.write_devices(gpu_dir, (2, 5, 7))
    workers.append(start_worker(gpu_dir))
    assert seen(workers[-1]) == (7, "7")

    # SIGKILL: the kernel drops the lock; the GPU is free for the next worker.
    victim = next(w for w, (gpu, _) in zip(workers, claims, strict=False) if gpu == 5)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    await eventually(lambda: devices.claimed(gpu_dir, (2, 5, 7)) == (2, 7))
    workers.append(start_worker(gpu_dir))
    assert seen(workers[-1]) == (5, "5")


def test_more_workers_than_gpus_is_a_clear_error(
    tmp_path: Path, workers: list[subprocess.Popen[str]]
) -> None:
    gpu_dir = tmp_path / "gpus"
    devices.write_devices(gpu_dir, (0,))
    workers.append(start_worker(gpu_dir))
    assert seen(workers[0]) == (0, "0")
    late = start_worker(gpu_dir, timeout_s=0.3)
    workers.append(late)
    _, err = late.communicate(timeout=30)
    assert late.returncode != 0
    assert "no free GPU among the job's [0] after 0.3s" in err


def test_outside_an_elastic_job_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devices.GPU_DIR_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert devices.claim_gpu() is None
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert devices.held_gpu() is None


@pytest.mark.parametrize(
    ("text", "words"),
    [("0,GPU-1f2e", "'GPU-1f2e' is not a GPU index"), ("1,1", "a GPU is listed twice")],
)
def test_a_bad_device_list_names_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        devices.parse_devices(text, where="CUDA_VISIBLE_DEVICES")
    assert devices.parse_devices(" 3, 1\n", where="x") == (3, 1)
