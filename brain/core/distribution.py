"""The distribution of job service (GPU-seconds) and the Gittins index over it.

Tiresias' 2D-Gittins ranks a job by the chance that it finishes within the next
quantum of service, per unit of service it is expected to use in that quantum, given
the service it has attained. The distribution is learned online: the shell (or the
simulator) adds every finished job's service with `with_sample`, on top of a prior of
weighted pseudo-samples, so the index is useful before many jobs have finished.

Finished jobs alone are a biased sample while a cluster runs: the long jobs are the
last to finish, so early on the distribution sees mostly short ones. A job that has
run X GPU-seconds without finishing says that its total exceeds X (a right-censored
sample); `with_censored` folds those in with the Kaplan-Meier estimate, which is the
unbiased estimate of the distribution from events and censored observations together.

Immutable: `with_sample` returns a new distribution, so a snapshot can hold one.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import add
from typing import Final


@dataclass(frozen=True, slots=True)
class ServiceDistribution:
    # Sorted sample values (GPU-seconds) and, aligned with them, running totals of
    # their weights and of weight x value, so that any tail sum is two look-ups.
    values: tuple[float, ...]
    cumulative_weight: tuple[float, ...]
    cumulative_weighted_value: tuple[float, ...]
    observed: int = 0

    @staticmethod
    def from_samples(
        samples: tuple[float, ...] | list[float], *, weight_each: float = 1.0
    ) -> ServiceDistribution:
        ordered = sorted(samples)
        return ServiceDistribution(
            values=tuple(ordered),
            cumulative_weight=tuple(accumulate(weight_each for _ in ordered)),
            cumulative_weighted_value=tuple(accumulate(weight_each * v for v in ordered)),
        )

    @staticmethod
    def log_uniform_prior(
        low: float, high: float, *, points: int = 24, total_weight: float = 8.0
    ) -> ServiceDistribution:
        """Pseudo-samples spread evenly in log space: a weak, scale-free prior."""
        ratio = (high / low) ** (1.0 / max(points - 1, 1))
        samples = [low * ratio**i for i in range(points)]
        return ServiceDistribution.from_samples(samples, weight_each=total_weight / points)

    def with_sample(self, value: float) -> ServiceDistribution:
        """A copy that has also seen one finished job's service (weight 1).

        The running totals above the new sample each grow by the same amount, added
        with `map` (no Python-level loop): the simulator adds every finished job, and
        rebuilding the totals one Python step per sample made learning quadratic in
        the trace (37 % of a 9,953-job replay)."""
        at = bisect.bisect_right(self.values, value)
        weights, weighted = self.cumulative_weight, self.cumulative_weighted_value
        below_w = weights[at - 1] if at else 0.0
        below_v = weighted[at - 1] if at else 0.0
        return ServiceDistribution(
            values=(*self.values[:at], value, *self.values[at:]),
            cumulative_weight=(*weights[:at], below_w + 1.0, *map(add, weights[at:], repeat(1.0))),
            cumulative_weighted_value=(
                *weighted[:at],
                below_v + value,
                *map(add, weighted[at:], repeat(value)),
            ),
            observed=self.observed + 1,
        )

    def with_samples(self, samples: Iterable[float]) -> ServiceDistribution:
        """A copy that has also seen these finished jobs' service (weight 1 each): one
        merge, where calling `with_sample` for each would copy the tuples every time."""
        added = list(samples)
        merged = sorted(
            [
                *zip(self.values, _weights(self.cumulative_weight), strict=True),
                *((v, 1.0) for v in added),
            ],
            key=lambda pair: pair[0],
        )
        return ServiceDistribution(
            values=tuple(v for v, _ in merged),
            cumulative_weight=tuple(accumulate(w for _, w in merged)),
            cumulative_weighted_value=tuple(accumulate(w * v for v, w in merged)),
            observed=self.observed + len(added),
        )

    def with_censored(self, censored: Iterable[float]) -> ServiceDistribution:
        """The Kaplan-Meier estimate from this distribution's samples (finished jobs,
        and the prior's pseudo-samples, as events) and `censored`: the attained
        service of jobs that have not finished (each says only that its total is
        larger). Each sample keeps its value and gets the estimate's probability mass
        there: S(t-) x d / n, with n the weight still at risk at t (samples and
        censored jobs at or above it). Mass the samples leave (censored jobs beyond
        the largest sample) goes to the largest censored value, the least it can be.
        The weights are scaled to sum to the samples' weight plus the censored jobs,
        so the index (a ratio) is unchanged by the scale.

        O(samples + censored log censored); the result is for ranking, not for
        `with_sample` (add finished jobs to the uncensored distribution)."""
        cut = sorted(c for c in censored if c > 0.0)
        values = self.values
        if not cut or not values:
            return self
        cumulative = self.cumulative_weight
        total = cumulative[-1]
        n_censored = len(cut)
        survival = 1.0
        masses: list[float] = []
        append = masses.append
        before = 0.0
        at = 0
        left = bisect.bisect_left
        for value, upto in zip(values, cumulative, strict=True):
            at = left(cut, value, at)
            at_risk = total - before + (n_censored - at)
            mass = survival * (upto - before) / at_risk
            append(mass)
            survival -= mass
            before = upto
        out_values: tuple[float, ...] = values
        if survival > 1e-12 and cut[-1] > values[-1]:
            out_values = (*values, cut[-1])
            append(survival)
        scale = total + n_censored
        weights = [m * scale for m in masses]
        return ServiceDistribution(
            values=out_values,
            cumulative_weight=tuple(accumulate(weights)),
            cumulative_weighted_value=tuple(
                accumulate(w * v for w, v in zip(weights, out_values, strict=True))
            ),
            observed=self.observed,
        )

    def blended(self, pooled: ServiceDistribution, weight: float) -> ServiceDistribution:
        """These samples, and `pooled`'s scaled to weigh `weight` in all: a class's
        own distribution shrunk toward the pooled one, which dominates while the class
        has few samples and fades as it gathers more than `weight`."""
        if not pooled.values or weight <= 0.0:
            return self
        scale = weight / pooled.cumulative_weight[-1]
        own = _weights(self.cumulative_weight)
        theirs = [w * scale for w in _weights(pooled.cumulative_weight)]
        merged = sorted(
            [*zip(self.values, own, strict=True), *zip(pooled.values, theirs, strict=True)],
            key=lambda pair: pair[0],
        )
        return ServiceDistribution(
            values=tuple(v for v, _ in merged),
            cumulative_weight=tuple(accumulate(w for _, w in merged)),
            cumulative_weighted_value=tuple(accumulate(w * v for v, w in merged)),
            observed=self.observed,
        )

    def gittins_index(self, attained: float, quantum: float) -> float:
        """P(S <= a + q | S > a) / E[min(S, a + q) - a | S > a]; higher runs first.

        A job past every sample is given 0, the lowest rank, as Tiresias does: the
        distribution says nothing about it except that it is very long. For many
        services at one quantum (a cycle's), `gittins_indexer` works the tail sums
        out once."""
        return self.gittins_indexer(quantum)(attained)

    def gittins_indexer(self, quantum: float) -> Callable[[float], float]:
        """`gittins_index` at `quantum`, for many services in turn: the tail sums are
        worked out once, so that each index is two bisections and a few operations (a
        `gittins` cycle asks for one per distinct service among its jobs, thousands)."""
        values = self.values
        if not values:
            return lambda attained: 0.0
        total_w, total_v = self.cumulative_weight[-1], self.cumulative_weighted_value[-1]
        # What lies above the first `at` samples: `tail_w[at]`, `tail_v[at]`.
        tail_w = [total_w - below for below in (0.0, *self.cumulative_weight)]
        tail_v = [total_v - below for below in (0.0, *self.cumulative_weighted_value)]
        right = bisect.bisect_right

        def index(attained: float) -> float:
            at = right(values, attained)
            above_w = tail_w[at]
            if above_w <= 0.0:
                return 0.0
            beyond = right(values, attained + quantum)
            beyond_w = tail_w[beyond]
            finishing_w = above_w - beyond_w
            finishing_service = (tail_v[at] - tail_v[beyond]) - attained * finishing_w
            expected_service = finishing_service + quantum * beyond_w
            if expected_service <= 0.0:
                return math.inf
            return finishing_w / expected_service

        return index

    def scaled_gittins_remaining(self, scale: float, done: float) -> float | None:
        """The reciprocal of the Gittins index of a job whose total is `scale` x a
        sample of this distribution (its samples are ratios: actual total over what
        the job believes), after `done` of it: min over look-aheads D of
        E[min(R, D) | R > 0] / P(R <= D | R > 0), R = scale x sample - done, D at
        every sample above (the index's supremum lies at one of them). It is the
        remaining work the job is worth ranking by: exactly what is left when the
        distribution is one point, and more than the expectation says where a long
        tail is likely (a job likely to finish soon ranks ahead of one whose
        expected remainder is the same but which may run much longer).

        None when no sample lies above `done / scale` (the job has outrun every
        ratio seen): the distribution says nothing more about it."""
        values = self.values
        if not values or scale <= 0.0:
            return None
        start = bisect.bisect_right(values, done / scale)
        if start >= len(values):
            return None
        weights, weighted = self.cumulative_weight, self.cumulative_weighted_value
        base_w = weights[start - 1] if start else 0.0
        base_v = weighted[start - 1] if start else 0.0
        total_w = weights[-1] - base_w
        # Look ahead to sample k: the finishing samples' work still to do, plus that
        # look-ahead for each of the rest, per unit of finishing weight. One
        # generator (no indexing) as it runs for every job of every cycle.
        best = min(
            (
                scale * (upto_v - base_v)
                - done * (upto_w - base_w)
                + (scale * value - done) * (total_w - (upto_w - base_w))
            )
            / (upto_w - base_w)
            for value, upto_w, upto_v in zip(
                values[start:], weights[start:], weighted[start:], strict=True
            )
        )
        return max(best, 0.0)

    def remaining_indexer(self) -> Callable[[float, float], float | None]:
        """`scaled_gittins_remaining` for many (scale, done) in turn, the same values
        (to rounding) for each: worked out once in time linear in the samples, then each
        a bisection and a short walk, where `scaled_gittins_remaining` goes over every
        sample above `done / scale` (`progress-gittins` asks for one per waiting job
        per cycle; `gittins-size` one per service seen).

        Why it holds: with `W_k`, `V_k` the running totals up to sample k, `v_k` its
        value and `x = done / scale`, the look-ahead to sample k (at or above the
        first sample above x, `s`) is worth `scale` x the slope from the point
        P = (W_{s-1}, V_{s-1} + x (W - W_{s-1})) to Q_k = (W_k, A_k), where
        A_k = V_k + v_k (W - W_k) and W is the total weight. The Q_k do not depend on
        the query, and P lies left of every Q_k with k >= s (weights are positive),
        so the least slope is at a vertex of the lower convex hull of Q_s, Q_{s+1},
        ...; along that chain the slope from P falls and then rises. The chain of each
        suffix is Q_s and then the chain of the suffix its first vertex after Q_s
        begins (`after`), so one pass from the right builds them all."""
        values = self.values
        if not values:
            return lambda scale, done: None
        weights, weighted = self.cumulative_weight, self.cumulative_weighted_value
        total = weights[-1]
        heights = [
            v_k + value * (total - w_k)
            for value, w_k, v_k in zip(values, weights, weighted, strict=True)
        ]
        after = [-1] * len(values)
        chain: list[int] = []  # the lower hull of the suffix, its first vertex last
        for start in range(len(values) - 1, -1, -1):
            x0, y0 = weights[start], heights[start]
            while len(chain) >= 2:
                a, b = chain[-1], chain[-2]
                # `a` is off the hull unless the slope from `start` to it is below the
                # slope from it to `b` (cross-multiplied: both runs are positive).
                if (heights[a] - y0) * (weights[b] - weights[a]) < (heights[b] - heights[a]) * (
                    weights[a] - x0
                ):
                    break
                chain.pop()
            after[start] = chain[-1] if chain else -1
            chain.append(start)
        right = bisect.bisect_right

        def remaining(scale: float, done: float) -> float | None:
            if scale <= 0.0:
                return None
            x = done / scale
            start = right(values, x)
            if start >= len(values):
                return None
            base_w = weights[start - 1] if start else 0.0
            base_v = weighted[start - 1] if start else 0.0
            height = base_v + x * (total - base_w)
            at = start
            best = (heights[at] - height) / (weights[at] - base_w)
            while (ahead := after[at]) >= 0:
                slope = (heights[ahead] - height) / (weights[ahead] - base_w)
                if slope >= best:
                    break
                at, best = ahead, slope
            return max(scale * best, 0.0)

        return remaining

    def gittins_index_exact(self, attained: float) -> float:
        """The Gittins index of a job that has attained this much service, over
        every look-ahead (the supremum, which lies at a sample): what Gittins' policy
        ranks by, and which minimises mean response time on one server when the
        distribution is the jobs' own. Not tied to a quantum, so it fits a
        distribution of any scale. 0 past the largest sample, as `gittins_index`."""
        left = self.scaled_gittins_remaining(1.0, attained)
        if left is None:
            return 0.0
        return math.inf if left <= 0.0 else 1.0 / left

    def compressed(self, points: int) -> ServiceDistribution:
        """At most `points` samples: consecutive samples of about equal total weight
        merged into one at their weighted mean (so the mean is kept). For ranking
        many jobs against a distribution of many samples, each look-up linear in
        the samples."""
        values = self.values
        if len(values) <= points:
            return self
        total = self.cumulative_weight[-1]
        out_w: list[float] = []
        out_v: list[float] = []
        before_w = before_v = 0.0
        at = 0
        for group in range(1, points + 1):
            target = total * group / points
            at = max(at, bisect.bisect_left(self.cumulative_weight, target - 1e-9 * total))
            if group == points:
                at = len(values) - 1
            upto_w, upto_v = self.cumulative_weight[at], self.cumulative_weighted_value[at]
            weight = upto_w - before_w
            if weight > 0.0:
                out_w.append(weight)
                out_v.append((upto_v - before_v) / weight)
            before_w, before_v = upto_w, upto_v
            at += 1
            if at >= len(values):
                break
        return ServiceDistribution(
            values=tuple(out_v),
            cumulative_weight=tuple(accumulate(out_w)),
            cumulative_weighted_value=tuple(
                accumulate(w * v for w, v in zip(out_w, out_v, strict=True))
            ),
            observed=self.observed,
        )

    def gittins_index_tiresias(self, attained: float, quantum: float) -> float:
        """The index as Tiresias' simulator computes it (`get_gittins_index` over
        `cal_r_gittins_index`), quirks kept: it is read at the first sample above the
        attained service (a step function), a job past the largest sample gets 0, the
        look-ahead past the largest sample leaves that sample out, and the expected
        service sums the finishing jobs' *whole* service rather than what is left of it
        (so a job with more service ranks lower than the exact index says)."""
        values = self.values
        # At or past the largest sample no sample lies above: 0, as Tiresias' look-up
        # gives (its table ends with 0 at `sys.maxint`).
        if not values or attained >= values[-1]:
            return 0.0
        point = values[bisect.bisect_right(values, attained)] - 1.0
        if point > values[-1] - 1.0:
            return 0.0
        total_w = self.cumulative_weight[-1]
        at = bisect.bisect_right(values, point)
        ahead = point + quantum
        beyond_at = (
            len(values) - 1 if ahead > values[-1] - 1.0 else bisect.bisect_right(values, ahead)
        )
        below_w = self.cumulative_weight[at - 1] if at else 0.0
        below_v = self.cumulative_weighted_value[at - 1] if at else 0.0
        upto_w = self.cumulative_weight[beyond_at - 1] if beyond_at else 0.0
        upto_v = self.cumulative_weighted_value[beyond_at - 1] if beyond_at else 0.0
        above_w = total_w - below_w
        if above_w <= 0.0:
            return 0.0
        finishing = (upto_w - below_w) / above_w
        expected = ((upto_v - below_v) + quantum * (total_w - upto_w)) / above_w
        return 0.0 if expected <= 0.0 else finishing / expected


def _weights(cumulative: tuple[float, ...]) -> list[float]:
    """Each sample's weight, from the running totals (none for `NO_SAMPLES`)."""
    return [w - p for w, p in zip(cumulative, (0.0, *cumulative)[: len(cumulative)], strict=True)]


def gpu_class(gpus: int) -> int:
    """The size class of a job asking `gpus` GPUs: 1, 2, 3-4, 5-8, 9-16, ... are
    classes 0, 1, 2, 3, 4, ...: jobs of one scale of parallelism, whatever the exact
    count (GPU counts are mostly powers of two)."""
    return max(0, (gpus - 1).bit_length())


# How many jobs' worth of weight the pooled distribution has in each class's: a class
# with fewer finished jobs than this ranks mostly by the pooled distribution.
CLASS_SHRINK_WEIGHT = 16.0


@dataclass(frozen=True, slots=True)
class ServiceByClass:
    """The service distribution of each size class (`gpu_class`), each already
    shrunk toward the pooled one (`ServiceDistribution.blended`): what is known at
    submission that is not the duration (how many GPUs a job asks) conditions what
    its service is likely to be. A class not listed has only the pooled one."""

    classes: tuple[tuple[int, ServiceDistribution], ...]

    def of(self, gpus: int) -> ServiceDistribution | None:
        wanted = gpu_class(gpus)
        for cls, distribution in self.classes:
            if cls == wanted:
                return distribution
        return None


def by_size_class(
    finished: Mapping[int, ServiceDistribution],
    unfinished: Iterable[tuple[int, float]],
    pooled: ServiceDistribution,
) -> ServiceByClass:
    """Each size class's distribution, as the live brain and the simulator both derive
    it: the class's finished jobs (`finished`, by class), the (GPUs, service so far) of
    its jobs not finished yet as censored samples, shrunk toward `pooled`
    (`CLASS_SHRINK_WEIGHT`). Only classes with a finished job are listed."""
    censored: dict[int, list[float]] = {}
    for gpus, service in unfinished:
        censored.setdefault(gpu_class(gpus), []).append(service)
    return ServiceByClass(
        tuple(
            (
                size_class,
                own.with_censored(censored.get(size_class, ())).blended(
                    pooled, CLASS_SHRINK_WEIGHT
                ),
            )
            for size_class, own in sorted(finished.items())
        )
    )


DEFAULT_SERVICE_PRIOR = ServiceDistribution.log_uniform_prior(10.0, 1.0e7)
# A distribution that has seen nothing: where a size class's own samples start.
NO_SAMPLES = ServiceDistribution((), (), ())

# What a job's actual total is, as a multiple of the total it believes (its progress
# reports' step / total steps): a weak prior, log-uniform from a quarter to four
# times, that the ratios of finished jobs soon outweigh.
DEFAULT_ERROR_PRIOR = ServiceDistribution.log_uniform_prior(0.25, 4.0, points=16, total_weight=4.0)
# What `progress-gittins` reads of the learned errors: compressed to this many samples
# (each job's rank is linear in them).
ERROR_POINTS: Final = 64
# The latest finished jobs' errors learned from (`BeliefErrors`): memory stays bounded
# and the distribution follows the jobs the cluster runs now.
ERROR_SAMPLES: Final = 10_000


class BeliefErrors:
    """What finished jobs' progress reports turned out to be off by, learned online on
    `DEFAULT_ERROR_PRIOR`, as the live brain (brain/progress.py) and the simulator both
    learn it. A job's error is the time it ran over the total its reports implied: they
    said a fraction `rate_per_s` of the work was done each second, so the whole would
    take 1 / rate. `view` is what `progress-gittins` ranks by
    (`ClusterSnapshot.error_distribution`).

    Kept: the latest `keep` errors to twice as many. Each is added to the distribution
    as it comes (linear in the samples, in C); once it holds twice `keep`, it is built
    again from the latest `keep` alone."""

    def __init__(self, keep: int = ERROR_SAMPLES) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self._keep = keep
        self._latest: deque[float] = deque(maxlen=keep)
        self._learned = DEFAULT_ERROR_PRIOR
        self.view = DEFAULT_ERROR_PRIOR

    def learn(self, executed_s: float, rate_per_s: float) -> None:
        """A job finished after running `executed_s` seconds; its reports last said it
        did `rate_per_s` of its work a second. A ratio that is not a positive number
        (no run, no rate) teaches nothing."""
        ratio = executed_s * rate_per_s
        if not (ratio > 0.0 and math.isfinite(ratio)):
            return
        self._latest.append(ratio)
        if self._learned.observed >= 2 * self._keep:
            self._learned = DEFAULT_ERROR_PRIOR.with_samples(self._latest)
        else:
            self._learned = self._learned.with_sample(ratio)
        self.view = self._learned.compressed(ERROR_POINTS)

    @property
    def learned(self) -> int:
        """How many finished jobs' errors the distribution holds."""
        return self._learned.observed

    @property
    def latest(self) -> tuple[float, ...]:
        """The latest errors learned, oldest first (`keep` at most)."""
        return tuple(self._latest)
