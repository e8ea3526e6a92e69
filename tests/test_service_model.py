"""The core's one model of a job's service (brain/core/model.py, `Service`), which the
live brain's records (brain/state.py, `service_of`, `accounted`) and the simulator's
jobs (brain/sim/engine.py) both reckon by: table-driven transitions, and a property
that the live brain's journaled records, transition by transition, say what the model
says of the same runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import Service
from brain.state import accounted, served, service_of
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant


@pytest.mark.parametrize(
    ("name", "steps", "now", "attained", "executed"),
    [
        ("never run", [], 50.0, 0.0, 0.0),
        ("running 2 GPUs for 10 s", [("start", 10.0, 2)], 20.0, 20.0, 10.0),
        ("ran 2 GPUs for 10 s, then waits", [("start", 10.0, 2), ("end", 20.0)], 99.0, 20.0, 10.0),
        (
            "2 GPUs for 10 s, grown to 4 for 5 s",
            [("start", 0.0, 2), ("resize", 10.0, 4)],
            15.0,
            40.0,
            15.0,
        ),
        (
            "two runs, preempted between",
            [("start", 0.0, 1), ("end", 10.0), ("start", 100.0, 8)],
            101.0,
            18.0,
            11.0,
        ),
        ("a quarter of a GPU for 40 s", [("start", 0.0, 0.25)], 40.0, 10.0, 40.0),
        ("a clock behind the run adds nothing", [("start", 10.0, 2)], 5.0, 0.0, 0.0),
        (
            "a clock behind the resize adds nothing",
            [("start", 0.0, 2), ("resize", 10.0, 4)],
            8.0,
            20.0,
            8.0,
        ),
        ("an end with no run changes nothing", [("end", 10.0)], 20.0, 0.0, 0.0),
    ],
)
def test_service_by_transition(
    name: str,
    steps: list[tuple[str, float] | tuple[str, float, float]],
    now: float,
    attained: float,
    executed: float,
) -> None:
    service = Service()
    for step in steps:
        if step[0] == "start":
            service = service.started(step[1], step[2])  # type: ignore[misc]
        elif step[0] == "resize":
            service = service.resized(step[1], step[2])  # type: ignore[misc]
        else:
            service = service.ended(step[1])
    assert service.attained_to(now) == pytest.approx(attained), name
    assert service.executed_to(now) == pytest.approx(executed), name


def test_transitions_that_cannot_happen_are_refused_naming_why() -> None:
    with pytest.raises(ValueError, match="has not ended"):
        Service().started(0.0, 1).started(5.0, 1)
    with pytest.raises(ValueError, match="no run is in progress"):
        Service().resized(5.0, 2)


def _record(state: JobState, spec: JobSpec, **fields: object) -> JobRecord:
    return JobRecord.model_validate(
        {"job_id": "1", "tenant": "t", "spec": spec, "state": state, "submitted_at": 0.0, **fields}
    )


# A run: (seconds waited before it, then its sizes, each with how long it held it).
_runs = st.lists(
    st.tuples(
        st.integers(0, 100),
        st.lists(st.tuples(st.integers(1, 8), st.integers(0, 500)), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(runs=_runs, peek=st.integers(0, 500))
def test_the_live_brains_records_reckon_service_as_the_model_does(
    runs: list[tuple[int, list[tuple[int, int]]]], peek: int
) -> None:
    """An elastic job's runs and resizes, journaled as the live brain journals them
    (every transition through `accounted`), against the model stepped through the same
    runs, and against the sum of size x time: equal at every step, and at any clock
    during a run."""
    spec = JobSpec(command=("train",), gpus=1, elastic=True, max_gpus=8)
    record = _record(JobState.PENDING, spec)
    model = Service()
    now = 0.0
    expected_attained = expected_executed = 0.0
    for attempt, (waited, sizes) in enumerate(runs, start=1):
        now += waited
        first = sizes[0][0]
        grants = (NodeGrant(node="n1", gpus=tuple(range(first))),)
        started = record.model_copy(
            update={
                "state": JobState.RUNNING,
                "attempt": attempt,
                "started_at": now,
                "grants": grants,
            }
        )
        record = accounted(record, started, now)
        model = model.started(now, first)
        for index, (size, held) in enumerate(sizes):
            if index and size != sizes[index - 1][0]:
                # A resize (one to the size it has is none).
                grants = (NodeGrant(node="n1", gpus=tuple(range(size))),)
                record = accounted(record, record.model_copy(update={"grants": grants}), now)
                model = model.resized(now, size)
            assert service_of(record) == model
            during = now + min(peek, held)
            assert served(record, during) == (model.attained_to(during), model.executed_to(during))
            now += held
            expected_attained += size * held
            expected_executed += held
        stopped = record.model_copy(update={"state": JobState.PENDING, "grants": ()})
        record = accounted(record, stopped, now)
        model = model.ended(now)
        assert service_of(record) == model
        assert (record.attained_gpu_seconds, record.executed_seconds) == (
            expected_attained,
            expected_executed,
        )
        # Waiting: the clock adds nothing.
        assert served(record, now + 1_000.0) == (expected_attained, expected_executed)
