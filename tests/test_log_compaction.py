"""The STATE log compacted behind snapshots (brain/replica.py): what is purged, and how a
brain that meets a compacted log starts, follows and fills its history. Against a real
nats-server with a synthetic log (tests/statelog.py): each job is 3 entries."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from brain.history import History
from brain.replica import LogCompacted, Replica
from bus.client import Bus
from schemas import subjects
from schemas.api import JobReply, SubmitRequest
from schemas.jobs import JobSpec, JobState
from tests.conftest import eventually
from tests.statelog import append_records, finished_job_records
from tests.test_cli import alnair


async def first_seq(bus: Bus) -> int:
    info = await bus.js.stream_info(subjects.STREAM_STATE)
    return int(info.state.first_seq)


async def grow(bus: Bus, replica: Replica, jobs: int, first: int) -> int:
    """`jobs` more finished jobs in the log, folded and snapshotted by `replica` (the
    leader); returns the snapshot's sequence."""
    await append_records(bus, finished_job_records(jobs, first=first))
    await replica.catch_up()
    return await replica.write_snapshot(taken_at=1.0, epoch=1)


async def leader(bus: Bus, tmp_path: Path, *, keep_entries: int) -> Replica:
    """A log of 30 finished jobs (90 entries), loaded and snapshotted."""
    await append_records(bus, finished_job_records(30))
    replica = Replica(bus, History(tmp_path / "leader.db"), keep_entries=keep_entries)
    await replica.load()
    await replica.write_snapshot(taken_at=1.0, epoch=1)
    return replica


@pytest.mark.parametrize(("keep_entries", "kept_from"), [(10, 91), (100, 21)])
async def test_a_snapshot_compacts_the_log_behind_the_one_before(
    connect, tmp_path: Path, keep_entries: int, kept_from: int
) -> None:
    """Purged: the entries the snapshot before covered (a brain that cannot read the
    newest still reads that one), but never the latest `keep_entries`."""
    bus = await connect("setup")
    replica = await leader(bus, tmp_path, keep_entries=keep_entries)
    assert await first_seq(bus) == 1  # no snapshot before the first: nothing purged
    assert await grow(bus, replica, 10, first=31) == 120
    assert await first_seq(bus) == kept_from

    # A brain started now reads the snapshot and what follows, as if nothing was purged;
    # its new history holds every entry the log still has, and knows it.
    history_path = tmp_path / "new.db"
    other = Replica(bus, History(history_path))
    await other.load()
    assert other.state.jobs == replica.state.jobs and other.state.last_seq == 120
    other.history.close()
    again = History(history_path)
    assert again.floor() == kept_from and again.last_seq() == 120
    assert len(again.job_events("40")) == 3
    again.close()


async def test_a_standby_behind_a_compaction_starts_again_from_the_snapshot(
    connect, tmp_path: Path
) -> None:
    """Cut off while the leader compacted past where it was, a standby's next read
    begins later than it asks: it loads the latest snapshot and follows on."""
    bus = await connect("setup")
    replica = await leader(bus, tmp_path, keep_entries=1)
    standby = Replica(await connect("standby"), History(tmp_path / "standby.db"))
    await standby.load()
    assert standby.state.last_seq == 90
    await grow(bus, replica, 10, first=31)
    await grow(bus, replica, 10, first=41)
    assert await first_seq(bus) == 121  # past the standby's 90

    standby.follow()
    await eventually(lambda: standby.state.last_seq == 150)
    assert standby.state.jobs == replica.state.jobs
    assert standby.snapshot_seq == 150
    await standby.stop_following()


async def test_without_a_snapshot_to_start_from_a_brain_refuses_a_compacted_log(
    connect, tmp_path: Path
) -> None:
    """Snapshots gone (an operator purged their stream, say): the log alone no longer
    holds the whole state, and a brain says so rather than fold what is left."""
    bus = await connect("setup")
    replica = await leader(bus, tmp_path, keep_entries=1)
    await grow(bus, replica, 10, first=31)
    await bus.js.purge_stream(subjects.STREAM_SNAPSHOTS)

    fresh = Replica(bus, History(tmp_path / "fresh.db"))
    with pytest.raises(LogCompacted, match=r"begins at seq 91 .* needs them from seq 1"):
        await fresh.load()
    assert fresh.state.jobs == {}  # nothing folded from the partial log


async def test_a_torn_newest_snapshot_starts_a_brain_from_the_one_before(
    connect, tmp_path: Path
) -> None:
    """The compaction keeps what the generation before the newest covers: a brain that
    cannot read the newest (a chunk gone) starts from that one and replays the rest."""
    bus = await connect("setup")
    replica = await leader(bus, tmp_path, keep_entries=1)
    await grow(bus, replica, 10, first=31)
    manifest = await replica.snapshots.latest_manifest()
    assert manifest is not None and manifest.last_seq == 120
    await bus.js.delete_msg(subjects.STREAM_SNAPSHOTS, manifest.chunks[0])

    fresh = Replica(bus, History(tmp_path / "fresh.db"))
    await fresh.load()
    assert fresh.snapshot_seq == 90 and fresh.replayed_at_load == 30
    assert fresh.state.jobs == replica.state.jobs


async def test_a_live_leader_compacts_and_a_standby_started_after_takes_over(
    brain_factory, connect
) -> None:
    """Brains as they run: the leader snapshots as entries accrue and compacts behind;
    a standby started after loads the snapshot, follows, and takes over with every job."""
    leader_brain = await brain_factory(snapshot_every=5, log_keep_entries=1)
    bus = await connect("observer")
    ids: list[str] = []
    # A snapshot is due after as many entries as the jobs it holds; the second one
    # stored is the first that compacts.
    while await first_seq(bus) == 1:
        assert len(ids) < 200, "never compacted"
        for _ in range(10):
            reply = await leader_brain.api.handle(
                "default", SubmitRequest(spec=JobSpec(command=("true",), gpus=64))
            )
            assert isinstance(reply, JobReply)
            ids.append(reply.job.job_id)
        await asyncio.sleep(0.5)  # a tick or two: the snapshot is taken at one
        await leader_brain.replica.snapshot_written()

    standby = await brain_factory(lead=False, snapshot_every=5, log_keep_entries=1)
    assert standby.replica.snapshot_seq >= await first_seq(bus) - 1
    await eventually(lambda: standby.state.last_seq == leader_brain.state.last_seq)
    await leader_brain.stop()
    await eventually(lambda: standby.leading.is_set(), timeout_s=30)
    assert sorted(standby.state.jobs) == sorted(ids)
    assert all(standby.state.jobs[i].state is JobState.PENDING for i in ids)


async def test_alnair_events_says_where_a_compacted_log_begins(
    connect, nats_server, tmp_path: Path
) -> None:
    bus = await connect("setup")
    replica = await leader(bus, tmp_path, keep_entries=1)
    await grow(bus, replica, 10, first=31)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALNAIR_")}
    env["ALNAIR_HOME"] = str(tmp_path / "home")
    code, out, err = await alnair("events", "--nats", nats_server.url, "--since", "5", env=env)
    assert code == 0, err
    assert "the log begins at seq 91: the entries before were compacted" in err
    assert out.split()[0] == "91" and len(out.splitlines()) == 30
