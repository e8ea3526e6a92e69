"""bench/gpu_check.py, the real-GPU check, kept working where there is no GPU: its
harness (the cluster, the CLI's JSON, /metrics, the probe's report) on a simulated GPU.
The probe's CUDA work fails here, and the check records that and goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_runs_its_steps_on_a_simulated_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            *["--out", str(out), "--gpus", "sim:1xH100"],
            *["--steps", "facts", "telemetry idle", "whole GPU job"],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert set(results) == {"facts", "telemetry idle", "whole GPU job"}
    assert not any("error" in step for step in results.values()), results
    idle = results["telemetry idle"]
    assert idle["backend"] == ["sim"]
    assert [gpu["model"] for gpu in idle["inventory"]] == ["NVIDIA H100 (simulated)"]
    job = results["whole GPU job"]
    assert job["state"] in ("SUCCEEDED", "FAILED")  # FAILED: no CUDA here
    # What the probe saw before it asked CUDA: its granted GPU, and who it runs as.
    seen = job["probe"][0]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert seen["env"]["ALNAIR_JOB_ID"] == job["job"]
    assert "uid" in seen["confinement"]
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check")
