"""Alibaba's GPU-sharing trace format, and replays of it through `brain.core.sharing`.

Reads the node list (`sn,cpu_milli,memory_mib,gpu,model`) and a task list
(`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,creation_time,
deletion_time,scheduled_time]`) of ../shared/data/alibaba-gpu-2023/. A bad row raises
`TraceError` naming the file, line and column.

Two replays:

- `replay`: tasks arrive at `creation_time` and leave at `deletion_time` (a task that
  cannot be placed when it arrives is counted and dropped: no queue). A file without
  times (multigpu50) arrives in file order and never leaves.
- `inflate`: FGD's workload inflation. Tasks drawn (seeded, with replacement) from the
  trace keep arriving, none leaving, until the GPUs they asked for reach the cluster's
  capacity; the unallocated GPU share is read at each checkpoint of arrived load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Final

from brain.core.sharing import (
    GPU_MILLI,
    InvalidShare,
    SharedCluster,
    SharedNode,
    SharedTask,
    SharePlacement,
    SharingPlugin,
    TaskMix,
)
from brain.sim.trace import MAX_TRACE_NUMBER, TraceError, csv_rows, trace_number

NODE_COLUMNS: Final = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
TASK_COLUMNS: Final = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
# GPU memory per model where it is public; the trace's G1-G3 are undisclosed (0: a task
# asking GPU memory does not fit there). The trace's tasks ask none.
GPU_MEMORY_MIB: Final[dict[str, int]] = {
    "P100": 16_384,
    "T4": 15_360,
    "V100M16": 16_384,
    "V100M32": 32_768,
    "A10": 24_576,
}


@dataclass(frozen=True, slots=True)
class TraceTask:
    task: SharedTask
    # None where the file has no times.
    created_s: float | None
    deleted_s: float | None


# The most GPUs a node of a node list may have (an agent reports at most 256).
MAX_NODE_GPUS: Final = 256


def _whole(
    row: dict[str, str], column: str, path: str, line: int, *, most: float = MAX_TRACE_NUMBER
) -> int:
    raw = row.get(column, "")
    if raw == "":
        raise TraceError("missing value", path=path, line=line, column=column)
    try:
        value = int(raw)
    except ValueError:
        raise TraceError(
            f"{raw!r} is not a whole number", path=path, line=line, column=column
        ) from None
    if value < 0:
        raise TraceError(f"{raw!r} must be >= 0", path=path, line=line, column=column)
    if value > most:
        raise TraceError(f"{raw!r} is more than {most:g}", path=path, line=line, column=column)
    return value


def _time(row: dict[str, str], column: str, path: str, line: int) -> float | None:
    raw = row.get(column, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{raw!r} is not a number", path=path, line=line, column=column) from None
    return trace_number(value, raw, path=path, line=line, column=column)


def load_nodes(path: str | Path) -> tuple[SharedNode, ...]:
    name = str(path)
    nodes: list[SharedNode] = []
    seen: set[str] = set()
    for line, row in csv_rows(path, NODE_COLUMNS):
        sn = row["sn"]
        if not sn:
            raise TraceError("missing value", path=name, line=line, column="sn")
        if sn in seen:
            raise TraceError(f"duplicate node {sn!r}", path=name, line=line, column="sn")
        seen.add(sn)
        gpus = _whole(row, "gpu", name, line, most=MAX_NODE_GPUS)
        model = row["model"]
        if gpus and not model:
            raise TraceError("a node with GPUs needs a model", path=name, line=line, column="model")
        nodes.append(
            SharedNode(
                sn,
                _whole(row, "cpu_milli", name, line),
                _whole(row, "memory_mib", name, line),
                gpus,
                model,
                GPU_MEMORY_MIB.get(model, 0),
            )
        )
    if not nodes:
        raise TraceError("the node list has no nodes", path=name)
    if not any(n.gpus for n in nodes):
        raise TraceError("no node of the node list has a GPU", path=name, column="gpu")
    return tuple(nodes)


def _task(row: dict[str, str], path: str, line: int) -> TraceTask:
    task_name = row["name"]
    if not task_name:
        raise TraceError("missing value", path=path, line=line, column="name")
    gpus = _whole(row, "num_gpu", path, line)
    milli = _whole(row, "gpu_milli", path, line)
    spec = row.get("gpu_spec", "")
    types = frozenset(t for t in spec.split("|") if t)
    created = _time(row, "creation_time", path, line)
    deleted = _time(row, "deletion_time", path, line)
    if created is not None and deleted is not None and deleted < created:
        raise TraceError(
            f"{deleted:g} is before creation_time {created:g}",
            path=path,
            line=line,
            column="deletion_time",
        )
    try:
        task = SharedTask(
            task_name,
            _whole(row, "cpu_milli", path, line),
            _whole(row, "memory_mib", path, line),
            gpus,
            milli if gpus else GPU_MILLI,
            0,
            types,
        )
    except InvalidShare as err:
        column = {"gpus": "num_gpu"}.get(err.field, err.field)
        raise TraceError(err.reason, path=path, line=line, column=column) from None
    return TraceTask(task, created, deleted)


def load_tasks(path: str | Path) -> tuple[TraceTask, ...]:
    """Every task, in file order."""
    name = str(path)
    tasks: list[TraceTask] = []
    seen: set[str] = set()
    untimed: int | None = None  # the first line without a creation time
    for line, row in csv_rows(path, TASK_COLUMNS):
        task = _task(row, name, line)
        if task.task.name in seen:
            raise TraceError(
                f"duplicate task {task.task.name!r}", path=name, line=line, column="name"
            )
        seen.add(task.task.name)
        if task.created_s is None and untimed is None:
            untimed = line
        tasks.append(task)
    if not tasks:
        raise TraceError("the task list has no tasks", path=name)
    if untimed is not None and any(t.created_s is not None for t in tasks):
        # Replayed in file order without departures, the times of the others would be
        # dropped without a word.
        raise TraceError(
            "missing value (other rows have times: give every row one, or none)",
            path=name,
            line=untimed,
            column="creation_time",
        )
    return tuple(tasks)


def check_types(nodes: Sequence[SharedNode], tasks: Sequence[TraceTask], path: str) -> None:
    """A GPU type no node has is a typo, not a constraint: refuse it."""
    models = {n.model for n in nodes}
    for index, t in enumerate(tasks):
        unknown = t.task.gpu_types - models
        if unknown:
            raise TraceError(
                f"GPU type(s) {', '.join(sorted(unknown))} on no node "
                f"(nodes have {', '.join(sorted(models))})",
                path=path,
                line=index + 2,
                column="gpu_spec",
            )


@dataclass(slots=True)
class ReplayResult:
    tasks: int = 0
    placed: int = 0
    unschedulable: int = 0
    gpu_capacity: float = 0.0
    peak_allocated_gpus: float = 0.0
    # Unallocated GPUs when the first task could not be placed (None: none failed).
    unallocated_at_first_failure: float | None = None
    failed_by_kind: dict[str, int] = field(default_factory=dict)


def _kind(task: SharedTask) -> str:
    shape = task.shape
    if shape.gpus == 0:
        return "cpu-only"
    if shape.fractional:
        return "share"
    return "whole"


def replay(
    nodes: Sequence[SharedNode],
    tasks: Sequence[TraceTask],
    plugin: SharingPlugin,
    *,
    on_step: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Arrivals by creation time, departures free what they held."""
    cluster = SharedCluster(nodes)
    timed = all(t.created_s is not None for t in tasks)
    events: list[tuple[float, int, int]] = []  # (time, 0 leave / 1 arrive, index)
    for index, t in enumerate(tasks):
        arrive = t.created_s if timed and t.created_s is not None else float(index)
        events.append((arrive, 1, index))
        if timed and t.deleted_s is not None:
            events.append((t.deleted_s, 0, index))
    # Leaves before arrivals at the same instant: what leaves frees room first.
    events.sort()
    held: dict[int, SharePlacement] = {}
    result = ReplayResult(gpu_capacity=cluster.gpu_capacity_milli / GPU_MILLI)
    for step, (_, kind, index) in enumerate(events):
        if kind == 0:
            placement = held.pop(index, None)
            if placement is not None:
                cluster.release(placement)
            continue
        task = tasks[index].task
        result.tasks += 1
        outcome = cluster.place(task, plugin)
        if isinstance(outcome, SharePlacement):
            held[index] = outcome
            result.placed += 1
            allocated = cluster.gpu_allocated_milli / GPU_MILLI
            result.peak_allocated_gpus = max(result.peak_allocated_gpus, allocated)
        else:
            result.unschedulable += 1
            result.failed_by_kind[_kind(task)] = result.failed_by_kind.get(_kind(task), 0) + 1
            if result.unallocated_at_first_failure is None:
                result.unallocated_at_first_failure = cluster.unallocated_gpus()
        if on_step is not None:
            on_step(step)
    return result


DEFAULT_CHECKPOINTS: Final = (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 1.00)


@dataclass(frozen=True, slots=True)
class InflationPoint:
    # Arrived GPU requests as a share of capacity.
    arrived: float
    # GPU capacity not allocated then, as a share of capacity.
    unallocated: float
    failed_tasks: int


@dataclass(frozen=True, slots=True)
class InflationResult:
    points: tuple[InflationPoint, ...]
    gpu_capacity: float
    arrived_tasks: int
    failed_tasks: int
    # Arrived load (share of capacity) when the first GPU task failed; None if none did.
    first_failure_at: float | None
    unallocated_at_first_failure: float | None


def draw(tasks: Sequence[SharedTask], gpu_capacity_milli: int, seed: int) -> list[SharedTask]:
    """Tasks drawn with replacement until their GPU requests reach the capacity (the
    last one crosses it). The same seed draws the same list, whatever plugin runs it."""
    rng = random.Random(seed)
    if not any(t.shape.gpu_milli_total for t in tasks):
        raise ValueError("no task asks for a GPU: the load could never reach capacity")
    drawn: list[SharedTask] = []
    asked = 0
    while asked < gpu_capacity_milli:
        task = tasks[rng.randrange(len(tasks))]
        drawn.append(task)
        asked += task.shape.gpu_milli_total
    return drawn


def inflate(
    nodes: Sequence[SharedNode],
    arrivals: Sequence[SharedTask],
    plugin: SharingPlugin,
    *,
    checkpoints: Sequence[float] = DEFAULT_CHECKPOINTS,
) -> InflationResult:
    """Place `arrivals` in order, none leaving; read the unallocated share of GPUs each
    time arrived GPU requests pass a checkpoint (a share of capacity)."""
    cluster = SharedCluster(nodes)
    capacity = cluster.gpu_capacity_milli
    marks = sorted(checkpoints)
    points: list[InflationPoint] = []
    asked = failed = 0
    first_failure_at: float | None = None
    unallocated_first: float | None = None
    for task in arrivals:
        outcome = cluster.place(task, plugin)
        if not isinstance(outcome, SharePlacement):
            failed += 1
            if first_failure_at is None and task.shape.gpus:
                first_failure_at = asked / capacity
                unallocated_first = cluster.unallocated_gpus() * GPU_MILLI / capacity
        asked += task.shape.gpu_milli_total
        while marks and asked >= marks[0] * capacity:
            unallocated = (capacity - cluster.gpu_allocated_milli) / capacity
            points.append(InflationPoint(marks.pop(0), unallocated, failed))
    return InflationResult(
        tuple(points),
        capacity / GPU_MILLI,
        len(arrivals),
        failed,
        first_failure_at,
        unallocated_first,
    )


@dataclass(frozen=True, slots=True)
class UnallocatedFloor:
    """What the shapes of some arrivals strand, in thousandths of a GPU
    (`unallocated_floor`)."""

    # With every share of more than half a GPU placed.
    every_share_placed: int
    # With any placement at all, one that leaves some of those shares unplaced too.
    any_placement: int


# A dual feasible function (Fekete and Schepers, "New classes of fast lower bounds for
# bin packing problems", Math. Programming 91, 2001): a map of item sizes, here in
# thousandths of a GPU, such that whatever fits on one GPU maps to at most one GPU.
Dff = Callable[[Fraction], Fraction]


def _u(k: int) -> Dff:
    """u^(k): x if (k+1)x is whole, else floor((k+1)x)/k (their Theorem 2)."""

    def u(x: Fraction) -> Fraction:
        scaled = (k + 1) * x
        return x if scaled.denominator == 1 else Fraction(math.floor(scaled), k)

    return u


def _big(epsilon: Fraction) -> Dff:
    """U^(epsilon), epsilon at most 1/2: 1 above 1 - epsilon, 0 below epsilon, x
    between (their Theorem 3)."""

    def u(x: Fraction) -> Fraction:
        return Fraction(1) if x > 1 - epsilon else Fraction(0) if x < epsilon else x

    return u


def _dual_feasible(sizes: Sequence[Fraction]) -> list[Dff]:
    """The functions the floor tries: U^(epsilon) at every threshold where it treats
    these sizes differently, u^(k) for k up to 12, and each u^(k) after each U^(epsilon)
    (a composition of such functions is one)."""
    half = Fraction(1, 2)
    thresholds = {Fraction(0)}
    for size in sizes:
        for epsilon in (size, 1 - size + Fraction(1, GPU_MILLI)):
            if 0 < epsilon <= half:
                thresholds.add(epsilon)
    bigs = [_big(e) for e in sorted(thresholds)]
    us = [_u(k) for k in range(1, 13)]
    return [*bigs, *us, *(_then(big, u) for u in us for big in bigs)]


def _then(first: Dff, second: Dff) -> Dff:
    def composed(x: Fraction) -> Fraction:
        return second(first(x))

    return composed


def _most_placed(
    u: Dff, sizes: dict[Fraction, int], gpus: int, *, big_shares_placed: bool = False
) -> Fraction | None:
    """The most GPU capacity any placement can fill on `gpus` GPUs, by `u`: the items
    placed need at least the sum of u over them in GPUs, so the most is a fractional
    knapsack, the items with most size per GPU they need first. `big_shares_placed`:
    every share of more than half a GPU is placed (whole GPUs need not be); None if,
    by `u`, they cannot all be."""
    room = Fraction(gpus)
    placed = Fraction(0)
    free: list[tuple[Fraction, Fraction, Fraction, int]] = []
    for size, count in sizes.items():
        need = u(size)
        if big_shares_placed and Fraction(1, 2) < size < 1:
            room -= need * count
            placed += size * count
        elif need == 0:
            placed += size * count
        else:
            free.append((size / need, size, need, count))
    if room < 0:
        return None
    for _, size, need, count in sorted(free, reverse=True):
        if room <= 0:
            break
        take = min(Fraction(count), room / need)
        placed += size * take
        room -= need * take
    return placed


def unallocated_floor(arrivals: Sequence[SharedTask], gpu_capacity_milli: int) -> UnallocatedFloor:
    """Lower bounds on the GPU capacity left unallocated once `arrivals` have all come
    and none left (`inflate` at its last checkpoint): what the trace's shapes strand,
    whatever the plugin, for reading a plugin's unallocated share against.

    Each GPU holds items summing to at most one GPU: a share, or one GPU of a whole-GPU
    task. For a dual feasible function u (whatever fits on one GPU maps to at most
    one), the items placed need at least the sum of u over them in GPUs; so the most a
    placement can fill is a fractional knapsack by u (`_most_placed`), and the least it
    leaves unallocated is the capacity less that. Every u gives a bound; the floor is
    the best over a family of them (`_dual_feasible`). The first figure holds for the
    placements that place every share of more than half a GPU (two of which never share
    a GPU, each leaving its remainder to smaller ones), the second for any placement.
    Nodes, CPUs, memory, GPU types and whole-GPU gangs are left out, which can only
    lower it."""
    gpus = gpu_capacity_milli // GPU_MILLI
    sizes: dict[Fraction, int] = {}
    for task in arrivals:
        shape = task.shape
        if not shape.gpus:
            continue
        size = Fraction(shape.gpu_milli, GPU_MILLI) if shape.fractional else Fraction(1)
        sizes[size] = sizes.get(size, 0) + (1 if shape.fractional else shape.gpus)
    functions = _dual_feasible(list(sizes))
    anyhow = Fraction(gpus)
    every: Fraction | None = Fraction(gpus)
    for u in functions:
        most = _most_placed(u, sizes, gpus)
        assert most is not None  # nothing is forced
        anyhow = min(anyhow, most)
        most = _most_placed(u, sizes, gpus, big_shares_placed=True)
        # None: no placement places every such share; what holds for any holds then.
        every = None if most is None or every is None else min(every, most)
    if every is None:
        every = anyhow
    return UnallocatedFloor(
        max(0, math.ceil(gpu_capacity_milli - every * GPU_MILLI)),
        max(0, math.ceil(gpu_capacity_milli - anyhow * GPU_MILLI)),
    )


def mix_of(tasks: Sequence[TraceTask]) -> TaskMix:
    return TaskMix.of(t.task for t in tasks)
