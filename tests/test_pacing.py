"""When scheduling passes may start (brain/pacing.py), on a clock the test gives."""

from __future__ import annotations

import pytest

from brain.pacing import PassPacer


def test_a_pass_owes_its_time_and_the_next_waits_it_out() -> None:
    pacer = PassPacer()
    pacer.ran(10.0, 10.2)
    assert pacer.wait_s(10.2, prompt=False) == pytest.approx(0.2)
    assert pacer.wait_s(10.3, prompt=False) == pytest.approx(0.1)
    assert pacer.wait_s(10.4, prompt=False) == 0.0


def test_a_submission_waits_for_no_more_than_the_prompt_allowance() -> None:
    pacer = PassPacer(prompt_owed_s=0.1)
    pacer.ran(10.0, 10.05)  # a short pass: its submission's pass starts at once
    assert pacer.wait_s(10.05, prompt=True) == 0.0
    assert pacer.wait_s(10.05, prompt=False) == pytest.approx(0.05)
    pacer.ran(20.0, 20.3)  # a long one: the rest is cut to the allowance
    assert pacer.wait_s(20.3, prompt=True) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("passes", "want_owed"),
    [
        # Back to back, prompt: what is owed grows by every pass, so passes cannot
        # take more than their share for long, however fast submissions come.
        ([(0.0, 0.05), (0.05, 0.1), (0.1, 0.15)], 0.15),
        # Each after the last was paid back: nothing carried over.
        ([(0.0, 0.05), (0.2, 0.25), (0.4, 0.45)], 0.05),
        # Capped: a pass of seconds (decide() in a thread) rests at most rest_max_s.
        ([(0.0, 5.0)], 1.0),
    ],
)
def test_what_is_owed_follows_the_passes(
    passes: list[tuple[float, float]], want_owed: float
) -> None:
    pacer = PassPacer(rest_max_s=1.0)
    for began, ended in passes:
        pacer.ran(began, ended)
    assert pacer.owed_at(passes[-1][1]) == pytest.approx(want_owed)


def test_a_flood_of_prompt_passes_keeps_half_the_loop() -> None:
    """Passes of 40 ms, each started as soon as the pacer lets a submission's pass
    start: over a long run they take about half the time, not all of it."""
    pacer = PassPacer()
    now, busy = 0.0, 0.0
    for _ in range(1000):
        now += pacer.wait_s(now, prompt=True)
        pacer.ran(now, now + 0.04)
        now, busy = now + 0.04, busy + 0.04
    assert busy / now == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("field", ["rest_ratio", "rest_max_s", "prompt_owed_s"])
def test_negative_settings_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PassPacer(**{field: -1.0})
