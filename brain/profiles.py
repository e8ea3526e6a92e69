"""Per-job GPU utilisation profiles: what a running job does with the GPUs it holds, and
what it will do over the next window (the seed profiler's analyzer, inside the brain).

Three parts, kept apart:

- the analysis: pure functions over numbers (`percentile`, `autocorrelation`,
  `detect_period`, `forecast`, `analyse`). No clock, no I/O; tested table-driven on
  recorded telemetry.
- `Profiler`, the brain's collector: a telemetry observer that files each GPU sample
  under the job holding that GPU and recomputes a job's profile at most every
  `recompute_s`, doing a bounded amount of work per call so the brain's loop never
  stalls. It reads the brain's running jobs through a callable and never changes
  brain state.
- `ProfileStore`, the sqlite table profiles are kept in, so `alnair job` shows a
  finished job's profile and a restarted brain still has it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import statistics
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import mul
from pathlib import Path
from typing import Final

import sqlite_utils

from brain.core.model import GpuMemory, UtilizationProfile
from schemas.jobs import JobRecord, JobState
from schemas.profiles import JobProfile
from schemas.state import JobChanged, StateRecord
from schemas.telemetry import GpuSample, GpuShares, TelemetryBatch

log = logging.getLogger(__name__)

# One histogram bin per whole percent of utilisation, 0..100: p95 over a whole run in
# constant memory.
UTIL_BINS: Final = 101
# A job's period is taken as the first autocorrelation peak that is at least this
# fraction of the highest one: the fundamental rather than one of its multiples.
FUNDAMENTAL_SHARE: Final = 0.9
# Forecasts average this many of the most recent cycles (seasonal naive, less noise).
FORECAST_CYCLES: Final = 3


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    # Period detection and the forecast look at this much recent telemetry.
    window_s: float = 600.0
    # The forecast covers this much of the future.
    horizon_s: float = 60.0
    # The window is resampled to at most this many points (bounds the autocorrelation).
    max_points: int = 240
    # A period must repeat at least this many times in the window to count.
    min_cycles: int = 2
    # ... and its autocorrelation peak must reach this.
    min_period_acf: float = 0.3
    # A GPU whose mean utilisation is below this is "barely used".
    idle_util_pct: float = 10.0
    # Do not judge a GPU idle on fewer samples than this.
    min_samples_to_judge: int = 30
    # Recompute a job's profile at most this often.
    recompute_s: float = 5.0
    # Profiles recomputed per call at most, so a big cluster never stalls the loop...
    max_refresh_per_call: int = 64
    # ... and no more once a call has spent this long (CPU-bound: a profile over a
    # full window takes about a millisecond, so 64 of them held the loop for tens of
    # ms at 1,000 running jobs); the stalest go first, the rest at the next call. What
    # a call holds the loop for is what a request arriving meanwhile waits.
    refresh_budget_s: float = 0.002


@dataclass(frozen=True, slots=True)
class Reading:
    """A job at one instant: mean utilisation over its GPUs, memory of its busiest GPU."""

    ts: float
    util_pct: float
    mem_mib: float


@dataclass(frozen=True, slots=True)
class RunTotals:
    """Whole-run aggregates of a job's GPU samples."""

    samples: int
    util_sum: float
    # Sample counts per whole percent of utilisation (UTIL_BINS bins).
    util_hist: tuple[int, ...]
    mem_peak_mib: float
    # Per held GPU: (mean utilisation, samples).
    per_gpu: tuple[tuple[float, int], ...]
    # The memory of its largest GPU (0: not reported), which no forecast passes.
    mem_total_mib: float = 0.0


# -- the analysis (pure) ----------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def histogram_percentile(hist: Sequence[int], q: float) -> float:
    """The q-th percentile (nearest rank) of values binned one per unit from 0."""
    total = sum(hist)
    if total == 0:
        raise ValueError("percentile of an empty histogram")
    rank = max(1, math.ceil(total * q / 100.0))
    seen = 0
    for value, count in enumerate(hist):
        seen += count
        if seen >= rank:
            return float(value)
    return float(len(hist) - 1)


def autocorrelation(values: Sequence[float], max_lag: int) -> tuple[float, ...]:
    """The sample autocorrelation r(0..max_lag) (the biased estimator, as statsmodels' acf).

    Empty when the series is constant: a flat line has no pattern to find.
    """
    n = len(values)
    max_lag = min(max_lag, n - 1)
    if n < 2 or max_lag < 0:
        return ()
    mean = sum(values) / n
    dev = [v - mean for v in values]
    variance = sum(d * d for d in dev)
    if variance <= 1e-12 * n:
        return ()
    # Each lag's sum of products with `map` (the same products, summed in the same
    # order): it runs for every running job every `recompute_s`, over up to `max_points`
    # points and half as many lags, and a generator per lag made it 1.4 ms a job.
    return tuple(sum(map(mul, dev, dev[lag:])) / variance for lag in range(max_lag + 1))


def detect_period(
    values: Sequence[float], *, min_cycles: int = 2, min_acf: float = 0.3
) -> float | None:
    """The series' period in samples (fractional), or None when it has none.

    The seed profiler's idea: the first autocorrelation peak after the function first
    goes negative. Lags before that only echo each sample's neighbours; a peak that
    repeats at least `min_cycles` times in the series and correlates at least `min_acf`
    is a cycle. Noise, a flat line and a trend have none.
    """
    max_lag = len(values) // max(1, min_cycles)
    if max_lag < 3:
        return None
    acf = autocorrelation(values, max_lag)
    if not acf:
        return None
    # A light 3-point smoothing keeps noise wiggles from passing for peaks.
    smooth = (
        [acf[0]]
        + [(acf[k - 1] + acf[k] + acf[k + 1]) / 3.0 for k in range(1, len(acf) - 1)]
        + [acf[-1]]
    )
    first_negative = next((k for k in range(1, len(smooth)) if smooth[k] < 0), None)
    if first_negative is None:
        return None
    peaks = [
        k
        for k in range(first_negative, len(smooth) - 1)
        if smooth[k] >= smooth[k - 1] and smooth[k] > smooth[k + 1] and smooth[k] >= min_acf
    ]
    if not peaks:
        return None
    best = max(smooth[k] for k in peaks)
    lag = next(k for k in peaks if smooth[k] >= FUNDAMENTAL_SHARE * best)
    return lag + _vertex_offset(acf[lag - 1], acf[lag], acf[lag + 1])


def _vertex_offset(left: float, centre: float, right: float) -> float:
    """Where a parabola through three equally spaced points peaks, relative to the centre."""
    curvature = left - 2.0 * centre + right
    if curvature >= 0:
        return 0.0
    return max(-0.5, min(0.5, 0.5 * (left - right) / curvature))


def forecast(values: Sequence[float], *, period: float | None, horizon: int) -> tuple[float, ...]:
    """The next `horizon` values of a regularly sampled series.

    With a period: seasonal naive, averaging the last few cycles at the same phase, which
    is what a training loop does next. Without one: Holt's linear trend, damped, so a
    short rise does not run away.
    """
    if not values or horizon <= 0:
        return ()
    n = len(values)
    if period is not None and period >= 2 and n >= round(period):
        step = round(period)
        cycles = min(FORECAST_CYCLES, n // step)
        return tuple(
            statistics.fmean(values[n - c * step + h % step] for c in range(1, cycles + 1))
            for h in range(horizon)
        )
    return damped_holt(values, horizon)


def damped_holt(
    values: Sequence[float],
    horizon: int,
    *,
    alpha: float = 0.5,
    beta: float = 0.2,
    damping: float = 0.9,
) -> tuple[float, ...]:
    level = values[0]
    trend = values[1] - values[0] if len(values) > 1 else 0.0
    for value in values[1:]:
        previous = level
        level = alpha * value + (1 - alpha) * (level + damping * trend)
        trend = beta * (level - previous) + (1 - beta) * damping * trend
    out = []
    reach = 0.0
    for h in range(1, horizon + 1):
        reach += damping**h
        out.append(level + reach * trend)
    return tuple(out)


def regular(readings: Sequence[Reading], max_points: int) -> tuple[list[float], list[float], float]:
    """Utilisation and memory on a regular time grid (linear interpolation), and its step.

    Telemetry arrives roughly every interval and may be lost; the autocorrelation needs
    equal spacing. The step is the median gap, coarser when the window holds more than
    `max_points` of them.
    """
    if len(readings) < 2:
        return [r.util_pct for r in readings], [r.mem_mib for r in readings], 0.0
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(readings) if b.ts > a.ts]
    span = readings[-1].ts - readings[0].ts
    if not gaps or span <= 0:
        return [readings[-1].util_pct], [readings[-1].mem_mib], 0.0
    step = max(statistics.median(gaps), span / max(1, max_points - 1))
    util: list[float] = []
    mem: list[float] = []
    i = 0
    t = readings[0].ts
    while t <= readings[-1].ts + 1e-9:
        while i + 2 < len(readings) and readings[i + 1].ts <= t:
            i += 1
        a, b = readings[i], readings[i + 1]
        share = 0.0 if b.ts <= a.ts else min(1.0, max(0.0, (t - a.ts) / (b.ts - a.ts)))
        util.append(a.util_pct + (b.util_pct - a.util_pct) * share)
        mem.append(a.mem_mib + (b.mem_mib - a.mem_mib) * share)
        t += step
    return util, mem, step


def analyse(
    readings: Sequence[Reading], totals: RunTotals, settings: ProfileSettings
) -> UtilizationProfile:
    """A job's profile: whole-run statistics, plus period and forecast from `readings`."""
    if totals.samples == 0:
        raise ValueError("cannot profile a job with no samples")
    util, mem, step = regular(readings, settings.max_points)
    period_steps = (
        detect_period(util, min_cycles=settings.min_cycles, min_acf=settings.min_period_acf)
        if step > 0
        else None
    )
    horizon = _horizon(settings, step)
    next_util = forecast(util, period=period_steps, horizon=horizon) or (0.0,)
    idle = sum(
        1
        for mean_util, count in totals.per_gpu
        if count >= settings.min_samples_to_judge and mean_util < settings.idle_util_pct
    )
    return UtilizationProfile(
        mean_util_pct=_pct(totals.util_sum / totals.samples),
        p95_util_pct=histogram_percentile(totals.util_hist, 95),
        mem_peak_mib=totals.mem_peak_mib,
        period_s=None if period_steps is None else round(period_steps * step, 3),
        forecast_util_pct=_pct(statistics.fmean(next_util)),
        forecast_mem_mib=_memory_ahead(mem, period_steps, horizon, totals.mem_total_mib),
        underused=idle > 0,
        idle_gpus=idle,
    )


def _own(sample: GpuSample, job_id: str, shares: Sequence[tuple[str, float]]) -> GpuSample:
    """A GPU's sample as one of its jobs' own: its memory less what the GPU's other
    shares use (`Profiler._share_use`). A host's profile is then its own, for the room
    beside it (`host_room`) and the pressure on it (`memory_pressure`)."""
    others = sum(used for share, used in shares if share != job_id)
    if not others:
        return sample
    return sample.model_copy(update={"mem_used_mib": max(0.0, sample.mem_used_mib - others)})


def _horizon(settings: ProfileSettings, step: float) -> int:
    """The forecast's horizon in steps of a regular series."""
    return max(1, math.ceil(settings.horizon_s / step)) if step > 0 else 1


def _memory_ahead(
    mem: Sequence[float], period_steps: float | None, horizon: int, gpu_mib: float
) -> float:
    """The most memory forecast over the horizon. Memory is planned for its peak: a GPU
    that runs out fails the job. A trend stops at what the GPU has (a step up
    extrapolates past it)."""
    ahead = forecast(mem, period=period_steps, horizon=horizon) or (0.0,)
    return round(min(max(0.0, max(ahead)), gpu_mib or math.inf), 1)


def gpu_memory(
    per_gpu: Mapping[tuple[str, int], _GpuTotals],
    settings: ProfileSettings,
    period_s: float | None,
    gpu_mib: float,
) -> tuple[GpuMemory, ...]:
    """A shareable job's memory on each of its GPUs: its peak, and its forecast as
    `analyse` makes the busiest GPU's (with the job's period, if it has one)."""
    found: list[GpuMemory] = []
    for (node, index), totals in sorted(per_gpu.items()):
        if totals.memory is None or not len(totals.memory):
            continue
        _, mem, step = regular(totals.memory.readings(), settings.max_points)
        period = period_s / step if period_s is not None and step > 0 else None
        ahead = _memory_ahead(mem, period, _horizon(settings, step), gpu_mib)
        found.append(GpuMemory(node, index, totals.mem_peak_mib, ahead))
    return tuple(found)


def _follow_memory(gpu: _GpuTotals, ts: float, mem_mib: float, window_s: float) -> None:
    gpu.mem_peak_mib = max(gpu.mem_peak_mib, mem_mib)
    if gpu.memory is None:
        gpu.memory = _Window()
    last = gpu.memory.last_ts()
    if last is None or ts > last:
        gpu.memory.append(ts, 0.0, mem_mib)
        gpu.memory.drop_before(ts - window_s)


def _pct(value: float) -> float:
    return round(min(100.0, max(0.0, value)), 2)


# -- the collector ----------------------------------------------------------------------


class _Window:
    """A job's readings over the last window, oldest first, in flat arrays of doubles:
    24 bytes a reading and no object a reading for the cyclic garbage collector to track.
    (With a `Reading` object a second, a job's track over a 10-minute window took about
    65 KiB, 5 GB at 80,000 running jobs, and every reading passed through the
    collector's youngest generation; as arrays, about 19 KiB: bench/telemetry_memory.py.)
    Readings leave from the front as the window moves; the arrays are cut once what has
    left is a quarter of them."""

    __slots__ = ("_mem", "_start", "_ts", "_util")

    def __init__(self) -> None:
        self._ts = array("d")
        self._util = array("d")
        self._mem = array("d")
        self._start = 0

    def __len__(self) -> int:
        return len(self._ts) - self._start

    def last_ts(self) -> float | None:
        return self._ts[-1] if len(self) else None

    def append(self, ts: float, util_pct: float, mem_mib: float) -> None:
        self._ts.append(ts)
        self._util.append(util_pct)
        self._mem.append(mem_mib)

    def drop_before(self, ts: float) -> None:
        """Forget the readings older than `ts`."""
        times, start = self._ts, self._start
        while start < len(times) and times[start] < ts:
            start += 1
        if start and start * 4 >= len(times):
            del times[:start], self._util[:start], self._mem[:start]
            start = 0
        self._start = start

    def readings(self) -> tuple[Reading, ...]:
        at = self._start
        return tuple(map(Reading, self._ts[at:], self._util[at:], self._mem[at:]))


@dataclass
class _GpuTotals:
    util_sum: float = 0.0
    samples: int = 0
    # A shareable job's own memory on this GPU: its peak, and its readings over the
    # window (`UtilizationProfile.gpu_memory`); None for other jobs.
    mem_peak_mib: float = 0.0
    memory: _Window | None = None


@dataclass
class _Track:
    """One running attempt of one job, as its telemetry accumulates."""

    job_id: str
    attempt: int
    gpus: int
    # Readings come from one node: on several, the time series would interleave.
    lead_node: str
    readings: _Window = field(default_factory=_Window)
    samples: int = 0
    util_sum: float = 0.0
    util_hist: list[int] = field(default_factory=lambda: [0] * UTIL_BINS)
    mem_peak_mib: float = 0.0
    mem_total_mib: float = 0.0
    per_gpu: dict[tuple[str, int], _GpuTotals] = field(default_factory=dict)
    first_ts: float | None = None
    last_ts: float | None = None
    profile: UtilizationProfile | None = None
    shown: JobProfile | None = None
    computed_at: float = -math.inf
    fresh_samples: bool = False
    # The (node, GPU) pairs the attempt holds, as last followed.
    held: tuple[tuple[str, int], ...] = ()
    # Other jobs' shares may run on its GPUs (it is shareable, or a share itself): its
    # samples' memory is the GPU's less theirs (`_own`).
    beside: bool = False
    # A shareable job: its memory is followed per GPU too (`_GpuTotals.memory`).
    hosts: bool = False

    def add(self, node: str, ts: float, samples: Sequence[GpuSample], window_s: float) -> None:
        for sample in samples:
            util = sample.util_gpu_pct
            self.samples += 1
            self.util_sum += util
            self.util_hist[min(UTIL_BINS - 1, max(0, round(util)))] += 1
            self.mem_peak_mib = max(self.mem_peak_mib, sample.mem_used_mib)
            gpu = self.per_gpu.setdefault((node, sample.index), _GpuTotals())
            gpu.util_sum += util
            gpu.samples += 1
            if self.hosts:
                _follow_memory(gpu, ts, sample.mem_used_mib, window_s)
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        self.fresh_samples = True
        if not self.mem_total_mib:  # an attempt's GPUs keep their memory: read once
            self.mem_total_mib = max(s.mem_total_mib for s in samples)
        last = self.readings.last_ts()
        if node != self.lead_node or (last is not None and ts <= last):
            return
        self.readings.append(
            ts,
            statistics.fmean(s.util_gpu_pct for s in samples),
            max(s.mem_used_mib for s in samples),
        )
        self.readings.drop_before(ts - window_s)

    def totals(self) -> RunTotals:
        return RunTotals(
            samples=self.samples,
            util_sum=self.util_sum,
            util_hist=tuple(self.util_hist),
            mem_peak_mib=self.mem_peak_mib,
            per_gpu=tuple(
                (g.util_sum / g.samples, g.samples) for g in self.per_gpu.values() if g.samples
            ),
            mem_total_mib=self.mem_total_mib,
        )


class Profiler:
    """Files telemetry under the jobs holding the GPUs, and keeps their profiles.

    Wire it to the brain with `observe` as a telemetry observer and `on_record` as a
    record observer; `current()` gives the profiles the policy core's snapshot carries.
    """

    def __init__(
        self,
        running_jobs: Callable[[], Iterable[JobRecord]],
        *,
        store: ProfileStore,
        settings: ProfileSettings | None = None,
        clock: Callable[[], float] = time.time,
        shares: Callable[[str], Sequence[GpuShares]] = lambda node: (),
    ) -> None:
        self._running_jobs = running_jobs
        self._shares = shares
        self.store = store
        self.settings = settings or ProfileSettings()
        self.clock = clock
        self._tracks: dict[str, _Track] = {}
        # node -> GPU index -> the track of the job holding it
        self._holders: dict[str, dict[int, _Track]] = {}
        self._stale_index = True
        # Set when a profile changed in a way a placement or elasticity policy acts on.
        self._news = False
        # The running jobs' profiles, kept as they change, and the copy `current` last
        # handed out (None: something changed since): a pass that finds the same
        # mapping as the last knows no profile changed (brain/state.py).
        self._profiles: dict[str, UtilizationProfile] = {}
        self._handed_out: dict[str, UtilizationProfile] | None = None
        # The tracks by when their profile was computed, stalest first: (computed_at,
        # serial, track), pushed when a track starts and at each computation (an entry
        # whose track ended or was computed since is passed over); and the jobs whose
        # track came due without new samples, pushed again when samples come. A refresh
        # reads what is due, not every track.
        self._due: list[tuple[float, int, _Track]] = []
        self._serial = itertools.count()
        self._parked: set[str] = set()

    # -- observers (run in the brain's loop; cheap, never raise on bad luck) ------------

    def observe(self, batch: TelemetryBatch) -> None:
        if self._stale_index:
            self._reindex()
        held = self._holders.get(batch.node)
        if not held:
            return
        by_track: dict[str, list[GpuSample]] = {}
        shared: dict[int, list[tuple[str, float]]] | None = None
        for sample in batch.samples:
            track = held.get(sample.index)
            if track is None:
                continue
            if track.beside:
                if shared is None:
                    shared = self._share_use(batch)
                sample = _own(sample, track.job_id, shared.get(sample.index, ()))
            by_track.setdefault(track.job_id, []).append(sample)
        for job_id, samples in by_track.items():
            track = self._tracks[job_id]
            track.add(batch.node, batch.ts, samples, self.settings.window_s)
            if job_id in self._parked:
                self._parked.discard(job_id)
                self._queue(track)

    def _share_use(self, batch: TelemetryBatch) -> dict[int, list[tuple[str, float]]]:
        """What each share on the node's GPUs uses of its GPU's memory (job, MiB): as
        read with the batch, or, from an agent that does not send it, as its last
        heartbeat said (a second or two older than the samples)."""
        use: dict[int, list[tuple[str, float]]] = {}
        if batch.shares is not None:
            for share in batch.shares:
                use.setdefault(share.index, []).append((share.job_id, share.memory_used_mib))
            return use
        for gpu in self._shares(batch.node):
            use[gpu.index] = [(u.job_id, u.memory_used_mib or 0.0) for u in gpu.jobs]
        return use

    def resync(self) -> None:
        """Follow the running jobs afresh at the next look (state was loaded or followed
        without this profiler seeing its records)."""
        self._stale_index = True

    def on_record(self, record: StateRecord, seq: int) -> None:
        if isinstance(record, JobChanged) and not self._stale_index:
            self._follow(record.job)

    # -- views -----------------------------------------------------------------------

    def poll(self) -> bool:
        """Refresh what is due; True if some profile changed in a way policy acts on
        (a first profile, a job turning underused or back, a cycle found or lost), so
        the brain decides again even when nothing else happened."""
        self._refresh()
        news, self._news = self._news, False
        return news

    def current(self, *, refresh: bool = True) -> Mapping[str, UtilizationProfile]:
        """Profiles of the running jobs, refreshing the stalest within the work budget
        first (unless `refresh` is False: as they stand, see `refresh`)."""
        if refresh:
            self._refresh()
        if self._handed_out is None:
            self._handed_out = dict(self._profiles)
        return self._handed_out

    def job_profile(self, job_id: str) -> JobProfile | None:
        """The job's latest profile: its running attempt's, else the stored one."""
        self._refresh((job_id,))
        track = self._tracks.get(job_id)
        if track is not None and track.shown is not None:
            return track.shown
        return self.store.load(job_id)

    def live_profiles(self, job_ids: Iterable[str]) -> tuple[JobProfile, ...]:
        """Profiles of those of these jobs that run now (memory only: cheap for a list)."""
        wanted = tuple(job_ids)
        self._refresh(wanted)
        found = (self._tracks.get(job_id) for job_id in wanted)
        return tuple(t.shown for t in found if t is not None and t.shown is not None)

    def running_profiles(self) -> tuple[JobProfile, ...]:
        self._refresh()
        return tuple(t.shown for t in self._tracks.values() if t.shown is not None)

    def close(self) -> None:
        self._save([self._compute(t) for t in self._tracks.values() if t.fresh_samples])
        self.store.close()

    # -- internals -------------------------------------------------------------------

    def _reindex(self) -> None:
        """Follow every running job at once (at start): new attempts get a track,
        ended ones are saved. After that, each job record is followed as it comes."""
        self._stale_index = False
        running = {job.job_id: job for job in self._running_jobs()}
        for job_id, track in list(self._tracks.items()):
            if job_id not in running:
                self._end(track)
        for job in running.values():
            self._follow(job)

    def _follow(self, job: JobRecord) -> None:
        """A job's record changed: its attempt's track starts, moves with its GPUs (an
        elastic job's change within an attempt), or ends and is saved."""
        track = self._tracks.get(job.job_id)
        if track is not None and (
            job.state is not JobState.RUNNING or job.attempt != track.attempt
        ):
            self._end(track)
            track = None
        if job.state is not JobState.RUNNING or not job.grants:
            return
        if track is None:
            track = _Track(
                job_id=job.job_id,
                attempt=job.attempt,
                gpus=job.gpu_count,
                lead_node=job.grants[0].node,
            )
            self._tracks[job.job_id] = track
            self._queue(track)
        track.gpus = job.gpu_count
        track.beside = job.spec.shareable or job.spec.gpu_milli is not None
        track.hosts = job.spec.shareable
        held = tuple((grant.node, gpu) for grant in job.grants for gpu in grant.gpus)
        if held != track.held:
            self._let_go(track)
            track.held = held
            for node, gpu in held:
                on_node = self._holders.setdefault(node, {})
                # A GPU's telemetry is filed under its whole-GPU job (its shares' use
                # taken off: `_own`); of shares alone, under the first's.
                if job.spec.gpu_milli is None or gpu not in on_node:
                    on_node[gpu] = track

    def _end(self, track: _Track) -> None:
        if track.fresh_samples:
            self._save([self._compute(track)])
        self._let_go(track)
        del self._tracks[track.job_id]
        self._parked.discard(track.job_id)
        if self._profiles.pop(track.job_id, None) is not None:
            self._handed_out = None

    def _let_go(self, track: _Track) -> None:
        """Its GPUs are no longer filed under it (unless another track holds them now)."""
        for node, gpu in track.held:
            on_node = self._holders.get(node)
            if on_node is not None and on_node.get(gpu) is track:
                del on_node[gpu]
                if not on_node:
                    del self._holders[node]
        track.held = ()

    def _refresh(self, job_ids: Iterable[str] | None = None) -> None:
        """Recompute the profiles that are due (of `job_ids`, or all), stalest first."""
        if self._stale_index:
            self._reindex()
        now = self.clock()
        settings = self.settings
        if job_ids is None:
            due = self._take_due(now - settings.recompute_s, settings.max_refresh_per_call)
        else:
            tracks = [t for t in map(self._tracks.get, job_ids) if t is not None]
            due = sorted(
                (
                    t
                    for t in tracks
                    if t.fresh_samples and now - t.computed_at >= settings.recompute_s
                ),
                key=lambda t: t.computed_at,
            )[: settings.max_refresh_per_call]
        computed: list[JobProfile | None] = []
        deadline = time.perf_counter() + settings.refresh_budget_s
        for track in due:
            computed.append(self._compute(track))
            if time.perf_counter() >= deadline:
                break
        for track in due[len(computed) :]:  # still due: first the next time
            self._queue(track)
        self._save(computed)

    def _queue(self, track: _Track) -> None:
        heapq.heappush(self._due, (track.computed_at, next(self._serial), track))

    def _take_due(self, computed_by: float, most: int) -> list[_Track]:
        """Up to `most` tracks computed at or before `computed_by` with new samples,
        stalest first, off the queue; those without new samples are parked."""
        due: list[_Track] = []
        queue, tracks = self._due, self._tracks
        while queue and len(due) < most and queue[0][0] <= computed_by:
            at, _, track = heapq.heappop(queue)
            if tracks.get(track.job_id) is not track or track.computed_at != at:
                continue  # ended, or computed since (queued again then)
            if track.fresh_samples:
                due.append(track)
            else:
                self._parked.add(track.job_id)
        return due

    def _compute(self, track: _Track) -> JobProfile | None:
        if track.samples == 0:
            self._parked.add(track.job_id)  # due again once samples come
            return None
        before = track.profile
        was_underused = before is not None and before.underused
        profile = analyse(track.readings.readings(), track.totals(), self.settings)
        if track.hosts:
            profile = replace(
                profile,
                gpu_memory=gpu_memory(
                    track.per_gpu, self.settings, profile.period_s, track.mem_total_mib
                ),
            )
        self._news = self._news or _matters_to_policy(before, profile)
        track.profile = self._profiles[track.job_id] = profile
        self._handed_out = None
        track.computed_at = self.clock()
        track.fresh_samples = False
        self._queue(track)
        if profile.underused and not was_underused:
            log.warning(
                "job %s holds %d GPUs and barely uses %d of them (mean %.1f%% utilisation)",
                track.job_id,
                track.gpus,
                profile.idle_gpus,
                profile.mean_util_pct,
            )
        track.shown = JobProfile(
            job_id=track.job_id,
            attempt=track.attempt,
            updated_at=track.computed_at,
            gpus=track.gpus,
            samples=track.samples,
            observed_s=max(0.0, (track.last_ts or 0.0) - (track.first_ts or 0.0)),
            mean_util_pct=profile.mean_util_pct,
            p95_util_pct=profile.p95_util_pct,
            mem_peak_mib=profile.mem_peak_mib,
            period_s=profile.period_s,
            forecast_util_pct=profile.forecast_util_pct,
            forecast_mem_mib=profile.forecast_mem_mib,
            horizon_s=self.settings.horizon_s,
            underused=profile.underused,
            idle_gpus=profile.idle_gpus,
        )
        return track.shown

    def _save(self, profiles: Sequence[JobProfile | None]) -> None:
        kept = [p for p in profiles if p is not None]
        if not kept:
            return
        try:
            self.store.save(kept)
        except Exception:
            # The profile stays in memory; only its durable copy is late.
            log.exception("could not store %d job profiles", len(kept))


# Co-location reads a job's peak and forecast memory (brain/core/shares.py): a move of
# more than this share of them is news, so a GPU nearing its memory is acted on at once.
MEMORY_NEWS_SHARE: Final = 0.1


def _matters_to_policy(before: UtilizationProfile | None, after: UtilizationProfile) -> bool:
    if before is None:
        return True
    if (before.underused, before.idle_gpus, before.period_s is None) != (
        after.underused,
        after.idle_gpus,
        after.period_s is None,
    ):
        return True
    # Its busiest GPU's memory, or a shareable job's on any one GPU (what co-location
    # reckons with there).
    pairs = [
        (
            max(before.mem_peak_mib, before.forecast_mem_mib),
            max(after.mem_peak_mib, after.forecast_mem_mib),
        )
    ]
    pairs += [
        (before.memory_on(g.node, g.gpu), max(g.peak_mib, g.forecast_mib)) for g in after.gpu_memory
    ]
    return any(abs(now - was) > MEMORY_NEWS_SHARE * max(was, 1.0) for was, now in pairs)


# -- storage ----------------------------------------------------------------------------


def profiles_path(history_path: Path | None) -> Path | None:
    """Profiles live next to the brain's history database (in memory when it does)."""
    return None if history_path is None else history_path.with_suffix(".profiles.db")


class ProfileStore:
    TABLE: Final = "profiles"

    def __init__(self, path: Path | None) -> None:
        if path is None:
            self.db = sqlite_utils.Database(memory=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite_utils.Database(path)
            self.db.execute("PRAGMA journal_mode=WAL")
        if self.TABLE not in self.db.table_names():
            self.db.table(self.TABLE).create(
                {
                    "job_id": str,
                    "attempt": int,
                    "updated_at": float,
                    "gpus": int,
                    "samples": int,
                    "observed_s": float,
                    "mean_util_pct": float,
                    "p95_util_pct": float,
                    "mem_peak_mib": float,
                    "period_s": float,
                    "forecast_util_pct": float,
                    "forecast_mem_mib": float,
                    "horizon_s": float,
                    "underused": int,
                    "idle_gpus": int,
                },
                pk="job_id",
            )

    def save(self, profiles: Iterable[JobProfile]) -> None:
        rows = [p.model_dump() for p in profiles]
        with self.db.conn:
            self.db.table(self.TABLE).upsert_all(rows, pk="job_id")

    def load(self, job_id: str) -> JobProfile | None:
        rows = list(self.db.table(self.TABLE).rows_where("job_id = ?", [job_id]))
        return JobProfile.model_validate(rows[0]) if rows else None

    def close(self) -> None:
        self.db.close()
