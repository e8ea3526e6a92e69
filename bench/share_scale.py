"""How long one live `decide()` takes to place jobs that ask shares, GPU types, CPUs and
memory: the Alibaba cluster and tasks, not a test.

    .venv/bin/python bench/share_scale.py [--load 0.25 0.5] [--plugin fgd best-fit]
        [--repeat 3]

The 1,213 nodes of Alibaba's GPU-sharing trace (../shared/data/alibaba-gpu-2023/, with
their CPUs, memory and GPU models) become the brain's node views, all idle; tasks drawn
from its default task list (seeded, with replacement) until their GPUs reach `--load`
of the cluster's become pending jobs, each with its `Demand` (a share, or whole GPUs;
its CPUs, memory and GPU types; CPU-only tasks left out). One `decide()` under fifo
places them through the sharing ledger with each plugin (`--plugin`). Beside it, in the
same run, the baseline: as many jobs of one whole GPU and no demand, placed on the same
nodes by the whole-GPU path. Prints CPU time (the median of `--repeat` runs), what was
placed and the ratio to the baseline, and writes bench/results/share-scale-<stamp>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from brain.core import ClusterSnapshot, Decisions, JobView, NodeView, Policy, decide  # noqa: E402
from brain.core.model import Demand  # noqa: E402
from brain.core.sharing import GPU_MILLI, SHARING_PLUGINS, SharedTask  # noqa: E402
from brain.sim.sharing import draw, load_nodes, load_tasks  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "alibaba-gpu-2023"
NOW = 1_000.0


def cluster() -> tuple[NodeView, ...]:
    return tuple(
        NodeView(
            n.name,
            tuple(range(n.gpus)),
            frozenset(range(n.gpus)),
            model=n.model,
            gpu_memory_mib=n.gpu_memory_mib,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
        )
        for n in load_nodes(DATA / "openb_node_list_gpu_node.csv")
        if n.gpus
    )


def _job(i: int, task: SharedTask) -> JobView:
    demand = Demand(
        gpu_milli=task.gpu_milli,
        gpu_memory_mib=task.gpu_memory_mib,
        gpu_types=tuple(sorted(task.gpu_types)),
        cpu_milli=task.cpu_milli,
        memory_mib=task.memory_mib,
    )
    return JobView(f"t{i}", task.gpus, float(i), demand=demand)


def pending(load: float, seed: int, capacity_gpus: int) -> tuple[JobView, ...]:
    """Jobs drawn from the trace's tasks (as the sharing bench draws them) until their
    GPUs reach `load` of capacity."""
    tasks = [t.task for t in load_tasks(DATA / "openb_pod_list_default.csv") if t.task.gpus]
    drawn = draw(tasks, int(load * capacity_gpus * GPU_MILLI), seed)
    return tuple(_job(i, task) for i, task in enumerate(drawn))


def timed(snapshot: ClusterSnapshot, policy: Policy, repeat: int) -> tuple[float, Decisions]:
    times: list[float] = []
    decisions: Decisions | None = None
    for _ in range(repeat):
        started = time.process_time()
        decisions = decide(snapshot, NOW, policy, waits=False)
        times.append(time.process_time() - started)
    assert decisions is not None
    return statistics.median(times), decisions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument(
        "--plugin", nargs="+", choices=sorted(SHARING_PLUGINS), default=["fgd", "best-fit"]
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    nodes = cluster()
    capacity = sum(len(n.gpus) for n in nodes)
    rows: list[dict[str, object]] = []
    print(f"{len(nodes):,} nodes, {capacity:,} GPUs (Alibaba's GPU-sharing trace), one decide")
    header = ("load", "path", "jobs", "placed", "CPU s", "ms per job", "x baseline")
    print("  ".join(f"{h:>21}" if h == "path" else f"{h:>12}" for h in header))
    for load in args.load:
        jobs = pending(load, args.seed, capacity)
        plain = tuple(JobView(j.job_id, 1, j.submitted_at) for j in jobs)
        base_s, base = timed(ClusterSnapshot(nodes, plain), Policy(order="fifo"), args.repeat)
        cases = [("whole GPUs (baseline)", base_s, base)]
        for plugin in args.plugin:
            policy = Policy(order="fifo", share_placement=plugin).validate()
            seconds, decisions = timed(ClusterSnapshot(nodes, jobs), policy, args.repeat)
            cases.append((plugin, seconds, decisions))
        for path, seconds, decisions in cases:
            placed = len(decisions.placements)
            ratio = seconds / base_s if base_s > 0 else float("inf")
            per_job = seconds / len(jobs) * 1_000
            print(
                f"{load:>12.2f}  {path:>21}  {len(jobs):>12,}  {placed:>12,}  "
                f"{seconds:>12.3f}  {per_job:>12.3f}  {ratio:>12.1f}"
            )
            rows.append(
                {
                    "load": load,
                    "path": path,
                    "jobs": len(jobs),
                    "placed": placed,
                    "cpu_s": round(seconds, 4),
                    "ms_per_job": round(per_job, 4),
                    "x_baseline": round(ratio, 2),
                }
            )
    payload = {
        "measure": "CPU seconds of one decide() (median of repeats) placing jobs drawn from "
        "Alibaba's task list on its idle cluster, beside as many one-GPU jobs without a demand",
        "nodes": len(nodes),
        "gpus": capacity,
        "repeat": args.repeat,
        "seed": args.seed,
    }
    json_path, csv_path = record("share-scale", payload, rows)
    print(f"results: {json_path.relative_to(REPO)}, {csv_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
