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

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from brain.sim.trace import TraceError, csv_rows

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


def _whole(row: dict[str, str], column: str, path: str, line: int) -> int:
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
    return value


def _time(row: dict[str, str], column: str, path: str, line: int) -> float | None:
    raw = row.get(column, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{raw!r} is not a number", path=path, line=line, column=column) from None
    if not value >= 0:
        raise TraceError(f"{raw!r} must be >= 0", path=path, line=line, column=column)
    return value


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
        gpus = _whole(row, "gpu", name, line)
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
    for line, row in csv_rows(path, TASK_COLUMNS):
        task = _task(row, name, line)
        if task.task.name in seen:
            raise TraceError(
                f"duplicate task {task.task.name!r}", path=name, line=line, column="name"
            )
        seen.add(task.task.name)
        tasks.append(task)
    if not tasks:
        raise TraceError("the task list has no tasks", path=name)
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


def unallocated_floor(arrivals: Sequence[SharedTask], gpu_capacity_milli: int) -> UnallocatedFloor:
    """Lower bounds on the GPU capacity left unallocated once `arrivals` have all come
    and none left (`inflate` at its last checkpoint): what the trace's shapes strand,
    whatever the plugin, for reading a plugin's unallocated share against.

    Two shares of more than half a GPU never share one: each placed one leaves its
    GPU's remainder (its hole) to shares no larger than it. Bounding what those can fill
    (for any size t, the holes up to t take only shares up to t) gives the capacity
    stranded with every such share placed. A placement may strand less only by leaving
    such shares unplaced, which costs their whole size (arrived work beyond the capacity
    aside); the bound is the least of the two over any choice of shares to leave,
    relaxed to fractions. Everything else (nodes, CPUs, memory, GPU types, whole-GPU
    gangs) is left out, which can only lower it."""
    shares = [t.gpu_milli for t in arrivals if t.gpus == 1 and t.gpu_milli < GPU_MILLI]
    holes = sorted(GPU_MILLI - s for s in shares if 2 * s > GPU_MILLI)
    small = sorted(s for s in shares if 2 * s <= GPU_MILLI)
    stranded = 0
    holes_upto = fill_upto = 0
    at = 0
    for hole in holes:
        holes_upto += hole
        while at < len(small) and small[at] <= hole:
            fill_upto += small[at]
            at += 1
        stranded = max(stranded, holes_upto - fill_upto)
    # Unallocated is the capacity not asked for plus what was asked and left unplaced.
    # Leave shares unplaced, the largest holes first (the most stranding spared for the
    # least work left): stranding falls by each hole, what is left unplaced rises by
    # each share, and the bound is where the two meet.
    left = gpu_capacity_milli - sum(t.shape.gpu_milli_total for t in arrivals)
    placed = max(stranded, left)
    if left >= stranded:
        # Less arrived than there is room for: leaving shares out only adds to it.
        return UnallocatedFloor(placed, placed)
    for hole in reversed(holes):
        share = GPU_MILLI - hole
        if stranded - hole <= left + share:
            part = (stranded - left) / (hole + share)
            return UnallocatedFloor(placed, max(0, int(stranded - part * hole)))
        stranded -= hole
        left += share
    return UnallocatedFloor(placed, max(0, stranded, left))


def mix_of(tasks: Sequence[TraceTask]) -> TaskMix:
    return TaskMix.of(t.task for t in tasks)
