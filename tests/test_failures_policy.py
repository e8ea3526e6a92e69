"""The pure failure policy: classification, the retry decision, the XID catalogue, and
the retry stage of `decide` (back-off and avoided nodes). No bus."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from brain.core import BackingOff, ClusterSnapshot, Grant, JobView, NodeView, Place, Wait, decide
from brain.core.decide import AVOIDANCE_RELEASED, Policy
from brain.core.failures import (
    BLACK_HOLE,
    AttemptEnd,
    FailurePolicy,
    GiveUp,
    NodeFailure,
    Retry,
    black_hole,
    classify,
    decide_retry,
    fault_action,
)
from brain.core.model import Demand
from cli import failures as failures_cli
from schemas.errors import AlnairError
from schemas.jobs import AttemptFailure, FailureClass, JobState

TRACEBACK = (
    "epoch 0 step 3",
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "ValueError: learning rate must be positive",
)


@pytest.mark.parametrize(
    ("end", "infra", "reported", "expected", "reason_has"),
    [
        (
            AttemptEnd(exit_code=1, log_tail=TRACEBACK),
            (),
            None,
            FailureClass.USER,
            "ValueError: learning rate must be positive",
        ),
        (
            AttemptEnd(exit_code=2, log_tail=("usage: train.py [-h]", "train.py: error: bad --lr")),
            (),
            None,
            FailureClass.USER,
            "configuration error",
        ),
        (
            AttemptEnd(exit_code=3, log_tail=("boom",)),
            (),
            None,
            FailureClass.USER,
            "no infrastructure event explains it: boom",
        ),
        (
            AttemptEnd(exit_code=1, log_tail=TRACEBACK),
            ("node n1 was lost",),
            None,
            FailureClass.INFRASTRUCTURE,
            "node n1 was lost",
        ),
        (
            AttemptEnd(
                exit_code=1,
                log_tail=("[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout",),
            ),
            (),
            None,
            FailureClass.INFRASTRUCTURE,
            "NCCL",
        ),
        (
            AttemptEnd(
                exit_code=1,
                log_tail=(
                    "RuntimeError: [../gloo/transport/tcp/pair.cc] Connection closed by peer",
                ),
            ),
            (),
            None,
            FailureClass.INFRASTRUCTURE,
            "Gloo",
        ),
        (AttemptEnd(signal=9), (), None, FailureClass.INFRASTRUCTURE, "OOM killer"),
        (
            AttemptEnd(exit_code=66, log_tail=("ALNAIR_BAD_INPUT s3://d/shard-7 truncated",)),
            (),
            None,
            FailureClass.INPUT,
            "s3://d/shard-7: truncated",
        ),
        (
            AttemptEnd(exit_code=1, log_tail=TRACEBACK),
            (),
            "file:///d/x",
            FailureClass.INPUT,
            "file:///d/x",
        ),
        # The marker without the documented exit code is just a log line.
        (
            AttemptEnd(exit_code=1, log_tail=("ALNAIR_BAD_INPUT s3://x",)),
            (),
            None,
            FailureClass.USER,
            "exit code 1",
        ),
    ],
)
def test_classify(
    end: AttemptEnd,
    infra: tuple[str, ...],
    reported: str | None,
    expected: FailureClass,
    reason_has: str,
) -> None:
    result = classify(end, infra, reported)
    assert result.failure_class is expected
    assert reason_has in result.reason


def _failure(
    attempt: int, kind: FailureClass, node: str = "n1", uri: str | None = None
) -> AttemptFailure:
    return AttemptFailure(
        attempt=attempt, failure_class=kind, reason="r", nodes=(node,), at=0.0, input_uri=uri
    )


def test_infrastructure_retries_back_off_avoid_nodes_then_unsuccessful() -> None:
    policy = FailurePolicy(infrastructure_retries=4, backoff_base_s=1.0)
    failures: list[AttemptFailure] = []
    delays = []
    for attempt in range(1, 5):
        failures.append(_failure(attempt, FailureClass.INFRASTRUCTURE, node=f"n{attempt}"))
        decision = decide_retry(failures, "default", 100.0, policy)
        assert isinstance(decision, Retry)
        delays.append(decision.not_before - 100.0)
        assert decision.avoid_nodes == tuple(f"n{i}" for i in range(1, attempt + 1))
    assert delays == [1.0, 2.0, 4.0, 8.0]
    failures.append(_failure(5, FailureClass.INFRASTRUCTURE))
    final = decide_retry(failures, "default", 100.0, policy)
    assert isinstance(final, GiveUp) and final.state is JobState.UNSUCCESSFUL


@pytest.mark.parametrize(
    ("resumed_at", "avoided"),
    [
        ({}, ("n1", "n2")),
        ({"n1": 5.0}, ("n2",)),  # resumed after it failed there: forgiven
        ({"n1": 5.0, "n2": 25.0}, ()),
        ({"n2": 15.0}, ("n1", "n2")),  # it failed on n2 again after the resume
    ],
)
def test_a_node_resumed_after_a_failure_is_not_avoided_for_it(
    resumed_at: dict[str, float], avoided: tuple[str, ...]
) -> None:
    failures = [
        _failure(1, FailureClass.INFRASTRUCTURE, node="n1").model_copy(update={"at": 1.0}),
        _failure(2, FailureClass.INFRASTRUCTURE, node="n2").model_copy(update={"at": 10.0}),
        _failure(3, FailureClass.INFRASTRUCTURE, node="n2").model_copy(update={"at": 20.0}),
    ]
    decision = decide_retry(failures, "default", 30.0, FailurePolicy(), forgiven=resumed_at)
    assert isinstance(decision, Retry) and decision.avoid_nodes == avoided


@pytest.mark.parametrize(
    ("log_line", "between"),
    [
        ("[E ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout", True),
        ("RuntimeError: [../gloo/transport/tcp/pair.cc] Connection closed by peer", True),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", False),
        ("Out of memory: Killed process 4242 (python)", False),
    ],
)
def test_a_collectives_failure_is_between_nodes_a_hardware_one_is_of_its_node(
    log_line: str, between: bool
) -> None:
    result = classify(AttemptEnd(exit_code=1, log_tail=(log_line,)))
    assert result.failure_class is FailureClass.INFRASTRUCTURE
    assert result.between_nodes is between


@pytest.mark.parametrize(
    ("at_fault", "avoided"),
    [
        (("n2",), ("n2",)),  # n2 was lost: n1 did nothing wrong
        (("n1", "n2"), ("n1", "n2")),  # a collective timed out between them
        (None, ("n1", "n2")),  # a record from before `at_fault`: every node of the attempt
    ],
)
def test_a_retry_avoids_the_nodes_a_failure_is_blamed_on(
    at_fault: tuple[str, ...] | None, avoided: tuple[str, ...]
) -> None:
    failure = AttemptFailure(
        attempt=1,
        failure_class=FailureClass.INFRASTRUCTURE,
        reason="r",
        nodes=("n1", "n2"),
        at_fault=at_fault,
        at=0.0,
    )
    decision = decide_retry([failure], "default", 1.0, FailurePolicy())
    assert isinstance(decision, Retry) and decision.avoid_nodes == avoided


def test_user_errors_not_retried_unless_the_queue_says_so() -> None:
    failures = [_failure(1, FailureClass.USER)]
    decision = decide_retry(failures, "default", 0.0, FailurePolicy())
    assert isinstance(decision, GiveUp) and decision.state is JobState.FAILED
    lenient = FailurePolicy(queue_user_retries=(("research", 1),))
    assert isinstance(decide_retry(failures, "research", 0.0, lenient), Retry)
    twice = [*failures, _failure(2, FailureClass.USER)]
    assert isinstance(decide_retry(twice, "research", 0.0, lenient), GiveUp)


def test_input_failures_retry_only_once_blacklisted() -> None:
    failures = [_failure(1, FailureClass.INPUT, uri="s3://bad")]
    waiting = decide_retry(failures, "default", 0.0, FailurePolicy())
    assert isinstance(waiting, GiveUp) and waiting.state is JobState.FAILED
    retry = decide_retry(
        failures, "default", 0.0, FailurePolicy(), blacklisted=frozenset({"s3://bad"})
    )
    assert isinstance(retry, Retry)


@pytest.mark.parametrize(
    ("fault", "xid", "drain"),
    [
        ("xid", 79, "node"),
        ("xid", 95, "node"),
        ("xid", 48, "gpu"),
        ("xid", 63, "gpu"),
        ("xid", 64, "gpu"),
        ("xid", 74, "gpu"),
        ("xid", 92, "gpu"),
        ("xid", 94, "gpu"),
        ("xid", 119, "gpu"),
        ("xid", 120, "gpu"),
        ("xid", 13, "none"),
        ("xid", 31, "none"),
        ("xid", 43, "none"),
        ("xid", 45, "none"),
        ("xid", 68, "none"),
        ("ecc_dbe", None, "gpu"),
        ("lost", None, "gpu"),
    ],
)
def test_xid_catalogue(fault: str, xid: int | None, drain: str) -> None:
    assert fault_action(fault, xid, 0).drain == drain  # type: ignore[arg-type]


def test_decide_waits_out_back_off_and_avoids_failed_nodes() -> None:
    nodes = (NodeView("n1", (0, 1), frozenset({0, 1})), NodeView("n2", (0, 1), frozenset({0, 1})))
    backing_off = JobView("1", 1, 0.0, not_before=50.0)
    avoiding = JobView("2", 2, 1.0, avoid_nodes=frozenset({"n1"}))
    decisions = decide(ClusterSnapshot(nodes=nodes, pending=(backing_off, avoiding)), 10.0)
    assert Wait("1", BackingOff()) in decisions.waits
    assert decisions.wake_at == 50.0
    (place,) = decisions.placements
    assert place == Place("2", (Grant("n2", (0, 1)),), place.why)
    later = decide(ClusterSnapshot(nodes=nodes, pending=(backing_off,)), 60.0)
    assert [p.job_id for p in later.placements] == ["1"]
    n2_busy = (nodes[0], NodeView("n2", (0, 1), frozenset()))
    waits_for_n2 = decide(ClusterSnapshot(nodes=n2_busy, pending=(avoiding,)), 60.0)
    assert not waits_for_n2.placements
    (wait,) = waits_for_n2.waits
    assert "avoiding n1" in wait.reason


def _gpus(name: str, count: int, model: str = "NVIDIA H100") -> NodeView:
    return NodeView(name, tuple(range(count)), frozenset(range(count)), model=model)


@pytest.mark.parametrize(
    ("nodes", "job", "placed_on"),
    [
        pytest.param((_gpus("n1", 2),), JobView("j", 2, 0.0), "n1", id="a one-node cluster"),
        pytest.param(
            (_gpus("n1", 8), _gpus("n2", 8)),
            JobView("j", 16, 0.0),
            "n1+n2",
            id="a whole-cluster gang",
        ),
        pytest.param(
            (_gpus("n1", 2, "NVIDIA A100"), _gpus("n2", 2)),
            JobView("j", 1, 0.0, demand=Demand(gpu_milli=500, gpu_types=("A100",))),
            "n1",
            id="the only node of its GPU type",
        ),
        pytest.param(
            (_gpus("n1", 8), _gpus("n2", 4)),
            JobView("j", 8, 0.0, min_gpus=4, max_gpus=8),
            "n2",
            id="elastic, sized by a stage: its minimum fits elsewhere",
        ),
        pytest.param(
            (_gpus("n1", 8), _gpus("n2", 4)), JobView("j", 8, 0.0), "n1", id="rigid: it does not"
        ),
    ],
)
def test_a_retried_job_goes_back_to_where_it_failed_only_when_nothing_else_could_run_it(
    nodes: tuple[NodeView, ...], job: JobView, placed_on: str
) -> None:
    avoiding = replace(job, avoid_nodes=frozenset({"n1"}))
    policy = Policy(elasticity="marginal-gain")
    (place,) = decide(ClusterSnapshot(nodes=nodes, pending=(avoiding,)), 60.0, policy).placements
    assert "+".join(g.node for g in place.grants) == placed_on
    assert (AVOIDANCE_RELEASED in place.reason) == ("n1" in placed_on)


def test_brain_flags_make_the_failure_policy() -> None:
    from cli.main import build_parser

    def policy(*flags: str) -> FailurePolicy:
        return failures_cli.policy_of(build_parser().parse_args(["brain", *flags]))

    assert policy() == FailurePolicy()
    made = policy(
        *("--infra-retries", "2", "--backoff", "0.5", "--backoff-max", "8"),
        *("--user-retries", "1", "--user-retries", "dev=3", "--blacklist-after", "5"),
        *("--prerun", "big", "--prerun-min-gpus", "8", "--prerun-seconds", "60"),
        *("--black-hole-after", "5", "--black-hole-window", "600"),
    )
    assert (made.infrastructure_retries, made.backoff_s(1), made.backoff_s(9)) == (2, 0.5, 8.0)
    assert (made.user_retries_for("dev"), made.user_retries_for("other")) == (3, 1)
    assert made.blacklist_after_jobs == 5
    assert made.wants_prerun("big", 8) and not made.wants_prerun("big", 4)
    assert (made.black_hole_after, made.black_hole_window_s) == (5, 600.0)
    for flags, words in [
        (("--user-retries", "dev=many"), "--user-retries takes N or QUEUE=N"),
        (("--user-retries", "=2"), "--user-retries takes N or QUEUE=N"),
        (("--infra-retries", "-1"), "infrastructure_retries cannot be negative"),
        (("--backoff", "5", "--backoff-max", "1"), "back-off needs 0 <= base <= max"),
        (("--blacklist-after", "0"), "blacklist_after_jobs must be at least 1"),
        (("--prerun-min-gpus", "1"), "prerun_min_gpus must be at least 2"),
        (("--prerun", "no spaces"), "queue"),
        (("--black-hole-window", "0"), "black_hole_window_s must be positive"),
    ]:
        with pytest.raises(AlnairError, match=re.escape(words)):
            policy(*flags)


# -- black holes ---------------------------------------------------------------------------

HOLE = FailurePolicy(black_hole_after=3, black_hole_window_s=3600.0)


def blamed(*failures: tuple[float, str]) -> list[NodeFailure]:
    return [NodeFailure(at, job, f"job {job} failed at {at:g}") for at, job in failures]


@pytest.mark.parametrize(
    ("failures", "now", "forgiven_at", "hole"),
    [
        pytest.param(blamed((0, "1"), (600, "2"), (1200, "3")), 1300, None, True, id="three"),
        pytest.param(blamed((0, "1"), (600, "2")), 1300, None, False, id="two incidents"),
        # A node lost (or a switch port down) takes every job there at once: one incident.
        pytest.param(
            blamed((0, "1"), (1, "2"), (2, "3"), (30, "4")), 1300, None, False, id="one incident"
        ),
        pytest.param(
            blamed((0, "1"), (1, "2"), (600, "3"), (1200, "4")), 1300, None, True, id="grouped"
        ),
        # Only within the window (an hour: the first is past it) ...
        pytest.param(blamed((300, "1"), (600, "2"), (1200, "3")), 4000, None, False, id="window"),
        # ... and since the node was last resumed.
        pytest.param(
            blamed((2000, "1"), (2600, "2"), (3200, "3")), 4000, 2100.0, False, id="forgiven"
        ),
        # One job's failures are not a node's (it avoids the node after the first).
        pytest.param(
            blamed((1000, "1"), (2000, "1"), (3000, "1")), 4000, None, False, id="one job"
        ),
    ],
)
def test_a_node_is_a_black_hole_after_separate_incidents_of_several_jobs(
    failures: list[NodeFailure], now: float, forgiven_at: float | None, hole: bool
) -> None:
    reason = black_hole(failures, now, HOLE, forgiven_at=forgiven_at)
    assert (reason is not None) is hole
    if reason is not None:
        assert reason.startswith(BLACK_HOLE)


def test_a_black_hole_says_which_jobs_failed_there_and_the_last_reason() -> None:
    failures = blamed(*((i * 100.0, str(10 - i)) for i in range(7)))
    reason = black_hole(failures, 700.0, HOLE)
    assert reason == (
        "black hole: 7 infrastructure failures within 60 min, of jobs 4, 5, 6, 7, 8 and 2 "
        "more; last: job 4 failed at 600"
    )
    assert black_hole(failures, 700.0, replace(HOLE, black_hole_after=0)) is None


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("black_hole_after", -1, "black_hole_after cannot be negative"),
        ("black_hole_window_s", 0.0, "black_hole_window_s must be positive"),
        ("black_hole_max_share", 0.0, "black_hole_max_share must be in (0, 1]"),
        ("black_hole_max_share", 1.5, "black_hole_max_share must be in (0, 1]"),
    ],
)
def test_black_hole_settings_that_make_no_sense_are_refused(
    field: str, value: float, named: str
) -> None:
    with pytest.raises(AlnairError, match=re.escape(named)):
        replace(FailurePolicy(), **{field: value}).validate()
