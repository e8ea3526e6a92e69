"""Utilisation profiles: the pure analysis, table-driven, on recorded telemetry.

The traces in tests/data/telemetry are what an agent publishes (see record.py there);
they are replayed through the same `Profiler` the brain runs, with no bus.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.profiles import (
    Profiler,
    ProfileSettings,
    ProfileStore,
    Reading,
    RunTotals,
    _Window,
    analyse,
    autocorrelation,
    detect_period,
    forecast,
    histogram_percentile,
    percentile,
    regular,
)
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.state import Cause, CauseKind, JobChanged
from schemas.telemetry import GpuSample, GpuShares, ShareSample, ShareUse, TelemetryBatch
from tests.data.telemetry.record import load

# -- the numbers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 95, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([float(v) for v in range(101)], 95, 95.0),
        ([10.0, 0.0, 20.0], 0, 0.0),
    ],
)
def test_percentile_interpolates_between_ranks(
    values: list[float], q: float, expected: float
) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_histogram_percentile_is_the_nearest_rank() -> None:
    hist = [0] * 101
    hist[10], hist[90] = 94, 6  # 94 samples at 10 %, 6 at 90 %
    assert histogram_percentile(hist, 94) == 10.0
    assert histogram_percentile(hist, 95) == 90.0
    with pytest.raises(ValueError, match="empty"):
        histogram_percentile([0] * 101, 95)


def test_autocorrelation_of_an_alternating_series() -> None:
    acf = autocorrelation([1.0, -1.0] * 50, 3)
    assert acf[0] == pytest.approx(1.0)
    assert acf[1] == pytest.approx(-0.99)
    assert acf[2] == pytest.approx(0.98)
    assert autocorrelation([3.0] * 20, 5) == ()  # a flat line has no pattern


def _sine(period: float, n: int, noise: float = 0.0, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [50 + 40 * math.sin(2 * math.pi * i / period) + rng.gauss(0, noise) for i in range(n)]


@pytest.mark.parametrize(
    ("name", "values", "period"),
    [
        ("sine, 10 samples", _sine(10, 120), 10.0),
        ("sine, 25 samples, noisy", _sine(25, 200, noise=8), 25.0),
        ("fractional period", _sine(12.5, 200), 12.5),
        ("square wave 16 on 4 off", [95.0 if i % 20 < 16 else 5.0 for i in range(200)], 20.0),
        ("white noise", [50 + random.Random(3).gauss(0, 10) for _ in range(200)], None),
        ("flat", [70.0] * 200, None),
        ("ramp", [0.4 * i for i in range(200)], None),
        ("only one cycle in view", _sine(150, 200), None),
    ],
)
def test_detect_period(name: str, values: list[float], period: float | None) -> None:
    found = detect_period(values)
    if period is None:
        assert found is None, name
    else:
        assert found == pytest.approx(period, rel=0.05), name


def test_forecast_continues_a_cycle_and_a_trend() -> None:
    square = [90.0 if i % 10 < 7 else 10.0 for i in range(100)]
    assert forecast(square, period=10, horizon=10) == tuple(square[:10])
    rising = [float(i) for i in range(50)]
    ahead = forecast(rising, period=None, horizon=5)
    assert all(a > rising[-1] for a in ahead) and list(ahead) == sorted(ahead)
    assert forecast([], period=None, horizon=3) == ()


def test_regular_resamples_lost_telemetry_onto_a_grid() -> None:
    readings = [Reading(0.0, 0.0, 0.0), Reading(1.0, 10.0, 100.0), Reading(3.0, 30.0, 300.0)]
    util, mem, step = regular(readings, max_points=100)
    assert step == pytest.approx(1.5)  # the median gap
    assert util == pytest.approx([0.0, 15.0, 30.0])
    assert mem == pytest.approx([0.0, 150.0, 300.0])


def test_analyse_flags_idle_gpus_only_on_enough_samples() -> None:
    settings = ProfileSettings(min_samples_to_judge=30)
    hist = [0] * 101
    hist[0] = 40
    totals = RunTotals(
        samples=40, util_sum=0.0, util_hist=tuple(hist), mem_peak_mib=0.0, per_gpu=((0.0, 40),)
    )
    readings = [Reading(float(t), 0.0, 0.0) for t in range(40)]
    assert analyse(readings, totals, settings).underused
    few = RunTotals(
        samples=10, util_sum=0.0, util_hist=tuple(hist), mem_peak_mib=0.0, per_gpu=((0.0, 10),)
    )
    assert not analyse(readings[:10], few, settings).underused


def test_a_memory_forecast_stops_at_what_the_gpu_has() -> None:
    # Seen on an H100: a job holding 2.6 GiB took 70 GiB more, and the damped trend
    # of the next minute read 154,560 of the GPU's 81,559 MiB.
    readings = [Reading(float(t), 0.0, 2654.0) for t in range(10)]
    readings += [Reading(float(t), 0.0, 73427.0) for t in range(10, 13)]

    def totals(mem_total_mib: float) -> RunTotals:
        hist = (13, *[0] * 100)
        return RunTotals(13, 0.0, hist, 73427.0, ((0.0, 13),), mem_total_mib=mem_total_mib)

    settings = ProfileSettings()
    assert analyse(readings, totals(0.0), settings).forecast_mem_mib > 81559
    assert analyse(readings, totals(81559.0), settings).forecast_mem_mib == 81559


# -- recorded telemetry through the Profiler ------------------------------------------


@dataclass(frozen=True)
class Expect:
    trace: str
    gpus: tuple[int, ...]
    mean: tuple[float, float]
    p95: tuple[float, float]
    period_s: tuple[float, float] | None
    underused: bool
    idle_gpus: int = 0


CASES = [
    Expect("training-sim", (0,), (80, 90), (95, 100), (14.5, 17.0), underused=False),
    Expect("dataloader-stall", (0,), (74, 79), (95, 98), (19.0, 21.0), underused=False),
    Expect("idle-holder", (0, 1), (29, 33), (65, 75), None, underused=True, idle_gpus=1),
    Expect("memory-leak", (0,), (53, 57), (60, 66), None, underused=False),
]


def _job(gpus: tuple[int, ...]) -> JobRecord:
    return JobRecord(
        job_id="7",
        tenant="alice",
        spec=JobSpec(command=("train",), gpus=len(gpus)),
        state=JobState.RUNNING,
        attempt=1,
        submitted_at=0.0,
        started_at=0.0,
        grants=(NodeGrant(node="rec", gpus=gpus),),
    )


def _replay(batches: list[TelemetryBatch], gpus: tuple[int, ...], path: Path | None) -> Profiler:
    job = _job(gpus)
    profiler = Profiler(lambda: [job], store=ProfileStore(path), clock=lambda: 0.0)
    for batch in batches:
        profiler.observe(batch)
    return profiler


@pytest.mark.parametrize("case", CASES, ids=[c.trace for c in CASES])
def test_profiles_of_recorded_jobs(case: Expect) -> None:
    batches = load(case.trace)
    profile = _replay(batches, case.gpus, None).current()["7"]
    assert case.mean[0] <= profile.mean_util_pct <= case.mean[1]
    assert case.p95[0] <= profile.p95_util_pct <= case.p95[1]
    peak = max(s.mem_used_mib for b in batches for s in b.samples)
    assert profile.mem_peak_mib == peak
    if case.period_s is None:
        assert profile.period_s is None
    else:
        assert profile.period_s is not None
        assert case.period_s[0] <= profile.period_s <= case.period_s[1]
    assert (profile.underused, profile.idle_gpus) == (case.underused, case.idle_gpus)


@pytest.mark.parametrize("trace", ["training-sim", "dataloader-stall"])
def test_forecast_predicts_the_held_out_window(trace: str) -> None:
    """Profile the first part of a trace; the forecast must match what came next."""
    batches = load(trace)
    step = batches[1].ts - batches[0].ts
    horizon = 20
    settings = ProfileSettings(horizon_s=horizon * step)
    history, future = batches[:-horizon], batches[-horizon:]
    job = _job((0,))
    profiler = Profiler(lambda: [job], store=ProfileStore(None), settings=settings)
    for batch in history:
        profiler.observe(batch)
    profile = profiler.current()["7"]
    actual_util = sum(b.samples[0].util_gpu_pct for b in future) / len(future)
    actual_mem = max(b.samples[0].mem_used_mib for b in future)
    assert profile.forecast_util_pct == pytest.approx(actual_util, abs=5.0)
    assert profile.forecast_mem_mib == pytest.approx(actual_mem, rel=0.02)


def test_a_memory_leak_is_forecast_above_what_was_seen() -> None:
    batches = load("memory-leak")
    profile = _replay(batches, (0,), None).current()["7"]
    assert profile.period_s is None
    assert profile.forecast_mem_mib > profile.mem_peak_mib


def test_profiles_are_kept_in_sqlite_after_the_job_ends(tmp_path: Path) -> None:
    batches = load("idle-holder")
    job = _job((0, 1))
    running = [job]
    path = tmp_path / "profiles.db"
    profiler = Profiler(lambda: running, store=ProfileStore(path), clock=lambda: 5.0)
    for batch in batches:
        profiler.observe(batch)
    live = profiler.job_profile("7")
    assert live is not None and live.underused and live.gpus == 2
    running.clear()
    ended = job.model_copy(update={"state": JobState.SUCCEEDED, "finished_at": 9.0})
    cause = Cause(kind=CauseKind.EXITED, message="exited 0", job_id="7")
    record = JobChanged(
        record_id="r1", ts=9.0, epoch=1, job=ended, previous=JobState.RUNNING, cause=cause
    )
    profiler.on_record(record, 42)
    assert profiler.current() == {}
    profiler.close()
    reopened = ProfileStore(path)
    try:
        assert reopened.load("7") == live
    finally:
        reopened.close()


def test_a_profile_is_computed_again_once_due_and_only_with_new_samples() -> None:
    """A refresh reads the tracks due (computed `recompute_s` ago or more), stalest
    first; one due without new telemetry waits for it, then comes first."""
    batches = load("training-sim")
    now = [0.0]
    settings = ProfileSettings()
    profiler = Profiler(lambda: [_job((0,))], store=ProfileStore(None), clock=lambda: now[0])
    for batch in batches[:50]:
        profiler.observe(batch)
    first = profiler.current()["7"]
    profiler.observe(batches[50])
    now[0] += settings.recompute_s / 2
    assert profiler.current()["7"] is first  # not due yet
    now[0] += settings.recompute_s
    second = profiler.current()["7"]
    assert second is not first  # due, with a new sample
    now[0] += 2 * settings.recompute_s
    assert profiler.current()["7"] is second  # due, but nothing new: parked
    for batch in batches[51:80]:
        profiler.observe(batch)
    assert profiler.current()["7"] is not second  # samples came: computed at once


def gpu_sample(index: int, *, util: float, used: float, total: float) -> GpuSample:
    return GpuSample(
        index=index,
        util_gpu_pct=util,
        util_mem_pct=10.0,
        mem_used_mib=used,
        mem_total_mib=total,
        power_w=100.0,
        temp_c=40.0,
        sm_clock_mhz=1500.0,
        mem_clock_mhz=1500.0,
    )


def test_a_job_s_telemetry_follows_its_gpus_as_its_records_change() -> None:
    """The profiler follows each job record as it comes: an elastic job's GPUs move
    within an attempt, a new attempt starts a new track, an ended one is let go; what
    the job no longer holds is not filed under it (nor under anyone)."""
    job = _job((0, 1))
    running = [job]
    profiler = Profiler(lambda: running, store=ProfileStore(None), clock=lambda: 0.0)

    def change(update: dict[str, object], seq: int) -> JobRecord:
        changed = job.model_copy(update=update)
        running[:] = [changed] if changed.state is JobState.RUNNING else []
        cause = Cause(kind=CauseKind.RESIZED, message="test", job_id="7")
        record = JobChanged(
            record_id=f"r{seq}", ts=1.0, epoch=1, job=changed, previous=job.state, cause=cause
        )
        profiler.on_record(record, seq)
        return changed

    def beat(node: str, ts: float) -> None:
        samples = tuple(gpu_sample(i, util=50.0, used=100.0, total=1000.0) for i in (0, 1))
        profiler.observe(TelemetryBatch(node=node, ts=ts, samples=samples))

    beat("rec", 1.0)
    assert profiler._tracks["7"].samples == 2
    # Shrunk to GPU 0 and grown onto GPU 1 of another node, in the same attempt.
    change({"grants": (NodeGrant(node="rec", gpus=(0,)), NodeGrant(node="b", gpus=(1,)))}, 2)
    beat("rec", 2.0)
    beat("b", 2.0)
    assert profiler._tracks["7"].samples == 4  # rec:0 and b:1, not rec:1 nor b:0
    # A new attempt starts afresh; an ended job holds nothing.
    change({"attempt": 2, "grants": (NodeGrant(node="b", gpus=(0,)),)}, 3)
    assert profiler._tracks["7"].samples == 0
    beat("rec", 3.0)
    assert profiler._tracks["7"].samples == 0
    change({"state": JobState.SUCCEEDED, "finished_at": 4.0}, 4)
    assert "7" not in profiler._tracks
    assert profiler._holders == {}


@pytest.mark.parametrize("said", ["with the samples", "by the last heartbeat"])
def test_a_shareable_job_s_profile_is_its_own_memory_not_its_guests(said: str) -> None:
    """On a shareable job's GPU, the GPU's memory less what its shares use is the
    host's: its guests neither fill the room it leaves nor press it to move them. The
    shares' use comes with the samples, read at the same instant (a guest growing
    between two heartbeats never shows in its host's peak); from an agent that does not
    send it, from the node's last heartbeat. Its memory is followed per GPU as well as
    on its busiest."""
    host = _job((0, 1)).model_copy(
        update={"spec": JobSpec(command=("train",), gpus=2, shareable=True)}
    )
    share = JobRecord(
        job_id="8",
        tenant="alice",
        spec=JobSpec(command=("infer",), gpus=1, gpu_milli=250, gpu_memory_mib=20_000),
        state=JobState.RUNNING,
        attempt=1,
        submitted_at=0.0,
        started_at=0.0,
        grants=(NodeGrant(node="rec", gpus=(1,)),),
    )
    with_samples = said == "with the samples"
    # The heartbeat's figure lags: with the samples sent, it says the guest uses none.
    beat = ShareUse(
        job_id="8", attempt=1, gpu_milli=250, memory_used_mib=0.0 if with_samples else 12_000.0
    )
    shares = (GpuShares(index=1, jobs=(beat,), enforcement="accounted"),)
    profiler = Profiler(
        lambda: [host, share],
        store=ProfileStore(None),
        clock=lambda: 100.0,
        shares=lambda node: shares if node == "rec" else (),
    )
    for ts in range(20):
        # The guest grows to 12,000 MiB; the host uses 40,000 of GPU 0, 16,000 of GPU 1.
        guest = 12_000.0 if not with_samples else min(12_000.0, ts * 1_000.0)
        samples = tuple(
            gpu_sample(i, util=20.0, used=used, total=81_920.0)
            for i, used in ((0, 40_000.0), (1, 16_000.0 + guest))
        )
        sent = (ShareSample(index=1, job_id="8", memory_used_mib=guest),) if with_samples else None
        profiler.observe(TelemetryBatch(node="rec", ts=float(ts), samples=samples, shares=sent))
    profile = profiler.current()["7"]
    assert profile.mem_peak_mib == 40_000.0  # GPU 0, the busiest
    assert profile.memory_on("rec", 0) == pytest.approx(40_000.0)
    assert profile.memory_on("rec", 1) == pytest.approx(16_000.0)
    assert [(g.gpu, g.peak_mib) for g in profile.gpu_memory] == [(0, 40_000.0), (1, 16_000.0)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.1, 30.0), st.floats(0, 100)), max_size=300),
    st.floats(1.0, 120.0),
)
def test_a_window_keeps_exactly_the_readings_of_its_last_span(
    steps: list[tuple[float, float]], window_s: float
) -> None:
    """`_Window` (flat arrays, cut now and then) keeps what a list trimmed at every
    reading would."""
    window, model = _Window(), []
    ts = 1_000_000.0
    for gap, util in steps:
        ts += gap
        window.append(ts, util, util * 10)
        window.drop_before(ts - window_s)
        model = [r for r in (*model, Reading(ts, util, util * 10)) if r.ts >= ts - window_s]
        assert len(window) == len(model)
    assert window.readings() == tuple(model)
    assert window.last_ts() == (model[-1].ts if model else None)
