"""What the brain keeps of telemetry, and what it costs the garbage collector: not a test.

    .venv/bin/python bench/telemetry_memory.py [--nodes 20000] [--rounds 5]
        [--jobs 8000] [--seconds 600] [--tree DIR] [--label NAME]

Two parts, each in its own process (so that one's heap does not time the other's
collections):

- **latest telemetry**: `--nodes` 8-GPU nodes each send `--rounds` batches (JSON, as
  agents publish them), decoded as the brain decodes them and kept as the latest per
  node: by the brain's store (`brain/telemetry.py`, packed) and, the baseline in the
  same run, in a dict of the decoded batches (what the brain kept before). Reports the
  CPU time, the objects the collector tracks and the memory that stay per node, and the
  collector's pauses while the rounds ran (count, total, longest).
- **profiles**: `--jobs` running 2-GPU jobs, four to an 8-GPU node, and `--seconds` of
  1 Hz telemetry for all of them through the brain's `Profiler` (a window is 600 s:
  `ProfileSettings.window_s`). Reports the memory and tracked objects per job at the
  end, the collector's pauses, and the CPU per batch observed.

`--tree DIR` imports the brain from another checkout (an older commit's worktree) for the
profiles part, to compare by turns; the latest-telemetry part needs this checkout's store
and is skipped there. Prints a table and writes bench/results/telemetry_memory-<stamp>.json.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GPUS = 8


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


class _Pauses:
    """The collector's collections while it is installed: count, total and longest."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._at = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._at = time.perf_counter()
        else:
            self.times.append(time.perf_counter() - self._at)

    def __enter__(self) -> _Pauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def row(self) -> dict[str, Any]:
        return {
            "collections": len(self.times),
            "gc_total_ms": round(sum(self.times) * 1000, 1),
            "gc_longest_ms": round(max(self.times, default=0.0) * 1000, 1),
        }


def _batch_json(node: str, ts: float) -> bytes:
    gpus = ",".join(
        f'{{"index":{g},"util_gpu_pct":{(g * 13 + ts) % 100:.1f},"util_mem_pct":12.5,'
        f'"mem_used_mib":{20_000 + g},"mem_total_mib":81559,"power_w":312.4,"temp_c":61,'
        f'"sm_clock_mhz":1980,"mem_clock_mhz":2619,"ecc_dbe_total":0}}'
        for g in range(GPUS)
    )
    return f'{{"node":"{node}","ts":{ts},"samples":[{gpus}]}}'.encode()


def _latest(variant: str, nodes: int, rounds: int) -> dict[str, Any]:
    from brain.telemetry import LatestTelemetry
    from schemas.base import decode
    from schemas.telemetry import TelemetryBatch

    names = [f"node-{i:05d}" for i in range(nodes)]
    raws = [[_batch_json(n, 1_000_000.0 + r) for n in names] for r in range(rounds)]
    packed = LatestTelemetry()
    plain: dict[str, TelemetryBatch] = {}
    keep: Callable[[TelemetryBatch], None] = (
        packed.put if variant == "packed" else lambda b: plain.__setitem__(b.node, b)
    )
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mib()
    cpu = time.process_time()
    with _Pauses() as pauses:
        for batch_raws in raws:
            for raw in batch_raws:
                keep(decode(raw, TelemetryBatch))
    cpu = time.process_time() - cpu
    gc.collect()
    return {
        "part": "latest telemetry",
        "variant": variant,
        "size": f"{nodes} nodes x {rounds} rounds",
        "cpu_s": round(cpu, 2),
        "us_per_batch": round(cpu / (nodes * rounds) * 1e6, 1),
        "tracked_per_unit": round((len(gc.get_objects()) - objects) / nodes, 1),
        "kib_per_unit": round((_rss_mib() - rss) * 1024 / nodes, 2),
        **pauses.row(),
    }


def _profiles(tree: str, jobs: int, seconds: int) -> dict[str, Any]:
    from brain.profiles import Profiler, ProfileStore
    from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
    from schemas.telemetry import GpuSample, TelemetryBatch

    per_node = GPUS // 2
    nodes = [f"node-{i:05d}" for i in range((jobs + per_node - 1) // per_node)]
    running = [
        JobRecord(
            job_id=str(j + 1),
            tenant="bench",
            spec=JobSpec(command=("train",), gpus=2),
            state=JobState.RUNNING,
            attempt=1,
            submitted_at=0.0,
            started_at=0.0,
            grants=(
                NodeGrant(
                    node=nodes[j // per_node],
                    gpus=(2 * (j % per_node), 2 * (j % per_node) + 1),
                ),
            ),
        )
        for j in range(jobs)
    ]
    samples = [
        tuple(
            GpuSample(
                index=g,
                util_gpu_pct=float((g * 7 + s) % 100),
                util_mem_pct=10.0,
                mem_used_mib=20_000.0,
                mem_total_mib=81_559.0,
                power_w=300.0,
                temp_c=60.0,
                sm_clock_mhz=1_980.0,
                mem_clock_mhz=2_619.0,
            )
            for g in range(GPUS)
        )
        for s in range(10)
    ]
    clock = [0.0]
    profiler = Profiler(lambda: running, store=ProfileStore(None), clock=lambda: clock[0])
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mib()
    cpu = 0.0
    with _Pauses() as pauses:
        for second in range(seconds):
            ts = 1_000_000.0 + second
            batches = [
                TelemetryBatch.model_construct(node=n, ts=ts, samples=samples[second % 10])
                for n in nodes
            ]
            started = time.process_time()
            for batch in batches:
                profiler.observe(batch)
            cpu += time.process_time() - started
    gc.collect()
    return {
        "part": "profiles",
        "variant": tree,
        "size": f"{jobs} jobs x {seconds} s",
        "cpu_s": round(cpu, 2),
        "us_per_batch": round(cpu / (len(nodes) * seconds) * 1e6, 1),
        "tracked_per_unit": round((len(gc.get_objects()) - objects) / jobs, 1),
        "kib_per_unit": round((_rss_mib() - rss) * 1024 / jobs, 2),
        **pauses.row(),
    }


def _child(tree: str, part: str, args: tuple[Any, ...], out: Any) -> None:
    sys.path.insert(0, tree)
    out.put(_latest(*args) if part == "latest" else _profiles(*args))


def _run(tree: str, part: str, *args: Any) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(tree, part, args, queue))
    process.start()
    row: dict[str, Any] = queue.get()
    process.join()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=8_000)
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument("--tree", type=Path, default=REPO)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    tree = str(args.tree.resolve())
    rows = []
    if tree == str(REPO):
        for variant in ("decoded", "packed"):
            rows.append(_run(tree, "latest", variant, args.nodes, args.rounds))
    rows.append(_run(tree, "profiles", args.label or tree, args.jobs, args.seconds))

    sys.path.insert(0, str(REPO))
    from bench.recording import record

    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("per unit: a node for latest telemetry, a job for profiles")
    paths = record("telemetry_memory", {"tree": tree, "label": args.label}, rows)
    print("results:", *map(str, paths))


if __name__ == "__main__":
    main()
