"""What a job sees of its GPUs, as JSON lines; optionally, load them.

Run as a job (`alnair submit --gpus 1 -- python -m workloads.examples.gpu_probe`) to
check that it sees exactly the GPUs it was granted: the environment the agent gave it
(`CUDA_VISIBLE_DEVICES`, the MPS limits of a share), and what CUDA then shows (device
count, names, UUIDs). It prints what it has found so far after each step (the last line
says the most), so that a step that fails leaves the others' findings.
bench/gpu_check.py runs it on a real GPU.

`--seconds S` keeps the GPUs busy with matrix products for S seconds (so telemetry has
something to show), holding `--hold-gib G` of GPU memory; `--try-gib X` then tries to
allocate X GiB more and says whether CUDA refused (a share's memory limit under MPS
refuses it). `--fill` instead takes GPU memory in 64 MiB blocks until CUDA refuses one
(a share's limit as MPS counts it, beside what NVML then reports). `--idle-s S` then
holds what it took (or `--hold-gib`) for S seconds without computing, a barely used job
as a profile sees it; with `--grow-when PATH --grow-gib G` it takes G GiB more once PATH
exists, a job whose memory grows on cue; `--children N` starts N copies of itself that hold
as much, each in a session of its own. `--illegal-address` makes a kernel write to an
unmapped address, which the driver reports as an XID (31, a GPU memory page fault) and
CUDA as an illegal memory access: the job fails, the GPU does not. It needs torch (the
`train` extra); the illegal write needs CuPy.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

SHOWN_ENV: Final = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "ALNAIR_GPU_SHARE",
    "ALNAIR_GPU_SHARE_ENFORCED",
    "ALNAIR_JOB_ID",
)
GIB: Final = 1 << 30
MIB: Final = 1 << 20
FILL_BLOCK_MIB: Final = 64


def confinement() -> dict[str, Any]:
    """Who the job runs as, its cgroup and that cgroup's limits (v2), and which of the
    node's NVIDIA device files it may open (a confined job: only its GPUs' and the
    driver's shared ones)."""
    found: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid()}
    try:
        lines = Path("/proc/self/cgroup").read_text().split()
    except OSError:
        lines = []
    found["cgroup"] = lines
    unified = next((line[3:] for line in lines if line.startswith("0::")), None)
    if unified is not None:
        limits = {}
        for name in ("memory.max", "pids.max", "cpu.max"):
            try:
                limits[name] = Path(f"/sys/fs/cgroup{unified}/{name}").read_text().strip()
            except OSError as error:
                limits[name] = f"({error.strerror})"
        found["limits"] = limits
    opened = {}
    for name in sorted(os.listdir("/dev")):
        if name.startswith("nvidia") and not os.path.isdir(f"/dev/{name}"):
            try:
                os.close(os.open(f"/dev/{name}", os.O_RDWR))
                opened[name] = "opened"
            except OSError as error:
                opened[name] = errno.errorcode.get(error.errno or 0, str(error.errno))
    found["devices"] = opened
    return found


def seen(torch: Any) -> dict[str, Any]:
    count = torch.cuda.device_count()
    devices = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": props.name,
                "uuid": f"GPU-{props.uuid}" if hasattr(props, "uuid") else None,
                "memory_mib": props.total_memory // (1 << 20),
                "multiprocessors": props.multi_processor_count,
            }
        )
    return {"device_count": count, "devices": devices}


def load(torch: Any, seconds: float, hold_gib: float) -> dict[str, Any]:
    held = torch.empty(int(hold_gib * GIB), dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    products = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        products += 20
    elapsed = time.monotonic() - start
    del held
    return {
        "seconds": round(elapsed, 2),
        "tflops": round(products * 2 * 8192**3 / elapsed / 1e12, 1),
        "held_gib": hold_gib,
    }


def try_allocate(torch: Any, gib: float) -> dict[str, Any]:
    try:
        block = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")
        block.fill_(1)
        torch.cuda.synchronize()
    except RuntimeError as error:  # torch.OutOfMemoryError is a RuntimeError
        return {"gib": gib, "allocated": False, "error": str(error).splitlines()[0][:300]}
    del block
    return {"gib": gib, "allocated": True}


def allocate(torch: Any, size: int) -> Any:
    block = torch.empty(size, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    return block


def fill(torch: Any, held: list[Any]) -> dict[str, Any]:
    """Takes 64 MiB blocks until CUDA refuses one; how much it got, and why it stopped."""
    error = ""
    while True:
        try:
            held.append(allocate(torch, FILL_BLOCK_MIB * MIB))
        except RuntimeError as refused:
            error = str(refused).splitlines()[0][:300]
            break
    return {"filled_mib": len(held) * FILL_BLOCK_MIB, "refused": error}


def idle(
    torch: Any, seconds: float, held: list[Any], grow_when: Path | None, grow_gib: float
) -> Iterator[dict[str, Any]]:
    """Holds what it has for `seconds` without computing; takes `grow_gib` more once
    `grow_when` exists. Yields a report of the growth when it happens."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if grow_when is not None and grow_when.exists():
            grow_when = None
            try:
                held.append(allocate(torch, int(grow_gib * GIB)))
                yield {"gib": grow_gib, "allocated": True, "at": time.time()}
            except RuntimeError as error:
                yield {"gib": grow_gib, "allocated": False, "error": str(error)[:300]}
        time.sleep(0.2)


def illegal_address() -> None:
    import cupy

    kernel = cupy.RawKernel(
        r'extern "C" __global__ void poke() { *(volatile int*)0x10 = 1; }', "poke"
    )
    kernel((1,), (1,), ())
    cupy.cuda.Device().synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_probe", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--hold-gib", type=float, default=1.0)
    p.add_argument("--try-gib", type=float, default=None)
    p.add_argument("--fill", action="store_true")
    p.add_argument("--idle-s", type=float, default=0.0)
    p.add_argument("--grow-when", type=Path, default=None)
    p.add_argument("--grow-gib", type=float, default=0.0)
    p.add_argument("--children", type=int, default=0)
    p.add_argument("--illegal-address", action="store_true")
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "env": {n: os.environ.get(n) for n in SHOWN_ENV},
        "confinement": confinement(),
    }
    print(json.dumps(report), flush=True)  # before CUDA, which may fail
    if args.illegal_address:
        illegal_address()
        return 0  # not reached: the write faults
    import torch

    report.update(seen(torch))
    print(json.dumps(report), flush=True)  # what it sees, even if the load then fails
    if args.seconds > 0:
        report["load"] = load(torch, args.seconds, args.hold_gib)
    if args.try_gib is not None:
        report["try"] = try_allocate(torch, args.try_gib)
    if args.children:
        # Each holds what this one holds, in a session of its own (out of the job's
        # process group): one job, several CUDA processes.
        alone = ("--hold-gib", str(args.hold_gib), "--idle-s", str(args.idle_s))
        report["children"] = [
            subprocess.Popen(
                [sys.executable, "-m", "workloads.examples.gpu_probe", *alone],
                start_new_session=True,
            ).pid
            for _ in range(args.children)
        ]
    held: list[Any] = []
    if args.fill:
        report["fill"] = fill(torch, held)
    elif args.idle_s > 0:
        held.append(allocate(torch, int(args.hold_gib * GIB)))
    print(json.dumps(report), flush=True)
    if args.idle_s > 0:
        for grown in idle(torch, args.idle_s, held, args.grow_when, args.grow_gib):
            report["grew"] = grown
            print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
