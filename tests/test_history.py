"""The brain's sqlite history (brain/history.py) as `alnair history` reads it: one row per
attempt, closed however the attempt ended; and a group it failed to write is written
again. No server."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from brain import history as history_module
from brain.history import History
from schemas.api import AttemptRow
from schemas.jobs import AttemptFailure, FailureClass, JobState
from schemas.state import Cause, CauseKind, JobChanged
from tests.statelog import START_TS, live_job_record, node_record

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
def test_an_attempt_that_went_back_to_pending_is_closed(
    ended: JobChanged, state: str, reason: str
) -> None:
    # Before, an attempt preempted or stopped by its node read RUNNING, with no end,
    # in `alnair history` for ever.
    history = History(None)
    history.record_many([(RUNNING, 1), (ended, 2)])
    (row,) = history.attempts("1")
    assert (row["attempt"], row["nodes"], row["state"]) == (1, "n1", state)
    assert (row["ended_at"], row["reason"]) == (START_TS + 10, reason)
    assert row["started_at"] == RUNNING.job.started_at
    assert AttemptRow(**row).state == state  # as the API answers it


def test_a_closed_attempt_is_not_reopened_or_rewritten_by_a_replay() -> None:
    history = History(None)
    preempted = requeued(CauseKind.PREEMPTED, "outranked by job 4 under las")
    history.record_many([(RUNNING, 1), (preempted, 2)])
    later = preempted.model_copy(update={"ts": START_TS + 99, "record_id": "again"})
    history.record_many([(later, 3)])
    (row,) = history.attempts("1")
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
