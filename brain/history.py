"""Job history and accounting in sqlite (through sqlite-utils), for queries.

This is a projection of the STATE log, not a source of truth: it remembers the last
log sequence it holds, and a brain that finds it missing or behind fills it from the
log. Nothing here is read to make a decision.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import sqlite_utils

from schemas.jobs import JobRecord
from schemas.state import (
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
    record_job_id,
    record_kind,
    record_node,
)

log = logging.getLogger(__name__)


class History:
    def __init__(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite_utils.Database(path)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        else:
            self.db = sqlite_utils.Database(memory=True)
        self._ensure_tables()
        self.last_seq_seen = self.last_seq()

    def _ensure_tables(self) -> None:
        db = self.db
        if "events" not in db.table_names():
            db.table("events").create(
                {
                    "seq": int,
                    "ts": float,
                    "kind": str,
                    "job_id": str,
                    "node": str,
                    "state": str,
                    "message": str,
                    "epoch": int,
                    "body": str,
                },
                pk="seq",
            )
            db.table("events").create_index(["job_id"])
        if "jobs" not in db.table_names():
            db.table("jobs").create(
                {
                    "job_id": str,
                    "tenant": str,
                    "name": str,
                    "queue": str,
                    "gpus": int,
                    "state": str,
                    "attempt": int,
                    "submitted_at": float,
                    "started_at": float,
                    "finished_at": float,
                    "exit_code": int,
                    "signal": int,
                    "nodes": str,
                    "reason": str,
                    "command": str,
                },
                pk="job_id",
            )
        if "attempts" not in db.table_names():
            db.table("attempts").create(
                {
                    "job_id": str,
                    "attempt": int,
                    "nodes": str,
                    "gpus": str,
                    "started_at": float,
                    "ended_at": float,
                    "state": str,
                    "exit_code": int,
                    "signal": int,
                    "reason": str,
                },
                pk=("job_id", "attempt"),
            )

    def last_seq(self) -> int:
        row = self.db.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def record(self, record: StateRecord, seq: int) -> None:
        self.last_seq_seen = max(self.last_seq_seen, seq)
        with self.db.conn:
            self.db.table("events").insert(
                {
                    "seq": seq,
                    "ts": record.ts,
                    "kind": record_kind(record),
                    "job_id": record_job_id(record),
                    "node": record_node(record),
                    "state": _state_of(record),
                    "message": _message_of(record),
                    "epoch": record.epoch,
                    "body": record.model_dump_json(),
                },
                replace=True,
            )
            if isinstance(record, JobChanged):
                self._job(record.job)

    def _job(self, job: JobRecord) -> None:
        self.db.table("jobs").upsert(
            {
                "job_id": job.job_id,
                "tenant": job.tenant,
                "name": job.spec.name,
                "queue": job.spec.queue,
                "gpus": job.spec.gpus,
                "state": job.state.value,
                "attempt": job.attempt,
                "submitted_at": job.submitted_at,
                "started_at": job.started_at,
                "finished_at": job.finished_at,
                "exit_code": job.exit_code,
                "signal": job.signal,
                "nodes": ",".join(job.nodes),
                "reason": job.reason,
                "command": json.dumps(list(job.spec.command)),
            },
            pk="job_id",
        )
        for failure in job.failures:
            # A failed attempt's row keeps where it ran; its end and class are added.
            self.db.table("attempts").upsert(
                {
                    "job_id": job.job_id,
                    "attempt": failure.attempt,
                    "nodes": ",".join(failure.nodes),
                    "ended_at": failure.at,
                    "state": "FAILED",
                    "exit_code": failure.exit_code,
                    "signal": failure.signal,
                    "failure_class": failure.failure_class.value,
                    "reason": failure.reason,
                },
                pk=("job_id", "attempt"),
                alter=True,
            )
        if job.attempt >= 1 and job.grants:
            self.db.table("attempts").upsert(
                {
                    "job_id": job.job_id,
                    "attempt": job.attempt,
                    "nodes": ",".join(job.nodes),
                    "gpus": json.dumps({g.node: list(g.gpus) for g in job.grants}),
                    "started_at": job.started_at,
                    "ended_at": job.finished_at,
                    "state": job.state.value,
                    "exit_code": job.exit_code,
                    "signal": job.signal,
                    "reason": job.reason,
                },
                pk=("job_id", "attempt"),
            )

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        """Every attempt of a job, oldest first, with the columns `AttemptRow` names."""
        columns = {c.name for c in self.db.table("attempts").columns}
        rows = self.db.table("attempts").rows_where("job_id = ?", [job_id], order_by="attempt")
        return [
            {
                "attempt": r["attempt"],
                "nodes": r["nodes"] or "",
                "gpus": r["gpus"] or "",
                "started_at": r["started_at"],
                "ended_at": r["ended_at"],
                "state": r["state"] or "",
                "exit_code": r["exit_code"],
                "signal": r["signal"],
                "failure_class": r["failure_class"] if "failure_class" in columns else None,
                "reason": r["reason"],
            }
            for r in rows
        ]

    def job_events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.db.table("events").rows_where("job_id = ?", [job_id], order_by="seq"))

    def job_changes(self, job_id: str, limit: int) -> tuple[list[tuple[int, JobChanged]], bool]:
        """The job's latest `limit` state records (oldest first) with their sequences,
        and whether older ones were left out. Node events about the job are not
        included: each one the brain acted on has a job record of its own."""
        rows = self.db.execute(
            "SELECT seq, body FROM events WHERE job_id = ? AND state IS NOT NULL "
            "ORDER BY seq DESC LIMIT ?",
            [job_id, limit + 1],
        ).fetchall()
        changes = [(int(seq), JobChanged.model_validate_json(body)) for seq, body in rows]
        return changes[:limit][::-1], len(changes) > limit

    def close(self) -> None:
        self.db.close()


def _state_of(record: StateRecord) -> str | None:
    if isinstance(record, JobChanged):
        return record.job.state.value
    if isinstance(record, NodeChanged):
        return record.node.state.value
    return None


def _message_of(record: StateRecord) -> str:
    if isinstance(record, NodeEventRecorded):
        return record.event.kind
    return record.cause.message
