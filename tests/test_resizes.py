"""Elastic resizes without a server (brain/resizes.py): staged with their commands,
committed or rolled back on the supervisor's answer or its silence."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel

from brain.core.failures import Classification
from brain.elastic import not_elastic
from brain.resizes import Resizes
from schemas import subjects
from schemas.api import ResizeRequest
from schemas.commands import Regrant
from schemas.commands import Resize as ResizeCommand
from schemas.errors import ApiError
from schemas.events import ResizeCompleted
from schemas.jobs import FailureClass, JobRecord, JobSpec, JobState, NodeGpus, NodeGrant
from schemas.state import CauseKind
from tests.parts import Clock, Shell
from tests.statelog import START_TS

TIMEOUT_S = 300.0


@dataclass
class Outbox:
    sent: list[tuple[str, BaseModel, str]] = field(default_factory=list)

    def send_after(self, subject: str, message: BaseModel, msg_id: str) -> None:
        self.sent.append((subject, message, msg_id))


@dataclass
class Supervisors:
    heard: set[str] = field(default_factory=lambda: {"1"})

    def heard_from(self, job_id: str) -> bool:
        return job_id in self.heard


@dataclass
class Failed:
    """The attempts failed (brain.attempts.Attempts.fail_attempt's place)."""

    attempts: list[tuple[JobRecord, str, Classification]] = field(default_factory=list)

    async def fail_attempt(self, job: JobRecord, node: str, why: Classification) -> None:
        self.attempts.append((job, node, why))


@dataclass
class Setup:
    shell: Shell
    outbox: Outbox
    supervisors: Supervisors
    clock: Clock
    resizes: Resizes
    leading: list[bool]
    failed: Failed

    @property
    def job(self) -> JobRecord:
        return self.shell.state.jobs["1"]


def setup(gpus: int = 2, n1_gpus: int = 8) -> Setup:
    """Elastic job 1 (1..4 GPUs) running on GPUs 0..gpus-1 of n1, its supervisor heard."""
    shell, outbox, supervisors, clock = Shell(), Outbox(), Supervisors(), Clock(START_TS + 100)
    shell.add_node("n1", gpus=n1_gpus)
    shell.add_node("n2", gpus=8)
    spec = JobSpec(
        name="elastic", command=("train",), gpus=gpus, elastic=True, min_gpus=1, max_gpus=4
    )
    shell.put_job(
        JobRecord(
            job_id="1",
            tenant="alice",
            spec=spec,
            state=JobState.RUNNING,
            submitted_at=START_TS,
            started_at=START_TS + 1,
            attempt=1,
            grants=(NodeGrant(node="n1", gpus=tuple(range(gpus)), pid=100),),
        )
    )
    leading = [True]
    failed = Failed()
    made = Resizes(
        lambda: shell.state,
        shell,
        outbox,
        supervisors,
        clock=clock,
        timeout_s=TIMEOUT_S,
        leading=lambda: leading[0],
        fail_attempt=failed.fail_attempt,
    )
    return Setup(shell, outbox, supervisors, clock, made, leading, failed)


def held(job: JobRecord) -> dict[str, tuple[int, ...]]:
    return {g.node: g.gpus for g in job.grants if g.gpus}


async def test_an_operators_grow_is_pinned_staged_and_commanded() -> None:
    s = setup()

    staged = await s.resizes.resize_request(
        "alice", ResizeRequest(job_id="1", gpus=4), operator=False
    )

    assert staged.pinned_gpus == 4 and staged.resize is not None and staged.resize.grow
    # A grow holds the added GPUs from the start, and the job's node is told so.
    assert held(staged) == {"n1": (0, 1, 2, 3)}
    [(node, regrant)] = s.shell.commands
    assert node == "n1" and isinstance(regrant, Regrant) and regrant.gpus == (0, 1, 2, 3)
    [(subject, command, msg_id)] = s.outbox.sent
    assert subject == subjects.job("1", "cmd") and isinstance(command, ResizeCommand)
    assert msg_id == staged.resize.command_id
    assert s.shell.causes[-1].kind is CauseKind.RESIZE_STAGED


@pytest.mark.parametrize(
    ("tenant", "operator", "gpus", "heard", "code"),
    [
        pytest.param("bob", False, 3, True, "not_found", id="another tenant's job"),
        pytest.param("alice", False, 5, True, "invalid", id="above its range"),
        pytest.param("alice", False, 3, False, "conflict", id="supervisor not heard yet"),
    ],
)
async def test_a_resize_that_cannot_be_is_refused_and_changes_nothing(
    tenant: str, operator: bool, gpus: int, heard: bool, code: str
) -> None:
    s = setup()
    if not heard:
        s.supervisors.heard.clear()
    before = s.shell.state.last_seq

    with pytest.raises(ApiError) as refused:
        await s.resizes.resize_request(
            tenant, ResizeRequest(job_id="1", gpus=gpus), operator=operator
        )

    assert refused.value.code == code
    assert s.shell.state.last_seq == before and s.outbox.sent == [] and s.shell.commands == []


async def test_a_resize_to_the_size_it_runs_at_only_pins_it_and_auto_unpins() -> None:
    s = setup()
    other = await s.resizes.resize_request("ops", ResizeRequest(job_id="1", gpus=2), operator=True)
    assert other.pinned_gpus == 2 and other.resize is None and s.outbox.sent == []
    assert "by an operator" in (other.reason or "")

    unpinned = await s.resizes.resize_request(
        "alice", ResizeRequest(job_id="1", gpus="auto"), operator=False
    )
    assert unpinned.pinned_gpus is None
    assert [c.kind for c in s.shell.causes[-2:]] == [
        CauseKind.RESIZE_PINNED,
        CauseKind.RESIZE_UNPINNED,
    ]


def completed(s: Setup, *, ok: bool, to_size: int, reason: str = "") -> ResizeCompleted:
    staged = s.job.resize
    assert staged is not None
    return ResizeCompleted(
        event_id="e-1",
        node="n1",
        ts=0.0,
        job_id="1",
        command_id=staged.command_id,
        from_size=staged.from_size,
        to_size=to_size,
        ok=ok,
        duration_s=2.5,
        reason=reason,
    )


async def test_a_shrink_commits_on_its_supervisors_answer_and_frees_the_gpus() -> None:
    s = setup(gpus=4)
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=2), operator=False)
    assert held(s.job) == {"n1": (0, 1, 2, 3)}  # held until the workers on them exit
    s.clock.now += 3.0

    await s.resizes.resize_completed(completed(s, ok=True, to_size=2))

    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)} and s.job.gpu_count == 2
    assert s.job.last_resize_s == pytest.approx(3.0)
    assert s.shell.causes[-1].kind is CauseKind.RESIZED
    assert isinstance(s.shell.commands[-1][1], Regrant) and s.shell.commands[-1][1].gpus == (0, 1)


async def test_a_shrink_says_the_gpus_its_workers_kept_not_the_ones_planned() -> None:
    # Seen live: "resized 4 -> 3 GPUs (node-1:0,1, node-2:0,1 -> node-1:0,1, node-2:0)
    # ...; GPUs node-2:0 released": Horovod retired the worker on node-2:0, not the one
    # on node-2:1 the brain planned to release, and the text said both.
    s = setup(gpus=2)
    two_nodes = (*s.job.grants, NodeGrant(node="n2", gpus=(0, 1), pid=101))
    s.shell.put_job(s.job.model_copy(update={"grants": two_nodes}))
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)
    planned = s.job.resize
    assert planned is not None
    assert [(p.node, p.gpus) for p in planned.after] == [("n1", (0, 1)), ("n2", (0,))]
    kept = (NodeGpus(node="n1", gpus=(0, 1)), NodeGpus(node="n2", gpus=(1,)))

    await s.resizes.resize_completed(
        completed(s, ok=True, to_size=3).model_copy(update={"placement": kept})
    )

    assert held(s.job) == {"n1": (0, 1), "n2": (1,)}
    assert s.shell.causes[-1].message == (
        "resized 4 -> 3 GPUs (n1:0,1, n2:0,1 -> n1:0,1, n2:1) in 2.5s; GPUs n2:0 released"
    )


async def test_an_answer_for_another_resize_is_ignored() -> None:
    s = setup()
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)
    before = s.shell.state.last_seq
    stale = completed(s, ok=True, to_size=3).model_copy(update={"command_id": "resize-old"})

    await s.resizes.resize_completed(stale)

    assert s.shell.state.last_seq == before and s.job.resize is not None


async def test_a_refused_grow_goes_back_and_lifts_the_pin() -> None:
    s = setup()
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)

    await s.resizes.resize_completed(completed(s, ok=False, to_size=2, reason="no"))

    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)} and s.job.pinned_gpus is None
    assert s.shell.causes[-1].kind is CauseKind.RESIZE_ROLLED_BACK


async def test_an_unanswered_grow_is_reverted_then_given_up_holding_every_gpu() -> None:
    s = setup()
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)

    s.clock.now += TIMEOUT_S  # not yet past the limit
    await s.resizes.check_resizes()
    assert s.job.resize is not None and not s.job.resize.reverting

    s.clock.now += 1.0
    await s.resizes.check_resizes()
    # Its supervisor may have moved part of the way: the old size is staged as a
    # resize of its own, the job holding both sizes' GPUs meanwhile.
    revert = s.job.resize
    assert revert is not None and revert.reverting and revert.to_size == 2
    assert held(s.job) == {"n1": (0, 1, 2)} and s.outbox.sent[-1][2] == revert.command_id

    s.clock.now += TIMEOUT_S + 1.0
    await s.resizes.check_resizes()
    assert s.job.resize is None and held(s.job) == {"n1": (0, 1, 2)}


async def test_a_grow_onto_a_node_whose_worker_host_fails_drops_that_node() -> None:
    s = setup(gpus=2, n1_gpus=2)  # n1 is full: a grow goes onto n2
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)
    assert held(s.job) == {"n1": (0, 1), "n2": (0,)} and s.shell.launches == ["n2"]
    # A launch that fails elsewhere is the job's own business, not the grow's.
    assert await s.resizes.join_failed(s.job, "n1", "no") is False

    assert await s.resizes.join_failed(s.job, "n2", "its worker host did not start") is True

    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)}
    assert s.job.failed_nodes == ("n2",) and s.job.pinned_gpus is None
    assert [(stop.node, stop.job_id) for stop in s.shell.stops] == [("n2", "1")]


async def test_resizes_are_sent_again_by_a_new_leader_only_while_it_leads() -> None:
    s = setup()
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)
    s.outbox.sent.clear()

    s.leading[0] = False
    await s.resizes.resend_staged_resizes()
    assert s.outbox.sent == []

    s.leading[0] = True
    await s.resizes.resend_staged_resizes()
    [(_, _, msg_id)] = s.outbox.sent
    assert s.job.resize is not None and msg_id == s.job.resize.command_id


def across(s: Setup, *, n2_gpus: tuple[int, ...] = (0, 1), min_gpus: int = 1) -> None:
    """Job 1 runs on n1's GPUs 0, 1 (its supervisor) and `n2_gpus` of n2 (none: its
    worker host idles there)."""
    spec = s.job.spec.model_copy(update={"gpus": 2 + len(n2_gpus), "min_gpus": min_gpus})
    grants = (
        NodeGrant(node="n1", gpus=(0, 1), pid=100),
        NodeGrant(node="n2", gpus=n2_gpus, pid=200),
    )
    s.shell.put_job(s.job.model_copy(update={"spec": spec, "grants": grants}))


async def test_an_elastic_job_sheds_a_lost_node_in_the_same_attempt() -> None:
    s = setup()
    across(s)
    s.shell.put_job(s.job.model_copy(update={"pinned_gpus": 4}))

    assert await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s") is True

    # Its part there is dropped at once and the node barred for the attempt; the
    # supervisor is told not to wait for the workers there.
    staged = s.job.resize
    assert staged is not None and staged.lost == ("n2",)
    assert (staged.from_size, staged.to_size) == (4, 2)
    assert held(s.job) == {"n1": (0, 1)} and s.job.failed_nodes == ("n2",)
    assert s.job.nodes == ("n1",) and s.job.state is JobState.RUNNING and s.job.attempt == 1
    [(_, command, _)] = s.outbox.sent
    assert isinstance(command, ResizeCommand) and command.lost == ("n2",)
    assert command.world_size == 2 and [p.node for p in command.placement] == ["n1"]
    # Its agent stopped the part there itself; should that not be so, it hears on return.
    assert [(stop.node, stop.job_id) for stop in s.shell.stops] == [("n2", "1")]
    assert s.shell.causes[-1].kind is CauseKind.RESIZE_STAGED
    assert "node n2 was lost" in s.shell.causes[-1].message
    # It cannot be held at the size it was pinned at.
    assert s.job.pinned_gpus is None and "pin at 4 GPUs is lifted" in s.shell.causes[-1].message

    await s.resizes.resize_completed(completed(s, ok=True, to_size=2))

    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)} and s.failed.attempts == []
    assert "its part on lost node(s) n2 dropped" in s.shell.causes[-1].message


@pytest.mark.parametrize("how", ["refused", "unanswered"])
async def test_a_lost_node_shed_that_does_not_complete_fails_the_attempt(how: str) -> None:
    s = setup()
    across(s)
    await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s")

    if how == "refused":
        await s.resizes.resize_completed(completed(s, ok=False, to_size=2, reason="stuck"))
    else:
        s.clock.now += TIMEOUT_S + 1.0
        await s.resizes.check_resizes()

    # Nothing to roll back onto: the part on n2 is gone.
    [(job, node, why)] = s.failed.attempts
    assert node == "n2" and job.resize is None
    assert why.failure_class is FailureClass.INFRASTRUCTURE
    assert why.reason.startswith("the job could not go on without its part on node n2")


@pytest.mark.parametrize(
    ("change", "lost"),
    [
        pytest.param({}, "n1", id="its supervisor's node"),
        pytest.param({"min_gpus": True}, "n2", id="what is left is under its minimum"),
        pytest.param({"heard": False}, "n2", id="its supervisor has not reported"),
        pytest.param({"elastic": False}, "n2", id="not elastic"),
        pytest.param({"resizing": True}, "n2", id="another resize under way"),
    ],
)
async def test_a_job_that_cannot_go_on_without_a_lost_node_is_left_to_fail(
    change: dict[str, object], lost: str
) -> None:
    s = setup()
    across(s, min_gpus=3 if "min_gpus" in change else 1)
    if change.get("heard") is False:
        s.supervisors.heard.clear()
    if change.get("elastic") is False:
        spec = JobSpec(name="rigid", command=("train",), gpus=4)
        s.shell.put_job(s.job.model_copy(update={"spec": spec}))
    if change.get("resizing"):
        await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)
    before = s.shell.state.last_seq

    assert await s.resizes.shrink_off_lost(s.job, lost, "no heartbeat for 10.0s") is False

    assert s.shell.state.last_seq == before and s.failed.attempts == []


async def test_a_part_its_node_stopped_is_shed_saying_so() -> None:
    s = setup()
    across(s)

    why = "its part on node n2 was stopped by that node (signal 9)"
    assert await s.resizes.shed(s.job, "n2", why) is True

    assert s.job.resize is not None and s.job.resize.lost == ("n2",)
    assert s.shell.causes[-1].message.endswith(
        f"staged: {why}; the job goes on without its GPUs there"
    )


async def test_a_lost_node_where_the_job_idles_is_dropped_without_a_resize() -> None:
    s = setup()
    across(s, n2_gpus=())

    assert await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s") is True

    assert s.job.resize is None and s.job.nodes == ("n1",) and s.job.failed_nodes == ("n2",)
    assert s.outbox.sent == [] and s.shell.causes[-1].kind is CauseKind.NODE_LOST
    assert [(stop.node, stop.job_id) for stop in s.shell.stops] == [("n2", "1")]


async def test_a_grow_onto_a_node_lost_before_its_worker_host_started_is_rolled_back() -> None:
    s = setup(gpus=2, n1_gpus=2)  # n1 is full: a grow goes onto n2
    await s.resizes.resize_request("alice", ResizeRequest(job_id="1", gpus=3), operator=False)

    assert await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s") is True

    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)}
    assert s.job.failed_nodes == ("n2",) and s.failed.attempts == []


def across_three() -> Setup:
    """Job 1 at 6 GPUs (1..6), two on each of n1, n2 and n3."""
    s = setup()
    spec = s.job.spec.model_copy(update={"gpus": 6, "min_gpus": 1, "max_gpus": 6})
    grants = tuple(
        NodeGrant(node=n, gpus=(0, 1), pid=100 + i) for i, n in enumerate(("n1", "n2", "n3"))
    )
    s.shell.add_node("n3", gpus=8)
    s.shell.put_job(s.job.model_copy(update={"spec": spec, "grants": grants}))
    return s


async def test_a_second_lost_node_supersedes_the_shed_under_way() -> None:
    s = across_three()
    await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s")
    first = s.job.resize
    assert first is not None and first.to_size == 4

    assert await s.resizes.shrink_off_lost(s.job, "n3", "no heartbeat for 10.0s") is True

    staged = s.job.resize
    assert staged is not None and staged.command_id != first.command_id
    assert staged.lost == ("n2", "n3") and (staged.from_size, staged.to_size) == (6, 2)
    assert held(s.job) == {"n1": (0, 1)} and s.job.failed_nodes == ("n2", "n3")
    [*_, (_, command, _)] = s.outbox.sent
    assert isinstance(command, ResizeCommand) and command.lost == ("n2", "n3")
    # The first shed's answer no longer matches: only the second commits.
    late = completed(s, ok=False, to_size=4).model_copy(update={"command_id": first.command_id})
    await s.resizes.resize_completed(late)
    assert s.failed.attempts == [] and s.job.resize == staged
    await s.resizes.resize_completed(completed(s, ok=True, to_size=2))
    assert s.job.resize is None and held(s.job) == {"n1": (0, 1)}


async def test_a_shed_of_several_lost_nodes_that_fails_blames_them_all() -> None:
    s = across_three()
    await s.resizes.shrink_off_lost(s.job, "n2", "no heartbeat for 10.0s")
    await s.resizes.shrink_off_lost(s.job, "n3", "no heartbeat for 10.0s")

    await s.resizes.resize_completed(completed(s, ok=False, to_size=2, reason="stuck"))

    [(_, node, why)] = s.failed.attempts
    assert node == "n2" and why.on_nodes == ("n2", "n3")


def test_a_share_is_told_shares_are_not_elastic() -> None:
    share = JobRecord(
        job_id="7",
        tenant="t",
        spec=JobSpec(command=("x",), gpus=1, gpu_milli=250),
        state=JobState.RUNNING,
        submitted_at=0.0,
    )
    assert not_elastic(share).startswith("job 7 is a share of one GPU (0.25 GPU): shares are")
