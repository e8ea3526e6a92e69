"""The brain's sqlite history (brain/history.py) as `alnair history` reads it: one row per
attempt, closed however the attempt ended; and a group it failed to write is written
again; the brain's reads wait behind the writes, off its loop. No server."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from brain import history as history_module
from brain.history import FinishedQuery, History
from schemas.api import AttemptRow
from schemas.jobs import AttemptFailure, FailureClass, JobState
from schemas.state import Cause, CauseKind, JobChanged
from tests.statelog import START_TS, finished_job_records, live_job_record, node_record

RUNNING = live_job_record(1, gpus=2, node="n1")


def requeued(kind: CauseKind, message: str, *, failed: bool = False) -> JobChanged:
    """Job 1's attempt 1 ended at START_TS + 10: back to PENDING."""
    update: dict[str, object] = {"state": JobState.PENDING, "grants": (), "started_at": None}
    if failed:
        update["failures"] = (
            AttemptFailure(
                attempt=1,
                failure_class=FailureClass.INFRASTRUCTURE,
                reason=message,
                nodes=("n1",),
                at=START_TS + 10,
            ),
        )
    return JobChanged(
        record_id="requeued",
        ts=START_TS + 10,
        epoch=1,
        job=RUNNING.job.model_copy(update=update),
        previous=JobState.RUNNING,
        cause=Cause(kind=kind, job_id="1", node="n1", message=message),
    )


@pytest.mark.parametrize(
    ("ended", "state", "reason"),
    [
        pytest.param(
            requeued(CauseKind.PREEMPTED, "outranked by job 4 under las"),
            "PREEMPTED",
            "outranked by job 4 under las",
            id="preempted",
        ),
        pytest.param(
            requeued(CauseKind.EXITED, "stopped by node n1 (signal 15)"),
            "REQUEUED",
            "stopped by node n1 (signal 15)",
            id="stopped by its node",
        ),
        pytest.param(
            requeued(CauseKind.RETRY_SCHEDULED, "node n1 was lost", failed=True),
            "FAILED",
            "node n1 was lost",
            id="failed and retried: the failure's row",
        ),
    ],
)
async def test_an_attempt_that_went_back_to_pending_is_closed(
    ended: JobChanged, state: str, reason: str
) -> None:
    # Before, an attempt preempted or stopped by its node read RUNNING, with no end,
    # in `alnair history` for ever.
    history = History(None)
    history.record_many([(RUNNING, 1), (ended, 2)])
    (row,) = await history.read_attempts("1")
    assert (row["attempt"], row["nodes"], row["state"]) == (1, "n1", state)
    assert (row["ended_at"], row["reason"]) == (START_TS + 10, reason)
    assert row["started_at"] == RUNNING.job.started_at
    assert AttemptRow(**row).state == state  # as the API answers it


async def test_a_closed_attempt_is_not_reopened_or_rewritten_by_a_replay() -> None:
    history = History(None)
    preempted = requeued(CauseKind.PREEMPTED, "outranked by job 4 under las")
    history.record_many([(RUNNING, 1), (preempted, 2)])
    later = preempted.model_copy(update={"ts": START_TS + 99, "record_id": "again"})
    history.record_many([(later, 3)])
    (row,) = await history.read_attempts("1")
    assert (row["state"], row["ended_at"]) == ("PREEMPTED", START_TS + 10)


def test_a_group_whose_write_failed_is_written_again_from_where_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history's thread drops a group it could not write (the log has it). The
    history then says it holds everything only up to before that group, also when the
    file is opened again after a restart, so that a brain replaying the log into it
    from there fills the hole; once it has, it says it holds everything again."""
    path = tmp_path / "history.db"
    history = History(path)
    real_write = history_module._Rows.write

    def fails_at_seq_4(rows: history_module._Rows, conn: sqlite3.Connection) -> None:
        if rows.events[0][0] == 4:
            raise sqlite3.OperationalError("database or disk is full")
        real_write(rows, conn)

    monkeypatch.setattr(history_module._Rows, "write", fails_at_seq_4)
    history.record_many((node_record(f"n{seq}", 8), seq) for seq in (1, 2, 3))
    history.record_many((node_record(f"n{seq}", 8), seq) for seq in (4, 5))
    history.record_many((node_record(f"n{seq}", 8), seq) for seq in (6, 7))
    assert history.last_seq() == 3
    monkeypatch.setattr(history_module._Rows, "write", real_write)
    history.close()

    again = History(path)
    assert again.last_seq() == 3 and again.rewind() == 3 and again.last_seq_seen == 3
    again.record_many((node_record(f"n{seq}", 8), seq) for seq in range(4, 8))
    assert again.last_seq() == 7
    assert [row["seq"] for row in again.db.table("events").rows] == list(range(1, 8))
    again.close()


async def test_the_brain_s_reads_run_behind_the_writes_handed_over_before_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read (`History.read`) is answered on the writer's thread once every group
    handed over before it is written: it sees them, and the loop waited for neither the
    writes nor the query. A query that fails fails its asker alone; once the history is
    closed, a read is refused rather than left waiting."""
    history = History(tmp_path / "history.db")
    real_write = history_module._Rows.write
    started, go = threading.Event(), threading.Event()

    def slow_write(rows: history_module._Rows, conn: sqlite3.Connection) -> None:
        started.set()
        assert go.wait(10)
        real_write(rows, conn)

    monkeypatch.setattr(history_module._Rows, "write", slow_write)
    ended = requeued(CauseKind.PREEMPTED, "outranked by job 4 under las")
    history.record_many([(RUNNING, 1), (ended, 2)])
    assert started.wait(10)
    reading = asyncio.ensure_future(history.read_last_job("1"))
    attempts = asyncio.ensure_future(history.read_attempts("1"))
    await asyncio.sleep(0.05)
    assert not reading.done()  # behind the write, which the loop did not wait for
    go.set()
    job = await reading
    assert job is not None and job.state is JobState.PENDING
    (row,) = await attempts
    assert row["state"] == "PREEMPTED"
    changes, truncated = await history.read_job_changes("1", limit=1)
    assert [seq for seq, _ in changes] == [2] and truncated

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("SELECT nothing FROM nowhere")

    with pytest.raises(sqlite3.OperationalError):
        await history.read(broken)
    assert await history.read_last_job("2") is None
    history.close()
    with pytest.raises(RuntimeError, match="the history is closed"):
        await history.read_last_job("1")


def timed(entries: list[JobChanged]) -> list[tuple[JobChanged, int]]:
    """Entries at seq 1, 2, ... with ts 1000 + seq; a finished job ended at its record's ts."""
    out = []
    for seq, record in enumerate(entries, start=1):
        job = record.job
        if job.state.terminal:
            job = job.model_copy(update={"finished_at": 1000.0 + seq})
        out.append((record.model_copy(update={"ts": 1000.0 + seq, "job": job}), seq))
    return out


async def test_pruning_forgets_what_ended_before_and_keeps_a_floor(tmp_path: Path) -> None:
    """`--history-keep-days`: the oldest entries go, in batches, with the jobs that
    finished before the cut; a live job, and the last entry, stay; a restart knows the
    history holds every entry from its new floor on."""
    path = tmp_path / "history.db"
    history = History(path)
    # Jobs 1..10 submitted (seq 1..10), started (11..20), finished (21..30); job 11 runs.
    entries = [*finished_job_records(10), live_job_record(11, gpus=1, node="n1")]
    history.record_many(timed(entries))
    assert await history.prune(1025.5, batch=7) == 25
    history.close()

    again = History(path)
    assert again.floor() == 26 and again.last_seq() == 31
    assert again.job_events("3") == []
    assert await again.read_last_job("3") is None  # finished at 1023
    kept = await again.read_last_job("7")  # finished at 1027
    assert kept is not None and kept.state is JobState.SUCCEEDED
    # Past everything: the last entry stays, so the history still knows where it is.
    assert await again.prune(1e12) == 5
    assert again.floor() == 31 and again.last_seq() == 31
    assert await again.read_last_job("10") is None
    live = await again.read_last_job("11")
    assert live is not None and live.state is JobState.RUNNING
    assert await again.prune(1e12) == 0
    again.close()


def of_array(record: JobChanged, array: str | None) -> JobChanged:
    spec = record.job.spec.model_copy(update={"array": array})
    return record.model_copy(update={"job": record.job.model_copy(update={"spec": spec})})


async def test_finished_jobs_are_listed_by_array_also_from_a_history_older_than_arrays(
    tmp_path: Path,
) -> None:
    """Jobs 1..30 finished; every third is of array "sweep". A listing by array reads
    the column; a file written before the column existed gets it when opened, filled
    from each job's last entry (a job that left its array, as no job does, is not of
    it: the last entry says)."""
    entries = [
        of_array(r, "sweep" if int(r.job.job_id) % 3 == 0 else None)
        for r in finished_job_records(30)
    ]
    query = FinishedQuery(
        states=(JobState.SUCCEEDED,), tenant=None, queues=None, before=None, limit=100
    )
    sweep = replace(query, arrays=("sweep",))
    expected = [str(n) for n in range(30, 0, -1) if n % 3 == 0]
    path = tmp_path / "history.db"
    history = History(path)
    history.record_many((record, seq) for seq, record in enumerate(entries, start=1))
    assert await history.read_finished_ids(sweep) == expected
    assert len(await history.read_finished_ids(query)) == 30
    history.close()

    # As an older brain left it: no column (nor its index), and job 3 re-entered
    # without its array after it was of one.
    last_of_3 = [r for r in entries if r.job.job_id == "3"][-1]
    assert last_of_3.job.spec.array == "sweep"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP INDEX jobs_by_array")
        conn.execute("ALTER TABLE jobs DROP COLUMN array")
        conn.execute(
            "INSERT INTO events (seq, ts, kind, job_id, node, state, message, epoch, body) "
            "VALUES (?, ?, 'exited', '3', '', 'SUCCEEDED', '', 1, ?)",
            (len(entries) + 1, START_TS, of_array(last_of_3, None).model_dump_json()),
        )
    conn.close()
    again = History(path)
    assert await again.read_finished_ids(sweep) == expected[:-1]  # not job 3
    assert await again.read_finished_ids(replace(query, arrays=("other",))) == []
    again.close()
