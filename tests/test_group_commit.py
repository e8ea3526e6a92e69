"""Group commit: the leader's records go to the log as fenced, pipelined groups.

`Bus.append_many` against a real nats-server (contiguous, retried without
duplicates, refused when another writer got there first), and the brain's journal:
callers are answered only once their group is stored, a group the log did not take
acknowledges nobody and leaves no trace in state, and a heartbeat with no news adds
no STATE entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from brain.service import Brain
from bus.client import Bus
from cli.client import submit as client_submit
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    ErrorReply,
    JobReply,
    StatusReply,
    StatusRequest,
    SubmitRequest,
)
from schemas.base import encode
from schemas.errors import ApiError, MessageTooLarge, NoDefiniteAnswer, SequenceConflict
from schemas.jobs import MAX_SPEC_BYTES, JobSpec, JobState
from schemas.state import (
    STATE_RECORD,
    BlacklistChanged,
    BlacklistEntry,
    Cause,
    CauseKind,
    JobChanged,
    NodeChanged,
)
from tests.conftest import eventually
from tests.statelog import node_record

TENANT = "team"


def entries(names: list[str]) -> list[tuple[str, NodeChanged, str]]:
    return [(subjects.state_node(name), node_record(name, 8), f"id-{name}") for name in names]


async def stored(bus: Bus) -> list[str]:
    """Node names of the STATE log's entries, in order."""
    return [
        item.node.name
        async for item, _, _ in bus.read(subjects.STREAM_STATE, STATE_RECORD, start_seq=1)
        if isinstance(item, NodeChanged)
    ]


async def test_a_group_lands_contiguously_after_the_fence(connect) -> None:
    bus = await connect("writer")
    await bus.ensure_streams()
    assert await bus.append_many(subjects.STREAM_STATE, entries(["a", "b"]), after=0) == 2
    last = await bus.append_many(subjects.STREAM_STATE, entries(["c", "d", "e"]), after=2)
    assert last == 5
    assert await stored(bus) == ["a", "b", "c", "d", "e"]


async def test_a_retried_group_is_not_stored_twice(connect) -> None:
    """A group sent again with the same ids (its acknowledgements were lost) counts
    what landed and stores only the rest."""
    bus = await connect("writer")
    await bus.ensure_streams()
    group = entries(["a", "b", "c", "d"])
    assert await bus.append_many(subjects.STREAM_STATE, group[:2], after=0) == 2  # half landed
    assert await bus.append_many(subjects.STREAM_STATE, group, after=0) == 4
    assert await bus.append_many(subjects.STREAM_STATE, group, after=0) == 4  # all had
    assert await stored(bus) == ["a", "b", "c", "d"]


async def test_a_group_behind_another_writer_is_refused_whole(connect) -> None:
    bus, rival = await connect("writer"), await connect("rival")
    await bus.ensure_streams()
    await bus.append_many(subjects.STREAM_STATE, entries(["a"]), after=0)
    await rival.append_many(subjects.STREAM_STATE, entries(["r"]), after=1)
    with pytest.raises(SequenceConflict):
        await bus.append_many(subjects.STREAM_STATE, entries(["b", "c"]), after=1)
    assert await stored(bus) == ["a", "r"]


async def submit(brain: Brain, name: str) -> JobReply:
    request = SubmitRequest(
        spec=JobSpec(name=name, command=("sleep", "1"), gpus=64), idempotency_key=name
    )
    reply = await brain.bus.request(subjects.api(TENANT, "submit"), request, JOB_RESULT)
    if not isinstance(reply, JobReply):
        raise ApiError(reply.code, reply.error)
    return reply


async def test_concurrent_submissions_share_groups_and_are_answered_once_stored(
    brain_factory: Callable[..., Awaitable[Brain]],
) -> None:
    brain = await brain_factory()
    stored_seqs: list[int] = []
    brain.record_observers.append(lambda record, seq: stored_seqs.append(seq))
    groups_before = brain.journal.groups
    replies = await asyncio.gather(*(submit(brain, f"burst-{i}") for i in range(40)))
    ids = {reply.job.job_id for reply in replies}
    assert len(ids) == 40
    # Every answered job is in the log, once.
    logged = [
        item.job.job_id
        async for item, _, _ in brain.bus.read(subjects.STREAM_STATE, STATE_RECORD, start_seq=1)
        if isinstance(item, JobChanged)
        and item.job.spec.name.startswith("burst-")
        and item.previous is None
    ]
    assert sorted(logged) == sorted(ids)
    # Fewer groups than submissions: concurrent callers shared appends.
    assert brain.journal.groups - groups_before < 40
    assert stored_seqs == sorted(stored_seqs)


async def test_a_group_the_log_refuses_acknowledges_nobody(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    """Another writer appends behind the leader's back: the leader's next group is
    refused whole. None of its callers is told the job exists, state forgets what the
    group held (it is read from the log again), and retried with their keys each job
    ends up stored exactly once."""
    brain = await brain_factory()
    await submit(brain, "before")
    rival = await connect("rival")
    last = await rival.last_seq(subjects.STREAM_STATE)
    intrusion = BlacklistChanged(
        record_id="intruder",
        ts=0.0,
        epoch=1,
        entries=(),
        cause=Cause(kind=CauseKind.BLACKLISTED, message="written behind the leader's back"),
    )
    await rival.append_many(
        subjects.STREAM_STATE, [(subjects.STATE_BLACKLIST, intrusion, "intruder")], after=last
    )
    results = await asyncio.gather(
        *(submit(brain, f"lost-{i}") for i in range(5)), return_exceptions=True
    )
    assert all(isinstance(r, ApiError) and r.code == "unavailable" for r in results), results
    # Stepping down, it reads state from the log again: the group's jobs are gone.
    await eventually(
        lambda: (
            not brain.journal.tainted
            and brain.state.last_seq > last
            and not any(j.spec.name.startswith("lost-") for j in brain.state.jobs.values())
        )
    )

    # It leads again (the lease is still its own) over state read from the log.
    await eventually(lambda: brain.leading.is_set(), timeout_s=30)
    retried = [await submit(brain, f"lost-{i}") for i in range(5)]
    names = [j.spec.name for j in brain.state.jobs.values() if j.spec.name.startswith("lost-")]
    assert sorted(names) == [f"lost-{i}" for i in range(5)]
    assert len({r.job.job_id for r in retried}) == 5


async def test_callers_of_a_group_cut_short_by_a_step_down_are_answered(
    brain_factory: Callable[..., Awaitable[Brain]],
) -> None:
    """Leadership ends while a group's append waits for the stream (the lease lost,
    say): stepping down cancels the inbox loop with the group in hand, off the inbox.
    Its caller hears `unavailable` at once, not never, and the job is not kept."""
    brain = await brain_factory()
    await submit(brain, "before")
    bus = brain.journal.bus
    appending = asyncio.Event()

    async def never_acknowledged(*args: object, **kwargs: object) -> int:
        appending.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    bus.append_many = never_acknowledged  # type: ignore[method-assign]
    try:
        caller = asyncio.ensure_future(submit(brain, "cut-short"))
        await asyncio.wait_for(appending.wait(), 10.0)
        await brain.leadership.stop_leading("test: the lease was lost")
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(caller, 5.0)
        assert refused.value.code == "unavailable"
    finally:
        del bus.append_many  # the bus's own again
    await eventually(lambda: brain.leading.is_set(), timeout_s=30)
    assert not any(j.spec.name == "cut-short" for j in brain.state.jobs.values())


async def test_a_pass_between_a_refused_group_and_the_step_down_stores_nothing(
    brain_factory: Callable[..., Awaitable[Brain]], connect, monkeypatch
) -> None:
    """The rival's one entry took the sequence of the refused group's one record, so a
    pass's group, staged on state that still holds the refused job, fits the fence.
    Before the brain has stepped down, such a pass must store nothing: the log would
    hold the job nobody was told exists (the flake CI met, with the pass noting why
    "lost" waits). The step-down is held off here until the pass has run."""
    brain = await brain_factory()
    for i in range(3):
        await submit(brain, f"before-{i}")
    step_down = asyncio.Event()
    real_stop = brain._stop_leading

    async def held(reason: str) -> None:
        await step_down.wait()
        await real_stop(reason)

    monkeypatch.setattr(brain, "_stop_leading", held)
    await refuse_a_group(brain, connect)
    assert brain.journal.tainted and brain.leading.is_set()
    last = await brain.bus.last_seq(subjects.STREAM_STATE)
    assert any(j.spec.name == "lost" for j in brain.state.jobs.values())  # not read again yet

    brain.scheduler.dirty = True
    brain.scheduler.waits_due = 0.0  # the pass explains why "lost" waits: a record
    with pytest.raises(ApiError) as refused:
        await brain.scheduler.run_pass()
    assert refused.value.code == "unavailable"
    assert await brain.bus.last_seq(subjects.STREAM_STATE) == last

    step_down.set()
    await eventually(lambda: not brain.journal.tainted and brain.leading.is_set(), timeout_s=30)
    assert sorted(j.spec.name for j in brain.state.jobs.values()) == [
        "before-0",
        "before-1",
        "before-2",
    ]


async def refuse_a_group(brain: Brain, connect: Callable[[str], Awaitable[Bus]]) -> None:
    """A node `intruder` appended behind the leader's back: its next group (submitting
    job "lost") is refused, nobody is told the job exists, and it steps down to read
    its state again."""
    rival = await connect("rival")
    last = await rival.last_seq(subjects.STREAM_STATE)
    await rival.append_many(subjects.STREAM_STATE, entries(["intruder"]), after=last)
    lost = await asyncio.gather(submit(brain, "lost"), return_exceptions=True)
    assert isinstance(lost[0], ApiError) and lost[0].code == "unavailable"


async def test_state_that_could_not_be_read_again_is_read_before_leading(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    """A refused group, and reading state again fails at the step-down (as when cut
    off from NATS): the brain must not lead on state that ran ahead of the log. It
    reads it again when it next takes over, and the group's job is not there."""
    brain = await brain_factory()
    await submit(brain, "before")
    real_reload = brain.replica.reload
    failures = []

    async def reload_fails_once() -> None:
        if not failures:
            failures.append(True)
            raise TimeoutError("cut off")
        await real_reload()

    brain.replica.reload = reload_fails_once  # type: ignore[method-assign]
    await refuse_a_group(brain, connect)

    await eventually(lambda: failures and brain.leading.is_set(), timeout_s=30)
    assert not brain.journal.tainted
    assert "intruder" in brain.state.nodes
    assert not any(j.spec.name == "lost" for j in brain.state.jobs.values())


async def test_a_heartbeat_with_no_news_adds_no_state_entry(
    brain_factory: Callable[..., Awaitable[Brain]], agent_factory
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: "n1" in brain.state.nodes)
    await eventually(lambda: brain.ingest.counts.heartbeats >= 2)
    seq = await brain.bus.last_seq(subjects.STREAM_STATE)
    beats = brain.ingest.counts.heartbeats
    await eventually(lambda: brain.ingest.counts.heartbeats >= beats + 3, timeout_s=30)
    assert await brain.bus.last_seq(subjects.STREAM_STATE) == seq


async def test_a_reply_lost_with_the_leader_is_given_by_the_next_one(
    brain_factory: Callable[..., Awaitable[Brain]], connect
) -> None:
    """The leader stores a submission's group and dies before answering. `alnair
    submit` (cli.client.submit) retries with its idempotency key through the failover
    and is answered, by the next leader, with the job the first try created."""
    first = await brain_factory()
    second = await brain_factory(lead=False)
    stored_commit = first.journal.commit

    async def commit_then_die() -> None:
        names = {r.job.spec.name for _, r, _ in first.journal.staged if isinstance(r, JobChanged)}
        await stored_commit()
        if "lost-reply" in names:
            await first.bus.nc.close()  # as if killed: no reply, no lease renewal
            await asyncio.Event().wait()

    first.journal.commit = commit_then_die  # type: ignore[method-assign]
    client = await connect("client")
    spec = JobSpec(name="lost-reply", command=("sleep", "1"), gpus=64)
    job = await client_submit(client, TENANT, spec, idempotency_key="k-1", retry_for_s=90)

    await eventually(lambda: second.leading.is_set(), timeout_s=30)
    created = [
        item.job.job_id
        async for item, _, _ in client.read(subjects.STREAM_STATE, STATE_RECORD, start_seq=1)
        if isinstance(item, JobChanged) and item.previous is None
    ]
    assert created == [job.job_id]


async def test_a_submission_on_a_closed_connection_gives_its_key(connect) -> None:
    """The CLI's connection gives up reconnecting (three tries) when no server comes
    back: `alnair submit` says it has no definite answer and names the key to find
    out with, at once, not a traceback (nor 120 s of retries that cannot be sent)."""
    client = await connect("client")
    await client.nc.close()
    spec = JobSpec(name="closed", command=("sleep", "1"), gpus=1)
    with pytest.raises(NoDefiniteAnswer) as unknown:
        await client_submit(client, TENANT, spec, idempotency_key="k-closed", retry_for_s=90)
    assert unknown.value.key == "k-closed"
    assert "--idempotency-key k-closed" in str(unknown.value)
    assert "closed" in str(unknown.value)


def _padded(record_id: str, size: int) -> BlacklistChanged:
    """A STATE entry of exactly `size` bytes, encoded."""

    def made(pad: int) -> BlacklistChanged:
        entry = BlacklistEntry(uri="s3://pad", reason="p" * pad, added_at=0.0, added_by="t")
        cause = Cause(kind=CauseKind.BLACKLISTED, message="padding")
        return BlacklistChanged(record_id=record_id, ts=0.0, epoch=1, entries=(entry,), cause=cause)

    return made(size - len(encode(made(0))))


async def test_a_group_with_an_entry_too_big_sends_none_of_it(connect) -> None:
    """An entry under nats-py's payload check but over the server's limit once its
    headers count is refused before anything is sent: sent, the server would close the
    connection ("Maximum Payload Violation") and take the brain's subscriptions with it."""
    bus = await connect("writer")
    await bus.ensure_streams()
    limit = bus.nc.max_payload
    big = _padded("big", limit - 100)
    assert len(encode(big)) == limit - 100
    group = [*entries(["a"]), (subjects.STATE_BLACKLIST, big, "id-big"), *entries(["c"])]
    with pytest.raises(MessageTooLarge, match=f"over the server's limit of {limit}"):
        await bus.append_many(subjects.STREAM_STATE, group, after=0)
    assert await stored(bus) == []
    assert bus.nc.is_connected and bus.nc.stats["reconnects"] == 0
    assert await bus.append_many(subjects.STREAM_STATE, entries(["a"]), after=0) == 1


async def test_a_log_of_large_entries_is_read_without_losing_the_connection(connect) -> None:
    """250 entries of 1 MB: read in batches of 512, the server queued them all for the
    reader at once and dropped it as a slow consumer (past 64 MiB), and the read hung;
    `read` sizes its fetches by the entries it meets."""
    bus = await connect("writer")
    await bus.ensure_streams()
    record = _padded("r", 1_000_000)
    for i in range(250):
        entry = (subjects.STATE_BLACKLIST, record, f"id-{i}")
        await bus.append_many(subjects.STREAM_STATE, [entry], after=i)
    reader = await connect("reader")

    async def read_all() -> list[int]:
        return [seq async for _, seq, _ in reader.read(subjects.STREAM_STATE, STATE_RECORD)]

    assert await asyncio.wait_for(read_all(), timeout=60) == list(range(1, 251))
    assert reader.nc.stats["reconnects"] == 0


async def test_a_spec_too_big_for_the_log_is_refused_at_submit(
    brain_factory: Callable[..., Awaitable[Brain]],
) -> None:
    """A submission fits one NATS message (1 MiB), but its job's record must too, and
    its launch, with the blacklist: a spec over MAX_SPEC_BYTES is refused, naming its
    size, and the brain goes on leading. Near 1 MiB, a record the log could not take
    made the brain step down."""
    brain = await brain_factory()
    spec = JobSpec(command=("true",), gpus=1, env={"BLOB": "x" * 300_000})
    refused = await brain.api.handle(TENANT, SubmitRequest(spec=spec))
    assert isinstance(refused, ErrorReply) and refused.code == "invalid"
    assert "the job's spec is 30" in refused.error
    assert f"over the {MAX_SPEC_BYTES} a job may take" in refused.error
    assert brain.leading.is_set()
    fine = await brain.api.handle(TENANT, SubmitRequest(spec=JobSpec(command=("true",), gpus=64)))
    assert isinstance(fine, JobReply)


async def test_a_command_stream_that_takes_nothing_holds_up_no_caller_or_read(
    brain_factory: Callable[..., Awaitable[Brain]], agent_factory
) -> None:
    """The node command stream takes nothing for a while (its leader moving, say): the
    placed job's Launch waits in the journal's sender, while submissions are answered
    and reads answer with the placement stored. Once the stream takes commands again
    the Launch goes out and the job starts."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: "n1" in brain.state.nodes)
    bus = brain.journal.bus
    stream_back = asyncio.Event()
    stalled: list[str] = []

    async def stalled_then_sent(messages: list, **kwargs: object) -> None:
        stalled.extend(msg_id for _, _, msg_id in messages)
        await stream_back.wait()
        await type(bus).publish_many_durable(bus, messages, **kwargs)  # type: ignore[arg-type]

    bus.publish_many_durable = stalled_then_sent  # type: ignore[method-assign]
    try:
        spec = JobSpec(name="placed", command=("sleep", "30"), gpus=1)
        placed = await brain.bus.request(
            subjects.api(TENANT, "submit"), SubmitRequest(spec=spec), JOB_RESULT
        )
        assert isinstance(placed, JobReply)
        await eventually(lambda: stalled)  # placed; its Launch is held by the stream
        assert brain.state.jobs[placed.job.job_id].state is JobState.RUNNING
        # Were the Launch sent within the unit that placed the job, that unit would
        # hold the writer, and so this read, as long as the stream takes nothing.
        status = await brain.api.handle(TENANT, StatusRequest())
        assert isinstance(status, StatusReply) and status.jobs_by_state["RUNNING"] == 1
        assert status.commands_queued >= 1  # the operator sees the stream is not taking them
        other = JobSpec(name="after", command=("sleep", "30"), gpus=2)
        answered = await brain.bus.request(
            subjects.api(TENANT, "submit"), SubmitRequest(spec=other), JOB_RESULT
        )
        assert isinstance(answered, JobReply)
        running = brain.state.jobs[placed.job.job_id]
        assert all(grant.pid is None for grant in running.grants)  # not launched yet
    finally:
        stream_back.set()
        del bus.publish_many_durable  # the bus's own again
    await eventually(
        lambda: all(g.pid is not None for g in brain.state.jobs[placed.job.job_id].grants),
        timeout_s=30,
    )
    assert brain.journal.commands_unsent == 0
