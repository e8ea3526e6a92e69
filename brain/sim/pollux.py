"""Pollux's workloads and measured scaling, for replaying elastic jobs.

Owns reading petuum/adaptdl's artifact data (`../shared/data/pollux`, see its README):
the 160-job workloads (`name,time,application,num_replicas,batch_size`) and, per
application, the measured step times (`placements.csv`, `scalability.csv`) and the
per-epoch validation tables (`validation-<batch>.csv`). From them it computes what the
artifact's simulator computes for a job with a fixed global batch size:

- the work: iterations to reach the application's `max_epochs`, from the per-epoch
  progress and gradient statistics (Pollux's statistical-efficiency model, evaluated at
  the job's batch size), so a job's trace duration is that many iterations at its
  requested size, packed on as few nodes as it fits;
- the speed anywhere else: an iteration's time on a given placement (GPUs per node) at
  the job's batch size, with the local batch split and gradient accumulation the
  artifact's simulator uses (`Job.update_local_bsz` for a fixed batch size).

A placement the artifact measured (up to 4 nodes of up to 4 GPUs) is interpolated
along the local batch size; any other is interpolated piecewise-linearly over the grid
of (nodes, replicas) the artifact measured (its `scalability.csv`, 6-16 nodes). The
artifact uses scipy's `LinearNDInterpolator` there; this module does without scipy, so
off-grid numbers differ slightly. What a resize does to the batch is
`PolluxScaling`'s `batch`: kept (as Horovod elastic with a constant global batch),
following the world size (each worker's batch kept), or re-chosen for the best
goodput at every allocation (Pollux's/AdaptDL's adaptation: one batch per
allocation, or per allocation and epoch).

No policy code lives here; the engine asks `PolluxScaling` for speeds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, TypeVar

from brain.sim.engine import SpeedCurve
from brain.sim.trace import TraceError, TraceJob, csv_rows, trace_number
from workloads.goodput import statistical_gain

POLLUX_COLUMNS: Final = ("name", "time", "application", "num_replicas", "batch_size")

# The epochs Pollux's artifact trains each application for (its applications.py).
MAX_EPOCHS: Final[dict[str, int]] = {
    "bert": 2,
    "cifar10": 100,
    "ncf": 10,
    "imagenet": 90,
    "deepspeech2": 80,
    "yolov3": 50,
}
# The artifact caps yolov3's local batch at 8 (memory), whatever was measured.
MAX_LOCAL_BATCH: Final[dict[str, int]] = {"yolov3": 8}
# Applications the artifact never scales past one GPU (ncf does not scale).
SINGLE_GPU_APPS: Final = frozenset({"ncf"})
# The artifact's simulator handles at most 64 replicas and 16 nodes of measurements.
MAX_REPLICAS: Final = 64
MAX_MEASURED_NODES: Final = 16
# Batch sizes an adaptive job tries at each allocation, geometrically spaced between
# its smallest and largest batch (AdaptDL's `np.geomspace` default).
ADAPTIVE_GRID: Final = 50

# (local batch, step time, sync time), sorted by local batch.
_Curve = tuple[tuple[float, float, float], ...]


def _interp_curve(curve: _Curve, local_bsz: float) -> tuple[float, float]:
    """Step and sync time at `local_bsz`, linear between measured batches, clamped."""
    batches = [point[0] for point in curve]
    if local_bsz <= batches[0]:
        return curve[0][1], curve[0][2]
    if local_bsz >= batches[-1]:
        return curve[-1][1], curve[-1][2]
    high = bisect.bisect_left(batches, local_bsz)
    b0, s0, y0 = curve[high - 1]
    b1, s1, y1 = curve[high]
    w = (local_bsz - b0) / (b1 - b0)
    return s0 + w * (s1 - s0), y0 + w * (y1 - y0)


def _lerp(a: tuple[float, float], b: tuple[float, float], w: float) -> tuple[float, float]:
    return a[0] + w * (b[0] - a[0]), a[1] + w * (b[1] - a[1])


def _bracket(values: Sequence[int], x: float) -> tuple[int, int, float]:
    """Neighbours of `x` among sorted `values` and the weight of the upper one."""
    if x <= values[0]:
        return values[0], values[0], 0.0
    if x >= values[-1]:
        return values[-1], values[-1], 0.0
    high = bisect.bisect_left(values, x)
    lo, hi = values[high - 1], values[high]
    if hi == x:
        return hi, hi, 0.0
    return lo, hi, (x - lo) / (hi - lo)


def normalize_placement(per_node: Iterable[int]) -> str:
    """The artifact's placement id: GPUs per node, rotated to the smallest sequence."""
    counts = tuple(c for c in per_node if c > 0)
    if not counts:
        raise ValueError("an empty placement")
    rotation = min(counts[i:] + counts[:i] for i in range(len(counts)))
    return "".join(map(str, rotation))


@dataclass(frozen=True, slots=True)
class _Epochs:
    """One validation table: per epoch, the cumulative progress and gradient stats."""

    batch_size: int
    progress: tuple[float, ...]
    grad_sqr: tuple[float, ...]
    grad_var: tuple[float, ...]


@dataclass(slots=True)
class PolluxApp:
    """One application's measurements (immutable once loaded; caches its lookups)."""

    name: str
    max_epochs: int
    init_batch_size: int
    max_batch_size: int
    min_local_bsz: int
    max_local_bsz: int
    # Measured placements (artifact id) and the (nodes, replicas) grid.
    placements: dict[str, _Curve]
    grid: dict[tuple[int, int], _Curve]
    validation: tuple[_Epochs, ...]
    _iterations: dict[int, float] = field(default_factory=dict)
    _epoch_steps: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def step_and_sync(self, per_node: Sequence[int], local_bsz: float) -> tuple[float, float]:
        key = normalize_placement(per_node)
        curve = self.placements.get(key)
        if curve is not None:
            return _interp_curve(curve, local_bsz)
        nodes = min(sum(1 for c in per_node if c > 0), MAX_MEASURED_NODES)
        return self._grid_lookup(nodes, sum(per_node), local_bsz)

    def _grid_lookup(self, nodes: int, replicas: int, local_bsz: float) -> tuple[float, float]:
        node_counts = sorted({n for n, _ in self.grid})
        lo, hi, w = _bracket(node_counts, nodes)
        at_lo = self._at_nodes(lo, replicas, local_bsz)
        if w == 0.0:
            return at_lo
        return _lerp(at_lo, self._at_nodes(hi, replicas, local_bsz), w)

    def _at_nodes(self, nodes: int, replicas: int, local_bsz: float) -> tuple[float, float]:
        counts = sorted(r for n, r in self.grid if n == nodes)
        lo, hi, w = _bracket(counts, replicas)
        at_lo = _interp_curve(self.grid[nodes, lo], local_bsz)
        if w == 0.0:
            return at_lo
        return _lerp(at_lo, _interp_curve(self.grid[nodes, hi], local_bsz), w)

    def local_split(self, replicas: int, batch_size: int) -> tuple[int, int]:
        """(atomic local batch, accumulation steps) of a `batch_size` job on `replicas`
        GPUs: the artifact's split (`Job.update_local_bsz` for a fixed batch)."""
        local_bsz = math.ceil(batch_size / replicas - 1e-8)
        accum_steps = math.ceil(local_bsz / self.max_local_bsz - 1e-8) - 1
        if replicas == 1 and batch_size > self.init_batch_size:
            # The artifact's simulator always accumulates at least once on one GPU.
            accum_steps = max(1, accum_steps)
        atomic_bsz = math.ceil(local_bsz / (accum_steps + 1) - 1e-8)
        atomic_bsz = min(atomic_bsz, int(self.max_batch_size / (replicas * (accum_steps + 1))))
        return atomic_bsz, accum_steps

    def iteration_time(self, per_node: Sequence[int], batch_size: int) -> float:
        """Seconds per optimizer step of a `batch_size` job on this placement: the
        artifact's local-batch split with gradient accumulation, for a fixed batch."""
        atomic_bsz, accum_steps = self.local_split(sum(per_node), batch_size)
        step, sync = self.step_and_sync(per_node, atomic_bsz)
        return step + accum_steps * (step - sync)

    def batch_candidates(self, replicas: int, *extra: int) -> tuple[int, ...]:
        """The global batches an adaptive job considers on `replicas` GPUs, ascending:
        `ADAPTIVE_GRID` geometric steps from max(init batch, smallest measured local
        batch x replicas) to the application's largest batch (as AdaptDL's
        `GoodputFunction.optimize` samples them, rounded to whole samples), dropping
        those whose atomic local batch falls below the smallest measured one, plus
        `extra` (the job's own batch, ...) clamped to [init batch, largest batch]."""
        low = min(max(self.init_batch_size, self.min_local_bsz * replicas), self.max_batch_size)
        high = self.max_batch_size
        ratio = (high / low) ** (1.0 / (ADAPTIVE_GRID - 1)) if high > low else 1.0
        grid = {round(low * ratio**i) for i in range(ADAPTIVE_GRID)}
        grid = {b for b in grid if self.local_split(replicas, b)[0] >= self.min_local_bsz}
        grid.add(low)
        grid.update(min(max(b, self.init_batch_size), high) for b in extra)
        return tuple(sorted(grid))

    def best_batch(self, per_node: Sequence[int], candidates: Iterable[int]) -> tuple[int, float]:
        """(batch, seconds to train the whole job) minimising iterations(batch) x
        iteration_time(placement, batch) among `candidates`; ties go to the smaller
        batch. Statistical efficiency is averaged over the whole run (one batch per
        placement, not one per epoch)."""
        best: tuple[int, float] | None = None
        for batch in sorted(set(candidates)):
            seconds = self.iterations(batch) * self.iteration_time(per_node, batch)
            if best is None or seconds < best[1]:
                best = (batch, seconds)
        if best is None:
            raise ValueError("no candidate batch sizes")
        return best

    def iterations(self, batch_size: int) -> float:
        """Optimizer steps to train `max_epochs` at `batch_size`: each epoch's progress
        (in samples at the initial batch size) divided by the statistical gain of the
        batch size in that epoch, as the artifact's simulator accumulates it."""
        cached = self._iterations.get(batch_size)
        if cached is not None:
            return cached
        total = self._iterations[batch_size] = sum(self.epoch_steps(batch_size))
        return total

    def epoch_steps(self, batch_size: int) -> tuple[float, ...]:
        """Optimizer steps each epoch takes at `batch_size` (their sum: `iterations`)."""
        cached = self._epoch_steps.get(batch_size)
        if cached is not None:
            return cached
        scale = batch_size / self.init_batch_size
        steps: list[float] = []
        previous = 0.0
        for epoch in range(self.max_epochs):
            target = min(v.progress[epoch] for v in self.validation)
            sqr, var = self._grad_stats(batch_size, epoch)
            steps.append((target - previous) / statistical_gain(sqr, var, scale))
            previous = target
        self._epoch_steps[batch_size] = tuple(steps)
        return self._epoch_steps[batch_size]

    def _grad_stats(self, batch_size: int, epoch: int) -> tuple[float, float]:
        sizes = [v.batch_size for v in self.validation]
        lo, hi, w = _bracket(sizes, batch_size)
        low = self.validation[sizes.index(lo)]
        high = self.validation[sizes.index(hi)]
        return _lerp(
            (low.grad_sqr[epoch], low.grad_var[epoch]),
            (high.grad_sqr[epoch], high.grad_var[epoch]),
            w,
        )


def _read_rows(path: Path) -> list[dict[str, str]]:
    return [row for _, row in csv_rows(path, ())]


def _floats(row: dict[str, str], columns: Sequence[str], path: Path, line: int) -> list[float]:
    out: list[float] = []
    for column in columns:
        try:
            value = float(row[column])
        except (KeyError, TypeError, ValueError):
            raise TraceError("not a number", path=str(path), line=line, column=column) from None
        if not math.isfinite(value):
            raise TraceError(
                f"{row[column]!r} is not a finite number", path=str(path), line=line, column=column
            )
        out.append(value)
    return out


_Key = TypeVar("_Key")
_Samples = dict[float, list[tuple[float, float]]]


def _curves(points: dict[_Key, _Samples]) -> dict[_Key, _Curve]:
    """Mean step and sync time per local batch, sorted by batch."""
    out: dict[_Key, _Curve] = {}
    for key, by_bsz in points.items():
        out[key] = tuple(
            (
                bsz,
                sum(s for s, _ in samples) / len(samples),
                sum(y for _, y in samples) / len(samples),
            )
            for bsz, samples in sorted(by_bsz.items())
        )
    return out


def load_app(directory: Path) -> PolluxApp:
    name = directory.name
    max_epochs = MAX_EPOCHS.get(name)
    if max_epochs is None:
        raise TraceError(f"unknown application {name!r}", path=str(directory))
    by_placement: dict[str, _Samples] = {}
    by_grid: dict[tuple[int, int], _Samples] = {}
    path = directory / "placements.csv"
    for line, row in enumerate(_read_rows(path), start=2):
        bsz, step, sync = _floats(row, ("local_bsz", "step_time", "sync_time"), path, line)
        placement = (row.get("placement") or "").strip()
        by_placement.setdefault(placement, {}).setdefault(bsz, []).append((step, sync))
        counts = [int(c) for c in placement]
        by_grid.setdefault((len(counts), sum(counts)), {}).setdefault(bsz, []).append((step, sync))
    path = directory / "scalability.csv"
    for line, row in enumerate(_read_rows(path), start=2):
        nodes, replicas, bsz, step, sync = _floats(
            row, ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"), path, line
        )
        by_grid.setdefault((int(nodes), int(replicas)), {}).setdefault(bsz, []).append((step, sync))
    validation: list[_Epochs] = []
    for table in sorted(directory.glob("validation-*.csv")):
        batch = int(table.stem.split("-")[-1])
        rows = _read_rows(table)
        cols = [
            _floats(r, ("progress", "grad_sqr", "grad_var"), table, i + 2)
            for i, r in enumerate(rows)
        ]
        validation.append(
            _Epochs(
                batch,
                tuple(c[0] for c in cols),
                tuple(c[1] for c in cols),
                tuple(c[2] for c in cols),
            )
        )
    if not validation or not by_placement:
        raise TraceError("no validation tables or placements", path=str(directory))
    validation.sort(key=lambda v: v.batch_size)
    local_batches = [b for curve in by_placement.values() for b in curve]
    placements = _curves(by_placement)
    grid = _curves(by_grid)
    return PolluxApp(
        name=name,
        max_epochs=min(max_epochs, *(len(v.progress) for v in validation)),
        init_batch_size=validation[0].batch_size,
        max_batch_size=validation[-1].batch_size,
        min_local_bsz=int(min(local_batches)),
        max_local_bsz=MAX_LOCAL_BATCH.get(name, int(max(local_batches))),
        placements=placements,
        grid=grid,
        validation=tuple(validation),
    )


def load_apps(directory: str | Path) -> dict[str, PolluxApp]:
    root = Path(directory)
    if not root.is_dir():
        raise TraceError("no such directory of Pollux applications", path=str(root))
    apps = {d.name: load_app(d) for d in sorted(root.iterdir()) if (d / "placements.csv").exists()}
    if not apps:
        raise TraceError("no application directories (with placements.csv)", path=str(root))
    return apps


def packed(gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """GPUs per node of a job packed on as few nodes as it fits."""
    full, rest = divmod(gpus, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


@dataclass(frozen=True, slots=True)
class ElasticRange:
    """How a replayed job's elastic range follows from its request (`num_replicas`).

    Defaults follow the artifact's Pollux runs: a job may shrink to one GPU and grow to
    twice what it asked for, within 64 replicas and the batch size's smallest local
    batch; ncf never scales past one GPU.
    """

    min_gpus: int = 1
    grow_factor: float = 2.0
    # Set: only jobs that fit on one node of this many GPUs are elastic (within it),
    # as the live brain runs them with --elastic-one-node; bigger ones stay rigid.
    node_gpus: int | None = None

    def of(self, app: PolluxApp, requested: int, batch_size: int) -> tuple[int, int] | None:
        """(min, max) GPUs of the job, or None for a rigid one."""
        if self.node_gpus is not None and requested > self.node_gpus:
            return None
        if app.name in SINGLE_GPU_APPS:
            return 1, 1
        most = min(
            max(requested, math.floor(requested * self.grow_factor)),
            MAX_REPLICAS,
            max(1, batch_size // app.min_local_bsz),
        )
        most = max(most, requested)
        if self.node_gpus is not None:
            most = min(most, self.node_gpus)
        return min(self.min_gpus, requested), most


BatchScaling = Literal["global", "local", "adaptive", "adaptive-epoch"]
BATCH_SCALINGS: Final[tuple[BatchScaling, ...]] = ("global", "local", "adaptive", "adaptive-epoch")


@dataclass(frozen=True, slots=True)
class _Phased:
    """An adaptive-epoch job on one placement: its batch per epoch, its speed by work
    left, and the seconds it takes there from start to finish."""

    batches: tuple[int, ...]
    curve: SpeedCurve
    seconds: float


class PolluxScaling:
    """The engine's speed model for Pollux jobs: how fast a job runs on a placement,
    relative to its trace duration (its requested size, packed, at its own batch), and
    the throughput its progress reports would show there (what the elasticity stage
    ranks marginal gains by).

    `batch` says what a resize does to the batch: "global" keeps the job's global batch
    (each worker's share changes), "local" keeps each worker's batch, so the global
    batch follows the world size (Horovod elastic's usual setup, with the learning rate
    rescaled). With "local" a job trained on fewer GPUs uses a smaller batch and needs
    fewer samples (Pollux's statistical efficiency), on more GPUs the opposite; its
    work at each size is the iterations its batch needs there, as if it ran there
    throughout. A job at the size it asked for runs the same under both, and its
    reports show samples/s.

    "adaptive" is Pollux's (AdaptDL's) batch-size adaptation: at every allocation the
    job trains with the global batch that minimises its time to train there,
    iterations(batch) x iteration_time(placement, batch), among `batch_candidates`
    (a geometric grid from the initial to the largest batch, plus the job's own batch
    and the batch "local" would use), with the artifact's local-batch split and
    gradient accumulation. So it is never slower than "global" or "local" on the same
    placement, and may beat its own batch even at its requested size. Its reports show
    goodput, not samples/s: samples per second at the initial batch's statistical
    efficiency (AdaptDL's goodput, averaged over the run), so a GPU that only buys a
    bigger, less sample-efficient batch does not look like a gain. It models a job
    that changes its batch on every resize; one batch per placement for the whole
    run (not re-chosen per epoch as AdaptDL does as the gradient noise grows).

    "adaptive-epoch" re-chooses the batch at every epoch too (among the same
    candidates, minimising that epoch's steps x iteration time), as the artifact's
    simulator re-optimises between epochs: small batches early, larger ones as the
    gradient noise grows. Its speed then changes with the work done (`speed_curve`,
    integrated by the engine); `speed` and the reported goodput are the averages over
    a whole run on the placement, so sizes observed at different points of training
    compare as AdaptDL's model compares them, at the same statistics.
    """

    def __init__(
        self, apps: dict[str, PolluxApp], gpus_per_node: int, *, batch: BatchScaling = "global"
    ) -> None:
        if batch not in BATCH_SCALINGS:
            raise ValueError(f"batch must be one of {', '.join(BATCH_SCALINGS)}, not {batch!r}")
        self._apps = apps
        self._gpus_per_node = gpus_per_node
        self._batch = batch
        self._times: dict[tuple[str, int, str], float] = {}
        # Adaptive: (application, own batch, requested GPUs, placement) -> (batch, s).
        self._best: dict[tuple[str, int, int, str], tuple[int, float]] = {}
        self._phased: dict[tuple[str, int, int, str], _Phased] = {}

    def app(self, job: TraceJob) -> PolluxApp:
        app = self._apps.get(job.model_name)
        if app is None:
            raise TraceError(f"job {job.job_id}: no scaling data for {job.model_name!r}")
        return app

    def _local_batch(self, job: TraceJob, size: int) -> int:
        """The global batch on `size` GPUs when each worker keeps its batch."""
        batch = job.batch_size or 0
        if size == job.gpus:
            return batch
        app = self.app(job)
        scaled = round(batch * size / job.gpus)
        return min(max(scaled, app.init_batch_size), app.max_batch_size)

    def batch_at(self, job: TraceJob, size: int) -> int:
        """The job's global batch on `size` GPUs (adaptive: packed on full nodes)."""
        if self._batch in ("adaptive", "adaptive-epoch"):
            return self.batch_on(job, packed(size, self._gpus_per_node))
        if self._batch == "global":
            return job.batch_size or 0
        return self._local_batch(job, size)

    def batch_on(self, job: TraceJob, per_node: Sequence[int]) -> int:
        """The job's global batch on this placement (adaptive-epoch: in its first
        epoch; `epoch_batches` has them all)."""
        if self._batch == "adaptive":
            return self._adaptive(job, per_node)[0]
        if self._batch == "adaptive-epoch":
            return self._phases(job, per_node).batches[0]
        return self.batch_at(job, sum(per_node))

    def epoch_batches(self, job: TraceJob, per_node: Sequence[int]) -> tuple[int, ...]:
        """The job's global batch in each epoch on this placement."""
        if self._batch == "adaptive-epoch":
            return self._phases(job, per_node).batches
        return (self.batch_on(job, per_node),) * self.app(job).max_epochs

    @staticmethod
    def _adaptive_key(job: TraceJob, per_node: Sequence[int]) -> tuple[str, int, int, str]:
        """What an adaptive choice depends on: the application, the job's own batch and
        size (its candidates), and the placement."""
        return (job.model_name, job.batch_size or 0, job.gpus, normalize_placement(per_node))

    def _candidates(self, job: TraceJob, size: int) -> tuple[int, ...]:
        """The batches an adaptive job considers on `size` GPUs: the grid, its own batch
        and the one each worker keeping its batch would give."""
        own = job.batch_size or 0
        return self.app(job).batch_candidates(size, own, self._local_batch(job, size))

    def _adaptive(self, job: TraceJob, per_node: Sequence[int]) -> tuple[int, float]:
        """(batch, seconds to train the whole job) of the best batch on this placement."""
        key = self._adaptive_key(job, per_node)
        cached = self._best.get(key)
        if cached is None:
            candidates = self._candidates(job, sum(per_node))
            cached = self.app(job).best_batch(tuple(c for c in per_node if c > 0), candidates)
            self._best[key] = cached
        return cached

    def _phases(self, job: TraceJob, per_node: Sequence[int]) -> _Phased:
        key = self._adaptive_key(job, per_node)
        cached = self._phased.get(key)
        if cached is not None:
            return cached
        app = self.app(job)
        own = job.batch_size or 0
        candidates = self._candidates(job, sum(per_node))
        times = {b: self._fixed_time(job, per_node, b) for b in candidates}
        steps = {b: app.epoch_steps(b) for b in candidates}
        # An epoch's work in trace seconds: its steps at the job's own batch, at the
        # reference placement.
        reference = self.reference_time(job)
        own_steps = app.epoch_steps(own)
        batches: list[int] = []
        phases: list[tuple[float, float]] = []
        total = 0.0
        for epoch in range(app.max_epochs):
            batch = min(candidates, key=lambda b: (steps[b][epoch] * times[b], b))
            seconds = steps[batch][epoch] * times[batch]
            work = own_steps[epoch] * reference
            batches.append(batch)
            if work > 0 and seconds > 0:
                phases.append((work, work / seconds))
            total += seconds
        cached = _Phased(tuple(batches), SpeedCurve.of(phases), total)
        self._phased[key] = cached
        return cached

    def speed_curve(self, job: TraceJob, per_node: Sequence[int]) -> SpeedCurve | None:
        """adaptive-epoch: the speed there by work left; other modes: None (`speed`)."""
        if self._batch != "adaptive-epoch":
            return None
        return self._phases(job, per_node).curve

    def _fixed_time(self, job: TraceJob, per_node: Sequence[int], batch: int) -> float:
        key = (job.model_name, batch, normalize_placement(per_node))
        cached = self._times.get(key)
        if cached is None:
            cached = self.app(job).iteration_time(tuple(c for c in per_node if c > 0), batch)
            self._times[key] = cached
        return cached

    def iteration_time(self, job: TraceJob, per_node: Sequence[int]) -> float:
        return self._fixed_time(job, per_node, self.batch_on(job, per_node))

    def _run_time(self, job: TraceJob, per_node: Sequence[int]) -> float:
        """Seconds to train the whole job on this placement."""
        if self._batch == "adaptive":
            return self._adaptive(job, per_node)[1]
        if self._batch == "adaptive-epoch":
            return self._phases(job, per_node).seconds
        iterations = self.app(job).iterations(self.batch_at(job, sum(per_node)))
        return iterations * self.iteration_time(job, per_node)

    def reference_time(self, job: TraceJob) -> float:
        """Seconds per step at the job's requested size, packed, at its own batch."""
        return self._fixed_time(job, packed(job.gpus, self._gpus_per_node), job.batch_size or 0)

    def speed(self, job: TraceJob, per_node: Sequence[int]) -> float:
        if self._batch == "global":
            return self.reference_time(job) / self.iteration_time(job, per_node)
        # The trace duration: its own batch, at its requested size, packed.
        reference = self.app(job).iterations(job.batch_size or 0) * self.reference_time(job)
        return reference / self._run_time(job, per_node)

    def throughput(self, job: TraceJob, per_node: Sequence[int]) -> float:
        if self._batch in ("adaptive", "adaptive-epoch"):
            app = self.app(job)
            # Progress to make, in samples at the initial batch (whose gain is 1).
            useful = app.init_batch_size * app.iterations(app.init_batch_size)
            return useful / self._run_time(job, per_node)
        return self.batch_at(job, sum(per_node)) / self.iteration_time(job, per_node)


def is_pollux_workload(columns: Sequence[str]) -> bool:
    return all(c in columns for c in POLLUX_COLUMNS)


def default_apps_dir(workload: Path) -> Path:
    """`../apps` beside the workload's directory, as in ../shared/data/pollux."""
    return workload.resolve().parent.parent / "apps"


def load_pollux_workload(
    path: str | Path,
    apps: dict[str, PolluxApp],
    *,
    gpus_per_node: int,
    elastic: ElasticRange | None = ElasticRange(),
) -> tuple[TraceJob, ...]:
    """Every job of a Pollux workload, as trace jobs: `duration_s` is the job's run time
    at its requested size packed on `gpus_per_node`-GPU nodes; `elastic` (None: rigid)
    gives each job its min..max range."""
    name = str(path)
    rows = _read_rows(Path(path))
    scaling = PolluxScaling(apps, gpus_per_node)
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for line, row in enumerate(rows, start=2):
        job_id = (row.get("name") or "").strip()
        if not job_id or job_id in seen:
            raise TraceError("missing or duplicate name", path=name, line=line, column="name")
        seen.add(job_id)
        application = (row.get("application") or "").strip()
        app = apps.get(application)
        if app is None:
            raise TraceError(
                f"no scaling data for {application!r}", path=name, line=line, column="application"
            )
        submit, replicas, batch = _floats(
            row, ("time", "num_replicas", "batch_size"), Path(path), line
        )
        trace_number(submit, row["time"], path=name, line=line, column="time")
        for column, value in (("num_replicas", replicas), ("batch_size", batch)):
            if value < 1 or value != int(value):
                raise TraceError(
                    f"{row[column]!r} is not a whole number >= 1",
                    path=name,
                    line=line,
                    column=column,
                )
        job = TraceJob(
            job_id=job_id,
            gpus=int(replicas),
            submit_time=submit,
            duration_s=0.0,
            model_name=application,
            batch_size=int(batch),
        )
        seconds = app.iterations(int(batch)) * scaling.reference_time(job)
        bounds = None if elastic is None else elastic.of(app, int(replicas), int(batch))
        low, high = (None, None) if bounds is None else bounds
        jobs.append(
            TraceJob(
                job_id=job_id,
                gpus=int(replicas),
                submit_time=submit,
                duration_s=seconds,
                iterations=round(app.iterations(int(batch))),
                model_name=application,
                batch_size=int(batch),
                min_gpus=low,
                max_gpus=high,
            )
        )
    if not jobs:
        raise TraceError("the workload has no jobs", path=name)
    return tuple(sorted(jobs, key=lambda j: j.submit_time))
