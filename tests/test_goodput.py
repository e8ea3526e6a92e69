"""Goodput arithmetic (workloads/goodput.py): the noise estimate, efficiency, and the
batch a job picks; and how a worker's report of them is read. Pure: no torch, no
horovod."""

from __future__ import annotations

import json

import pytest

from workloads.goodput import (
    BatchLimits,
    GradientNoise,
    StepTiming,
    choose_local_batch,
    goodput,
)
from workloads.progress import WorkerReport

LIMITS = BatchLimits(base=16, min_local=4, max_local=128, max_global=512)


def measured(per_sample_s: float, fixed_s: float) -> StepTiming:
    timing = StepTiming()
    timing.observe(per_sample_s * 16, per_sample_s * 16 + fixed_s, 16)
    return timing


def test_the_noise_estimate_recovers_gradient_and_variance() -> None:
    # |G|^2 = 2, tr(S) = 8: a worker's gradient over 4 samples has expected squared
    # norm 2 + 8/4, the average of 4 workers 2 + 8/16.
    noise = GradientNoise()
    noise.update(local_sqr=4.0, global_sqr=2.5, local_batch=4, workers=4)
    assert noise.sqr == pytest.approx(2.0)
    assert noise.var == pytest.approx(8.0)
    # Smoothed: a later, different step moves it a tenth of the way.
    noise.update(local_sqr=4.0 + 2.0, global_sqr=2.5 + 2.0, local_batch=4, workers=4)
    assert noise.sqr == pytest.approx(2.2)


def test_one_gradient_cannot_measure_noise() -> None:
    with pytest.raises(ValueError, match="two gradients"):
        GradientNoise().update(1.0, 1.0, local_batch=8, workers=1)


def test_efficiency_is_one_at_the_base_batch_and_falls_above_it() -> None:
    noise = GradientNoise(sqr=1.0, var=4.0)
    assert noise.gain(1.0) == pytest.approx(1.0)
    assert noise.efficiency(1.0) == pytest.approx(1.0)
    gains = [noise.gain(s) for s in (1, 2, 4, 8, 64)]
    assert gains == sorted(gains)
    assert gains[-1] < (4.0 + 1.0) / 1.0  # never past (var + sqr) / sqr
    efficiencies = [noise.efficiency(s) for s in (1, 2, 4, 8, 64)]
    assert efficiencies == sorted(efficiencies, reverse=True)
    # Unmeasured: linear scaling assumed, every sample worth one.
    assert GradientNoise().gain(8.0) == 8.0 and GradientNoise().efficiency(8.0) == 1.0


def test_the_base_batch_until_noise_and_step_time_are_measured() -> None:
    choice = choose_local_batch(GradientNoise(), measured(1e-3, 0.05), LIMITS, 2)
    assert choice.local_batch == 16 and choice.goodput is None
    choice = choose_local_batch(GradientNoise(sqr=1.0, var=4.0), StepTiming(), LIMITS, 2)
    assert choice.local_batch == 16


def test_noisy_gradients_and_fixed_costs_pick_a_large_batch() -> None:
    noise = GradientNoise(sqr=1.0, var=1000.0)
    choice = choose_local_batch(noise, measured(1e-4, 0.05), LIMITS, 2)
    assert choice.local_batch == 128
    assert choice.lr_scale == pytest.approx(noise.gain(2 * 128 / 16))
    assert choice.goodput == pytest.approx(goodput(noise, measured(1e-4, 0.05), LIMITS, 2, 128))


def test_clean_gradients_and_compute_bound_steps_pick_a_small_batch() -> None:
    # No noise: a bigger batch makes the same progress per step, and costs more.
    choice = choose_local_batch(GradientNoise(sqr=1.0, var=0.0), measured(1e-2, 0.0), LIMITS, 2)
    assert choice.local_batch == 4


def test_candidates_keep_within_the_limits() -> None:
    assert LIMITS.candidates(1) == [4, 8, 16, 32, 64, 128]
    # 512 in all over 8 workers: at most 64 each.
    assert LIMITS.candidates(8) == [4, 8, 16, 32, 64]
    # More workers than the global batch allows: the smallest local batch.
    assert LIMITS.candidates(1000) == [4]


def test_bad_limits_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="min local"):
        BatchLimits(base=16, min_local=32, max_local=64, max_global=512)
    with pytest.raises(ValueError, match="max global batch 8"):
        BatchLimits(base=16, min_local=4, max_local=64, max_global=8)


def test_a_workers_bad_rates_and_batch_are_dropped_at_decode() -> None:
    # A report must never stop the supervisor's progress messages (ge=0, ge=1 there).
    fields = {"rank": 0, "pid": 7, "step": 3, "world_size": 2, "loss": 0.5}
    odd = {**fields, "samples_per_s": float("nan"), "goodput": -1.0, "batch_size": 0}
    report = WorkerReport.decode(json.dumps(odd).encode())
    assert (report.samples_per_s, report.goodput, report.batch_size) == (0.0, None, None)
    good = {**fields, "samples_per_s": 90.0, "goodput": 60.0, "batch_size": 32}
    report = WorkerReport.decode(json.dumps(good).encode())
    assert (report.samples_per_s, report.goodput, report.batch_size) == (90.0, 60.0, 32)
