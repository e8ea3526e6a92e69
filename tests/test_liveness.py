"""Liveness of nodes without a server (brain/liveness.py): joins, returns and changes
journaled; lost nodes' jobs run elsewhere only once fenced; vanished attempts and
unconfirmed launches taken back; drains and resumes. Failures go to the real
brain/attempts.py over the same fakes."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest

from brain.attempts import Attempts
from brain.core import DEFAULT_POLICY, Policy
from brain.core.failures import DEFAULT_FAILURE_POLICY
from brain.liveness import Liveness, LostParts
from schemas.api import DrainRequest, ResumeRequest
from schemas.errors import ApiError
from schemas.events import GpuFault
from schemas.jobs import AttemptFailure, FailureClass, JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import NodeState
from schemas.state import CauseKind
from tests.parts import Clock, Shell, heartbeat
from tests.statelog import START_TS


@dataclass(frozen=True)
class Settings:
    node_timeout_s: float = 5.0
    fence_margin_s: float = 5.0
    keep_disconnected_s: float = 300.0
    launch_ttl_s: float = 60.0
    policy: Policy = DEFAULT_POLICY


@dataclass
class Heard:
    last_seen: dict[str, float] = field(default_factory=dict)
    reported: dict[str, frozenset[tuple[str, int]]] = field(default_factory=dict)

    def known(self, node: str) -> bool:
        return node in self.last_seen

    def running(self, node: str) -> frozenset[tuple[str, int]]:
        return self.reported.get(node, frozenset())

    def silent(self, now: float) -> Iterable[tuple[str, float]]:
        return [
            (n, now - t) for n, t in self.last_seen.items() if now - t > Settings.node_timeout_s
        ]


@dataclass
class Hearing:
    deaf: bool = False

    def deaf_within(self, window_s: float) -> bool:
        return self.deaf


@dataclass
class Setup:
    shell: Shell
    heard: Heard
    hearing: Hearing
    monotonic: Clock
    clock: Clock
    liveness: Liveness
    attempts: Attempts


def setup(*nodes: str, parts: LostParts | None = None, settings: Settings | None = None) -> Setup:
    shell, heard, hearing = Shell(), Heard(), Hearing()
    monotonic, clock = Clock(1_000.0), Clock(START_TS + 1_000)
    for node in nodes:
        shell.add_node(node)
        heard.last_seen[node] = monotonic.now
    attempts = Attempts(
        lambda: shell.state, shell, NoJoins(), policy=DEFAULT_FAILURE_POLICY, clock=clock
    )
    made = Liveness(
        lambda: shell.state,
        shell,
        attempts,
        heard,
        hearing,
        parts or NoLostParts(),
        settings=settings or Settings(),
        clock=clock,
        monotonic=monotonic,
    )
    return Setup(shell, heard, hearing, monotonic, clock, made, attempts)


class NoLostParts:
    async def shrink_off_lost(self, job: object, node: str, why: str) -> bool:
        return False


class NoJoins:
    async def join_failed(self, job: object, node: str, why: str) -> bool:
        return False

    async def shed(self, job: object, node: str, why: str) -> bool:
        return False


async def test_a_new_node_joins_and_one_that_returns_keeps_its_drain() -> None:
    s = setup()
    await s.liveness.heartbeat(heartbeat("n1"))
    assert s.shell.state.nodes["n1"].state is NodeState.READY
    assert s.shell.causes[-1].kind is CauseKind.NODE_JOINED

    await s.liveness.heartbeat(heartbeat("n1"))  # nothing new
    assert len(s.shell.causes) == 1

    await s.liveness.drain("ops", DrainRequest(node="n1", reason="maintenance"))
    lost = s.shell.state.nodes["n1"].model_copy(update={"state": NodeState.LOST})
    await s.shell.node_changed(lost, NodeState.DRAINED, s.shell.causes[-1])
    await s.liveness.heartbeat(heartbeat("n1"))
    node = s.shell.state.nodes["n1"]
    assert (node.state, node.drain_reason) == (NodeState.DRAINED, "maintenance")
    assert s.shell.causes[-1].kind is CauseKind.NODE_RETURNED

    await s.liveness.heartbeat(heartbeat("n1", instance="restarted"))
    assert s.shell.causes[-1].kind is CauseKind.NODE_UPDATED
    assert s.shell.state.nodes["n1"].instance == "restarted"


@pytest.mark.parametrize(
    ("fence_s", "warned"),
    [(None, "does not fence itself"), (10.0, "a partition of it may run them twice"), (9.9, None)],
)
async def test_an_agent_that_fences_too_late_is_warned_of(
    fence_s: float | None, warned: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    s = setup()
    with caplog.at_level(logging.WARNING, logger="brain.liveness"):
        await s.liveness.heartbeat(heartbeat("n1").model_copy(update={"fence_s": fence_s}))
    messages = [r.getMessage() for r in caplog.records]
    assert any(warned in m for m in messages) if warned else messages == []


@pytest.mark.parametrize(
    ("on_disconnect", "silent_s", "deaf", "lost", "failed"),
    [
        pytest.param("stop", 5.0, False, False, False, id="within the node timeout"),
        pytest.param("stop", 6.0, False, True, False, id="lost, its agent not fenced yet"),
        pytest.param("stop", 10.5, False, True, True, id="lost and fenced: runs elsewhere"),
        pytest.param("keep", 10.5, False, True, False, id="a keep job runs on unheard"),
        pytest.param("keep", 305.5, False, True, True, id="until keep_disconnected_s + margin"),
        pytest.param("stop", 60.0, True, False, False, id="a deaf brain judges nobody"),
    ],
)
async def test_a_silent_nodes_jobs_run_elsewhere_only_once_fenced(
    on_disconnect: str, silent_s: float, deaf: bool, lost: bool, failed: bool
) -> None:
    s = setup("n1")
    job = s.shell.add_job(1, node="n1")
    spec = JobSpec(name="j", command=("x",), gpus=1, on_disconnect=on_disconnect)  # type: ignore[arg-type]
    s.shell.put_job(job.model_copy(update={"spec": spec}))
    s.hearing.deaf = deaf
    s.monotonic.now += silent_s

    await s.liveness.check_nodes()

    assert (s.shell.state.nodes["n1"].state is NodeState.LOST) is lost
    after = s.shell.state.jobs["1"]
    assert (after.state is JobState.PENDING) is failed
    if failed:
        assert after.failures[-1].failure_class is FailureClass.INFRASTRUCTURE
        assert "node n1 was lost" in after.failures[-1].reason


@dataclass
class ShedsParts:
    """Goes on without every lost part (brain.resizes.Resizes for an elastic job)."""

    asked: list[tuple[str, str, str]] = field(default_factory=list)

    async def shrink_off_lost(self, job: JobRecord, node: str, why: str) -> bool:
        self.asked.append((job.job_id, node, why))
        return True


async def test_a_job_that_goes_on_without_its_part_on_a_lost_node_is_not_failed() -> None:
    parts = ShedsParts()
    s = setup("n1", parts=parts)
    s.shell.add_job(1, node="n1")
    s.monotonic.now += 10.0

    await s.liveness.check_nodes()

    assert s.shell.state.nodes["n1"].state is NodeState.LOST
    [(job_id, node, why)] = parts.asked
    assert (job_id, node) == ("1", "n1") and why.startswith("no heartbeat for 10.0s")
    assert s.shell.state.jobs["1"].state is JobState.RUNNING


@pytest.mark.parametrize(
    ("reported_again", "exited_meanwhile", "waited_s", "failed"),
    [
        (False, False, 5.0, True),
        (False, False, 4.9, False),
        (True, False, 5.0, False),  # the new agent found it after all
        (False, True, 5.0, False),  # its exit arrived: handled as an exit
    ],
)
async def test_an_attempt_gone_with_a_restarted_agent_fails_a_node_timeout_later(
    reported_again: bool, exited_meanwhile: bool, waited_s: float, failed: bool
) -> None:
    s = setup("n1")
    s.shell.add_job(1, node="n1")

    await s.liveness.heartbeat(heartbeat("n1", instance="second"))  # reports nothing
    assert set(s.liveness.vanishing) == {("1", 1, "n1")}
    if reported_again:
        s.heard.reported["n1"] = frozenset({("1", 1)})
    if exited_meanwhile:
        job = s.shell.state.jobs["1"]
        grant = job.grants[0].model_copy(update={"exited": True, "exit_code": 1})
        s.shell.put_job(job.model_copy(update={"grants": (grant,)}))
    s.monotonic.now += waited_s

    await s.liveness.check_vanished()

    assert (s.shell.state.jobs["1"].state is JobState.PENDING) is failed
    assert bool(s.liveness.vanishing) is (waited_s < 5.0)


async def test_a_job_across_nodes_whose_agent_restarted_on_one_avoids_that_one_only() -> None:
    # Seen: a 4-GPU job on n1 and n2; n2's agent was killed and restarted, and the
    # retry avoided n1 too, although nothing had failed there.
    s = setup("n1", "n2")
    job = s.shell.add_job(1, gpus=2, node="n1")
    both = (*job.grants, NodeGrant(node="n2", gpus=(0, 1), pid=4242))
    s.shell.put_job(job.model_copy(update={"grants": both}))
    s.heard.reported["n1"] = frozenset({("1", 1)})

    await s.liveness.heartbeat(heartbeat("n2", instance="second"))  # reports nothing
    s.monotonic.now += 5.0
    await s.liveness.check_vanished()

    after = s.shell.state.jobs["1"]
    assert after.state is JobState.PENDING
    assert after.failures[-1].nodes == ("n1", "n2")  # the attempt ran on both
    assert after.avoid_nodes == ("n2",)
    assert "avoiding n2" in s.shell.causes[-1].message


@pytest.mark.parametrize(
    ("age_s", "running_reported", "requeued"),
    [(64.9, False, False), (65.1, False, True), (100.0, True, False)],
)
async def test_a_launch_no_node_confirmed_is_requeued(
    age_s: float, running_reported: bool, requeued: bool
) -> None:
    s = setup("n1")
    job = s.shell.add_job(1, node="n1")
    unconfirmed = NodeGrant(node="n1", gpus=(0,))
    s.shell.put_job(
        job.model_copy(update={"grants": (unconfirmed,), "started_at": s.clock.now - age_s})
    )
    if running_reported:
        s.heard.reported["n1"] = frozenset({("1", 1)})

    await s.liveness.check_launches()

    after = s.shell.state.jobs["1"]
    assert (after.state is JobState.PENDING) is requeued
    if requeued:
        assert after.attempt == 1 and s.shell.causes[-1].kind is CauseKind.LAUNCH_FAILED


async def test_operators_drain_and_resume_nodes_and_gpus() -> None:
    s = setup("n1")
    await s.liveness.drain("ops", DrainRequest(node="n1", reason="fan"))
    await s.liveness.drain("ops", DrainRequest(node="n1", reason="fan"))  # no change
    await s.liveness.drain("ops", DrainRequest(node="n1", gpu=3, reason="hot"))
    node = s.shell.state.nodes["n1"]
    assert (node.state, node.drain_reason) == (NodeState.DRAINED, "fan")
    assert [d.index for d in node.drained_gpus] == [3]
    assert [c.kind for c in s.shell.causes] == [CauseKind.NODE_DRAINED, CauseKind.GPU_DRAINED]

    await s.liveness.resume("ops", ResumeRequest(node="n1"))
    node = s.shell.state.nodes["n1"]
    assert (node.state, node.drain_reason, node.drained_gpus) == (NodeState.READY, None, ())

    with pytest.raises(ApiError) as not_drained:
        await s.liveness.resume("ops", ResumeRequest(node="n1"))
    with pytest.raises(ApiError) as unknown:
        await s.liveness.drain("ops", DrainRequest(node="n9"))
    assert (not_drained.value.code, unknown.value.code) == ("conflict", "not_found")


async def test_a_resumed_node_is_no_longer_avoided_by_the_jobs_that_failed_there() -> None:
    # A GPU falls off the bus: the node is drained and its job retried elsewhere,
    # avoiding it. Once an operator resumes the node, the job may go back: before,
    # it waited for room on the other nodes while the resumed one idled.
    s = setup("n1", "n2")
    s.shell.add_job(1, node="n1")
    s.shell.add_job(2, node="n1")
    earlier = AttemptFailure(
        attempt=1, failure_class=FailureClass.INFRASTRUCTURE, reason="lost", nodes=("n2",), at=0.0
    )
    s.shell.put_job(s.shell.state.jobs["2"].model_copy(update={"failures": (earlier,)}))
    await s.attempts.gpu_fault(
        GpuFault(event_id="e", node="n1", ts=0.0, gpu=0, fault="xid", xid=79)
    )
    assert s.shell.state.nodes["n1"].state is NodeState.DRAINED
    assert [s.shell.state.jobs[j].avoid_nodes for j in ("1", "2")] == [("n1",), ("n1", "n2")]

    s.clock.now += 60
    await s.liveness.resume("ops", ResumeRequest(node="n1"))

    assert s.shell.state.nodes["n1"].resumed_at == s.clock.now
    assert [s.shell.state.jobs[j].avoid_nodes for j in ("1", "2")] == [(), ("n2",)]
    forgiven = [c for c in s.shell.causes[-2:] if c.kind is CauseKind.NODE_RESUMED]
    assert [c.job_id for c in forgiven] == ["1", "2"]
    assert forgiven[0].message == (
        "node n1 resumed by ops: it may run there again, where it failed before"
    )

    # Its next failure, elsewhere, does not bring back what was forgiven.
    s.shell.put_job(
        s.shell.state.jobs["1"].model_copy(
            update={"state": JobState.RUNNING, "grants": (NodeGrant(node="n2", gpus=(0,)),)}
        )
    )
    s.clock.now += 60
    await s.attempts.gpu_fault(
        GpuFault(event_id="f", node="n2", ts=0.0, gpu=0, fault="xid", xid=79)
    )
    assert s.shell.state.jobs["1"].avoid_nodes == ("n2",)


@pytest.mark.parametrize(
    ("gpu", "requeued"),
    [(None, {"1", "2"}), (1, {"2"}), (7, set())],
)
async def test_a_drain_that_requeues_stops_what_runs_there_and_spends_no_retry(
    gpu: int | None, requeued: set[str]
) -> None:
    s = setup("n1", "n2")
    s.shell.add_job(1, gpus=1, node="n1")  # GPU 0
    s.shell.put_job(  # GPUs 1, 2
        s.shell.add_job(2, gpus=1, node="n1").model_copy(
            update={"grants": (NodeGrant(node="n1", gpus=(1, 2), pid=1002),)}
        )
    )
    s.shell.add_job(3, gpus=1, node="n2")

    request = DrainRequest(node="n1", gpu=gpu, reason="BIOS update", requeue=True)
    await s.liveness.drain("ops", request)

    jobs = s.shell.state.jobs
    assert {j for j in ("1", "2", "3") if jobs[j].state is JobState.PENDING} == requeued
    where = "n1" if gpu is None else f"n1 GPU {gpu}"
    for job_id in requeued:
        assert jobs[job_id].failures == () and jobs[job_id].attempt == 1
        assert jobs[job_id].reason == f"requeued: {where} drained by ops: BIOS update"
    assert {(stop.job_id, stop.node) for stop in s.shell.stops} == {(j, "n1") for j in requeued}
    node = s.shell.state.nodes["n1"]
    if gpu is None:
        assert (node.state, node.drain_reason) == (NodeState.DRAINED, "BIOS update")
    else:
        assert [d.index for d in node.drained_gpus] == [gpu]
    # Again: drained already, nothing left to requeue.
    causes = len(s.shell.causes)
    await s.liveness.drain("ops", request)
    assert len(s.shell.causes) == causes


async def test_a_drain_leaves_a_lost_nodes_jobs_to_its_loss() -> None:
    s = setup("n1")
    s.shell.add_job(1, node="n1")
    s.monotonic.now += 6.0  # lost, not yet fenced
    await s.liveness.check_nodes()
    assert s.shell.state.nodes["n1"].state is NodeState.LOST

    await s.liveness.drain("ops", DrainRequest(node="n1", reason="dead PSU", requeue=True))

    assert s.shell.state.jobs["1"].state is JobState.RUNNING
    assert s.shell.stops == []


@pytest.mark.parametrize(
    ("elasticity", "pinned", "drained", "requeued"),
    [
        pytest.param("marginal-gain", None, "n1", False, id="shrinks off n1 in place"),
        pytest.param("none", None, "n1", True, id="no elasticity stage: requeued"),
        pytest.param("marginal-gain", 4, "n1", True, id="pinned: its size is the operator's"),
        pytest.param("marginal-gain", None, "n2", True, id="its supervisor's node"),
    ],
)
async def test_an_elastic_job_that_can_shrink_off_a_drained_node_is_not_requeued(
    elasticity: str, pinned: int | None, drained: str, requeued: bool
) -> None:
    policy = Policy(elasticity=elasticity)
    s = setup("n1", "n2", settings=Settings(policy=policy))
    spec = JobSpec(command=("x",), gpus=2, elastic=True, min_gpus=1, max_gpus=4)
    grants = (NodeGrant(node="n2", gpus=(0, 1), pid=7), NodeGrant(node="n1", gpus=(0, 1), pid=8))
    s.shell.put_job(
        s.shell.add_job(1, node="n2").model_copy(
            update={"spec": spec, "grants": grants, "pinned_gpus": pinned}
        )
    )
    await s.liveness.drain("ops", DrainRequest(node=drained, reason="swap", requeue=True))
    assert (s.shell.state.jobs["1"].state is JobState.PENDING) is requeued
