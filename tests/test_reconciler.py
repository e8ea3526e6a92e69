"""The reconciler without a server: what a node runs that the brain does not hold is
stopped, once per RESTOP_AFTER_S; an elastic attempt whose GPUs a node counts otherwise
is regranted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from brain.reconciler import RESTOP_AFTER_S, SWEEP_EVERY_S, Reconciler
from schemas.commands import Regrant
from schemas.events import JobExited
from schemas.jobs import JobState, NodeGpus, StagedResize
from schemas.telemetry import Heartbeat
from tests.parts import Clock, Shell, heartbeat


@dataclass
class Nodes:
    beats: list[Heartbeat] = field(default_factory=list)

    def reporting(self, now: float, names: Iterable[str] | None = None) -> Iterable[Heartbeat]:
        wanted = None if names is None else set(names)
        return [b for b in self.beats if wanted is None or b.node in wanted]

    def running(self, node: str) -> frozenset[tuple[str, int]]:
        beat = next(b for b in self.beats if b.node == node)
        return frozenset((r.job_id, r.attempt) for r in beat.running)


def reconciler(
    shell: Shell, clock: Clock, stops_sent: dict[tuple[str, str, int], float]
) -> tuple[Reconciler, Nodes]:
    nodes = Nodes()
    made = Reconciler(
        lambda: shell.state, nodes, shell, stops_sent=stops_sent, monotonic=clock, clock=clock
    )
    return made, nodes


@pytest.mark.parametrize(
    ("reported", "stopped"),
    [
        pytest.param(("1", 1), False, id="the attempt it holds runs on"),
        pytest.param(("1", 2), True, id="another attempt of the job"),
        pytest.param(("9", 1), True, id="a job the brain does not know"),
        pytest.param(("2", 1), True, id="a job the brain runs on another node"),
        pytest.param(("3", 1), True, id="a job that waits"),
    ],
)
async def test_a_process_the_brain_does_not_hold_there_is_stopped(
    reported: tuple[str, int], stopped: bool
) -> None:
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1"), shell.add_node("n2")
    shell.add_job(1, node="n1"), shell.add_job(2, node="n2"), shell.add_job(3)
    made, _ = reconciler(shell, clock, {})

    await made.reconcile(heartbeat("n1", reported))

    expected = [("n1", reported[0], reported[1])] if stopped else []
    assert [(s.node, s.job_id, s.attempt) for s in shell.stops] == expected
    assert all("stale" in s.reason for s in shell.stops)


@pytest.mark.parametrize(
    ("stopped_ago", "stopped_again"),
    [(None, True), (0.0, False), (RESTOP_AFTER_S - 0.1, False), (RESTOP_AFTER_S, True)],
)
async def test_a_stop_is_not_repeated_within_restop_after_s(
    stopped_ago: float | None, stopped_again: bool
) -> None:
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1")
    sent = {} if stopped_ago is None else {("n1", "7", 1): clock.now - stopped_ago}
    made, _ = reconciler(shell, clock, sent)

    await made.reconcile(heartbeat("n1", ("7", 1)))

    assert len(shell.stops) == (1 if stopped_again else 0)


async def test_reconcile_all_covers_every_reporting_node() -> None:
    shell, clock = Shell(), Clock(100.0)
    for name in ("n1", "n2", "n3"):
        shell.add_node(name)
    shell.add_job(1, node="n1")
    made, nodes = reconciler(shell, clock, {})
    nodes.beats = [heartbeat("n1", ("1", 1)), heartbeat("n2", ("5", 1)), heartbeat("n3", ("6", 2))]

    await made.reconcile_all()

    assert [(s.node, s.job_id, s.attempt) for s in shell.stops] == [("n2", "5", 1), ("n3", "6", 2)]


async def test_between_sweeps_only_nodes_where_what_the_brain_runs_changed_are_read() -> None:
    """A heartbeat that changes nothing is not handed to the loop: a job ended while its
    node still lists it is found through the node's changed (job, attempt) pairs at the
    next tick; a node where nothing changed waits for the next sweep."""
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1"), shell.add_node("n2")
    running = shell.add_job(1, node="n1")
    made, nodes = reconciler(shell, clock, {})
    nodes.beats = [heartbeat("n1", ("1", 1)), heartbeat("n2")]
    await made.reconcile_all()  # the first is a sweep: all is the brain's
    assert shell.stops == []

    shell.put_job(running.model_copy(update={"state": JobState.SUCCEEDED}))
    nodes.beats[1] = heartbeat("n2", ("9", 1))  # not news: never handed to the loop
    clock.now += 0.5
    await made.reconcile_all()
    assert [(s.node, s.job_id) for s in shell.stops] == [("n1", "1")]

    clock.now += SWEEP_EVERY_S  # n1 still lists job 1, RESTOP_AFTER_S later: again
    await made.reconcile_all()
    assert [(s.node, s.job_id) for s in shell.stops] == [("n1", "1"), ("n1", "1"), ("n2", "9")]


@pytest.mark.parametrize(
    ("exited_after_beat_s", "stopped"),
    [
        pytest.param(0.3, False, id="the beat predates its node's exit report"),
        pytest.param(0.0, False, id="sent at the same instant"),
        pytest.param(-0.3, True, id="listed after its node said it exited"),
        pytest.param(None, True, id="no exit reported"),
    ],
)
async def test_a_beat_older_than_its_nodes_exit_report_stops_nothing(
    exited_after_beat_s: float | None, stopped: bool
) -> None:
    # A job ended and its record is final; the node's latest heartbeat, sent before the
    # process exited, still lists it until the next one.
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1")
    made, _ = reconciler(shell, clock, {})
    beat = heartbeat("n1", ("7", 1))
    if exited_after_beat_s is not None:
        made.exited(
            JobExited(
                event_id="n1-7-1-exited",
                node="n1",
                ts=beat.ts + exited_after_beat_s,
                job_id="7",
                attempt=1,
                exit_code=0,
                runtime_s=20.0,
            )
        )

    await made.reconcile(beat)

    assert len(shell.stops) == (1 if stopped else 0)


async def test_a_node_told_other_gpus_for_an_elastic_attempt_is_regranted() -> None:
    """A shrink's `Regrant` that never arrived: the node still counts the GPUs the job
    gave back. At the next sweep it is told the grant again, not more often than
    RESTOP_AFTER_S; nothing is sent where it agrees, nor while a resize is in flight."""
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1")
    job = shell.add_job(1, gpus=2, node="n1")
    elastic = job.spec.model_copy(update={"elastic": True, "min_gpus": 1, "max_gpus": 4})
    shell.put_job(job.model_copy(update={"spec": elastic}))
    made, nodes = reconciler(shell, clock, {})
    stale = heartbeat("n1", ("1", 1))
    stale = stale.model_copy(
        update={"running": (stale.running[0].model_copy(update={"gpus": (0, 1, 2, 3)}),)}
    )
    nodes.beats = [stale]

    await made.reconcile_all()
    ((node, command),) = shell.commands
    assert node == "n1" and isinstance(command, Regrant)
    assert (command.job_id, command.attempt, command.gpus) == ("1", 1, (0, 1))
    assert not shell.stops  # the attempt is the brain's: it is not stopped
    clock.now += SWEEP_EVERY_S - 0.1
    await made.reconcile_all()
    assert len(shell.commands) == 1
    clock.now += RESTOP_AFTER_S
    await made.reconcile_all()
    assert len(shell.commands) == 2
    # While a resize is in flight, its own regrants speak for it.
    staged = StagedResize(
        command_id="resize-1",
        node="n1",
        before=(NodeGpus(node="n1", gpus=(0, 1)),),
        after=(NodeGpus(node="n1", gpus=(0, 1, 2, 3)),),
        staged_at=clock.now,
        cause="test",
    )
    running = shell.state.jobs["1"]
    shell.put_job(running.model_copy(update={"resize": staged}))
    clock.now += SWEEP_EVERY_S + RESTOP_AFTER_S
    await made.reconcile_all()
    assert len(shell.commands) == 2
    shell.put_job(running)
    # Told: the node agrees.
    nodes.beats = [heartbeat("n1", ("1", 1))]
    nodes.beats[0] = nodes.beats[0].model_copy(
        update={"running": (nodes.beats[0].running[0].model_copy(update={"gpus": (0, 1)}),)}
    )
    clock.now += SWEEP_EVERY_S + RESTOP_AFTER_S
    await made.reconcile_all()
    assert len(shell.commands) == 2


async def test_a_node_is_not_regranted_just_after_a_resize_committed() -> None:
    """Its heartbeat may predate the Regrant the commit sent: wait one RESTOP_AFTER_S."""
    shell, clock = Shell(), Clock(100.0)
    shell.add_node("n1")
    job = shell.add_job(1, gpus=2, node="n1")
    elastic = job.spec.model_copy(update={"elastic": True, "min_gpus": 1, "max_gpus": 4})
    shell.put_job(job.model_copy(update={"spec": elastic, "last_resize_at": clock.now - 1}))
    made, nodes = reconciler(shell, clock, {})
    stale = heartbeat("n1", ("1", 1))
    running = stale.running[0].model_copy(update={"gpus": (0, 1, 2, 3)})
    nodes.beats = [stale.model_copy(update={"running": (running,)})]
    await made.reconcile_all()
    assert shell.commands == []
    clock.now += SWEEP_EVERY_S
    await made.reconcile_all()
    assert len(shell.commands) == 1
