"""What confinement adds to a launch on this machine: not a test.

    .venv/bin/python bench/confine_costs.py [--runs 50]

- the cgroup v2 device program (agents/devices_bpf.py) for a job granted 2 GPUs: its
  size, and load + attach to a fresh directory of a cgroup2 mount (the host's unified
  hierarchy, mounted again under a temporary directory, as tests/test_confine.py does;
  needs root; skipped, saying why, otherwise);
- an attempt's TLS client certificate (bus/tls.py: a P-256 key, `openssl req` and
  `openssl ca`), as the agent makes one at each confined launch under mutual TLS.

Prints the median and the maximum of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agents import cgroups, devices_bpf
from bus.tls import JobIssuer, issue_job_certificate, write_tls_files

# Two granted GPUs and NVIDIA's control devices, with the numbers a driver gives them.
RULES = (
    *cgroups.BASE_DEVICES,
    "c 195:0 rwm",
    "c 195:1 rwm",
    "c 195:255 rwm",
    "c 195:254 rwm",
    "c 508:0 rwm",
    "c 508:1 rwm",
)


def timed(runs: int, action: Callable[[int], None]) -> str:
    times = []
    for i in range(runs):
        start = time.perf_counter()
        action(i)
        times.append((time.perf_counter() - start) * 1e3)
    return f"median {statistics.median(times):.2f} ms, max {max(times):.2f} ms ({runs} runs)"


def bench_device_program(base: Path, runs: int) -> None:
    program = devices_bpf.device_program(RULES)
    print(f"device program: {len(RULES)} rules, {len(program) // 8} instructions")
    if os.geteuid() != 0:
        print("device program load + attach: skipped (needs root)")
        return
    mount = base / "cgroup2"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "cgroup2", "none", str(mount)], check=False)
    if mounted.returncode != 0:
        print("device program load + attach: skipped (cannot mount cgroup2)")
        return
    try:

        def attach(i: int) -> None:
            directory = mount / f"alnair-bench-{os.getpid()}-{i}"
            directory.mkdir()
            try:
                devices_bpf.attach(directory, RULES)
            finally:
                directory.rmdir()  # takes the program with it

        print(f"device program load + attach: {timed(runs, attach)}")
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def bench_certificate(base: Path, runs: int) -> None:
    files = write_tls_files(base / "tls")
    issuer = JobIssuer.in_dir(files.ca.parent)

    def issue(i: int) -> None:
        issue_job_certificate(
            issuer,
            base / "tls-cert.pem",
            base / "tls-key.pem",
            name=f"job-{i}-1",
            valid_s=3600,
            now=time.time(),
        )

    print(f"job certificate: {timed(runs, issue)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="alnair-bench-confine-"))
    try:
        bench_device_program(base, args.runs)
        bench_certificate(base, args.runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
