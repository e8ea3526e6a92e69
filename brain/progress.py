"""Jobs' progress as their supervisors report it (`alnair.job.<job>.progress`).

Owns, in memory only, what the leading brain learned from those reports: each job's
throughput per world size (the mean of the last `WINDOW` samples/s rank 0 reported at
that size, or of its goodput when it reports one: a job that adapts its batch, with
the mean's relative standard error once `MIN_REPORTS` came, so that the policy decides
nothing on a difference within the noise), the fraction of its steps done and how fast
that grows (for jobs that say how many steps they mean to take), and whether the
supervisor of its current run has spoken yet (it listens for Resize commands before its
workers start, so a report means a resize will be heard). And, across jobs, how wrong
their reports turned out to be (`errors`): each job that succeeded after reporting a
rate ran for some multiple of the total that rate implied (`BeliefErrors`, which
`progress-gittins` weighs beliefs by). The brain passes these into the snapshot, as it
does utilisation profiles.

None of it is in the STATE log: reports are lossy and frequent, and a new leader learns
them again from the next ones (the errors from the next jobs to finish: until then it
ranks by the prior). It never changes the brain's state.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from brain.core import BeliefErrors
from brain.core.model import Measured
from schemas.jobs import JobState
from schemas.progress import Progress
from schemas.state import CauseKind, JobChanged, StateRecord

# Weight of the newest report in the progress-rate average: about the last five count.
NEWEST_WEIGHT: Final = 0.3
# Throughput at a size is the mean of this many latest reports there (one a second by
# default): a window long enough to average out step-time noise, short enough to
# follow a change of phase.
WINDOW: Final = 10
# Reports at a size before its rate's error is known; until then the policy makes no
# move that rests on it.
MIN_REPORTS: Final = 3


@dataclass(frozen=True, slots=True)
class ObservedProgress:
    """What the policy may know of a job's progress."""

    # Samples/s of the whole job per world size, sorted by size.
    throughput: tuple[Measured, ...] = ()
    progress_fraction: float | None = None
    progress_rate_per_s: float | None = None


@dataclass
class _Rates:
    """The latest reports at one world size."""

    rates: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    at: float | None = None

    def measured(self, size: int) -> Measured:
        mean = statistics.fmean(self.rates)
        if len(self.rates) < MIN_REPORTS:
            return Measured(size, mean, math.inf, self.at)
        error = statistics.stdev(self.rates) / math.sqrt(len(self.rates)) / mean
        return Measured(size, mean, error, self.at)


@dataclass
class _Track:
    throughput: dict[int, _Rates] = field(default_factory=dict)
    world_size: int = 0
    step: int = 0
    ts: float | None = None
    total_steps: int | None = None
    rate_per_s: float | None = None
    # The supervisor of the current run has reported.
    heard: bool = False

    def observed(self) -> ObservedProgress:
        fraction = None
        if self.total_steps is not None:
            fraction = min(1.0, self.step / self.total_steps)
        return ObservedProgress(
            throughput=tuple(
                self.throughput[size].measured(size)
                for size in sorted(self.throughput)
                if self.throughput[size].rates
            ),
            progress_fraction=fraction,
            progress_rate_per_s=self.rate_per_s if fraction is not None else None,
        )


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - NEWEST_WEIGHT) * old + NEWEST_WEIGHT * new


class ProgressTracker:
    def __init__(self) -> None:
        self._jobs: dict[str, _Track] = {}
        self.errors = BeliefErrors()

    def observe(self, report: Progress) -> bool:
        """Fold in one report; True when it tells the policy something new (the job's
        first report in this run, its first at this world size, or the one that makes
        its rate there known well enough to act on)."""
        track = self._jobs.setdefault(report.job_id, _Track())
        rates = track.throughput.setdefault(report.world_size, _Rates())
        news = not track.heard or not rates.rates
        # The first step at a new world size (or of a job) runs while the world warms
        # up (its rendezvous, the state broadcast): not what the size can do.
        warming = report.world_size != track.world_size
        track.heard = True
        # A job that adapts its batch reports its goodput: samples/s would reward a GPU
        # that only buys a bigger, less useful batch.
        rate = report.goodput if report.goodput is not None else report.samples_per_s
        if rate > 0 and not warming:
            rates.rates.append(rate)
            rates.at = report.ts
            news = news or len(rates.rates) == MIN_REPORTS
        if report.total_steps is not None:
            if (
                track.ts is not None
                and report.ts > track.ts
                and report.step >= track.step
                and track.total_steps == report.total_steps
            ):
                rate = (report.step - track.step) / report.total_steps / (report.ts - track.ts)
                track.rate_per_s = _blend(track.rate_per_s, rate)
            track.total_steps = report.total_steps
        track.world_size = report.world_size
        track.step = report.step
        track.ts = report.ts
        return news

    def heard_from(self, job_id: str) -> bool:
        """Whether the supervisor of the job's current run has reported."""
        track = self._jobs.get(job_id)
        return track is not None and track.heard

    def world_size(self, job_id: str) -> int | None:
        track = self._jobs.get(job_id)
        return track.world_size if track is not None and track.heard else None

    def current(self) -> dict[str, ObservedProgress]:
        return {job_id: track.observed() for job_id, track in self._jobs.items()}

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def on_record(self, record: StateRecord, seq: int) -> None:
        """A record observer: a new run has not reported yet; an ended job is forgotten,
        and one that succeeded after reporting its rate of progress teaches how far such
        rates are off. Throughput per size outlives a run (the job's code and data are
        the same)."""
        if not isinstance(record, JobChanged):
            return
        job = record.job
        if job.state.terminal:
            track = self._jobs.get(job.job_id)
            if job.state is JobState.SUCCEEDED and track is not None and track.rate_per_s:
                # Only a success ran its whole work; a failed or cancelled run did not.
                self.errors.learn(job.executed_seconds, track.rate_per_s)
            self.forget(job.job_id)
            return
        track = self._jobs.get(job.job_id)
        if track is None:
            return
        if job.state is not JobState.RUNNING or record.cause.kind is CauseKind.PLACED:
            track.heard = False
            track.ts = None
            track.world_size = 0  # its next first step is a warm-up too
