"""`alnair sim`: replay a trace through the brain's policy and report what it measured.

Glue only: argument parsing, a progress bar on stderr, the table or JSON on stdout.
The CLI wires it with `add_arguments(parser)` and `run(args)`; `python -m brain.sim`
runs it standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from brain.core import ORDERINGS, PLACEMENTS, PREEMPTIONS, Policy, ServiceDistribution
from brain.core.decide import InvalidPolicy
from brain.sim.engine import SimConfig, simulate
from brain.sim.report import PlotUnavailable, format_table, plot, preemption_causes, summarize
from brain.sim.trace import TraceError, load_trace, parse_cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        required=True,
        type=Path,
        help="Tiresias-format CSV (job_id,num_gpu,submit_time,duration,...)",
    )
    parser.add_argument(
        "--cluster", required=True, metavar="NODESxGPUS", help="cluster shape, e.g. 12x4"
    )
    parser.add_argument(
        "--policy", default="las", choices=sorted(ORDERINGS), help="queue order (default: las)"
    )
    parser.add_argument("--placement", default="consolidate", choices=sorted(PLACEMENTS))
    parser.add_argument(
        "--preemption",
        default="by-rank",
        choices=sorted(PREEMPTIONS),
        help="which running jobs may lose their GPUs (default: by-rank)",
    )
    parser.add_argument(
        "--preemption-cost",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="work a preempted job loses when it resumes (default: 0, "
        "as Tiresias' simulator assumes)",
    )
    parser.add_argument(
        "--las-thresholds",
        default="3250,7200",
        metavar="GPU_S,...",
        help="LAS band thresholds in GPU-seconds (default: 3250,7200)",
    )
    parser.add_argument("--gittins-quantum", type=float, default=3250.0, metavar="GPU_S")
    parser.add_argument(
        "--starvation-guard",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a job pending this long ranks first (default: off)",
    )
    parser.add_argument(
        "--relax-locality-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="Philly back-off before a job may spread over switches",
    )
    parser.add_argument("--nodes-per-switch", type=int, default=None)
    parser.add_argument(
        "--service-prior",
        type=Path,
        default=None,
        metavar="CSV",
        help="samples (a 'duration' column, GPU-seconds) to seed the Gittins "
        "distribution, e.g. Tiresias' yarn-gput1000.csv",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="draw the JCT CDF and utilisation over time (needs matplotlib)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise TraceError(f"--las-thresholds {text!r} is not a comma-separated list") from None


def load_prior(path: Path) -> ServiceDistribution:
    """Samples from a CSV's `duration` column, each with weight 1."""
    import csv

    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            if "duration" not in (reader.fieldnames or []):
                raise TraceError("no 'duration' column", path=str(path), line=1)
            samples = []
            for row in reader:
                try:
                    samples.append(float(row["duration"]))
                except (TypeError, ValueError):
                    raise TraceError(
                        "not a number", path=str(path), line=reader.line_num, column="duration"
                    ) from None
    except OSError as err:
        raise TraceError(f"cannot open: {err.strerror}", path=str(path)) from None
    return ServiceDistribution.from_samples(samples)


class ProgressBar:
    """A one-line bar on a terminal, redrawn when a whole percent more is done."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self._stream = stream
        self._label = label
        self._shown = -1

    def __call__(self, done: int, total: int) -> None:
        percent = done * 100 // max(total, 1)
        if percent == self._shown:
            return
        self._shown = percent
        filled = percent * 30 // 100
        self._stream.write(
            f"\r{self._label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} jobs"
        )
        if done >= total:
            self._stream.write("\n")
        self._stream.flush()


def policy_from_args(args: argparse.Namespace) -> Policy:
    return Policy(
        order=args.policy,
        placement=args.placement,
        preemption=args.preemption,
        las_thresholds_gpu_s=_thresholds(args.las_thresholds),
        gittins_quantum_gpu_s=args.gittins_quantum,
        starvation_guard_s=args.starvation_guard,
        relax_locality_after_s=args.relax_locality_after,
    ).validate()


def run(args: argparse.Namespace) -> int:
    try:
        policy = policy_from_args(args)
        cluster = parse_cluster(args.cluster, nodes_per_switch=args.nodes_per_switch)
        trace = load_trace(args.trace)
        config = SimConfig(policy=policy, cluster=cluster, preemption_cost_s=args.preemption_cost)
        if args.service_prior is not None:
            config = SimConfig(
                policy=policy,
                cluster=cluster,
                preemption_cost_s=args.preemption_cost,
                service_prior=load_prior(args.service_prior),
            )
    except (TraceError, InvalidPolicy) as err:
        print(f"alnair sim: {err}", file=sys.stderr)
        return 2
    show_progress = not args.no_progress and sys.stderr.isatty()
    bar = ProgressBar(sys.stderr, f"{policy.order} on {cluster.describe()}")
    result = simulate(trace, config, on_progress=bar if show_progress else None)
    metrics = summarize(result)
    if args.json:
        print(json.dumps(metrics.as_json(), sort_keys=True))
    else:
        print(
            f"trace {args.trace} ({metrics.jobs} jobs) on {cluster.describe()} GPUs, "
            f"{policy.describe()}, preemption cost {args.preemption_cost:g} s"
        )
        print(format_table([(policy.order, metrics)]))
        for kind, count in preemption_causes(result):
            print(f"  preemptions, {kind}: {count}")
    if args.plot is not None:
        try:
            paths = plot(result, args.plot, title=f"{policy.order} on {cluster.describe()}")
        except PlotUnavailable as err:
            print(f"alnair sim: {err}", file=sys.stderr)
            return 2
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    return 0 if metrics.unfinished == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alnair sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
