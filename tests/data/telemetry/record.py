"""Writes the recorded telemetry the profile tests replay (run once; the output is checked in).

`python -m tests.data.telemetry.record` regenerates every trace below from fixed seeds:
what the simulated backend really emits while a job runs, and three shapes real jobs
show (a data-loader stall, a job that holds a GPU it never uses, a memory leak).
Each line is one `TelemetryBatch` as an agent publishes it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

from agents.gpu import SimulatedGpus
from schemas.telemetry import GpuSample, TelemetryBatch

HERE = Path(__file__).resolve().parent
T0 = 1_700_000_000.0
H100_MIB = 81_559.0


def _sample(index: int, util: float, mem: float) -> GpuSample:
    return GpuSample(
        index=index,
        util_gpu_pct=round(min(100.0, max(0.0, util)), 1),
        util_mem_pct=round(min(100.0, max(0.0, util * 0.6)), 1),
        mem_used_mib=round(mem, 1),
        mem_total_mib=H100_MIB,
        power_w=round(80 + 6 * util, 1),
        temp_c=round(32 + 0.4 * util, 1),
        sm_clock_mhz=1980.0,
        mem_clock_mhz=2619.0,
        ecc_dbe_total=0,
    )


def simulated(count: int, interval_s: float) -> Iterator[TelemetryBatch]:
    gpus = SimulatedGpus("rec", 1, "H100", seed=7)
    gpus.set_busy([0])
    for tick in range(count):
        yield TelemetryBatch(node="rec", ts=T0 + tick * interval_s, samples=gpus.sample())


def shaped(
    count: int, interval_s: float, gpus: Callable[[int, random.Random], list[GpuSample]]
) -> Iterator[TelemetryBatch]:
    rng = random.Random(11)
    for tick in range(count):
        yield TelemetryBatch(node="rec", ts=T0 + tick * interval_s, samples=tuple(gpus(tick, rng)))


def dataloader_stall(tick: int, rng: random.Random) -> list[GpuSample]:
    # 16 s of compute, then 4 s waiting on input: a 20 s cycle.
    util = 95.0 if tick % 20 < 16 else 4.0
    return [_sample(0, util + rng.uniform(-2, 2), 61_000 + rng.uniform(-200, 200))]


def idle_holder(tick: int, rng: random.Random) -> list[GpuSample]:
    # Asked for two GPUs, computes on one.
    return [
        _sample(0, 62 + rng.gauss(0, 6), 40_000 + rng.uniform(-100, 100)),
        _sample(1, rng.uniform(0, 1.5), 310.0),
    ]


def memory_leak(tick: int, rng: random.Random) -> list[GpuSample]:
    return [_sample(0, 55 + rng.gauss(0, 4), 20_000 + 120.0 * tick)]


TRACES: dict[str, Callable[[], Iterator[TelemetryBatch]]] = {
    "training-sim": lambda: simulated(200, 0.5),
    "dataloader-stall": lambda: shaped(160, 1.0, dataloader_stall),
    "idle-holder": lambda: shaped(120, 1.0, idle_holder),
    "memory-leak": lambda: shaped(120, 1.0, memory_leak),
}


def load(name: str) -> list[TelemetryBatch]:
    lines = (HERE / f"{name}.jsonl").read_text().splitlines()
    return [TelemetryBatch.model_validate_json(line) for line in lines]


if __name__ == "__main__":
    for name, trace in TRACES.items():
        lines = [batch.model_dump_json(exclude_defaults=True) for batch in trace()]
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"wrote {name}.jsonl: {len(lines)} batches")
