"""Goodput: how fast a data-parallel job trains, not only how many samples it reads.

Pollux's (AdaptDL's) model, for jobs that adapt their batch size to the GPUs they get
(`workloads/adaptive_batch.py` does it for Horovod jobs; the simulator's `--batch
adaptive-epoch` models the same). Pure arithmetic: no torch, no horovod.

- **Gradient noise.** With local batch `b` on each of `n` workers, a worker's gradient
  has expected squared norm `|G|^2 + tr(S)/b` and the average over workers
  `|G|^2 + tr(S)/(n b)` (`G` the true gradient, `S` the per-sample covariance). One
  step's two norms give unbiased estimates of both (`GradientNoise.update`), smoothed
  over steps.
- **Statistical efficiency.** A step at global batch `B = s * B0` makes the progress of
  `gain(s) = (var + sqr) / (var / s + sqr)` steps at the base batch `B0`, so a sample
  at `B` is worth `gain(s) / s` of one at `B0` (1 at `B0`, less above it).
- **Goodput** = samples/s x that efficiency: samples/s at the base batch's worth, the
  unit the brain compares world sizes in.
- **Step time** of one worker at local batch `b`: a part that grows with the batch
  (forward and backward, per sample) and a part that does not (gradient allreduce,
  fixed costs), each measured (`StepTiming`).

`choose_local_batch` picks the local batch with the best goodput for a world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

# Weight of the newest observation in the moving averages.
SMOOTHING: Final = 0.1


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def statistical_gain(sqr: float, var: float, scale: float) -> float:
    """Progress of one step at `scale` times the base batch, in base-batch steps, for a
    gradient of squared norm `sqr` and per-sample variance `var` (`scale` when the
    statistics say nothing)."""
    below = var / scale + sqr
    return (var + sqr) / below if below > 0 else scale


@dataclass(slots=True)
class GradientNoise:
    """Smoothed estimates of `|G|^2` (`sqr`) and `tr(S)` (`var`), per sample."""

    sqr: float | None = None
    var: float | None = None

    @property
    def known(self) -> bool:
        return self.sqr is not None and self.var is not None

    def update(self, local_sqr: float, global_sqr: float, local_batch: int, workers: int) -> None:
        """Fold in one step: `local_sqr` the workers' mean squared norm of their own
        gradient (each over `local_batch` samples), `global_sqr` the squared norm of
        their average. Needs two or more gradients (`workers` >= 2)."""
        if workers < 2 or local_batch < 1:
            raise ValueError(f"noise needs two gradients or more, not {workers}")
        if not (math.isfinite(local_sqr) and math.isfinite(global_sqr)):
            return
        small, big = local_batch, local_batch * workers
        var = max((local_sqr - global_sqr) / (1.0 / small - 1.0 / big), 0.0)
        sqr = max(global_sqr - var / big, 0.0)
        self.var = _blend(self.var, var, SMOOTHING)
        self.sqr = _blend(self.sqr, sqr, SMOOTHING)

    def gain(self, scale: float) -> float:
        """Progress of one step at `scale` times the base batch, in base-batch steps
        (`scale` with no noise estimate yet: linear scaling assumed)."""
        if scale <= 0:
            raise ValueError(f"scale must be positive, not {scale}")
        if self.sqr is None or self.var is None:
            return scale
        return statistical_gain(self.sqr, self.var, scale)

    def efficiency(self, scale: float) -> float:
        """What one sample at `scale` times the base batch is worth, in base-batch
        samples (1 at the base batch, less above it)."""
        return self.gain(scale) / scale


@dataclass(slots=True)
class StepTiming:
    """One worker's step time as `fixed_s + per_sample_s * local_batch`, smoothed."""

    per_sample_s: float | None = None
    fixed_s: float | None = None

    def observe(self, compute_s: float, total_s: float, local_batch: int) -> None:
        """`compute_s`: the part that grows with the batch (forward and backward);
        `total_s`: the whole step."""
        if local_batch < 1 or compute_s < 0 or total_s < compute_s:
            return
        self.per_sample_s = _blend(self.per_sample_s, compute_s / local_batch, SMOOTHING)
        self.fixed_s = _blend(self.fixed_s, total_s - compute_s, SMOOTHING)

    def step_s(self, local_batch: int) -> float | None:
        if self.per_sample_s is None or self.fixed_s is None:
            return None
        return self.fixed_s + self.per_sample_s * local_batch


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The batches a job may train with: `base` is the local batch its learning rate
    was tuned for on one worker (`B0`)."""

    base: int
    min_local: int
    max_local: int
    max_global: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_local <= self.base <= self.max_local:
            raise ValueError(
                f"need 1 <= min local ({self.min_local}) <= base ({self.base}) "
                f"<= max local ({self.max_local}) batch"
            )
        if self.max_global < self.base:
            raise ValueError(
                f"max global batch {self.max_global} is below the base batch {self.base}"
            )

    def candidates(self, workers: int) -> list[int]:
        """Local batches to consider on `workers` workers: doublings and halvings of
        the base, within the limits."""
        top = min(self.max_local, max(self.min_local, self.max_global // max(workers, 1)))
        found = {min(self.base, top)}
        size = self.base
        while size * 2 <= top:
            size *= 2
            found.add(size)
        size = self.base
        while size // 2 >= self.min_local:
            size //= 2
            found.add(size)
        return sorted(b for b in found if b <= top)


@dataclass(frozen=True, slots=True)
class BatchChoice:
    local_batch: int
    # Predicted goodput there, base-batch samples/s (None: no timing measured yet).
    goodput: float | None
    # The learning-rate multiplier for it (AdaScale: the gain over the base batch).
    lr_scale: float


def goodput(
    noise: GradientNoise, timing: StepTiming, limits: BatchLimits, workers: int, local: int
) -> float | None:
    step_s = timing.step_s(local)
    if step_s is None or step_s <= 0:
        return None
    scale = workers * local / limits.base
    return workers * local / step_s * noise.efficiency(scale)


def choose_local_batch(
    noise: GradientNoise, timing: StepTiming, limits: BatchLimits, workers: int
) -> BatchChoice:
    """The local batch with the best predicted goodput on `workers` workers; the base
    batch (within the limits) until both the noise and the step time are measured."""
    options = limits.candidates(workers)
    best = min(options, key=lambda b: abs(b - limits.base))
    best_goodput = None
    if noise.known:
        for local in options:
            value = goodput(noise, timing, limits, workers, local)
            if value is not None and (best_goodput is None or value > best_goodput):
                best, best_goodput = local, value
    scale = workers * best / limits.base
    return BatchChoice(best, best_goodput, noise.gain(scale))
