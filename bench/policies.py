"""Scheduling quality on real traces, beside Tiresias' published simulator numbers.

Runs every queue-order policy (and a few tuned variants) through `brain.sim` on the
Philly virtual cluster vc_0e4a51 at 12x4 and 8x4 GPUs and on Tiresias' 60_job trace
at 2x4 and 4x4, with zero preemption cost as Tiresias' simulator assumes, prints our
average JCT beside the reference, checks the two targets of the issue, and writes
everything to bench/results/ (JSON and CSV) to compare run to run.

    .venv/bin/python bench/policies.py [--only vc_0e4a51-12x4] [--workers N]

Not a test: nothing here asserts; it reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from brain.core import Policy  # noqa: E402
from brain.sim import SimConfig, load_trace, parse_cluster, simulate, summarize  # noqa: E402
from brain.sim.report import Metrics  # noqa: E402

DATA = REPO.parent / "shared" / "data"

# Tiresias' own simulator on these files (../shared/data/README.md): average JCT.
REFERENCE: dict[str, dict[str, float]] = {
    "vc_0e4a51-12x4": {
        "fifo": 1_407_738,
        "dlas-gpu": 376_388,
        "dlas-gpu-gittins": 351_635,
        "shortest-gpu": 195_115,
    },
    "vc_0e4a51-8x4": {
        "fifo": 3_179_904,
        "dlas-gpu": 800_817,
        "dlas-gpu-gittins": 773_834,
        "shortest-gpu": 353_150,
    },
    "60_job-2x4": {
        "fifo": 1_556.5,
        "dlas-gpu": 715.3,
        "dlas-gpu-gittins": 821.2,
        "shortest-gpu": 563.4,
    },
    "60_job-4x4": {
        "fifo": 200.8,
        "dlas-gpu": 190.7,
        "dlas-gpu-gittins": 219.1,
        "shortest-gpu": 195.9,
    },
}
SCENARIOS: dict[str, tuple[Path, str]] = {
    "vc_0e4a51-12x4": (DATA / "philly" / "vc_0e4a51.csv", "12x4"),
    "vc_0e4a51-8x4": (DATA / "philly" / "vc_0e4a51.csv", "8x4"),
    "60_job-2x4": (DATA / "tiresias" / "60_job.csv", "2x4"),
    "60_job-4x4": (DATA / "tiresias" / "60_job.csv", "4x4"),
}
# Fifteen geometric LAS bands, 100 GPU-s doubling: close to continuous LAS.
FINE_BANDS = tuple(100.0 * 2**i for i in range(15))


@dataclass(frozen=True)
class Variant:
    label: str
    policy: Policy
    # The Tiresias column it is compared with, if any.
    counterpart: str | None
    knows_durations: bool = False
    # `progress` only: how wrong jobs may be about their total work (see SimConfig).
    progress_error: float = 0.0


VARIANTS: tuple[Variant, ...] = (
    Variant("fifo", Policy(order="fifo"), "fifo"),
    Variant("priority", Policy(order="priority"), None),
    Variant("las", Policy(order="las"), "dlas-gpu"),
    Variant("las-fine", Policy(order="las", las_thresholds_gpu_s=FINE_BANDS), None),
    Variant("gittins", Policy(order="gittins"), "dlas-gpu-gittins"),
    Variant(
        "gittins-1band",
        Policy(order="gittins", las_thresholds_gpu_s=(), gittins_quantum_gpu_s=300_000.0),
        None,
    ),
    Variant("progress", Policy(order="progress"), None),
    Variant("progress-2x-off", Policy(order="progress"), None, progress_error=1.0),
    Variant("srtf", Policy(order="srtf"), "shortest-gpu", knows_durations=True),
)


@dataclass(frozen=True)
class Row:
    scenario: str
    variant: str
    knows_durations: bool
    counterpart: str | None
    reference_avg_jct: float | None
    metrics: Metrics
    wall_s: float
    decide_calls: int


def run_one(scenario: str, variant: Variant) -> Row:
    trace_path, cluster = SCENARIOS[scenario]
    trace = load_trace(trace_path)
    started = time.perf_counter()
    config = SimConfig(
        policy=variant.policy, cluster=parse_cluster(cluster), progress_error=variant.progress_error
    )
    result = simulate(trace, config)
    wall = time.perf_counter() - started
    reference = REFERENCE[scenario].get(variant.counterpart) if variant.counterpart else None
    return Row(
        scenario,
        variant.label,
        variant.knows_durations,
        variant.counterpart,
        reference,
        summarize(result),
        wall,
        result.decide_calls,
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_table(rows: list[Row]) -> None:
    header = (
        "scenario",
        "policy",
        "avg JCT",
        "Tiresias",
        "vs ref",
        "median",
        "p99",
        "makespan",
        "util",
        "preempt",
        "wall s",
    )
    lines = [header]
    for r in rows:
        m = r.metrics
        ratio = "-" if r.reference_avg_jct is None else f"{m.avg_jct / r.reference_avg_jct:.3f}"
        label = r.variant + (" *" if r.knows_durations else "")
        lines.append(
            (
                r.scenario,
                label,
                _fmt(m.avg_jct),
                _fmt(r.reference_avg_jct) + (f" ({r.counterpart})" if r.counterpart else ""),
                ratio,
                _fmt(m.median_jct),
                _fmt(m.p99_jct),
                _fmt(m.makespan),
                f"{m.utilization:.1%}",
                str(m.preemptions),
                f"{r.wall_s:.1f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    print("* knows job durations (clairvoyant); every other policy does not")


def targets(rows: list[Row]) -> list[str]:
    out: list[str] = []
    main = [r for r in rows if r.scenario == "vc_0e4a51-12x4"]
    las = next((r for r in main if r.variant == "las"), None)
    if las is not None:
        gap = las.metrics.avg_jct / 376_388 - 1
        out.append(
            f"las vs Tiresias dlas-gpu at 12x4: {las.metrics.avg_jct:,.0f} s "
            f"({gap:+.1%}; target within 5%: {'met' if abs(gap) <= 0.05 else 'MISSED'})"
        )
    blind = [r for r in main if not r.knows_durations]
    if blind:
        best = min(blind, key=lambda r: r.metrics.avg_jct)
        ratio = best.metrics.avg_jct / 351_635
        out.append(
            f"best policy blind to durations at 12x4: {best.variant} "
            f"{best.metrics.avg_jct:,.0f} s = {ratio:.3f} x Tiresias' best (351,635); "
            f"target <= 0.75 x (264,000 s): {'met' if ratio <= 0.75 else 'MISSED'}"
        )
        service_only = [r for r in blind if not r.variant.startswith("progress")]
        if service_only:
            best_service = min(service_only, key=lambda r: r.metrics.avg_jct)
            out.append(
                f"best policy that also ignores progress reports: {best_service.variant} "
                f"{best_service.metrics.avg_jct:,.0f} s = "
                f"{best_service.metrics.avg_jct / 351_635:.3f} x Tiresias' best"
            )
    return out


def write_results(rows: list[Row], notes: list[str]) -> tuple[Path, Path]:
    records = [
        {
            "scenario": r.scenario,
            "policy": r.variant,
            "knows_durations": r.knows_durations,
            "tiresias_counterpart": r.counterpart,
            "tiresias_avg_jct": r.reference_avg_jct,
            "wall_s": round(r.wall_s, 2),
            "decide_calls": r.decide_calls,
            **r.metrics.as_json(),
        }
        for r in rows
    ]
    return record("policies", {"preemption_cost_s": 0.0, "targets": notes}, records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    scenarios = args.only or list(SCENARIOS)
    jobs = [(s, v) for s in scenarios for v in VARIANTS]
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        rows = list(pool.map(run_one, [s for s, _ in jobs], [v for _, v in jobs]))
    print_table(rows)
    notes = targets(rows)
    for note in notes:
        print(note)
    json_path, csv_path = write_results(rows, notes)
    print(f"results: {json_path.relative_to(REPO)}, {csv_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
