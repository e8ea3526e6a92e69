"""Snapshots of any size: the format round-trips, a restart uses it, a torn one is not.

The pure part (encode/decode) runs without a server; the rest against a real
nats-server with a synthetic STATE log (tests/statelog.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from brain.history import History
from brain.replica import LEGACY_SNAPSHOT_BUCKET, LEGACY_SNAPSHOT_NAME, Replica, snapshot_due
from brain.snapshots import SnapshotStore, decode_snapshot, encode_snapshot
from brain.state import BrainState
from bus.client import Bus
from schemas import subjects
from schemas.api import JobReply, SubmitRequest
from schemas.base import MAX_MESSAGE_BYTES, encode
from schemas.errors import SnapshotUnreadable
from schemas.jobs import AttemptFailure, FailureClass, JobSpec, JobState
from tests.conftest import eventually
from tests.statelog import append_records, finished_job_records

# Enough finished jobs for a snapshot well over the bus's 1 MiB message bound.
JOBS = 1_500


def folded(count: int) -> BrainState:
    state = BrainState()
    for seq, record in enumerate(finished_job_records(count), start=1):
        state.apply(record, seq)
    return state


def test_a_snapshot_over_the_message_bound_round_trips() -> None:
    state = folded(JOBS)
    snapshot = state.to_snapshot(taken_at=5.0, epoch=3)
    encoded = encode_snapshot(snapshot)
    assert encoded.raw_size > MAX_MESSAGE_BYTES
    chunks = encoded.chunks(64 * 1024)
    manifest = encoded.manifest(tuple(range(1, len(chunks) + 1)))

    back = decode_snapshot(manifest, b"".join(chunks))

    assert back == snapshot
    again = BrainState.from_snapshot(back)
    assert again.jobs == state.jobs
    assert list(again.service_samples) == list(state.service_samples)
    assert again.job_for_key("default", "key-7") == state.jobs["7"]


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda body: body[:-1], "bytes, its manifest says"),
        (lambda body: body[:-1] + bytes([body[-1] ^ 1]), "SHA-256"),
    ],
)
def test_a_damaged_body_is_refused_with_the_reason(damage, says) -> None:
    encoded = encode_snapshot(folded(10).to_snapshot(taken_at=0.0, epoch=1))
    manifest = encoded.manifest((1,))
    with pytest.raises(SnapshotUnreadable, match=says):
        decode_snapshot(manifest, damage(encoded.body))


async def log_and_snapshot(bus: Bus, history_path: Path, *, chunk_bytes: int) -> Replica:
    """A log of JOBS finished jobs, folded (history included) and snapshotted."""
    await append_records(bus, finished_job_records(JOBS))
    history = History(history_path)
    replica = Replica(bus, history)
    replica.snapshots = SnapshotStore(bus, chunk_bytes=chunk_bytes)
    await replica.load()
    await replica.write_snapshot(taken_at=1.0, epoch=1)
    history.close()
    return replica


async def test_a_restart_uses_a_snapshot_over_one_mib(connect, brain_factory, tmp_path) -> None:
    bus = await connect("setup")
    history_path = tmp_path / "history.db"
    before = await log_and_snapshot(bus, history_path, chunk_bytes=8 * 1024)
    manifest = await SnapshotStore(bus).latest_manifest()
    assert manifest is not None and manifest.raw_size > MAX_MESSAGE_BYTES
    assert len(manifest.chunks) > 1 and manifest.last_seq == 3 * JOBS
    tail = await append_records(bus, finished_job_records(2, first=JOBS + 1))

    brain = await brain_factory(history_path=history_path)

    # Only the entries after the snapshot were read from the log.
    assert brain.replica.snapshot_seq == 3 * JOBS
    assert brain.replica.replayed_at_load == tail - 3 * JOBS == 6
    assert brain.state.last_seq >= tail
    for job_id, job in before.state.jobs.items():
        assert brain.state.jobs[job_id] == job
    assert brain.state.jobs[str(JOBS + 2)].state is JobState.SUCCEEDED
    assert brain.state.next_job_id() == str(JOBS + 3)
    assert list(brain.state.service_samples)[-JOBS - 2 :] == [120.0] * (JOBS + 2)


async def test_a_new_snapshot_keeps_the_one_before(connect, tmp_path) -> None:
    bus = await connect("setup")
    replica = await log_and_snapshot(bus, tmp_path / "history.db", chunk_bytes=8 * 1024)
    first = await replica.snapshots.latest_manifest()
    await append_records(bus, finished_job_records(1, first=JOBS + 1))
    await replica.catch_up()
    await replica.write_snapshot(taken_at=2.0, epoch=1)
    second = await replica.snapshots.latest_manifest()
    assert first is not None and second is not None and second.last_seq == first.last_seq + 3
    # The previous generation's chunks are still there for a reader that took its manifest.
    for seq in (*first.chunks, *second.chunks):
        await bus.js.get_msg(subjects.STREAM_SNAPSHOTS, seq=seq)
    snapshot = await replica.snapshots.read()
    assert snapshot is not None and snapshot.last_seq == second.last_seq


async def tear_chunk(bus: Bus) -> None:
    manifest = await SnapshotStore(bus).latest_manifest()
    assert manifest is not None
    await bus.js.delete_msg(subjects.STREAM_SNAPSHOTS, manifest.chunks[1])


async def tear_manifest(bus: Bus) -> None:
    # As if the writer died after its last chunk, before the manifest.
    await bus.js.purge_stream(subjects.STREAM_SNAPSHOTS, subject=subjects.SNAPSHOT_MANIFEST)


@pytest.mark.parametrize("tear", [tear_chunk, tear_manifest])
async def test_a_torn_snapshot_falls_back_to_the_whole_log(
    tear, connect, brain_factory, tmp_path, caplog
) -> None:
    bus = await connect("setup")
    history_path = tmp_path / "history.db"
    before = await log_and_snapshot(bus, history_path, chunk_bytes=8 * 1024)
    await tear(bus)

    with caplog.at_level(logging.ERROR, logger="brain.replica"):
        brain = await brain_factory(history_path=history_path)

    assert brain.replica.snapshot_seq == 0
    assert brain.replica.replayed_at_load == 3 * JOBS
    assert brain.state.jobs == before.state.jobs
    unreadable = [r for r in caplog.records if "snapshot unreadable" in r.getMessage()]
    assert bool(unreadable) == (tear is tear_chunk)
    if unreadable:
        assert "chunk 2 of" in unreadable[0].getMessage()


async def test_an_old_single_object_snapshot_is_still_read(
    connect, brain_factory, tmp_path
) -> None:
    bus = await connect("setup")
    await append_records(bus, finished_job_records(JOBS))
    state = folded(JOBS)
    data = encode(state.to_snapshot(taken_at=1.0, epoch=1))
    assert len(data) > MAX_MESSAGE_BYTES  # what brains before chunked snapshots could not read
    store = await bus.js.create_object_store(LEGACY_SNAPSHOT_BUCKET)
    await store.put(LEGACY_SNAPSHOT_NAME, data)

    brain = await brain_factory(history_path=tmp_path / "history.db")

    assert brain.replica.snapshot_seq == 3 * JOBS
    assert brain.state.jobs == state.jobs


async def test_history_written_in_batches_keeps_every_entry_and_each_jobs_latest_state() -> None:
    entries = list(finished_job_records(3))
    running = entries[4]  # job 2 started (attempt 1)
    failure = AttemptFailure(
        attempt=1, failure_class=FailureClass.INFRASTRUCTURE, reason="XID 79", at=9.0
    )
    retried = running.model_copy(
        update={"job": running.job.model_copy(update={"attempt": 2, "failures": (failure,)})}
    )
    entries.append(retried)
    batched = History(None)
    batched.record_many((entry, seq) for seq, entry in enumerate(entries, start=1))

    events = batched.db.execute("SELECT seq FROM events ORDER BY seq").fetchall()
    assert [seq for (seq,) in events] == list(range(1, len(entries) + 1))
    # Within one batch, a job's later entry wins: job 2 is running its second attempt.
    jobs = batched.db.execute("SELECT job_id, state, attempt FROM jobs ORDER BY 1").fetchall()
    assert jobs == [("1", "SUCCEEDED", 1), ("2", "RUNNING", 2), ("3", "SUCCEEDED", 1)]
    attempts = await batched.read_attempts("2")
    assert [(a["attempt"], a["state"], a["failure_class"]) for a in attempts] == [
        (1, "FAILED", "infrastructure"),
        (2, "RUNNING", None),
    ]
    assert batched.last_seq() == batched.last_seq_seen == len(entries)


async def test_a_history_file_is_written_by_its_thread_in_order_and_read_after_it(
    tmp_path, caplog
) -> None:
    """A history in a file is written off the caller's thread, a transaction per group
    in the order handed over; every read sees all that was handed over before it; a
    group that fails is logged and the next ones are written; closing writes the rest."""
    entries = list(finished_job_records(40))
    history = History(tmp_path / "history.db")
    for start in range(0, len(entries), 7):
        group = entries[start : start + 7]
        history.record_many((e, seq) for seq, e in enumerate(group, start=start + 1))
    assert history.last_seq_seen == len(entries)
    assert history.last_seq() == len(entries)
    assert [r["state"] for r in history.job_events("40")] == ["PENDING", "RUNNING", "SUCCEEDED"]
    seventeen = await history.read_last_job("17")
    assert seventeen is not None and seventeen.state.terminal

    history.db.execute("DROP TABLE attempts")  # the next group's transaction fails
    history.record_many([(entries[40], 121)])  # job 1 starts: an attempt row
    history.flush()
    history.db.execute(
        "CREATE TABLE attempts (job_id TEXT, attempt INTEGER, "
        "nodes TEXT, gpus TEXT, started_at FLOAT, ended_at FLOAT, state TEXT, "
        "exit_code INTEGER, signal INTEGER, failure_class TEXT, reason TEXT, "
        "PRIMARY KEY (job_id, attempt))"
    )
    history.record_many([(entries[-1], 122)])
    # The failed group left nothing and the next was written; the history holds every
    # entry only up to before the failed one (a brain that loads writes it again).
    assert history.last_seq() == 120
    history.close()
    history.close()  # twice: nothing more
    with pytest.raises(RuntimeError, match="closed"):
        history.record_many([(entries[-1], 123)])
    assert "history write failed for seq 121 to 121" in caplog.text

    again = History(tmp_path / "history.db")
    assert again.last_seq() == 120
    assert [r["seq"] for r in again.job_events("1")] == [1, 41, 81]
    assert [r["seq"] for r in again.job_events("40")][-1] == 122
    again.close()


async def test_a_leading_brain_stores_snapshots_in_the_background(brain_factory) -> None:
    brain = await brain_factory(snapshot_every=5)
    for _ in range(6):
        reply = await brain.api.handle(
            "default", SubmitRequest(spec=JobSpec(command=("true",), gpus=1))
        )
        assert isinstance(reply, JobReply)
    store = brain.replica.snapshots

    async def stored() -> bool:
        manifest = await store.latest_manifest()
        return manifest is not None and manifest.last_seq >= 5

    await eventually(stored)
    await brain.replica.snapshot_written()  # its bookkeeping follows the manifest
    snapshot = await store.read()
    assert snapshot is not None and len(snapshot.jobs) >= 5
    assert brain.replica.snapshot_seq >= snapshot.last_seq


@pytest.mark.parametrize(
    ("entries_since", "jobs", "due"),
    [
        pytest.param(999, 10, False, id="few jobs: after `every` entries"),
        pytest.param(1000, 10, True, id="few jobs: due at `every`"),
        pytest.param(1000, 20_000, False, id="many jobs: not after `every` alone"),
        pytest.param(19_999, 20_000, False, id="many jobs: not before as many entries"),
        pytest.param(20_000, 20_000, True, id="many jobs: due at as many entries"),
    ],
)
def test_a_snapshot_is_due_after_every_entries_or_as_many_as_its_jobs(
    entries_since: int, jobs: int, due: bool
) -> None:
    assert snapshot_due(entries_since, jobs, 1000) is due
