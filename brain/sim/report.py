"""What a replay measured: JCT statistics, queueing, makespan, utilisation, preemptions.

Definitions (seconds): JCT = finish - submission; queueing delay = time a job spent
pending, over all its waits (first wait and every wait after a preemption); makespan =
last finish - first submission; utilisation = GPU-seconds held by jobs / (cluster
GPUs x makespan). Percentiles interpolate linearly between order statistics (numpy's
default). Only finished jobs count; `unfinished` says how many never could.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from brain.sim.engine import SimResult
from schemas.errors import AlnairError


class PlotUnavailable(AlnairError, RuntimeError):
    """`--plot` needs matplotlib, which is an optional dependency."""


@dataclass(frozen=True, slots=True)
class Metrics:
    avg_jct: float
    median_jct: float
    p95_jct: float
    p99_jct: float
    avg_queue: float
    makespan: float
    utilization: float
    preemptions: int
    jobs: int
    unfinished: int
    # Resizes of elastic jobs (0 without any); per hour that jobs ran; and the share of
    # the GPU-seconds jobs held that they held standing still in a resize.
    resizes: int = 0
    resizes_per_job_hour: float = 0.0
    resize_gpu_share: float = 0.0

    def as_json(self) -> dict[str, float | int]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    if not sorted_values:
        return math.nan
    position = fraction * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    weight = position - low
    return sorted_values[low] * (1 - weight) + sorted_values[high] * weight


def summarize(result: SimResult) -> Metrics:
    finished = [o for o in result.outcomes if o.finished_at is not None]
    jcts = sorted(o.finished_at - o.submitted_at for o in finished if o.finished_at is not None)
    count = len(jcts)
    if finished:
        first_submit = min(o.submitted_at for o in result.outcomes)
        last_finish = max(o.finished_at for o in finished if o.finished_at is not None)
        makespan = last_finish - first_submit
    else:
        makespan = 0.0
    held = sum(o.gpu_seconds for o in result.outcomes)
    capacity = result.capacity_gpus * makespan
    resizes = sum(o.resizes for o in result.outcomes)
    ran_h = sum(o.executed_s for o in result.outcomes) / 3600.0
    return Metrics(
        avg_jct=sum(jcts) / count if count else math.nan,
        median_jct=percentile(jcts, 0.5),
        p95_jct=percentile(jcts, 0.95),
        p99_jct=percentile(jcts, 0.99),
        avg_queue=sum(o.queued_s for o in finished) / count if count else math.nan,
        makespan=makespan,
        utilization=held / capacity if capacity > 0 else 0.0,
        preemptions=len(result.preemptions),
        jobs=len(result.outcomes),
        unfinished=len(result.outcomes) - count,
        resizes=resizes,
        resizes_per_job_hour=resizes / ran_h if ran_h > 0 else 0.0,
        resize_gpu_share=sum(o.resize_gpu_seconds for o in result.outcomes) / held
        if held > 0
        else 0.0,
    )


def preemption_causes(result: SimResult) -> list[tuple[str, int]]:
    """Preemptions counted by the kind of their cause ("Outranked", "QuotaReclaim")."""
    kinds = Counter(record.kind for record in result.preemptions)
    return sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.1f}"


def format_table(rows: Sequence[tuple[str, Metrics]]) -> str:
    """A plain-text table, one row per (label, metrics)."""
    header = (
        "policy",
        "avg JCT",
        "median",
        "p95",
        "p99",
        "avg queue",
        "makespan",
        "util",
        "preempt",
        "unfinished",
    )
    lines = [header]
    for label, m in rows:
        lines.append(
            (
                label,
                _seconds(m.avg_jct),
                _seconds(m.median_jct),
                _seconds(m.p95_jct),
                _seconds(m.p99_jct),
                _seconds(m.avg_queue),
                _seconds(m.makespan),
                f"{m.utilization:.1%}",
                str(m.preemptions),
                str(m.unfinished),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells))
    return "\n".join(out)


def plot(result: SimResult, directory: Path, *, title: str) -> list[Path]:
    """Draw the JCT CDF and GPU utilisation over time to PNG files in `directory`."""
    # Imported by name: matplotlib is optional and has no stubs in the type check.
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib; install it with `pip install matplotlib`"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    jcts = sorted(o.jct for o in result.outcomes if o.jct is not None)
    cdf_path = directory / "jct_cdf.png"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    if jcts:
        axes.plot(jcts, [(i + 1) / len(jcts) for i in range(len(jcts))])
        axes.set_xscale("log")
    axes.set_xlabel("job completion time (s)")
    axes.set_ylabel("fraction of jobs")
    axes.set_title(f"JCT CDF — {title}")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(cdf_path, dpi=120)
    plt.close(figure)

    util_path = directory / "utilization.png"
    figure, axes = plt.subplots(figsize=(7, 4.5))
    points = list(result.busy_timeline)
    if points:
        times = [t for t, _ in points]
        share = [busy / result.capacity_gpus for _, busy in points]
        axes.step(times, share, where="post")
    axes.set_xlabel("simulated time (s)")
    axes.set_ylabel("GPUs busy (fraction)")
    axes.set_ylim(0, 1.05)
    axes.set_title(f"GPU utilisation — {title}")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(util_path, dpi=120)
    plt.close(figure)
    return [cdf_path, util_path]
