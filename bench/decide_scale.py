"""How long one `decide()` takes on a large cluster: times and action counts, not a test.

    .venv/bin/python bench/decide_scale.py [--size 1k 5k 20k] [--order fifo las ...]
        [--repeat 3] [--timeout 120] [--profile las@1k] [--stages gittins@5k]

Builds seeded synthetic snapshots: nodes of 8 GPUs, 32 nodes to a switch; running jobs
of 1, 2, 4, 8 and 16 GPUs packed onto them (the cluster nearly full), with attained
service spread over every LAS band; pending jobs, most of them new (no service: they
outrank the long-running jobs under LAS and Gittins, which therefore preempt); three
configured queues (two `train` with guarantees, one `build`) beside the unconfigured
default. Each job's recorded LAS band matches its service, as the shell keeps it, so a
cycle changes no band. Times `decide()` as the brain's pass calls it, with the cyclic
collector paused until its decisions are freed (the median of `--repeat` runs, wall clock
and CPU time of the process: on a shared machine the CPU time is the steadier; a case whose
first run passes `--timeout` seconds is killed and reported as such) and, by turns with it,
`decide(..., waits=False)` (CPU time: a pass that explains no one, as the simulator's every
pass and most of the live brain's), counts its placements, preemptions and waits, prints a
table and writes bench/results/decide-scale-<stamp>.json.

The raw baseline, timed by turns with them on the same snapshot (CPU time): `bare_decide`,
the same kind of cycle written as plainly as Python allows (rank, fill the GPUs by count,
preempt the running jobs past them, place the rest best-fit), without what Alnair decides
beyond that (quotas, holds, the starvation guard, locality, elasticity, shares, reasons).
`cpu / bare` is how many times its cost a `decide` takes: the figure to compare from run
to run on a shared machine, where both move with the load.

Sizes: 1k = 1,000 nodes, 4,000 running, 10,000 pending (the issue's case); 5k and 20k
scale all three by 5 and 20.

`--profile ORDER@SIZE` runs that case once under cProfile and prints the top functions
by cumulative and by own time instead.

`--stages ORDER@SIZE` times instead each stage of `decide` in that case (the order's
ranks, their sort, the standings, the selection walk, placing and releasing, settling the
victims, ...): CPU time around each of the module's stage functions, the median of
`--repeat` decides, without the profiler's cost per call; what is left is the rest (the
ledger, assembling the actions). Results: bench/results/decide-stages-<stamp>.json.

`--instructions ORDER@SIZE ...` counts instead what one decide executes, with valgrind's
cachegrind: the instructions of a process that builds the snapshot and decides once (as
the pass calls it, the decisions freed before the collector runs again), less those of one
that only builds it (`PYTHONHASHSEED=0`). The count does not move with what
else the machine runs, as the times do; `--before DIR` counts the same cases in another
checkout in the same run and prints the ratio. The same code counts a few per cent apart
from one directory to another (the paths are strings the interpreter hashes and stores):
read a ratio within 5 % as no change. Each 5k case takes a few minutes. Results:
bench/results/decide-instructions-<stamp>.json.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import importlib
import multiprocessing
import os
import pstats
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from brain.core import (  # noqa: E402
    ClusterSnapshot,
    Grant,
    JobView,
    NodeView,
    Policy,
    QueueQuota,
    decide,
)
from brain.core.collector import collector_paused  # noqa: E402

GPUS_PER_NODE: Final = 8
NODES_PER_SWITCH: Final = 32
NOW: Final = 1_000_000.0
# Job sizes and their weights: about 2 GPUs a job on average, so 4 running jobs per
# node nearly fill the cluster.
SIZES: Final = (1, 2, 4, 8, 16)
SIZE_WEIGHTS: Final = (0.65, 0.2, 0.09, 0.05, 0.01)
QUEUES: Final = (
    QueueQuota("research", 800, "train"),
    QueueQuota("prod", 400, "train"),
    QueueQuota("interactive", 100, "build"),
)
DEFAULT_LAS_THRESHOLDS: Final = Policy().las_thresholds_gpu_s
QUEUE_NAMES: Final = ("default", "default", "research", "prod", "interactive")


@dataclass(frozen=True)
class Size:
    label: str
    nodes: int
    running: int
    pending: int


SIZES_BY_LABEL: Final = {
    "1k": Size("1k", 1_000, 4_000, 10_000),
    "5k": Size("5k", 5_000, 20_000, 50_000),
    "20k": Size("20k", 20_000, 80_000, 200_000),
}
ORDERS: Final = ("fifo", "priority", "las", "gittins")


def _service(rng: random.Random, gpus: int) -> float:
    """Attained GPU-seconds spread over the three default LAS bands (3,250 and 7,200)."""
    band = rng.random()
    if band < 0.25:
        return rng.uniform(0.0, 3_000.0)
    if band < 0.5:
        return rng.uniform(3_300.0, 7_000.0)
    return rng.uniform(7_300.0, 100_000.0) * max(1, gpus // 4)


def _level(service: float) -> int:
    """The LAS band the shell would have recorded for this service (default bands)."""
    return bisect.bisect_right(DEFAULT_LAS_THRESHOLDS, service)


def _pack(rng: random.Random, nodes: int, count: int) -> list[tuple[int, list[Grant]]]:
    """`count` running jobs' sizes and grants, biggest first onto nodes in turn (a
    16-GPU job takes two whole nodes); stops early when the cluster is full."""
    sizes = sorted(rng.choices(SIZES, SIZE_WEIGHTS, k=count), reverse=True)
    free = [GPUS_PER_NODE] * nodes
    placed: list[tuple[int, list[Grant]]] = []
    cursor = 0
    for size in sizes:
        grants: list[Grant] = []
        left = size
        while left > 0 and cursor < nodes:
            if free[cursor] == 0:
                cursor += 1
                continue
            take = min(left, free[cursor])
            if take < left and size <= GPUS_PER_NODE:
                # A job that fits a node is not split: move on to the next node.
                cursor += 1
                continue
            first = GPUS_PER_NODE - free[cursor]
            grants.append(Grant(f"n{cursor}", tuple(range(first, first + take))))
            free[cursor] -= take
            left -= take
        if left > 0:
            break
        placed.append((size, grants))
    return placed


def build_snapshot(size: Size, seed: int = 18) -> ClusterSnapshot:
    rng = random.Random(seed)
    packed = _pack(rng, size.nodes, size.running)
    used: dict[str, set[int]] = {}
    running: list[JobView] = []
    job_id = 0
    for gpus, grants in packed:
        for g in grants:
            used.setdefault(g.node, set()).update(g.gpus)
        job_id += 1
        started = NOW - rng.uniform(60.0, 50_000.0)
        service = _service(rng, gpus)
        running.append(
            JobView(
                str(job_id),
                gpus,
                submitted_at=started - rng.uniform(0.0, 3_600.0),
                queue=rng.choice(QUEUE_NAMES),
                priority=rng.choice((0, 0, 1, 2)),
                grants=tuple(grants),
                started_at=started,
                attained_gpu_seconds=service,
                service_level=_level(service),
                service_level_since=started,
            )
        )
    nodes = tuple(
        NodeView(
            f"n{i}",
            tuple(range(GPUS_PER_NODE)),
            frozenset(set(range(GPUS_PER_NODE)) - used.get(f"n{i}", set())),
            f"s{i // NODES_PER_SWITCH}",
        )
        for i in range(size.nodes)
    )
    pending: list[JobView] = []
    for _ in range(size.pending):
        job_id += 1
        gpus = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        # Most are new; a tenth were preempted before and carry some service.
        service = _service(rng, gpus) if rng.random() < 0.1 else 0.0
        pending.append(
            JobView(
                str(job_id),
                gpus,
                submitted_at=NOW - rng.uniform(0.0, 7_200.0),
                queue=rng.choice(QUEUE_NAMES),
                priority=rng.choice((0, 1, 2, 3)),
                attained_gpu_seconds=service,
                service_level=_level(service),
            )
        )
    return ClusterSnapshot(nodes, tuple(pending), tuple(running), QUEUES)


@dataclass(frozen=True)
class Result:
    size: str
    order: str
    nodes: int
    running: int
    pending: int
    runs: int
    median_s: float | None
    # CPU seconds of the same runs (median): on a shared machine, the steadier figure.
    median_cpu_s: float | None
    # CPU seconds (median) of `decide(..., waits=False)` on the same snapshot, run by
    # turns with the others: a pass that explains no one, as the simulator's every
    # pass and most of the live brain's (brain/service.py, EXPLAIN_WAITS_EVERY_S).
    median_quiet_cpu_s: float | None
    placements: int
    preemptions: int
    waits: int
    timed_out: bool
    # The raw baseline, by turns with the others: `bare_decide`'s CPU seconds (median),
    # placements and preemptions.
    median_bare_cpu_s: float | None = None
    bare_placements: int = 0
    bare_preemptions: int = 0


def _policy(order: str) -> Policy:
    return Policy(order=order)


def _bare_band_rank(job: JobView) -> tuple[int, float]:
    return (_level(job.attained_gpu_seconds), job.submitted_at)


# The bare scheduler's rank of a job (smaller first), by order, as Alnair's orders rank
# (fifo and priority: running jobs first, so neither preempts among equals), without
# bands kept in the view, indices or labels. Gittins is ranked as LAS (its index is a
# look-up per service; the sort is the work).
_BARE_RANKS: Final = {
    "fifo": lambda j: (not j.grants, j.submitted_at),
    "priority": lambda j: (-j.priority, not j.grants, j.submitted_at),
    "las": _bare_band_rank,
    "gittins": _bare_band_rank,
}


def bare_decide(
    snapshot: ClusterSnapshot, order: str
) -> tuple[list[tuple[str, list[Grant]]], list[str]]:
    """The raw baseline: the same kind of cycle written as plainly as Python allows.
    Every job by rank; the GPUs go to the first that fit by count (fifo: up to the
    first pending job that does not, as Alnair's and Tiresias' fifo); running jobs past
    them are preempted (all at once, their GPUs freed); each pending job within them is
    placed best-fit (the node with the fewest free GPUs that holds it; a gang larger
    than a node takes the emptiest nodes whole). No quotas, holds, starvation guard,
    locality, elasticity, shares or reasons: what `decide` does beyond this is its
    features' cost. Returns (placements, preempted job ids)."""
    jobs = sorted((*snapshot.running, *snapshot.pending), key=_BARE_RANKS[order])
    budget = sum(len(n.gpus) for n in snapshot.nodes)
    to_place: list[JobView] = []
    preempted: list[str] = []
    free = {n.name: sorted(n.free) for n in snapshot.nodes}
    blocking = order == "fifo"
    for job in jobs:
        if job.gpus <= budget:
            budget -= job.gpus
            if not job.grants:
                to_place.append(job)
        elif not job.grants:
            if blocking:
                budget = 0
        else:
            preempted.append(job.job_id)
            for grant in job.grants:
                free[grant.node].extend(grant.gpus)
    # Nodes by free count, each row a set (no tie-break by name: a baseline).
    rows: list[set[str]] = [set() for _ in range(GPUS_PER_NODE + 1)]
    for name, gpus in free.items():
        gpus.sort()
        rows[len(gpus)].add(name)
    placements: list[tuple[str, list[Grant]]] = []
    for job in to_place:
        chosen = _bare_fit(rows, job.gpus)
        if not chosen:
            continue
        grants = []
        for name, take in chosen:
            gpus = free[name]
            rows[len(gpus)].discard(name)
            grants.append(Grant(name, tuple(gpus[:take])))
            del gpus[:take]
            rows[len(gpus)].add(name)
        placements.append((job.job_id, grants))
    return placements, preempted


def _bare_fit(rows: list[set[str]], need: int) -> list[tuple[str, int]]:
    """`bare_decide`'s nodes for a job of `need` GPUs, and how many each gives."""
    if need <= GPUS_PER_NODE:
        for count in range(need, GPUS_PER_NODE + 1):
            if rows[count]:
                return [(next(iter(rows[count])), need)]
        return []
    chosen: list[tuple[str, int]] = []
    for count in range(GPUS_PER_NODE, 0, -1):
        for name in rows[count]:
            chosen.append((name, min(count, need)))
            need -= count
            if need <= 0:
                return chosen
    return []


def _time_case(size: Size, order: str, repeat: int, conn: object) -> None:
    """In a child process: build the snapshot, time `repeat` decides, send the result."""
    snapshot = build_snapshot(size)
    policy = _policy(order)
    times: list[float] = []
    cpu: list[float] = []
    quiet: list[float] = []
    bare: list[float] = []
    counts = (0, 0, 0)
    bare_counts = (0, 0)
    for _ in range(repeat):
        # As the brain's pass calls it: the cyclic collector paused until the decisions
        # are freed (brain/scheduler.py), which is not this decide's work either.
        with collector_paused():
            started, started_cpu = time.perf_counter(), time.process_time()
            decisions = decide(snapshot, NOW, policy)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
            counts = (len(decisions.placements), len(decisions.preemptions), len(decisions.waits))
            del decisions
            started_cpu = time.process_time()
            quiet_decisions = decide(snapshot, NOW, policy, waits=False)
            quiet.append(time.process_time() - started_cpu)
            del quiet_decisions
            started_cpu = time.process_time()
            placed, preempted = bare_decide(snapshot, order)
            bare.append(time.process_time() - started_cpu)
            bare_counts = (len(placed), len(preempted))
            del placed, preempted
    conn.send(  # type: ignore[attr-defined]
        Result(
            size.label,
            order,
            size.nodes,
            len(snapshot.running),
            len(snapshot.pending),
            repeat,
            statistics.median(times),
            statistics.median(cpu),
            statistics.median(quiet),
            *counts,
            False,
            statistics.median(bare),
            *bare_counts,
        )
    )


def run_case(size: Size, order: str, repeat: int, timeout_s: float) -> Result:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_time_case, args=(size, order, repeat, send))
    child.start()
    # Generous: `timeout_s` bounds each decide, plus the time to build the snapshot.
    if receive.poll(timeout_s * repeat + 60.0):
        result: Result = receive.recv()
        child.join()
        return result
    child.kill()
    child.join()
    return Result(
        size.label,
        order,
        size.nodes,
        size.running,
        size.pending,
        0,
        None,
        None,
        None,
        0,
        0,
        0,
        True,
    )


def print_table(results: list[Result], timeout_s: float) -> None:
    header = (
        "size",
        "order",
        "nodes",
        "running",
        "pending",
        "decide ms",
        "cpu ms",
        "no-waits cpu ms",
        "place",
        "preempt",
        "bare cpu ms",
        "bare place",
        "bare preempt",
        "cpu / bare",
    )
    lines = [header]
    for r in results:
        median = f"> {timeout_s * 1000:,.0f}" if r.median_s is None else f"{r.median_s * 1000:,.1f}"
        cpu = "-" if r.median_cpu_s is None else f"{r.median_cpu_s * 1000:,.1f}"
        quiet = "-" if r.median_quiet_cpu_s is None else f"{r.median_quiet_cpu_s * 1000:,.1f}"
        bare = "-" if r.median_bare_cpu_s is None else f"{r.median_bare_cpu_s * 1000:,.1f}"
        ratio = (
            "-"
            if r.median_cpu_s is None or not r.median_bare_cpu_s
            else f"{r.median_cpu_s / r.median_bare_cpu_s:.2f}"
        )
        lines.append(
            (
                r.size,
                r.order,
                f"{r.nodes:,}",
                f"{r.running:,}",
                f"{r.pending:,}",
                median,
                cpu,
                quiet,
                f"{r.placements:,}",
                f"{r.preemptions:,}",
                bare,
                f"{r.bare_placements:,}",
                f"{r.bare_preemptions:,}",
                ratio,
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


def _case(flag: str, case: str) -> tuple[str, Size]:
    """ORDER@SIZE (SIZE 1k when left out), or exit naming what is wrong."""
    order, _, label = case.partition("@")
    size = SIZES_BY_LABEL.get(label or "1k")
    if order not in ORDERS or size is None:
        raise SystemExit(
            f"{flag}: {case!r} is not ORDER@SIZE: ORDER one of {', '.join(ORDERS)};"
            f" SIZE one of {', '.join(SIZES_BY_LABEL)}"
        )
    return order, size


def profile(case: str) -> None:
    order, size = _case("--profile", case)
    snapshot = build_snapshot(size)
    profiler = cProfile.Profile()
    with collector_paused():
        profiler.enable()
        decide(snapshot, NOW, _policy(order))
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(15)


# What `--stages` times: the functions of brain/core/decide.py that a cycle calls once
# each, in the order it calls them, by what they do.
STAGES: Final = (
    ("_retry_stage", "back-offs"),
    ("_avoidance_stage", "nodes to avoid"),
    ("_checked_demands", "demands checked"),
    ("rank_order", "the ranks' sort"),
    ("_selection_order", "standings"),
    ("_select", "selection walk"),
    ("_place_all", "placing and releasing"),
    ("_settle_victims", "settling victims"),
    ("_starvation_wakes", "starvation wakes"),
    ("_placed_crossings", "band crossings"),
)


def stages(order: str, size: Size, repeat: int) -> list[tuple[str, float]]:
    """Each stage's CPU seconds in one decide (the median of `repeat`), the order's ranks
    first, then the rest of the cycle and the whole: the stage functions are wrapped for
    the time of it, and put back after."""
    snapshot, policy = build_snapshot(size), _policy(order)
    core = importlib.import_module("brain.core.decide")
    spent: dict[str, list[float]] = {}

    def timed(name: str, stage: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            started = time.process_time()
            try:
                return stage(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.process_time() - started)

        return run

    ranks = "the order's ranks"
    totals: list[float] = []
    with contextlib.ExitStack() as wrapped:
        for name, what in STAGES:
            wrapped.enter_context(mock.patch.object(core, name, timed(what, getattr(core, name))))
        # The plugin with its ranking timed: its flags (`view_only`, ...) stay its own.
        plugin = core.ORDERINGS[order]
        timed_plugin = replace(plugin, rank=timed(ranks, plugin.rank))
        wrapped.enter_context(mock.patch.dict(core.ORDERINGS, {order: timed_plugin}))
        for _ in range(repeat):
            with collector_paused():
                started = time.process_time()
                decisions = decide(snapshot, NOW, policy)
                totals.append(time.process_time() - started)
                del decisions
    rows = [(ranks, statistics.median(spent[ranks]))]
    rows += [(what, statistics.median(spent[what])) for _, what in STAGES if what in spent]
    total = statistics.median(totals)
    rows += [("the rest", max(0.0, total - sum(t for _, t in rows))), ("decide", total)]
    return rows


def print_stages(case: str, repeat: int, note: str) -> int:
    rows = stages(*_case("--stages", case), repeat)
    total = rows[-1][1]
    width = max(len(what) for what, _ in rows)
    print(f"{case}, CPU ms, the median of {repeat} decides")
    for what, seconds in rows:
        print(f"  {what.ljust(width)}  {seconds * 1000:8.1f}  {seconds / total:6.1%}")
    json_path, _ = record(
        "decide-stages",
        {"case": case, "repeat": repeat, "note": note},
        [{"stage": what, "cpu_ms": round(seconds * 1000, 2)} for what, seconds in rows],
    )
    print(f"results: {json_path.relative_to(REPO)}")
    return 0


# One process of `count_instructions`: build the case's snapshot, decide `decides` times.
_DECIDE_ONLY: Final = """
import sys
sys.path.insert(0, sys.argv[1])
from bench.decide_scale import NOW, SIZES_BY_LABEL, _policy, build_snapshot
from brain.core import decide
from brain.core.collector import collector_paused
order, label, decides = sys.argv[2], sys.argv[3], int(sys.argv[4])
snapshot, policy = build_snapshot(SIZES_BY_LABEL[label]), _policy(order)
for _ in range(decides):
    with collector_paused():
        decide(snapshot, NOW, policy)
"""
_REFS: Final = re.compile(r"I\s+refs:\s+([\d,]+)")


def count_instructions(checkout: Path, case: str) -> int:
    """Instructions of one decide of `case` (ORDER@SIZE) in `checkout`, by cachegrind:
    a process that decides once, less one that only builds the snapshot."""
    order, _, label = case.partition("@")
    counts = []
    for decides in (0, 1):
        done = subprocess.run(
            [
                "valgrind",
                "--tool=cachegrind",
                "--cache-sim=no",
                "--cachegrind-out-file=/dev/null",
                sys.executable,
                "-c",
                _DECIDE_ONLY,
                str(checkout),
                order,
                label,
                str(decides),
            ],
            cwd=checkout,
            env={**os.environ, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
        )
        found = _REFS.search(done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"cachegrind of {case} in {checkout} failed:\n{done.stderr[-2000:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return counts[1] - counts[0]


def instructions(cases: list[str], before: Path | None, note: str) -> int:
    # Each as ORDER@SIZE, the size named (1k when left out).
    cases = [f"{order}@{size.label}" for order, size in (_case("--instructions", c) for c in cases)]
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (cachegrind) on the PATH")
    if before is not None and not (before / "bench" / "decide_scale.py").is_file():
        raise SystemExit(f"--before {before}: no bench/decide_scale.py there (not a checkout)")
    rows = []
    for case in cases:
        count = count_instructions(REPO, case)
        then = None if before is None else count_instructions(before, case)
        rows.append(
            {
                "case": case,
                "instructions_m": round(count / 1e6, 1),
                "before_instructions_m": None if then is None else round(then / 1e6, 1),
                "ratio": None if then is None else round(count / then, 4),
            }
        )
        said = f"  {case}: {count / 1e6:,.0f} M"
        if then is not None:
            said += f", before {then / 1e6:,.0f} M, ratio {count / then:.3f}"
        print(said, flush=True)
    json_path, _ = record(
        "decide-instructions",
        {"before": None if before is None else str(before), "note": note},
        rows,
    )
    print(f"results: {json_path.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES_BY_LABEL), nargs="+", default=["1k", "5k"])
    parser.add_argument("--order", choices=ORDERS, nargs="+", default=list(ORDERS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per decide")
    parser.add_argument("--profile", metavar="ORDER@SIZE")
    parser.add_argument("--stages", metavar="ORDER@SIZE", help="time each stage of decide")
    parser.add_argument(
        "--instructions", metavar="ORDER@SIZE", nargs="+", help="count one decide's instructions"
    )
    parser.add_argument(
        "--before", type=Path, metavar="DIR", help="with --instructions: count another checkout too"
    )
    parser.add_argument("--note", default="", help="free text stored with the results")
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.profile)
        return 0
    if args.stages:
        return print_stages(args.stages, args.repeat, args.note)
    if args.instructions:
        return instructions(args.instructions, args.before, args.note)
    if args.before is not None:
        parser.error("--before goes with --instructions")
    results: list[Result] = []
    for label in args.size:
        for order in args.order:
            result = run_case(SIZES_BY_LABEL[label], order, args.repeat, args.timeout)
            results.append(result)
            print(
                f"  {label} {order}: "
                + ("timed out" if result.timed_out else f"{(result.median_s or 0) * 1000:.1f} ms"),
                flush=True,
            )
    print_table(results, args.timeout)
    rows = [
        {
            "size": r.size,
            "order": r.order,
            "nodes": r.nodes,
            "gpus": r.nodes * GPUS_PER_NODE,
            "running": r.running,
            "pending": r.pending,
            "runs": r.runs,
            "median_ms": None if r.median_s is None else round(r.median_s * 1000, 2),
            "median_cpu_ms": None if r.median_cpu_s is None else round(r.median_cpu_s * 1000, 2),
            "median_no_waits_cpu_ms": None
            if r.median_quiet_cpu_s is None
            else round(r.median_quiet_cpu_s * 1000, 2),
            "timed_out": r.timed_out,
            "placements": r.placements,
            "preemptions": r.preemptions,
            "waits": r.waits,
            "median_bare_cpu_ms": None
            if r.median_bare_cpu_s is None
            else round(r.median_bare_cpu_s * 1000, 2),
            "bare_placements": r.bare_placements,
            "bare_preemptions": r.bare_preemptions,
            "cpu_over_bare": None
            if r.median_cpu_s is None or not r.median_bare_cpu_s
            else round(r.median_cpu_s / r.median_bare_cpu_s, 3),
        }
        for r in results
    ]
    json_path, csv_path = record(
        "decide-scale",
        {"timeout_s": args.timeout, "repeat": args.repeat, "note": args.note},
        rows,
    )
    print(f"results: {json_path.relative_to(REPO)}, {csv_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
