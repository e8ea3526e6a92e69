"""Ingest apart from decisions: brain/ingest.py without a server, a real brain that
journals nothing for heartbeats that change nothing, and the snapshot's reused node views."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core.model import RankedOut, UtilizationProfile
from brain.ingest import NodeIngest
from brain.state import BrainState, job_view, node_view
from schemas import subjects
from schemas.base import encode
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import DrainedGpu, NodeRecord, NodeState
from schemas.state import Cause, CauseKind, JobChanged, NodeChanged
from schemas.telemetry import GpuHealth, GpuInfo, GpuSample, Heartbeat, RunningJob, TelemetryBatch
from tests.conftest import eventually

TIMEOUT_S = 5.0


def gpus(count: int = 2, *, unhealthy: int | None = None) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{i}",
            model="H100",
            memory_mib=81920,
            health=GpuHealth.UNHEALTHY if i == unhealthy else GpuHealth.HEALTHY,
        )
        for i in range(count)
    )


def beat(
    node: str = "n1",
    seq: int = 1,
    *,
    instance: str = "a",
    inventory: tuple[GpuInfo, ...] | None = None,
    running: tuple[RunningJob, ...] = (),
    epoch_seen: int = 0,
) -> Heartbeat:
    return Heartbeat(
        node=node,
        ts=1000.0 + seq,
        seq=seq,
        instance=instance,
        hostname="host",
        backend="sim",
        interval_s=1.0,
        gpus=gpus() if inventory is None else inventory,
        running=running,
        epoch_seen=epoch_seen,
    )


def job(job_id: str, attempt: int = 1, pid: int = 10) -> RunningJob:
    return RunningJob(job_id=job_id, attempt=attempt, pid=pid, gpus=(0,))


def test_a_node_known_from_the_log_has_not_been_seen_until_it_is_heard() -> None:
    # `alnair nodes` (SEEN) and `alnair up` (ready) read it: a node the log knows, in
    # its grace period after a brain starts, was read as seen just now.
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.expect("n1", "old-instance", 10.0)
    assert ingest.last_seen_ago("n1", 12.0) is None
    ingest.heartbeat(beat(seq=1), 13.0)
    assert ingest.last_seen_ago("n1", 14.0) == pytest.approx(1.0)


def test_first_heartbeat_is_news_and_repeats_are_not() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    first = ingest.heartbeat(beat(seq=1), 0.0)
    assert first is not None and first.kind == "first"
    # Time, sequence and the epoch the agent saw change every beat: none is news.
    for seq in range(2, 50):
        assert ingest.heartbeat(beat(seq=seq, epoch_seen=seq), seq * 1.0) is None
    assert ingest.last_seen_ago("n1", 52.0) == pytest.approx(3.0)
    assert ingest.counts.heartbeats == 49
    assert ingest.counts.heartbeats_forwarded == 1


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"instance": "b"}, "agent restarted"),
        ({"inventory": gpus(3)}, "inventory"),
        ({"inventory": gpus(2, unhealthy=1)}, "GPU health"),
        ({"running": (job("7"),)}, "processes"),
    ],
)
def test_a_change_in_what_decisions_read_is_news(change: dict[str, object], what: str) -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.heartbeat(beat(seq=1), 0.0)
    news = ingest.heartbeat(beat(seq=2, **change), 1.0)  # type: ignore[arg-type]
    assert news is not None and news.kind == "changed", what
    # ...once: the same again is not news.
    assert ingest.heartbeat(beat(seq=3, **change), 2.0) is None  # type: ignore[arg-type]


def test_a_process_that_only_changes_pid_is_the_same_attempt() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.heartbeat(beat(seq=1, running=(job("7", pid=10),)), 0.0)
    assert ingest.heartbeat(beat(seq=2, running=(job("7", pid=11),)), 1.0) is None
    assert ingest.running("n1") == frozenset({("7", 1)})
    news = ingest.heartbeat(beat(seq=3, running=(job("7", attempt=2),)), 2.0)
    assert news is not None and ingest.running("n1") == frozenset({("7", 2)})


def test_silence_and_return() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.heartbeat(beat("n1", 1), 0.0)
    ingest.heartbeat(beat("n2", 1), 0.0)
    ingest.heartbeat(beat("n2", 2), 4.0)
    assert list(ingest.silent(5.0)) == []
    assert list(ingest.silent(5.5)) == [("n1", 5.5)]
    # Reported every time it is asked: the loop decides what is new (it may have failed).
    assert [name for name, _ in ingest.silent(6.0)] == ["n1"]
    back = ingest.heartbeat(beat("n1", 2), 7.0)
    assert back is not None and back.kind == "returned"
    assert list(ingest.silent(7.0)) == []


def test_an_unchanged_inventory_is_kept_once() -> None:
    """A heartbeat decoded again (after a silence, with news about its processes, or with
    its bytes) keeps the inventory objects its node already has, which the node's record
    shares: one copy of every GPU's description per node, however often it is decoded."""
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    first = beat("n1", 1)
    ingest.heartbeat(first, 0.0, encode(first))
    kept = first.gpus
    for later, now in (
        (beat("n1", 2), 1.0),  # decoded although a repeat
        (beat("n1", 3), 9.0),  # back after a silence
        (beat("n1", 4, running=(job("j"),)), 10.0),  # news about its processes
    ):
        ingest.heartbeat(later, now, encode(later))
        latest = ingest.latest_beat("n1")
        assert latest is not None and latest.gpus is kept and latest.seq == later.seq
    changed = beat("n1", 5, inventory=gpus(unhealthy=1))
    news = ingest.heartbeat(changed, 11.0, encode(changed))
    assert news is not None and news.kind == "changed" and news.beat.gpus == gpus(unhealthy=1)


def test_nodes_from_the_log_get_a_grace_period_and_their_first_beat_is_news() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.expect("n1", "a", 100.0)
    assert ingest.known("n1")
    assert list(ingest.silent(104.0)) == []
    assert [name for name, _ in ingest.silent(105.5)] == ["n1"]
    ingest.reset()
    ingest.expect("n1", "a", 200.0)
    news = ingest.heartbeat(beat("n1", 9), 201.0)
    assert news is not None and news.kind == "first"
    assert ingest.instance("n1") == "a"


def test_unsettled_node_makes_its_next_beat_news() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.heartbeat(beat(seq=1), 0.0)
    ingest.unsettle("n1")
    again = ingest.heartbeat(beat(seq=2), 1.0)
    assert again is not None and again.kind == "first"
    ingest.unsettle("unknown")  # harmless


def test_reporting_lists_live_nodes_with_processes() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    ingest.heartbeat(beat("n1", 1, running=(job("1"),)), 0.0)
    ingest.heartbeat(beat("n2", 1), 0.0)
    assert [b.node for b in ingest.reporting(1.0)] == ["n1"]
    # A node gone silent: its last word is stale, nothing of it is stopped again.
    assert list(ingest.reporting(TIMEOUT_S + 1.0)) == []
    assert ingest.running("n2") == frozenset()
    assert ingest.running("n3") == frozenset()


def test_latest_telemetry_per_node() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    sample = GpuSample(
        index=0,
        util_gpu_pct=50,
        util_mem_pct=10,
        mem_used_mib=1,
        mem_total_mib=2,
        power_w=100,
        temp_c=40,
        sm_clock_mhz=1000,
        mem_clock_mhz=1000,
    )
    for ts in (1.0, 2.0, 3.0):
        ingest.telemetry(TelemetryBatch(node="n1", ts=ts, samples=(sample,)))
    assert ingest.latest_telemetry["n1"].ts == 3.0
    assert ingest.counts.telemetry == 3


def test_raw_bytes_make_repeats_cheap_and_changes_still_news() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    first = beat(seq=1)
    assert ingest.heartbeat(first, 0.0, encode(first)) is not None
    for seq in range(2, 10):
        same = beat(seq=seq)
        assert ingest.heartbeat(same, float(seq), encode(same)) is None
    changed = beat(seq=10, running=(job("3"),))
    news = ingest.heartbeat(changed, 10.0, encode(changed))
    assert news is not None and news.kind == "changed"
    assert ingest.running("n1") == frozenset({("3", 1)})
    # Only the epoch seen differs: the bytes differ, the news is none.
    seen = beat(seq=11, running=(job("3"),), epoch_seen=4)
    assert ingest.heartbeat(seen, 11.0, encode(seen)) is None
    # A silent node's heartbeat is news even when its bytes are the same.
    back = beat(seq=12, running=(job("3"),), epoch_seen=4)
    returned = ingest.heartbeat(back, 20.0, encode(back))
    assert returned is not None and returned.kind == "returned"


def test_raw_bytes_in_another_layout_fall_back_to_comparing_fields() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    # Keys in another order (another sender's encoder): compared field by field.
    for seq in (1, 2):
        message = beat(seq=seq)
        fields = json.loads(encode(message))
        reordered = json.dumps({"gpus": fields.pop("gpus"), **fields}).encode()
        news = ingest.heartbeat(message, float(seq), reordered)
        assert (news is not None) == (seq == 1)
    grown = beat(seq=3, inventory=gpus(4))
    fields = json.loads(encode(grown))
    raw = json.dumps({"gpus": fields.pop("gpus"), **fields}).encode()
    assert ingest.heartbeat(grown, 3.0, raw) is not None


def test_bad_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="node_timeout_s"):
        NodeIngest(node_timeout_s=0)


async def test_a_heartbeat_that_changes_nothing_journals_nothing(brain_factory, connect) -> None:
    """A fake node beats fast; after its join, the STATE log does not grow, and no
    scheduling pass runs, however many heartbeats arrive."""
    brain = await brain_factory()
    node = await connect("agent:fake")
    passes = [0]
    brain.decision_observers.append(lambda _: passes.__setitem__(0, passes[0] + 1))

    async def beat_for(count: int, start: int, **change: object) -> None:
        for seq in range(start, start + count):
            message = beat("fake", seq, **change)  # type: ignore[arg-type]
            await node.publish(subjects.node("fake", "heartbeat"), message)
            await asyncio.sleep(0.005)
        await node.nc.flush()

    await beat_for(5, 1)
    await eventually(lambda: "fake" in brain.state.nodes)
    # Let the join's own passes settle.
    await eventually(lambda: brain.ingest.counts.heartbeats >= 5)
    # The join's passes are done: nothing dirty, nothing queued.
    await eventually(lambda: not brain.scheduler.dirty and brain._inbox.queue.empty())
    seq_before, passes_before = brain.state.last_seq, passes[0]
    forwarded_before = brain.ingest.counts.heartbeats_forwarded
    received_before = brain.ingest.counts.heartbeats

    await beat_for(200, 10)
    await eventually(lambda: brain.ingest.counts.heartbeats >= received_before + 200)
    await asyncio.sleep(3 * brain.config.tick_s)  # ticks run meanwhile: still nothing
    assert brain.state.last_seq == seq_before
    assert passes[0] == passes_before
    assert brain.ingest.counts.heartbeats_forwarded == forwarded_before
    seen_ago = brain.last_seen_ago("fake")
    assert seen_ago is not None and seen_ago < 2 * brain.config.node_timeout_s

    # A change is news: journaled once.
    await beat_for(20, 300, inventory=gpus(3))
    await eventually(lambda: brain.state.nodes["fake"].gpu_count == 3)
    assert brain.state.last_seq == seq_before + 1


# -- the snapshot's node views, reused while nothing about a node changed ---------------


def _node_changed(name: str, seq: int, **update: object) -> NodeChanged:
    record = NodeRecord(
        name=name,
        state=NodeState.READY,
        hostname=name,
        backend="sim",
        instance="a",
        gpus=gpus(4),
        joined_at=0.0,
    ).model_copy(update=update)
    cause = Cause(kind=CauseKind.NODE_UPDATED, node=name, message="test")
    return NodeChanged(
        record_id=f"n-{seq}", ts=0.0, epoch=1, node=record, previous=None, cause=cause
    )


def _job_on(job_id: str, node: str, gpu_ids: tuple[int, ...], state: JobState) -> JobChanged:
    job = JobRecord(
        job_id=job_id,
        tenant="t",
        spec=JobSpec(command=("true",), gpus=len(gpu_ids)),
        state=state,
        submitted_at=0.0,
        grants=(NodeGrant(node=node, gpus=gpu_ids),) if state is JobState.RUNNING else (),
    )
    cause = Cause(kind=CauseKind.PLACED, job_id=job_id, message="test")
    return JobChanged(
        record_id=f"j-{job_id}-{state}", ts=0.0, epoch=1, job=job, previous=None, cause=cause
    )


_NODE_CHANGES = st.lists(
    st.tuples(
        st.sampled_from("abcdef"),
        st.sampled_from(list(NodeState)),
        st.integers(min_value=0, max_value=8),  # GPUs
        st.sets(st.integers(min_value=0, max_value=7), max_size=3),  # drained
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(changes=_NODE_CHANGES, asked_from=st.integers(min_value=0, max_value=40))
def test_kept_gpu_totals_equal_a_fresh_count(
    changes: list[tuple[str, NodeState, int, set[int]]], asked_from: int
) -> None:
    """`capacity`, `largest_node` and `registered_gpus` are kept up to date as nodes
    change once first asked (a mass join asks at every status): whatever changed, and
    whenever they were first asked, they equal a state's that counts them afresh."""
    state = BrainState()
    for seq, (name, node_state, count, drained) in enumerate(changes, start=1):
        if seq == asked_from:
            state.capacity(), state.registered_gpus()
        update = {
            "state": node_state,
            "gpus": gpus(count),
            "drained_gpus": tuple(DrainedGpu(index=i, reason="x", at=0.0) for i in drained),
        }
        state.apply(_node_changed(name, seq, **update), seq)
    fresh = BrainState()
    fresh.nodes = dict(state.nodes)
    assert (state.capacity(), state.largest_node()) == (fresh.capacity(), fresh.largest_node())
    assert state.registered_gpus() == fresh.registered_gpus()


def test_snapshot_views_follow_nodes_and_allocations() -> None:
    state = BrainState()
    seq = 0

    def apply(record: NodeChanged | JobChanged) -> None:
        nonlocal seq
        seq += 1
        state.apply(record, seq)

    for name in ("b", "a", "c"):
        apply(_node_changed(name, seq))
    assert (state.capacity(), state.largest_node()) == (12, 4)
    first = state.snapshot().nodes
    assert [v.name for v in first] == ["a", "b", "c"]
    assert all(v.free == frozenset(range(4)) for v in first)
    # Nothing changed: the very same views.
    assert all(x is y for x, y in zip(first, state.snapshot().nodes, strict=True))

    apply(_job_on("1", "b", (0, 1), JobState.RUNNING))
    apply(_node_changed("c", seq, drained_gpus=(DrainedGpu(index=3, reason="x", at=0.0),)))
    apply(_node_changed("a", seq, state=NodeState.LOST))
    views = {v.name: v for v in state.snapshot().nodes}
    assert set(views) == {"b", "c"}
    # Counted again after nodes changed: a drained GPU and a LOST node leave it.
    assert (state.capacity(), state.largest_node()) == (7, 4)
    assert views["b"].free == frozenset({2, 3}) and views["b"].gpus == (0, 1, 2, 3)
    assert views["c"].gpus == (0, 1, 2) and views["c"].free == frozenset({0, 1, 2})
    assert state.free_gpus() == {"b": frozenset({2, 3}), "c": frozenset({0, 1, 2})}

    apply(_job_on("1", "b", (0, 1), JobState.SUCCEEDED))
    apply(_node_changed("d", seq))
    assert state.free_gpus() == {
        "b": frozenset(range(4)),
        "c": frozenset({0, 1, 2}),
        "d": frozenset(range(4)),
    }
    assert [v.name for v in state.snapshot().nodes] == ["b", "c", "d"]


def test_running_views_without_the_clock_are_reused_and_decide_alike() -> None:
    """For a policy that reads no running job's service (fifo, priority), a pass reuses
    running jobs' views, as of their records, until a record changes; its decisions
    are those made over views with the clock."""
    from brain.core import ORDERINGS, Policy, decide

    assert not ORDERINGS["fifo"].reads_running_service
    assert ORDERINGS["las"].reads_running_service
    state = BrainState()
    for seq, record in enumerate(
        (
            _node_changed("a", 0),
            _node_changed("b", 0),
            _job_on("10", "a", (0, 1), JobState.RUNNING),
            _job_on("2", "b", (0,), JobState.RUNNING),
            _job_on("3", "", (0, 1, 2), JobState.PENDING),
        ),
        start=1,
    ):
        state.apply(record, seq)
    started = {
        job_id: state.jobs[job_id].model_copy(update={"started_at": 0.0}) for job_id in ("10", "2")
    }
    for seq, job in enumerate(started.values(), start=10):
        cause = Cause(kind=CauseKind.STARTED, job_id=job.job_id, message="test")
        state.apply(
            JobChanged(record_id=f"s{seq}", ts=0.0, epoch=1, job=job, previous=None, cause=cause),
            seq,
        )
    clocked = state.snapshot(now=100.0)
    first = state.snapshot(now=100.0, running_service=False)
    assert [v.job_id for v in first.running] == ["2", "10"]  # job order
    assert [v.attained_gpu_seconds for v in clocked.running] == [100.0, 200.0]
    assert [v.attained_gpu_seconds for v in first.running] == [0.0, 0.0]
    again = state.snapshot(now=200.0, running_service=False)
    assert all(x is y for x, y in zip(first.running, again.running, strict=True))
    policy = Policy(order="fifo")
    assert decide(clocked, 100.0, policy).actions == decide(first, 100.0, policy).actions

    ended = started["2"].model_copy(update={"state": JobState.SUCCEEDED})
    cause = Cause(kind=CauseKind.EXITED, job_id="2", message="test")
    state.apply(
        JobChanged(record_id="e", ts=0.0, epoch=1, job=ended, previous=None, cause=cause), 20
    )
    after = state.snapshot(now=300.0, running_service=False)
    assert [v.job_id for v in after.running] == ["10"]
    assert after.running[0] is first.running[1]
    assert state.allocated() == {"a": frozenset({0, 1})}


_NODES = ("a", "b")
_JOBS = tuple(str(i) for i in range(1, 6))
_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("node"),
            st.sampled_from(_NODES),
            st.sampled_from((NodeState.READY, NodeState.READY, NodeState.LOST)),
            st.one_of(st.none(), st.integers(0, 3)),
        ),
        st.tuples(
            st.just("job"),
            st.sampled_from(_JOBS),
            st.sampled_from((JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED)),
            st.sampled_from((*_NODES, "gone")),
            st.frozensets(st.integers(0, 3), min_size=1),
            st.booleans(),
        ),
        st.tuples(
            st.just("profiles"),
            st.dictionaries(st.sampled_from(_JOBS), st.integers(0, 2), max_size=5),
        ),
        st.tuples(st.just("snapshot")),
    ),
    min_size=8,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_steps)
def test_kept_snapshot_views_equal_views_built_afresh(steps: list[tuple[object, ...]]) -> None:
    """Whatever the sequence of node and job records and profile mappings, the views a
    snapshot keeps from pass to pass (node views, running jobs' views without the
    clock), and the indexes kept for the reconciler and the launch check, are those
    built from the records as they stand."""
    state = BrainState()
    profiles: dict[str, UtilizationProfile] = {}
    kinds = {k: UtilizationProfile(float(k), 0.0, 0.0, None, 0.0, 0.0) for k in range(3)}

    def check() -> None:
        snapshot = state.snapshot(profiles=profiles, running_service=False)
        lost = {n for n, r in state.nodes.items() if r.state is NodeState.LOST}
        nodes = tuple(
            node_view(
                r,
                gpus := state.schedulable_gpus(r),
                frozenset(gpus) - state.allocated().get(name, frozenset()),
            )
            for name, r in sorted(state.nodes.items())
            if r.state is NodeState.READY
        )
        running = tuple(
            job_view(j, profiles.get(j.job_id))
            for j in state.jobs_in(JobState.RUNNING)
            if not any(g.node in lost for g in j.grants)
        )
        assert snapshot.nodes == nodes
        assert snapshot.running == running
        # The reconciler's and the launch check's indexes.
        jobs = state.jobs_in(JobState.RUNNING)
        for name in (*_NODES, "gone"):
            assert state.attempts_on(name) == {
                (j.job_id, j.attempt) for j in jobs if name in j.nodes
            }
        assert state.unconfirmed() == [
            j for j in jobs if any(g.pid is None and not g.exited for g in j.grants)
        ]

    for seq, step in enumerate(steps, start=1):
        match step:
            case ("node", name, node_state, unhealthy):
                record = _node_changed(str(name), seq, state=node_state)
                record = record.model_copy(
                    update={
                        "node": record.node.model_copy(
                            update={"gpus": gpus(4, unhealthy=unhealthy)}  # type: ignore[arg-type]
                        )
                    }
                )
                state.apply(record, seq)
            case ("job", job_id, job_state, node, gpu_ids, confirmed):
                ids = tuple(sorted(gpu_ids))  # type: ignore[call-overload]
                record = _job_on(str(job_id), str(node), ids, job_state)  # type: ignore[arg-type]
                if confirmed:  # its node reported the process
                    grants = tuple(g.model_copy(update={"pid": 7}) for g in record.job.grants)
                    job = record.job.model_copy(update={"grants": grants})
                    record = record.model_copy(update={"job": job})
                state.apply(record, seq)
            case ("profiles", chosen):
                profiles = {k: kinds[v] for k, v in chosen.items()}  # type: ignore[attr-defined]
            case _:
                check()
    check()


def test_a_waiting_reason_s_new_figures_are_shown_without_a_new_record() -> None:
    """A pass that only changes a waiting reason's figures (GPUs left) keeps the job's
    record, so its view is reused; callers see today's figures; the next record of
    the job says why again."""
    state = BrainState()
    state.apply(_node_changed("a", 0), 1)
    state.apply(_job_on("1", "", (0, 1, 2, 3, 4), JobState.PENDING), 2)
    record = state.jobs["1"]
    view = state.snapshot().pending[0]
    state.refresh_wait("1", RankedOut(5, False, 4, "fifo"))
    assert state.jobs["1"] is record
    assert state.snapshot().pending[0] is view
    assert state.reason_of(record) == "needs 5 GPUs; 4 left after higher-ranked jobs (fifo)"
    assert state.shown(record).reason == "needs 5 GPUs; 4 left after higher-ranked jobs (fifo)"
    state.apply(_job_on("2", "", (0,), JobState.PENDING), 3)
    state.apply(_job_on("2", "a", (0,), JobState.RUNNING), 4)
    assert "2" not in state._pending_stale  # a standby, taking no snapshot, keeps nothing
    state.apply(_job_on("1", "a", (0, 1, 2, 3), JobState.RUNNING), 5)
    assert state.reason_of(state.jobs["1"]) == state.jobs["1"].reason
    state.refresh_wait("1", RankedOut(5, False, 3, "fifo"))  # not pending: not shown
    assert state.wait_details == {}


async def test_a_subscription_drops_unread_while_it_does_not_accept(connect) -> None:
    """How the brain sheds telemetry while it is behind: dropped before decoding
    (garbage is not even dead-lettered), counted; taken again once it accepts."""
    receiver = await connect("brain:ingest")
    sender = await connect("agent:n1")
    accepting = [False]
    got: list[TelemetryBatch] = []

    async def handler(batch: TelemetryBatch, _msg: object) -> None:
        got.append(batch)

    await receiver.subscribe(
        subjects.ALL_TELEMETRY, TelemetryBatch, handler, accept=lambda: accepting[0]
    )
    await receiver.nc.flush()
    batch = TelemetryBatch(node="n1", ts=1.0, samples=())
    # Until delivery is seen to work: a nats-server just started (with JetStream) has
    # been seen, about 3 times in 100, to deliver nothing of the first messages to a
    # subscription it lists (its connz shows them in, none out; later ones arrive).
    while receiver.dropped[subjects.ALL_TELEMETRY] == 0:
        await sender.publish(subjects.node("n1", "telemetry"), batch)
        await sender.nc.flush()
        await asyncio.sleep(0.05)
    seen = receiver.dropped[subjects.ALL_TELEMETRY]
    for _ in range(5):
        await sender.publish(subjects.node("n1", "telemetry"), batch)
    await sender.nc.publish(subjects.node("n1", "telemetry"), b"garbage")
    await sender.nc.flush()
    await eventually(lambda: receiver.dropped[subjects.ALL_TELEMETRY] == seen + 6)
    accepting[0] = True
    await sender.publish(subjects.node("n1", "telemetry"), batch)
    await eventually(lambda: len(got) == 1)
    assert receiver.dead_lettered["node.telemetry"] == 0


def test_a_repeated_heartbeat_is_taken_in_without_decoding() -> None:
    """The bytes of a node's last heartbeat but for its time and sequence: noted (the
    node's last-seen time moves) with no decoding; anything else is decoded as before."""
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    assert not ingest.repeat("n1", encode(beat(seq=1)), 0.0)  # never heard of
    first = beat(seq=1)
    assert ingest.heartbeat(first, 0.0, encode(first)) is not None
    for seq in range(2, 6):
        assert ingest.repeat("n1", encode(beat(seq=seq)), float(seq))
    assert ingest.last_seen_ago("n1", 5.0) == 0.0
    assert ingest.counts.heartbeats == 5
    # Another node's subject, another content, a silence: decoded.
    assert not ingest.repeat("n2", encode(beat(seq=6)), 6.0)
    assert not ingest.repeat("n1", encode(beat(seq=6, running=(job("3"),))), 6.0)
    assert not ingest.repeat("n1", encode(beat(seq=6)), 5.0 + TIMEOUT_S + 1.0)


@pytest.mark.parametrize(
    "clock",
    [
        b'"ts":"soon","seq":7',
        b'"ts":1007.0,"seq":-7',
        b'"ts":1007.0,"seq":07',
        b'"ts":1007.0,"seq":7.5',
        b'"ts":NaN,"seq":7',
        b'"ts":1007.0,"seq":7,"x":1',
    ],
)
def test_a_repeat_with_a_malformed_clock_is_decoded_and_refused(clock: bytes) -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    first = beat(seq=1)
    ingest.heartbeat(first, 0.0, encode(first))
    raw = encode(beat(seq=7)).replace(b'"ts":1007.0,"seq":7', clock)
    assert raw != encode(beat(seq=7))
    assert not ingest.repeat("n1", raw, 1.0)


def test_after_news_the_loop_could_not_act_on_no_heartbeat_is_a_repeat() -> None:
    ingest = NodeIngest(node_timeout_s=TIMEOUT_S)
    first = beat(seq=1)
    ingest.heartbeat(first, 0.0, encode(first))
    ingest.unsettle("n1")
    assert not ingest.repeat("n1", encode(beat(seq=2)), 1.0)


def _applier(state: BrainState) -> Callable[[JobChanged | NodeChanged], None]:
    """Applies records to `state` as the log would, in sequence."""
    seq = [state.last_seq]

    def apply(record: JobChanged | NodeChanged) -> None:
        seq[0] += 1
        state.apply(record, seq[0])

    return apply


def _with_job(record: JobChanged, **update: object) -> JobChanged:
    return record.model_copy(update={"job": record.job.model_copy(update=update)})


def test_the_learned_distribution_counts_unfinished_jobs_as_censored() -> None:
    """Gittins learns from finished jobs and, as censored samples, from the service of
    jobs still running (to now) or preempted: long jobs tell it something before they end."""
    from brain.core.distribution import DEFAULT_SERVICE_PRIOR
    from brain.state import CENSORED_REFRESH_S

    state = BrainState()
    apply = _applier(state)
    apply(_node_changed("a", 0))
    for job_id, service in (("1", 600.0), ("2", 1200.0)):
        apply(
            _with_job(_job_on(job_id, "a", (0,), JobState.SUCCEEDED), attained_gpu_seconds=service)
        )
    running = _job_on("3", "a", (0, 1), JobState.RUNNING)
    apply(_with_job(running, started_at=1000.0, attained_gpu_seconds=5000.0))
    preempted = _job_on("4", "a", (0,), JobState.PENDING)
    apply(_with_job(preempted, attained_gpu_seconds=9000.0))
    finished_only = DEFAULT_SERVICE_PRIOR.with_samples([600.0, 1200.0])
    assert state.service_distribution() == finished_only
    # Job 3 has run 100 s more on 2 GPUs by now.
    learned = state.service_distribution(now=1100.0)
    assert learned == finished_only.with_censored([5200.0, 9000.0])
    assert learned != finished_only
    # Kept until a job finishes or the refresh interval passes.
    assert state.service_distribution(now=1100.0 + CENSORED_REFRESH_S / 2) is learned
    later = state.service_distribution(now=1100.0 + CENSORED_REFRESH_S)
    assert later == finished_only.with_censored([5200.0 + 2 * CENSORED_REFRESH_S, 9000.0])


def test_each_size_class_learns_its_own_distribution_live() -> None:
    """`gittins-size` in the live brain: each size class's finished jobs, its unfinished
    ones censored, shrunk toward the pooled distribution, as the simulator derives it;
    the GPUs of each sample survive a snapshot (and one without them counts for no class)."""
    from brain.core.distribution import (
        CLASS_SHRINK_WEIGHT,
        DEFAULT_SERVICE_PRIOR,
        NO_SAMPLES,
        gpu_class,
    )

    state = BrainState()
    apply = _applier(state)
    apply(_node_changed("a", 0))
    for job_id, gpu_ids, service in (("1", (0,), 100.0), ("2", (0,), 300.0), ("3", (0, 1), 9e4)):
        apply(
            _with_job(
                _job_on(job_id, "a", gpu_ids, JobState.SUCCEEDED), attained_gpu_seconds=service
            )
        )
    running = _job_on("4", "a", (0, 1), JobState.RUNNING)
    apply(_with_job(running, started_at=1000.0, attained_gpu_seconds=1e5))
    pooled = state.service_distribution(now=1000.0)
    by_class = state.service_by_class(now=1000.0)
    assert by_class.of(1) == NO_SAMPLES.with_samples([100.0, 300.0]).blended(
        pooled, CLASS_SHRINK_WEIGHT
    )
    assert by_class.of(2) == NO_SAMPLES.with_samples([9e4]).with_censored([1e5]).blended(
        pooled, CLASS_SHRINK_WEIGHT
    )
    assert by_class.of(8) is None and gpu_class(8) != gpu_class(2)
    snapshot = state.snapshot(now=1000.0, service_prior=DEFAULT_SERVICE_PRIOR, by_class=True)
    assert snapshot.service_by_class == by_class
    assert state.snapshot(now=1000.0).service_by_class is None

    kept = state.to_snapshot(taken_at=0.0, epoch=1)
    assert kept.service_sample_gpus == (1, 1, 2)
    assert BrainState.from_snapshot(kept).service_by_class(now=1000.0) == by_class
    older = BrainState.from_snapshot(kept.model_copy(update={"service_sample_gpus": None}))
    assert older.service_by_class(now=1000.0).classes == ()
