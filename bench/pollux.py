"""Elastic scheduling on Pollux's workloads, beside the published Pollux and Tiresias.

Replays petuum/adaptdl's workload-1..4 (160 jobs each, 1.0x load) on 16 nodes x 4 GPUs
through `brain.sim` with the applications' measured step times
(../shared/data/pollux, brain/sim/pollux.py): once with rigid jobs under static `las`
(the baseline), and with the elasticity stage (`las+marginal-gain`) under a few cost
models. Prints average JCT beside the artifact's published numbers, the published
Pollux/Tiresias ratio beside our elastic/static ratio, and writes everything to
bench/results/ (JSON and CSV).

Costs, as Pollux's simulator charges them: a job stalls 30 s when it first starts and
loses 30 s when it resumes after a preemption; an elastic resize stalls it
`resize_cost_s` (30 s in Pollux's restart-based rescale); `-measured` rows charge
what Horovod elastic's in-place resize took here instead (17 s a grow, 3 s a shrink,
bench/resize_latency.py). `batch` is what a resize keeps: the global batch
(scheduling gains only), each worker's batch (Horovod elastic's usual setup, where
a smaller world also trains a smaller, more sample-efficient batch), or neither
(`adaptive`: the batch with the best goodput on the new allocation). `-60s` and
`-measured` rows resize running jobs by the stage's own choice only every 60 s, as
the artifact schedules (`Policy.elastic_resize_interval_s`). `adaptive` rows model
Pollux's own batch-size adaptation (a job re-choosing its batch for the best goodput
at every allocation, as AdaptDL's do), with `las-adaptive` the same adaptation on
rigid jobs (to separate the two effects); `adaptive-epoch` rows also re-choose the
batch at every epoch, as the artifact's simulator does and as Alnair's elastic jobs
do with `workloads/adaptive_batch.py` (the example's `--adaptive-batch`). The primary
row is `elastic-adaptive-epoch-measured`; `elastic-local-measured` is the same for
jobs that keep each worker's batch.

    .venv/bin/python bench/pollux.py [--only workload-1] [--workers N]

Not a test: nothing here asserts; it reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from brain.core import Policy  # noqa: E402
from brain.sim import SimConfig, parse_cluster, simulate, summarize  # noqa: E402
from brain.sim.pollux import (  # noqa: E402
    BatchScaling,
    ElasticRange,
    PolluxScaling,
    load_apps,
    load_pollux_workload,
)
from brain.sim.report import Metrics  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "pollux"
CLUSTER = "16x4"
RESTART_COST_S = 30.0

# The artifact's results-jobload/*-1.0 (../shared/data/README.md): average JCT, s.
PUBLISHED: dict[str, dict[str, float]] = {
    "workload-1": {"tiresias": 2_473.7, "optimus": 4_087.1, "pollux": 2_088.8},
    "workload-2": {"tiresias": 5_145.0, "optimus": 6_913.9, "pollux": 3_322.9},
    "workload-3": {"tiresias": 3_876.3, "optimus": 3_944.0, "pollux": 2_188.5},
    "workload-4": {"tiresias": 3_280.3, "optimus": 5_967.8, "pollux": 2_721.0},
}
# Across all eight of the artifact's workloads (the README): Pollux / Tiresias.
PUBLISHED_RATIO_ALL = 2_751 / 4_038
BASELINE = "las"


@dataclass(frozen=True)
class Variant:
    label: str
    policy: Policy
    resize_cost_s: float = RESTART_COST_S
    batch: BatchScaling = "global"
    note: str = ""
    # A shrink's stall when not `resize_cost_s` (None: the same).
    shrink_cost_s: float | None = None
    # How each job's elastic range follows from its request (ignored by static runs).
    elastic_range: ElasticRange = field(default_factory=ElasticRange)


# Horovod elastic's resize here, through the brain (bench/resize_latency.py,
# bench/results/resize-latency-*.json): a grow 13-19 s (16.8 s on average: the new
# workers start and join), a shrink 2-3 s (2.6 s: the removed workers leave).
MEASURED_GROW_S = 17.0
MEASURED_SHRINK_S = 3.0
ELASTIC = Policy(order="las", elasticity="marginal-gain", elastic_may_spread=True)
# The artifact's scheduling interval: the stage resizes running jobs by its own choice
# only at these rounds (a reclaim for an arriving job is not deferred).
ROUND_S = 60.0
ELASTIC_ROUNDS = replace(ELASTIC, elastic_resize_interval_s=ROUND_S)
VARIANTS: tuple[Variant, ...] = (
    Variant(BASELINE, Policy(order="las"), note="static: rigid jobs, Tiresias' 2D-LAS"),
    Variant(
        "las-tiresias-cfg",
        Policy(order="las", las_thresholds_gpu_s=(57_600.0,)),
        note="static, the artifact's Tiresias setting (2 queues, 16 GPU-hours)",
    ),
    Variant("elastic", ELASTIC, note="global batch kept, 30 s resize, resizes at every event"),
    Variant(
        "elastic-60s",
        ELASTIC_ROUNDS,
        note="global batch kept, 30 s resize, grows/retreats every 60 s (the artifact's round)",
    ),
    Variant(
        "elastic-linear",
        replace(ELASTIC, elasticity="linear"),
        note="throughput-blind growth (even split), for comparison",
    ),
    Variant("elastic-local", ELASTIC, batch="local", note="worker batch kept, 30 s resize"),
    Variant(
        "elastic-local-60s",
        ELASTIC_ROUNDS,
        batch="local",
        note="worker batch kept (Horovod elastic), 30 s resize, 60 s rounds",
    ),
    Variant(
        "elastic-local-measured",
        ELASTIC_ROUNDS,
        resize_cost_s=MEASURED_GROW_S,
        shrink_cost_s=MEASURED_SHRINK_S,
        batch="local",
        note="worker batch kept, Horovod elastic's measured resize (17 s grow, 3 s shrink), "
        "60 s rounds",
    ),
    # Pollux's/AdaptDL's batch-size adaptation: every job re-chooses its global batch
    # for the best goodput at each allocation (brain/sim/pollux.py, `batch="adaptive"`).
    # A job that does this on every resize, as AdaptDL's do; Horovod elastic jobs in
    # Alnair do not unless their script adapts the batch. Not the primary row.
    Variant(
        "las-adaptive",
        Policy(order="las"),
        batch="adaptive",
        note="static, rigid jobs each at its best-goodput batch for its size: batch "
        "adaptation alone",
    ),
    Variant(
        "elastic-adaptive-60s",
        ELASTIC_ROUNDS,
        batch="adaptive",
        note="batch re-chosen for goodput at every resize (AdaptDL), 30 s resize, 60 s rounds",
    ),
    Variant(
        "elastic-adaptive-measured",
        ELASTIC_ROUNDS,
        resize_cost_s=MEASURED_GROW_S,
        shrink_cost_s=MEASURED_SHRINK_S,
        batch="adaptive",
        note="batch re-chosen for goodput at every resize, measured resize, 60 s rounds",
    ),
    Variant(
        "las-adaptive-epoch",
        Policy(order="las"),
        batch="adaptive-epoch",
        note="static, rigid jobs re-choosing the batch every epoch as well",
    ),
    Variant(
        "elastic-adaptive-epoch-60s",
        ELASTIC_ROUNDS,
        batch="adaptive-epoch",
        note="batch re-chosen at every resize and every epoch, 30 s resize, 60 s rounds",
    ),
    Variant(
        "elastic-adaptive-epoch-measured",
        ELASTIC_ROUNDS,
        resize_cost_s=MEASURED_GROW_S,
        shrink_cost_s=MEASURED_SHRINK_S,
        batch="adaptive-epoch",
        note="batch re-chosen at every resize and every epoch (the example's "
        "--adaptive-batch), measured resize, 60 s rounds",
    ),
)
# The live brain with --elastic-one-node: jobs within a node elastic on it, bigger ones
# at a fixed size across nodes (what it ran before resizes across nodes were built).
ONE_NODE = Variant(
    "elastic-one-node-measured",
    replace(ELASTIC_ROUNDS, elastic_may_spread=False),
    resize_cost_s=MEASURED_GROW_S,
    shrink_cost_s=MEASURED_SHRINK_S,
    batch="adaptive-epoch",
    note="as the primary, with --elastic-one-node: jobs within a node elastic on it, "
    "bigger ones at a fixed size across nodes",
    elastic_range=ElasticRange(node_gpus=4),
)
VARIANTS = (*VARIANTS, ONE_NODE)
# The row compared with the published ratio: jobs that adapt their batch at every
# resize and epoch, as Pollux's do (workloads/adaptive_batch.py; the example's
# --adaptive-batch), resized in place by Horovod elastic at the cost measured here
# (within a node and across nodes alike: bench/resize_latency.py's brain-2node mode),
# the stage resizing every 60 s (the artifact's round): the live brain's
# `--policy las --elastic-resize-interval 60`. `elastic-local-measured` is
# the same for jobs that keep each worker's batch.
PRIMARY = "elastic-adaptive-epoch-measured"
WORKLOADS = tuple(PUBLISHED)


def payback_variant(factor: float) -> Variant:
    """The primary row with another payback factor (how long a job runs at a size,
    in multiples of its last resize's time, before the policy moves it again)."""
    primary = next(v for v in VARIANTS if v.label == PRIMARY)
    return replace(
        primary,
        label=f"{PRIMARY}-payback-{factor:g}",
        policy=replace(primary.policy, elastic_payback=factor),
        note=f"as the primary, payback factor {factor:g} (default "
        f"{primary.policy.elastic_payback:g})",
    )


@dataclass(frozen=True)
class Row:
    workload: str
    variant: str
    note: str
    batch: str
    resize_cost_s: float
    shrink_cost_s: float | None
    metrics: Metrics
    wall_s: float
    decide_calls: int


def run_one(workload: str, variant: Variant) -> Row:
    cluster = parse_cluster(CLUSTER)
    apps = load_apps(DATA / "apps")
    jobs = load_pollux_workload(
        DATA / "workloads" / f"{workload}.csv",
        apps,
        gpus_per_node=cluster.gpus_per_node,
        elastic=variant.elastic_range,
    )
    config = SimConfig(
        variant.policy,
        cluster,
        preemption_cost_s=RESTART_COST_S,
        start_cost_s=RESTART_COST_S,
        resize_cost_s=variant.resize_cost_s,
        shrink_cost_s=variant.shrink_cost_s,
        scaling=PolluxScaling(apps, cluster.gpus_per_node, batch=variant.batch),
    )
    started = time.perf_counter()
    result = simulate(jobs, config)
    wall = time.perf_counter() - started
    return Row(
        workload,
        variant.label,
        variant.note,
        variant.batch,
        variant.resize_cost_s,
        variant.shrink_cost_s,
        summarize(result),
        wall,
        result.decide_calls,
    )


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _baseline(rows: list[Row]) -> dict[str, float]:
    return {r.workload: r.metrics.avg_jct for r in rows if r.variant == BASELINE}


def print_table(rows: list[Row], variants: tuple[Variant, ...]) -> None:
    base = _baseline(rows)
    header = (
        "workload",
        "policy",
        "avg JCT",
        "vs las",
        "Tiresias",
        "Pollux",
        "Pollux/Tir.",
        "median",
        "p99",
        "util",
        "preempt",
        "resizes",
        "/job-h",
        "resizing",
        "wall s",
    )
    lines = [header]
    for r in rows:
        m = r.metrics
        ref = PUBLISHED[r.workload]
        ratio = m.avg_jct / base[r.workload] if r.workload in base else None
        lines.append(
            (
                r.workload,
                r.variant,
                _fmt(m.avg_jct),
                _fmt(ratio, 3),
                _fmt(ref["tiresias"]),
                _fmt(ref["pollux"]),
                _fmt(ref["pollux"] / ref["tiresias"], 3),
                _fmt(m.median_jct),
                _fmt(m.p99_jct),
                f"{m.utilization:.1%}",
                str(m.preemptions),
                str(m.resizes),
                f"{m.resizes_per_job_hour:.2f}",
                f"{m.resize_gpu_share:.2%}",
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
    for variant in variants:
        print(f"  {variant.label}: {variant.note}")
    print("  /job-h: resizes per hour jobs ran; resizing: share of held GPU-time stalled in one")


def summary(rows: list[Row], variants: tuple[Variant, ...] = VARIANTS) -> list[str]:
    """Ratios across the workloads run, per elastic variant, beside the published ones."""
    base = _baseline(rows)
    done = sorted(base)
    if not done:
        return []
    published = sum(PUBLISHED[w]["pollux"] for w in done) / sum(
        PUBLISHED[w]["tiresias"] for w in done
    )
    published_each = [PUBLISHED[w]["pollux"] / PUBLISHED[w]["tiresias"] for w in done]
    ours_static = sum(base[w] for w in done) / sum(PUBLISHED[w]["tiresias"] for w in done)
    out = [
        f"workloads: {', '.join(done)} on {CLUSTER}",
        f"published Pollux/Tiresias: {published:.3f} (ratio of average JCTs; per workload "
        f"{', '.join(f'{x:.2f}' for x in published_each)}; all eight workloads "
        f"{PUBLISHED_RATIO_ALL:.2f})",
        f"our static las / published Tiresias: {ours_static:.3f} (the replay's fidelity)",
    ]
    # The best static row that trains the trace's own batches (batch adaptation would
    # flatter every other row's comparison).
    best_static = min(
        (v.label for v in VARIANTS if v.policy.elasticity == "none" and v.batch == "global"),
        key=lambda label: sum(r.metrics.avg_jct for r in rows if r.variant == label),
    )
    best = {r.workload: r.metrics.avg_jct for r in rows if r.variant == best_static}
    # Static rows of the batch-adapting modes, by mode: what batch adaptation alone does.
    static_of = {
        v.batch: v.label
        for v in VARIANTS
        if v.policy.elasticity == "none" and v.batch not in ("global", "local")
    }
    for variant in variants:
        if variant.label == BASELINE:
            continue
        mine = {r.workload: r.metrics.avg_jct for r in rows if r.variant == variant.label}
        if set(mine) != set(done):
            continue
        ratio = sum(mine.values()) / sum(base[w] for w in done)
        each = ", ".join(f"{mine[w] / base[w]:.2f}" for w in done)
        verdict = "met" if ratio <= PUBLISHED_RATIO_ALL else "MISSED"
        mark = " (primary)" if variant.label == PRIMARY else ""
        against_best = ""
        if variant.policy.elasticity != "none" and best_static != BASELINE:
            against_best = f"; / {best_static}: {sum(mine.values()) / sum(best.values()):.3f}"
        same_batch = static_of.get(variant.batch)
        if variant.policy.elasticity != "none" and same_batch is not None:
            theirs = {r.workload: r.metrics.avg_jct for r in rows if r.variant == same_batch}
            if set(theirs) == set(done):
                ratio_same = sum(mine.values()) / sum(theirs.values())
                against_best += f"; / {same_batch}: {ratio_same:.3f}"
        out.append(
            f"{variant.label}{mark} / static las: {ratio:.3f} (per workload {each}); "
            f"target <= {PUBLISHED_RATIO_ALL:.2f}: {verdict}{against_best}"
        )
    return out


def write_results(rows: list[Row], notes: list[str]) -> tuple[Path, Path]:
    base = _baseline(rows)
    records = [
        {
            "workload": r.workload,
            "policy": r.variant,
            "note": r.note,
            "batch": r.batch,
            "resize_cost_s": r.resize_cost_s,
            "shrink_cost_s": r.resize_cost_s if r.shrink_cost_s is None else r.shrink_cost_s,
            "ratio_vs_static_las": (
                r.metrics.avg_jct / base[r.workload] if r.workload in base else None
            ),
            "published_tiresias_avg_jct": PUBLISHED[r.workload]["tiresias"],
            "published_pollux_avg_jct": PUBLISHED[r.workload]["pollux"],
            "wall_s": round(r.wall_s, 2),
            "decide_calls": r.decide_calls,
            **r.metrics.as_json(),
        }
        for r in rows
    ]
    payload = {
        "cluster": CLUSTER,
        "preemption_cost_s": RESTART_COST_S,
        "start_cost_s": RESTART_COST_S,
        "summary": notes,
    }
    return record("pollux", payload, records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=WORKLOADS, action="append")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--payback",
        type=float,
        nargs="+",
        default=(),
        metavar="K",
        help="also run the primary row with these payback factors (Policy.elastic_payback)",
    )
    args = parser.parse_args(argv)
    if not (DATA / "apps").is_dir():
        print(f"no Pollux data at {DATA}", file=sys.stderr)
        return 2
    workloads = args.only or list(WORKLOADS)
    variants = (*VARIANTS, *(payback_variant(k) for k in args.payback))
    jobs = [(w, v) for w in workloads for v in variants]
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        rows = list(pool.map(run_one, [w for w, _ in jobs], [v for _, v in jobs]))
    print_table(rows, variants)
    notes = summary(rows, variants)
    for note in notes:
        print(note)
    json_path, csv_path = write_results(rows, notes)
    print(f"results: {json_path.relative_to(REPO)}, {csv_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
