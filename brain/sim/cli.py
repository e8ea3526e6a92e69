"""`alnair sim`: replay a trace through the brain's policy and report what it measured.

Glue only: argument parsing, a progress bar on stderr, the table or JSON on stdout.
The CLI wires it with `add_arguments(parser)` and `run(args)`; `python -m brain.sim`
runs it standalone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from brain.core import (
    ORDERINGS,
    PLACEMENTS,
    PREEMPTIONS,
    Policy,
    QueueQuota,
    ServiceDistribution,
)
from brain.core.decide import DEFAULT_POLICY, InvalidPolicy, UnknownPlugin
from brain.core.elastic import ELASTICITIES
from brain.core.model import gpus_said
from brain.core.sharing import SHARING_PLUGINS
from brain.queues import QueueConfigError, checked, load_queues, parse_quota
from brain.queues import describe as describe_queues
from brain.sim.engine import Scaling, SimConfig, SimResult, check_trace_fits, simulate
from brain.sim.pollux import (
    BATCH_SCALINGS,
    PolluxScaling,
    default_apps_dir,
    is_pollux_workload,
    load_apps,
    load_pollux_workload,
)
from brain.sim.report import PlotUnavailable, format_table, plot, preemption_causes, summarize
from brain.sim.sharing import check_types, load_nodes, load_tasks, mix_of, replay
from brain.sim.trace import (
    ClusterSpec,
    TraceError,
    TraceJob,
    csv_rows,
    load_trace,
    parse_cluster,
    trace_number,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        help="Tiresias-format CSV (job_id,num_gpu,submit_time,duration,...), or a Pollux "
        "workload (name,time,application,num_replicas,batch_size: elastic jobs)",
    )
    parser.add_argument(
        "--cluster", metavar="NODESxGPUS", help="cluster shape, e.g. 12x4 (with --trace)"
    )
    parser.add_argument(
        "--policy",
        default="las",
        metavar="ORDER[+ELASTICITY]",
        help=f"queue order ({', '.join(sorted(ORDERINGS))}), optionally with an elasticity "
        f"stage ({', '.join(e for e in sorted(ELASTICITIES) if e != 'none')}), "
        "e.g. las+marginal-gain (default: las)",
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
    parser.add_argument(
        "--fixed-distribution",
        action="store_true",
        help="with --service-prior: the samples are the whole Gittins distribution and "
        "finished jobs teach it nothing (as Tiresias' dlas-gpu-gittins reads "
        "yarn-gput1000.csv); default: learned online on top of the prior",
    )
    parser.add_argument(
        "--progress-error",
        type=float,
        default=0.0,
        metavar="E",
        help="each job's believed total work is off by a factor in [1/(1+E), 1+E], fixed "
        "per job id (what `progress` reads; default 0: exact)",
    )
    parser.add_argument(
        "--queues",
        type=Path,
        default=None,
        metavar="FILE",
        help="queue quotas, the brain's YAML format (name, guaranteed_gpus, class); "
        "a trace's `queue` column says which queue each job is in",
    )
    parser.add_argument(
        "--quota",
        action="append",
        default=[],
        metavar="NAME=GPUS[:build|train]",
        help="a queue's quota (repeatable; with --queues, adds to the file's)",
    )
    shared = parser.add_argument_group(
        "shared, typed GPUs (Alibaba's GPU-sharing trace format, instead of --trace)"
    )
    shared.add_argument(
        "--nodes",
        type=Path,
        metavar="CSV",
        help="node list (sn,cpu_milli,memory_mib,gpu,model), e.g. openb_node_list_gpu_node.csv",
    )
    shared.add_argument(
        "--tasks",
        type=Path,
        metavar="CSV",
        help="task list (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...,"
        "creation_time,deletion_time]), e.g. openb_pod_list_default.csv",
    )
    shared.add_argument(
        "--share-placement",
        default="fgd",
        choices=sorted(SHARING_PLUGINS),
        help="placement plugin for shared GPUs (default: fgd)",
    )
    shared.add_argument(
        "--seed", type=int, default=0, help="seed of the random plugin (default: 0)"
    )
    elastic = parser.add_argument_group("elastic jobs (Pollux workloads)")
    elastic.add_argument(
        "--resize-cost",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds an elastic job makes no progress after a resize (default: 0)",
    )
    elastic.add_argument(
        "--shrink-cost",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a shrink's stall, when not --resize-cost's (Horovod elastic: a shrink is "
        "faster than a grow, which starts workers)",
    )
    elastic.add_argument(
        "--start-cost",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds a job makes no progress when it first starts (default: 0)",
    )
    elastic.add_argument(
        "--elastic-one-node",
        action="store_true",
        help="keep each elastic job on one node (the live brain's --elastic-one-node; "
        "default: may span)",
    )
    elastic.add_argument(
        "--elastic-min-gain",
        type=float,
        default=DEFAULT_POLICY.elastic_min_gain,
        metavar="SHARE",
        help="grow while the next GPU adds at least this share of an average GPU's "
        f"throughput (default: {DEFAULT_POLICY.elastic_min_gain})",
    )
    elastic.add_argument(
        "--elastic-resize-interval",
        type=float,
        default=DEFAULT_POLICY.elastic_resize_interval_s,
        metavar="SECONDS",
        help="resize running elastic jobs only at rounds this far apart, as the Pollux "
        "artifact does every 60 s (default: 0, at every event)",
    )
    elastic.add_argument(
        "--elastic-payback",
        type=float,
        default=DEFAULT_POLICY.elastic_payback,
        metavar="K",
        help="move a running elastic job again only after it ran K times as long as its "
        f"last resize took (default: {DEFAULT_POLICY.elastic_payback:g})",
    )
    elastic.add_argument(
        "--elastic-reprobe",
        type=float,
        default=DEFAULT_POLICY.elastic_reprobe_s,
        metavar="SECONDS",
        help="try a size a job left for lack of gain again after this long "
        f"(default: {DEFAULT_POLICY.elastic_reprobe_s:g}; 0: never)",
    )
    elastic.add_argument(
        "--apps",
        type=Path,
        default=None,
        metavar="DIR",
        help="Pollux application data (default: ../apps beside the workload's directory)",
    )
    elastic.add_argument(
        "--batch",
        choices=BATCH_SCALINGS,
        default="global",
        help="what a resize does to the batch: keep the global batch (default); keep "
        "each worker's batch (Horovod elastic's usual setup: the global batch follows "
        "the world size); adaptive: re-choose it for the best goodput on each "
        "allocation (Pollux/AdaptDL); adaptive-epoch: and at every epoch",
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
    samples = []
    for line, row in csv_rows(path, ("duration",)):
        raw = row["duration"]
        try:
            value = float(raw)
        except ValueError:
            raise TraceError(
                f"{raw!r} is not a number", path=str(path), line=line, column="duration"
            ) from None
        samples.append(trace_number(value, raw, path=str(path), line=line, column="duration"))
    if not samples:
        raise TraceError("no durations: a prior needs one at least", path=str(path))
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


def queues_from_args(args: argparse.Namespace) -> tuple[QueueQuota, ...]:
    from_file = load_queues(args.queues) if args.queues is not None else ()
    return checked((*from_file, *(parse_quota(text) for text in args.quota)), where="--quota")


def policy_from_args(args: argparse.Namespace) -> Policy:
    order, _, elasticity = args.policy.partition("+")
    return Policy(
        order=order,
        placement=args.placement,
        preemption=args.preemption,
        las_thresholds_gpu_s=_thresholds(args.las_thresholds),
        gittins_quantum_gpu_s=args.gittins_quantum,
        starvation_guard_s=args.starvation_guard,
        relax_locality_after_s=args.relax_locality_after,
        elasticity=elasticity or "none",
        elastic_may_spread=not args.elastic_one_node,
        elastic_min_gain=args.elastic_min_gain,
        elastic_resize_interval_s=args.elastic_resize_interval,
        elastic_payback=args.elastic_payback,
        elastic_reprobe_s=args.elastic_reprobe,
    ).validate()


def _columns(path: Path) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            return next(csv.reader(handle), [])
    except OSError as err:
        raise TraceError(f"cannot open: {err.strerror}", path=str(path)) from None
    except UnicodeDecodeError:
        raise TraceError("not UTF-8 text; save it as UTF-8 CSV", path=str(path)) from None


def load_workload(
    args: argparse.Namespace, cluster: ClusterSpec
) -> tuple[tuple[TraceJob, ...], Scaling | None]:
    """The trace's jobs, and the speed model a Pollux workload brings (detected by its
    columns; its jobs are elastic)."""
    if not is_pollux_workload(_columns(args.trace)):
        return load_trace(args.trace), None
    apps = load_apps(args.apps or default_apps_dir(args.trace))
    trace = load_pollux_workload(args.trace, apps, gpus_per_node=cluster.gpus_per_node)
    return trace, PolluxScaling(apps, cluster.gpus_per_node, batch=args.batch)


def _check_costs(args: argparse.Namespace) -> None:
    if args.trace is None or args.cluster is None:
        raise TraceError("--trace and --cluster are required (or --nodes and --tasks)")
    for flag in ("preemption_cost", "resize_cost", "shrink_cost", "start_cost"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < math.inf:
            raise TraceError(
                f"--{flag.replace('_', '-')} must be a number of seconds >= 0, not {value:g}"
            )


def run_shared(args: argparse.Namespace) -> int:
    """Replay a node list and a task list through a sharing placement plugin."""
    try:
        if args.nodes is None or args.tasks is None:
            raise TraceError("--nodes and --tasks go together")
        if args.trace is not None:
            raise TraceError("--trace replays whole-GPU jobs; give it or --nodes/--tasks")
        nodes = load_nodes(args.nodes)
        tasks = load_tasks(args.tasks)
        check_types(nodes, tasks, str(args.tasks))
    except TraceError as err:
        print(f"alnair sim: {err}", file=sys.stderr)
        return 2
    plugin = SHARING_PLUGINS[args.share_placement](mix_of(tasks), args.seed)
    result = replay(nodes, tasks, plugin)
    timed = all(t.created_s is not None for t in tasks)
    report = {
        "tasks": result.tasks,
        "placed": result.placed,
        "unschedulable": result.unschedulable,
        "unschedulable_by_kind": result.failed_by_kind,
        "gpu_capacity": result.gpu_capacity,
        "peak_allocated_gpus": round(result.peak_allocated_gpus, 3),
        "unallocated_gpus_at_first_failure": result.unallocated_at_first_failure,
        "timed": timed,
    }
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    order = "creation/deletion times" if timed else "file order, no departures (no times)"
    print(
        f"tasks {args.tasks} ({result.tasks}) on {args.nodes} ({len(nodes)} nodes, "
        f"{result.gpu_capacity:,.0f} GPUs), placement {args.share_placement}, {order}"
    )
    print(f"  placed {result.placed:,}, unschedulable {result.unschedulable:,}", end="")
    kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(result.failed_by_kind.items()))
    print(f" ({kinds})" if kinds else "")
    print(
        f"  peak allocated {result.peak_allocated_gpus:,.1f} GPUs "
        f"({result.peak_allocated_gpus / result.gpu_capacity:.1%})"
    )
    if result.unallocated_at_first_failure is not None:
        print(
            f"  unallocated when the first task could not be placed: "
            f"{result.unallocated_at_first_failure:,.1f} GPUs"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    """A whole-GPU job trace (`--trace`) or a shared-GPU node and task list."""
    if args.nodes is not None or args.tasks is not None:
        return run_shared(args)
    return run_jobs(args)


def run_jobs(args: argparse.Namespace) -> int:
    try:
        _check_costs(args)
        policy = policy_from_args(args)
        cluster = parse_cluster(args.cluster, nodes_per_switch=args.nodes_per_switch)
        trace, scaling = load_workload(args, cluster)
        queues = queues_from_args(args)
        config = SimConfig(
            policy=policy,
            cluster=cluster,
            preemption_cost_s=args.preemption_cost,
            queues=queues,
            scaling=scaling,
            resize_cost_s=args.resize_cost,
            shrink_cost_s=args.shrink_cost,
            start_cost_s=args.start_cost,
        )
        if not 0 <= args.progress_error < math.inf:
            raise TraceError(f"--progress-error must be a number >= 0, not {args.progress_error:g}")
        config = replace(config, progress_error=args.progress_error)
        if args.service_prior is not None:
            config = replace(config, service_prior=load_prior(args.service_prior))
        if args.fixed_distribution:
            if args.service_prior is None:
                raise TraceError("--fixed-distribution needs --service-prior")
            config = replace(config, learn_service=False)
        check_trace_fits(trace, policy)
    except (TraceError, InvalidPolicy, UnknownPlugin, QueueConfigError) as err:
        # A KeyError (UnknownPlugin) would print its message quoted.
        print(f"alnair sim: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    show_progress = not args.no_progress and sys.stderr.isatty()
    bar = ProgressBar(sys.stderr, f"{args.policy} on {cluster.describe()}")
    result = simulate(trace, config, on_progress=bar if show_progress else None)
    _report(args, config, result)
    if args.plot is not None:
        try:
            paths = plot(result, args.plot, title=f"{args.policy} on {cluster.describe()}")
        except PlotUnavailable as err:
            print(f"alnair sim: {err}", file=sys.stderr)
            return 2
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    if result.unfinished:
        print(f"alnair sim: {never_finished(trace, result)}", file=sys.stderr)
        return 1
    return 0


def _report(args: argparse.Namespace, config: SimConfig, result: SimResult) -> None:
    metrics = summarize(result)
    if args.json:
        print(json.dumps(metrics.as_json(), sort_keys=True))
        return
    print(
        f"trace {args.trace} ({metrics.jobs} jobs) on {config.cluster.describe()} GPUs, "
        f"{config.policy.describe()}, preemption cost {args.preemption_cost:g} s"
    )
    if config.queues:
        print(f"queues: {describe_queues(config.queues)}")
    print(format_table([(args.policy, metrics)]))
    for kind, count in preemption_causes(result):
        print(f"  preemptions, {kind}: {count}")
    if metrics.resizes:
        shrink = "" if args.shrink_cost is None else f", shrink {args.shrink_cost:g} s"
        print(f"  resizes: {metrics.resizes} (resize cost {args.resize_cost:g} s{shrink})")


def never_finished(trace: Sequence[TraceJob], result: SimResult, *, named: int = 5) -> str:
    """Which jobs never finished, and why where the trace says (a job larger than the
    cluster); the first `named` of them."""
    gpus = {job.job_id: job.gpus for job in trace}
    capacity = result.capacity_gpus

    def say(job_id: str) -> str:
        asked = gpus.get(job_id)
        if asked is not None and asked > capacity:
            return f"{job_id} (asks {gpus_said(asked)}; the cluster has {capacity})"
        return job_id

    unfinished = result.unfinished
    shown = ", ".join(say(job_id) for job_id in unfinished[:named])
    more = f" and {len(unfinished) - named} more" if len(unfinished) > named else ""
    jobs = "job" if len(unfinished) == 1 else "jobs"
    return f"{len(unfinished)} {jobs} never finished: {shown}{more}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alnair sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
