"""Scheduling quality on the shared Philly clusters, beside Tiresias' own simulator.

Runs every queue order (and Tiresias' quirks as their named orders) through `brain.sim`
on the four shared Philly virtual clusters (../shared/data/README.md), with zero
preemption cost as Tiresias' simulator assumes, prints our average JCT beside
Tiresias' number for the same trace and cluster, the CPU seconds of each replay and
jobs replayed per CPU second, checks the issue's targets, and writes everything to
bench/results/ (JSON and CSV).

    .venv/bin/python bench/policies.py [--only vc_0e4a51] [--variant las] [--workers N]
        [--tiresias-dir DIR]

With `--tiresias-dir DIR` (a checkout of SymbioticLab/Tiresias you provide; its code is
not part of this project) it also runs Tiresias' own simulator in the same run, on the
same trace and cluster, for every Tiresias policy a variant is compared with, and
prints its average JCT, CPU seconds and jobs per CPU second beside ours
(bench/tiresias_ref.py: how it is run and adapted to Python 3).

Not a test: nothing here asserts; it reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from bench.tiresias_ref import TiresiasRun, simulator_dir  # noqa: E402
from bench.tiresias_ref import run as run_tiresias  # noqa: E402
from brain.core import DEFAULT_SERVICE_PRIOR, Policy, ServiceDistribution  # noqa: E402
from brain.sim import (  # noqa: E402
    SimConfig,
    load_trace,
    parse_cluster,
    simulate,
    summarize,
)
from brain.sim.cli import load_prior  # noqa: E402
from brain.sim.report import Metrics  # noqa: E402

DATA = REPO.parent / "shared" / "data"
YARN = DATA / "tiresias" / "yarn-gput1000.csv"

# Tiresias' own simulator on these files (../shared/data/README.md): average JCT.
REFERENCE: dict[str, dict[str, float]] = {
    "vc_0e4a51": {
        "fifo": 1_407_738,
        "dlas-gpu": 376_388,
        "dlas-gpu-gittins": 351_635,
        "shortest-gpu": 195_115,
    },
    "vc_2869ce": {
        "fifo": 841_485,
        "dlas-gpu": 362_072,
        "dlas-gpu-gittins": 607_775,
        "shortest-gpu": 260_758,
    },
    "vc_6c71a0": {
        "fifo": 818_597,
        "dlas-gpu": 50_922,
        "dlas-gpu-gittins": 36_004,
        "shortest-gpu": 26_122,
    },
    "vc_b436b2": {
        "fifo": 1_326_675,
        "dlas-gpu": 24_288,
        "dlas-gpu-gittins": 34_141,
        "shortest-gpu": 20_822,
    },
}
CLUSTERS: dict[str, str] = {
    "vc_0e4a51": "12x4",
    "vc_2869ce": "12x4",
    "vc_6c71a0": "12x4",
    "vc_b436b2": "18x4",
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
    # The Gittins distribution: "learned" (online, from the default prior), "yarn"
    # (Tiresias' yarn-gput1000.csv, fixed: what its dlas-gpu-gittins reads).
    distribution: str = "learned"
    # Reads progress reports (not durations, but not blind to how far a job is).
    reads_progress: bool = False
    # Learned distribution: also from unfinished jobs' service (Kaplan-Meier).
    censored: bool = True


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "progress E=1", Policy(order="progress"), None, progress_error=1.0, reads_progress=True
    ),
    Variant(
        "progress-gittins E=1",
        Policy(order="progress-gittins"),
        None,
        progress_error=1.0,
        reads_progress=True,
    ),
    Variant("fifo", Policy(order="fifo"), "fifo"),
    Variant("las", Policy(order="las"), "dlas-gpu"),
    Variant("las-tiresias", Policy(order="las-tiresias"), "dlas-gpu"),
    Variant("las-fine", Policy(order="las", las_thresholds_gpu_s=FINE_BANDS), None),
    Variant("gittins", Policy(order="gittins"), "dlas-gpu-gittins"),
    Variant("gittins-size", Policy(order="gittins-size"), "dlas-gpu-gittins"),
    # One band: the exact index alone, no LAS bands around it (more churn, no guard).
    Variant("gittins-size 1band", Policy(order="gittins-size", las_thresholds_gpu_s=()), None),
    Variant("gittins finished-only", Policy(order="gittins"), "dlas-gpu-gittins", censored=False),
    Variant("gittins yarn", Policy(order="gittins"), "dlas-gpu-gittins", distribution="yarn"),
    Variant(
        "gittins-tiresias yarn",
        Policy(order="gittins-tiresias"),
        "dlas-gpu-gittins",
        distribution="yarn",
    ),
    Variant("progress E=0", Policy(order="progress"), None, reads_progress=True),
    Variant("progress-gittins E=0", Policy(order="progress-gittins"), None, reads_progress=True),
    Variant("srtf", Policy(order="srtf"), "shortest-gpu", knows_durations=True),
)


@dataclass(frozen=True)
class Row:
    scenario: str
    variant: Variant
    reference_avg_jct: float | None
    metrics: Metrics
    cpu_s: float
    decide_calls: int
    # Learned Gittins only: finished jobs after which the index stayed near its final.
    converged_after: int | None = None
    # With --tiresias-dir: Tiresias' own simulator on the counterpart, same run.
    tiresias: TiresiasRun | None = None

    @property
    def jobs_per_cpu_s(self) -> float:
        return self.metrics.jobs / self.cpu_s if self.cpu_s > 0 else float("inf")


def _prior(variant: Variant) -> tuple[ServiceDistribution, bool]:
    if variant.distribution == "yarn":
        return load_prior(YARN), False
    return DEFAULT_SERVICE_PRIOR, True


# Attained services (GPU-s) at which convergence is judged: a new job, the band
# thresholds, and deep in the last band.
PROBES = (0.0, 1_000.0, 3_250.0, 7_200.0, 36_000.0)


def converged_after(learned: tuple[tuple[int, tuple[float, ...]], ...]) -> int:
    """How many finished jobs (in finishing order) the learned distribution took until
    its Gittins index at every probe (`PROBES`) stayed within 10 % of where the replay
    left it: `learned` is the simulator's record, one entry per change."""
    if not learned:
        return 0
    final = learned[-1][1]
    settled = 0
    for n, (finished, indices) in enumerate(learned):
        if any(abs(i - f) > 0.1 * f for i, f in zip(indices, final, strict=True)):
            settled = learned[n + 1][0] if n + 1 < len(learned) else finished
    return settled


def run_one(scenario: str, variant: Variant) -> Row:
    trace = load_trace(DATA / "philly" / f"{scenario}.csv")
    prior, learn = _prior(variant)
    config = SimConfig(
        policy=variant.policy,
        cluster=parse_cluster(CLUSTERS[scenario]),
        progress_error=variant.progress_error,
        service_prior=prior,
        learn_service=learn,
        learn_censored=variant.censored,
        index_probes_gpu_s=PROBES if learn else (),
    )
    started = time.process_time()
    result = simulate(trace, config)
    cpu = time.process_time() - started
    reference = REFERENCE[scenario].get(variant.counterpart) if variant.counterpart else None
    learned = None
    if learn and variant.policy.order.startswith("gittins"):
        learned = converged_after(result.learned_index)
    return Row(scenario, variant, reference, summarize(result), cpu, result.decide_calls, learned)


def run_reference(checkout: str, scenario: str, schedule: str) -> tuple[str, TiresiasRun]:
    nodes, gpus = CLUSTERS[scenario].split("x")
    trace = DATA / "philly" / f"{scenario}.csv"
    return scenario, run_tiresias(Path(checkout), trace, int(nodes), int(gpus), schedule)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_table(rows: list[Row]) -> None:
    header = (
        "cluster",
        "policy",
        "avg JCT",
        "Tiresias",
        "vs ref",
        "p99",
        "preempt",
        "CPU s",
        "jobs/s",
    )
    with_tiresias = any(r.tiresias is not None for r in rows)
    if with_tiresias:
        header = (*header, "Tiresias run: avg JCT", "CPU s", "jobs/s", "CPU x ours")
    lines = [header]
    for r in rows:
        m = r.metrics
        ratio = "-" if r.reference_avg_jct is None else f"{m.avg_jct / r.reference_avg_jct:.3f}"
        v = r.variant
        label = v.label + (" *" if v.knows_durations else "")
        lines.append(
            (
                r.scenario,
                label,
                _fmt(m.avg_jct),
                _fmt(r.reference_avg_jct) + (f" ({v.counterpart})" if v.counterpart else ""),
                ratio,
                _fmt(m.p99_jct),
                str(m.preemptions),
                f"{r.cpu_s:.1f}",
                f"{r.jobs_per_cpu_s:,.0f}",
                *(_tiresias_cells(r) if with_tiresias else ()),
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


def _tiresias_cells(row: Row) -> tuple[str, ...]:
    t = row.tiresias
    if t is None:
        return ("-", "-", "-", "-")
    return (
        _fmt(t.avg_jct),
        f"{t.cpu_s:.1f}",
        f"{t.jobs_per_cpu_s:,.0f}",
        f"{t.cpu_s / row.cpu_s:.1f}" if row.cpu_s > 0 else "-",
    )


def targets(rows: list[Row]) -> list[str]:
    out: list[str] = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        ref = REFERENCE[scenario]
        best_ref = min(ref["dlas-gpu"], ref["dlas-gpu-gittins"])
        mine = {r.variant.label: r for r in rows if r.scenario == scenario}
        for label, column in (
            ("las", "dlas-gpu"),
            ("las-tiresias", "dlas-gpu"),
            ("gittins", "dlas-gpu-gittins"),
            ("gittins-size", "dlas-gpu-gittins"),
            ("gittins-tiresias yarn", "dlas-gpu-gittins"),
        ):
            if label in mine:
                ratio = mine[label].metrics.avg_jct / ref[column]
                verdict = (
                    "at or below" if ratio <= 1.0 else "within 5%" if ratio <= 1.05 else "OVER"
                )
                out.append(f"{scenario}: {label} = {ratio:.3f} x Tiresias {column} ({verdict})")
        for label, column in (("fifo", "fifo"), ("srtf", "shortest-gpu")):
            if label in mine:
                gap = mine[label].metrics.avg_jct - ref[column]
                out.append(f"{scenario}: {label} - Tiresias {column} = {gap:+.1f} s")
        blind = [
            r
            for r in mine.values()
            if not r.variant.knows_durations and not r.variant.reads_progress
        ]
        if blind:
            best = min(blind, key=lambda r: r.metrics.avg_jct)
            ratio = best.metrics.avg_jct / best_ref
            out.append(
                f"{scenario}: best duration-blind: {best.variant.label} = {ratio:.3f} x "
                f"Tiresias' best ({best_ref:,.0f}); target <= 0.9: "
                f"{'met' if ratio <= 0.9 else 'MISSED'}"
            )
        for r in mine.values():
            if r.tiresias is not None:
                t = r.tiresias
                out.append(
                    f"{scenario}: {r.variant.label}: {r.cpu_s:.2f} CPU-s "
                    f"({r.jobs_per_cpu_s:,.0f} jobs/s); Tiresias' {t.schedule} in the same run "
                    f"{t.cpu_s:.2f} CPU-s ({t.jobs_per_cpu_s:,.0f} jobs/s, avg JCT "
                    f"{t.avg_jct:,.0f}): {'faster' if r.cpu_s < t.cpu_s else 'SLOWER'}"
                )
        finished_only = mine.get("gittins finished-only")
        if finished_only is not None and finished_only.converged_after is not None:
            out.append(
                f"{scenario}: gittins learned from finished jobs only: "
                f"{finished_only.metrics.avg_jct:,.0f} s, its index settled after "
                f"{finished_only.converged_after:,} finished jobs"
            )
        learned = mine.get("gittins")
        if learned is not None and learned.converged_after is not None:
            fixed = mine.get("gittins yarn")
            beside = (
                f"; fed Tiresias' yarn-gput1000 in advance: {fixed.metrics.avg_jct:,.0f} s"
                if fixed is not None
                else ""
            )
            out.append(
                f"{scenario}: gittins learned online (finished and, censored, unfinished "
                f"jobs): {learned.metrics.avg_jct:,.0f} s{beside}; "
                f"its index settled (within 10 % of its end value at "
                f"{', '.join(f'{a:,.0f}' for a in PROBES)} GPU-s) after "
                f"{learned.converged_after:,} of {learned.metrics.jobs:,} finished jobs"
            )
        out.extend(progress_targets(scenario, mine, best_ref))
    return out


def progress_targets(scenario: str, mine: dict[str, Row], best_ref: float) -> list[str]:
    """The progress target (<= 0.75x Tiresias' best at E=1), beside what the
    clairvoyant `srtf` reaches: no ranking by remaining work is likely to beat it."""
    out: list[str] = []
    for label in ("progress E=1", "progress-gittins E=1"):
        if label in mine:
            ratio = mine[label].metrics.avg_jct / best_ref
            out.append(
                f"{scenario}: {label.removesuffix(' E=1')} at E=1 = {ratio:.3f} x Tiresias' "
                f"best; target <= 0.75: {'met' if ratio <= 0.75 else 'MISSED'}"
            )
    if "srtf" in mine:
        ratio = mine["srtf"].metrics.avg_jct / best_ref
        out.append(f"{scenario}: clairvoyant srtf = {ratio:.3f} x Tiresias' best (a bound)")
    return out


def write_results(rows: list[Row], notes: list[str]) -> tuple[Path, Path]:
    records = [
        {
            "cluster": r.scenario,
            "shape": CLUSTERS[r.scenario],
            "policy": r.variant.label,
            "order": r.variant.policy.order,
            "distribution": r.variant.distribution,
            "progress_error": r.variant.progress_error,
            "knows_durations": r.variant.knows_durations,
            "tiresias_counterpart": r.variant.counterpart,
            "tiresias_avg_jct": r.reference_avg_jct,
            "cpu_s": round(r.cpu_s, 2),
            "jobs_per_cpu_s": round(r.jobs_per_cpu_s, 1),
            "decide_calls": r.decide_calls,
            "gittins_converged_after_jobs": r.converged_after,
            "learn_censored": r.variant.censored,
            "tiresias_same_run_avg_jct": None if r.tiresias is None else r.tiresias.avg_jct,
            "tiresias_same_run_cpu_s": None if r.tiresias is None else round(r.tiresias.cpu_s, 2),
            "tiresias_same_run_jobs_per_cpu_s": (
                None if r.tiresias is None else round(r.tiresias.jobs_per_cpu_s, 1)
            ),
            **r.metrics.as_json(),
        }
        for r in rows
    ]
    return record("policies", {"preemption_cost_s": 0.0, "targets": notes}, records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CLUSTERS), action="append")
    parser.add_argument(
        "--variant", choices=[v.label for v in VARIANTS], action="append", metavar="LABEL"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--tiresias-dir",
        type=Path,
        metavar="DIR",
        help="a checkout of SymbioticLab/Tiresias (or its simulator/ folder): also run "
        "its simulator on every counterpart in this run, for CPU time side by side",
    )
    args = parser.parse_args(argv)
    scenarios = args.only or list(CLUSTERS)
    variants = [v for v in VARIANTS if not args.variant or v.label in args.variant]
    # The longest replays first, so that the pool ends together.
    jobs = [
        (s, v)
        for s in ("vc_6c71a0", "vc_b436b2", "vc_0e4a51", "vc_2869ce")
        if s in scenarios
        for v in variants
    ]
    references: dict[tuple[str, str], TiresiasRun] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        pending = None
        if args.tiresias_dir is not None:
            # Checked here, so that a wrong folder fails before minutes of replays.
            checkout = str(simulator_dir(args.tiresias_dir.resolve()))
            wanted = list(dict.fromkeys((s, v.counterpart) for s, v in jobs if v.counterpart))
            pending = pool.map(
                run_reference,
                [checkout] * len(wanted),
                [s for s, _ in wanted],
                [c for _, c in wanted if c is not None],
            )
        rows = list(pool.map(run_one, [s for s, _ in jobs], [v for _, v in jobs]))
        for scenario, reference in pending or ():
            references[(scenario, reference.schedule)] = reference
    rows = [
        replace(r, tiresias=references.get((r.scenario, r.variant.counterpart or ""))) for r in rows
    ]
    rows.sort(key=lambda r: (list(CLUSTERS).index(r.scenario), VARIANTS.index(r.variant)))
    print_table(rows)
    notes = targets(rows)
    for note in notes:
        print(note)
    json_path, csv_path = write_results(rows, notes)
    print(f"results: {json_path.relative_to(REPO)}, {csv_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
