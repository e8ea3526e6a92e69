"""What `/metrics` counts of each cycle's decisions (brain/metrics.py, `on_decisions`):
actions by kind, preemptions and elastic resizes by their typed cause."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from brain.core import (
    BandCrossed,
    Decisions,
    Evacuated,
    Grant,
    Grown,
    Moved,
    Outranked,
    Preempt,
    Resize,
    Retreated,
    SetServiceLevel,
    ShrunkFor,
)
from brain.metrics import BrainMetrics
from brain.service import Brain

ON_N1 = (Grant("n1", (0, 1)),)


def test_resizes_are_counted_by_their_cause_and_preemptions_by_theirs() -> None:
    # The brain the metrics observe: only its observer lists are read here.
    brain = SimpleNamespace(record_observers=[], decision_observers=[])
    metrics = BrainMetrics(cast(Brain, brain))
    assert brain.decision_observers == [metrics.on_decisions]
    metrics.on_decisions(
        Decisions(
            (
                Preempt("9", ON_N1, Outranked("2", "las", "las band 2", "las band 0")),
                Resize("1", ON_N1, Grown(1, 2, 0.8, 1, 4, "concave prior")),
                Resize("3", ON_N1, Grown(1, 2, 0.5, 1, 4, "concave prior")),
                Resize("4", ON_N1, ShrunkFor(4, 2, "7", 0.3, 4, 1, "concave prior")),
                Resize("5", ON_N1, Retreated(4, 2, 40.0, 39.0, 0.5)),
                Resize("6", ON_N1, Evacuated(4, 2, (("n0", 0), ("n0", 1)))),
                Resize("8", ON_N1, Moved(2, "concave prior")),
                SetServiceLevel("2", 1, 10.0, BandCrossed(3_300.0, 3_250.0, 0, 1)),
            )
        )
    )
    sample = metrics.registry.get_sample_value
    for cause, count in (("grow", 2), ("shrink_for", 1), ("retreat", 1), ("evacuate", 1)):
        assert sample("alnair_scheduler_resizes_total", {"cause": cause}) == count
    assert sample("alnair_scheduler_resizes_total", {"cause": "move"}) == 1
    assert sample("alnair_scheduler_preemptions_total", {"cause": "outranked"}) == 1
    assert sample("alnair_scheduler_decisions_total", {"action": "resize"}) == 6
    assert sample("alnair_scheduler_decisions_total", {"action": "set_service_level"}) == 1


def test_a_resize_says_why_and_whether_it_is_a_retreat() -> None:
    retreat = Resize("5", ON_N1, Retreated(4, 2, 40.0, 39.0, 0.5))
    assert retreat.retreat
    assert retreat.reason == (
        "shrunk from 4 to 2 GPUs: the last 2 did not earn their keep (observed 39/s at 2, "
        "40/s at 4: less than 50% of an average GPU each); they go to other jobs"
    )
    shrunk = Resize("4", ON_N1, ShrunkFor(4, 2, "7", 0.3, 4, 1, "concave prior"))
    assert not shrunk.retreat
    assert shrunk.reason.startswith("shrunk from 4 to 2 GPUs for job 7 (estimated throughput -30%")
