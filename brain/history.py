"""Job history and accounting in sqlite (through sqlite-utils), for queries.

This is a projection of the STATE log, not a source of truth: it remembers the last
log sequence it holds, and a brain that finds it missing or behind fills it from the
log. Nothing here is read to make a decision.

A history in a file is written by a thread of its own, on its own connection: the
brain's loop turns each group of stored records into rows and hands them over, and
goes on (on the loop that sends Launches, a group's transaction took 0.2-0.3 ms, and
now and then up to 16 ms: sqlite checkpoints its write-ahead log in the connection that
commits). Groups are
written in the order handed over, one transaction each. A read waits until what was
handed over before it is written, so a query sees every record stored before it: the
brain's queries (`read`) run on that thread, queued behind those groups, so that the loop
waits neither for the writes nor for the query.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import sqlite_utils

from schemas.jobs import JobRecord, JobState
from schemas.state import (
    CauseKind,
    JobChanged,
    NodeChanged,
    NodeEventRecorded,
    StateRecord,
    record_job_id,
    record_kind,
    record_node,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Log entries `History.prune` removes in one transaction.
PRUNE_BATCH: Final = 20_000


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
        self._writer: _Writer | None = None
        if path is not None:
            # A file left with a hole (a group whose write failed before a restart) is
            # filled again from the hole on.
            self._writer = _Writer(path, failed_from=self._first_hole())
        # The last sequence written or handed to the writer.
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
                    "array": str,
                },
                pk="job_id",
            )
        elif "array" not in {c.name for c in db.table("jobs").columns}:
            self._add_arrays()
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
                    "failure_class": str,
                    "reason": str,
                },
                pk=("job_id", "attempt"),
            )
        elif "failure_class" not in {c.name for c in db.table("attempts").columns}:
            db.execute("ALTER TABLE attempts ADD COLUMN failure_class TEXT")
        # Listings walk jobs newest first by number (`_finished_ids`).
        db.execute(f"CREATE INDEX IF NOT EXISTS jobs_by_number ON jobs({_BY_NUMBER})")
        # An array's jobs, for a listing of one (most jobs are of none: not indexed).
        db.execute(
            "CREATE INDEX IF NOT EXISTS jobs_by_array ON jobs(array) WHERE array IS NOT NULL"
        )
        # `floor`: the first sequence this history holds every entry from (`begin_at`).
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER)")

    def _add_arrays(self) -> None:
        """Give a history written before jobs named their array (`JobSpec.array`) the
        column, filled from each job's last entry; only an array's jobs name one."""
        with self.db.conn:
            self.db.execute("ALTER TABLE jobs ADD COLUMN array TEXT")
            self.db.execute(
                "UPDATE jobs SET array = ("
                "SELECT json_extract(body, '$.job.spec.array') FROM events "
                "WHERE events.job_id = jobs.job_id AND state IS NOT NULL "
                "ORDER BY seq DESC LIMIT 1"
                ") WHERE job_id IN ("
                "SELECT job_id FROM events "
                'WHERE state IS NOT NULL AND instr(body, \'"array":"\') > 0)'
            )

    def last_seq(self) -> int:
        """The last sequence the history holds every entry up to: before a group whose
        write failed (the writer keeps the first such sequence until it is written),
        else the last it holds."""
        self.flush()
        row = self.db.execute("SELECT MAX(seq) FROM events").fetchone()
        last = int(row[0]) if row and row[0] is not None else 0
        failed_from = self._writer.failed_from if self._writer is not None else None
        return last if failed_from is None else min(last, failed_from - 1)

    def rewind(self) -> int:
        """Before a replay into the history: `last_seq`, and entries after it count as
        not yet handed over (`last_seq_seen`), so that the replay writes them again."""
        self.last_seq_seen = self.last_seq()
        return self.last_seq_seen

    def floor(self) -> int:
        """The first sequence the history holds every entry from: 1, unless it was
        filled from a log whose earlier entries were compacted away (`begin_at`), or
        pruned (`prune`). It only rises."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'floor'").fetchone()
        return int(row[0]) if row else 1

    def _first_hole(self) -> int | None:
        """The first sequence missing below the last the file holds (the log has every
        entry from the floor on), or None."""
        floor = self.floor()
        low, high, count = self.db.execute(
            "SELECT MIN(seq), MAX(seq), COUNT(*) FROM events WHERE seq >= ?", (floor,)
        ).fetchone()
        if not count or (low == floor and count == high - floor + 1):
            return None
        if low > floor:
            return floor
        row = self.db.execute(
            "SELECT MIN(seq) + 1 FROM events AS e WHERE seq >= ? "
            "AND NOT EXISTS (SELECT 1 FROM events WHERE seq = e.seq + 1)",
            (floor,),
        ).fetchone()
        return int(row[0])

    def begin_at(self, seq: int) -> None:
        """The entries before `seq` that the history lacks are gone from the log for
        good (compacted behind snapshots): from now on it holds every entry from `seq`
        on, and a restart does not look for the ones before (`_first_hole`). Written
        in order with the rows handed over before and after."""
        rows = _Rows(floor=seq)
        if self._writer is not None:
            self._writer.put(rows)
        else:
            rows.write(self.db.conn)

    def record_many(self, entries: Iterable[tuple[StateRecord, int]]) -> None:
        """Log entries with their sequences, in one transaction.

        Plain SQL: sqlite-utils' insert and upsert inspect the table on every call
        (65 statements for one job entry, 0.64 ms), which made filling the history the
        bulk of a brain's replay of a long log.
        """
        rows = _Rows()
        for record, seq in entries:
            rows.add(record, seq)
        if not rows.events:
            return
        if self._writer is not None:
            self._writer.put(rows)
        else:
            rows.write(self.db.conn)
        self.last_seq_seen = max(self.last_seq_seen, rows.last_seq)

    def flush(self) -> None:
        """Wait until every row handed to the writer is written (or failed, logged)."""
        if self._writer is not None:
            self._writer.flush()

    async def read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        """`query`'s answer from the history as every group handed over before it left
        it, without holding up the loop: in a file, on the writer's thread, after those
        groups (in memory, at once)."""
        if self._writer is None:
            return query(self.db.conn)
        return await asyncio.wrap_future(self._writer.read(query))

    async def prune(self, before_ts: float, *, batch: int = PRUNE_BATCH) -> int:
        """Forget what ended before `before_ts`: the log entries older than that (from
        the oldest, so the history still holds every entry from its new floor on; the
        last entry is always kept, so the history knows where it is), and the jobs that
        finished before it, with their attempts. A job still live keeps its row. In
        transactions of at most `batch` entries, each queued on the writer's thread as a
        read is: writes and queries handed over meanwhile go between them. The file
        stops growing (sqlite reuses the pages); it does not shrink. Returns the entries
        removed."""
        removed = 0
        while True:
            step = await self.read(partial(_prune_some, before_ts, batch))
            removed += step
            if step < batch:
                return removed

    async def read_attempts(self, job_id: str) -> list[dict[str, Any]]:
        """Every attempt of a job, oldest first, with the columns `AttemptRow` names."""
        return await self.read(partial(_attempts, job_id))

    def job_events(self, job_id: str) -> list[dict[str, Any]]:
        self.flush()
        return list(self.db.table("events").rows_where("job_id = ?", [job_id], order_by="seq"))

    async def read_job_changes(
        self, job_id: str, limit: int
    ) -> tuple[list[tuple[int, JobChanged]], bool]:
        """The job's latest `limit` state records (oldest first) with their sequences,
        and whether older ones were left out. Node events about the job are not
        included: each one the brain acted on has a job record of its own."""
        return await self.read(partial(_job_changes, job_id, limit))

    async def read_last_job(self, job_id: str) -> JobRecord | None:
        """The job as its latest record left it (for a finished job no longer in the
        brain's memory), or None if the history has no record of it."""
        return await self.read(partial(_last_job, job_id))

    async def read_finished_ids(self, query: FinishedQuery) -> list[str]:
        """The ids of the newest finished jobs `query` matches, newest first."""
        return await self.read(partial(_finished_ids, query))

    async def read_last_jobs(self, job_ids: Iterable[str]) -> list[JobRecord]:
        """`read_last_job` of each of `job_ids` the history has, in their order."""
        return await self.read(partial(_last_jobs, tuple(job_ids)))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.db.close()


_TERMINAL: Final = tuple(state.value for state in JobState if state.terminal)
_RAISE_FLOOR: Final = (
    "INSERT INTO meta (key, value) VALUES ('floor', ?) "
    "ON CONFLICT (key) DO UPDATE SET value = MAX(value, excluded.value)"
)


def _prune_some(before_ts: float, batch: int, conn: sqlite3.Connection) -> int:
    """One transaction of `History.prune`: up to `batch` of the oldest entries older than
    `before_ts`, the floor moved past them, and the jobs that finished before it."""
    with conn:
        last = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
        if last is None:
            return 0
        keep = conn.execute(
            "SELECT MIN(seq) FROM events WHERE ts >= ? OR seq = ?", (before_ts, last)
        ).fetchone()[0]
        low = conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
        cut = min(keep, low + batch)
        removed = conn.execute("DELETE FROM events WHERE seq < ?", (cut,)).rowcount
        conn.execute(_RAISE_FLOOR, (cut,))
        marks = ", ".join("?" for _ in _TERMINAL)
        gone = f"finished_at < ? AND state IN ({marks})"
        conn.execute(
            f"DELETE FROM attempts WHERE job_id IN (SELECT job_id FROM jobs WHERE {gone})",
            (before_ts, *_TERMINAL),
        )
        conn.execute(f"DELETE FROM jobs WHERE {gone}", (before_ts, *_TERMINAL))
    return int(removed)


def _attempts(job_id: str, conn: sqlite3.Connection) -> list[dict[str, Any]]:
    cursor = conn.execute(
        "SELECT attempt, nodes, gpus, started_at, ended_at, state, exit_code, signal, "
        "failure_class, reason FROM attempts WHERE job_id = ? ORDER BY attempt",
        [job_id],
    )
    names = [column[0] for column in cursor.description]
    rows = [dict(zip(names, row, strict=True)) for row in cursor]
    for row in rows:  # an attempt not started or ended yet has no text there
        for text in ("nodes", "gpus", "state"):
            row[text] = row[text] or ""
    return rows


def _job_changes(
    job_id: str, limit: int, conn: sqlite3.Connection
) -> tuple[list[tuple[int, JobChanged]], bool]:
    rows = conn.execute(
        "SELECT seq, body FROM events WHERE job_id = ? AND state IS NOT NULL "
        "ORDER BY seq DESC LIMIT ?",
        [job_id, limit + 1],
    ).fetchall()
    changes = [(int(seq), JobChanged.model_validate_json(body)) for seq, body in rows]
    return changes[:limit][::-1], len(changes) > limit


def _last_job(job_id: str, conn: sqlite3.Connection) -> JobRecord | None:
    row = conn.execute(
        "SELECT body FROM events WHERE job_id = ? AND state IS NOT NULL ORDER BY seq DESC LIMIT 1",
        [job_id],
    ).fetchone()
    return JobChanged.model_validate_json(row[0]).job if row is not None else None


def _last_jobs(job_ids: tuple[str, ...], conn: sqlite3.Connection) -> list[JobRecord]:
    jobs = (_last_job(job_id, conn) for job_id in job_ids)
    return [job for job in jobs if job is not None]


# Job ids as numbers without parsing them: brain-made ids are decimal, without leading
# zeros, so a shorter one is smaller.
_BY_NUMBER: Final = "length(job_id), job_id"


@dataclass(frozen=True)
class FinishedQuery:
    """Finished jobs to list from the history (the brain's memory holds only the
    latest ones): in `states` (terminal ones), of `tenant` (None: any), of `queues`
    and of `arrays` (None: any), numbered below `before` (None: the newest), at most
    `limit`, none of `skip` (the jobs the caller answers from memory)."""

    states: tuple[JobState, ...]
    tenant: str | None
    queues: tuple[str, ...] | None
    before: str | None
    limit: int
    skip: frozenset[str] = frozenset()
    arrays: tuple[str, ...] | None = None


def _finished_ids(query: FinishedQuery, conn: sqlite3.Connection) -> list[str]:
    """Numbered ids only (`_BY_NUMBER`): every id a brain gives is. The jobs table's rows
    are walked newest first by `jobs_by_number`; a batch that was mostly `skip` is
    followed by the next."""
    where = [
        f"state IN ({', '.join('?' * len(query.states))})",
        "job_id != ''",
        "job_id NOT GLOB '*[^0-9]*'",
        "substr(job_id, 1, 1) != '0'",
    ]
    params: list[Any] = [state.value for state in query.states]
    if query.tenant is not None:
        where.append("tenant = ?")
        params.append(query.tenant)
    if query.queues is not None:
        where.append(f"queue IN ({', '.join('?' * len(query.queues))})")
        params.extend(query.queues)
    if query.arrays is not None:
        where.append(f"array IN ({', '.join('?' * len(query.arrays))})")
        params.extend(query.arrays)
    batch = query.limit + len(query.skip)
    found: list[str] = []
    before = query.before
    if before is not None and not before.isdigit():
        before = None  # a name that is not a number sorts after every number
    elif before is not None:
        before = str(int(before))
    while len(found) < query.limit:
        clauses, values = list(where), list(params)
        if before is not None:
            clauses.append("(length(job_id) < ? OR (length(job_id) = ? AND job_id < ?))")
            values += [len(before), len(before), before]
        rows = [
            row[0]
            for row in conn.execute(
                f"SELECT job_id FROM jobs WHERE {' AND '.join(clauses)} "
                "ORDER BY length(job_id) DESC, job_id DESC LIMIT ?",
                [*values, batch],
            )
        ]
        found.extend(job_id for job_id in rows if job_id not in query.skip)
        if len(rows) < batch:
            break
        before = rows[-1]
    return found[: query.limit]


@dataclass
class _Read:
    """A query for the writer's thread, and where its answer goes."""

    query: Callable[[sqlite3.Connection], Any]
    answer: Future[Any] = field(default_factory=Future)


class _Writer:
    """A thread writing rows to the history's file, a transaction per group handed
    over, in order. A group that fails is logged and dropped: the log has its records,
    and `failed_from` keeps its first sequence until a group from there on is written,
    so the history says it is behind from there (`History.last_seq`) and a brain that
    loads fills it again."""

    def __init__(self, path: Path, *, failed_from: int | None = None) -> None:
        self.failed_from = failed_from
        # Opened here, so that a file that cannot be opened says so at once; used only
        # by the thread.
        self._conn = sqlite3.connect(path, check_same_thread=False)
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._queue: queue.Queue[_Rows | _Read | None] = queue.Queue()
        # Set, under the lock, once the thread takes nothing more: a read then fails.
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="history-writer", daemon=True)
        self._thread.start()

    def put(self, rows: _Rows) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the history is closed")
        self._queue.put(rows)

    def read(self, query: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Run `query` on this thread's connection once what was put before it is
        written."""
        item = _Read(query)
        with self._closing:
            if self._closed:
                raise RuntimeError("the history is closed")
            self._queue.put(item)
        return item.answer

    def flush(self) -> None:
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what was handed over, then stop (a second close does nothing)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                rows = self._queue.get()
                if isinstance(rows, _Read):
                    self._answer(rows)
                    continue
                try:
                    if rows is None:
                        return
                    rows.write(self._conn)
                    if rows.floor is not None and self.failed_from is not None:
                        # What is missing below the floor never comes: missing from it.
                        self.failed_from = max(self.failed_from, rows.floor)
                    if (
                        rows.events
                        and self.failed_from is not None
                        and rows.first_seq <= self.failed_from
                    ):
                        self.failed_from = None  # filled again from the first failed on
                except Exception:
                    assert rows is not None
                    if self.failed_from is None or rows.first_seq < self.failed_from:
                        self.failed_from = rows.first_seq
                    log.exception(
                        "history write failed for seq %d to %d; the log has them, and a "
                        "brain that loads writes them again",
                        rows.first_seq,
                        rows.last_seq,
                    )
                finally:
                    self._queue.task_done()
        finally:
            self._conn.close()
            # A read put after the close: answered, not left waiting.
            with self._closing:
                self._closed = True
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, _Read) and item.answer.set_running_or_notify_cancel():
                    item.answer.set_exception(RuntimeError("the history is closed"))
                self._queue.task_done()

    def _answer(self, read: _Read) -> None:
        try:
            if read.answer.set_running_or_notify_cancel():
                read.answer.set_result(read.query(self._conn))
        except Exception as error:  # the asker's to handle, not the writer's
            read.answer.set_exception(error)
        finally:
            self._queue.task_done()


_INSERT_EVENT: Final = (
    "INSERT OR REPLACE INTO events (seq, ts, kind, job_id, node, state, message, epoch, body) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _upsert(table: str, key: tuple[str, ...], columns: tuple[str, ...]) -> str:
    """Insert a row, or update the given columns of the row with that key."""
    names = ", ".join((*key, *columns))
    marks = ", ".join("?" for _ in (*key, *columns))
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns)
    return (
        f"INSERT INTO {table} ({names}) VALUES ({marks}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"
    )


_JOB_COLUMNS: Final = (
    "tenant", "name", "queue", "gpus", "state", "attempt", "submitted_at", "started_at",
    "finished_at", "exit_code", "signal", "nodes", "reason", "command", "array",
)  # fmt: skip
_UPSERT_JOB: Final = _upsert("jobs", ("job_id",), _JOB_COLUMNS)
# A failed attempt's row keeps where it ran; its end and class are added.
_UPSERT_FAILED_ATTEMPT: Final = _upsert(
    "attempts",
    ("job_id", "attempt"),
    ("nodes", "ended_at", "state", "exit_code", "signal", "failure_class", "reason"),
)
_UPSERT_ATTEMPT: Final = _upsert(
    "attempts",
    ("job_id", "attempt"),
    ("nodes", "gpus", "started_at", "ended_at", "state", "exit_code", "signal", "reason"),
)

# An attempt that ended without failing or finishing the job (preempted, stopped by its
# node, a pre-run passed): the job went back to PENDING, and its row is closed.
_END_REQUEUED_ATTEMPT: Final = (
    "UPDATE attempts SET ended_at = ?, state = ?, reason = ? "
    "WHERE job_id = ? AND attempt = ? AND ended_at IS NULL"
)

Row = tuple[object, ...]


@dataclass
class _Rows:
    """The rows a batch of log entries writes, in log order."""

    events: list[Row] = field(default_factory=list)
    jobs: list[Row] = field(default_factory=list)
    attempts: list[tuple[str, Row]] = field(default_factory=list)
    last_seq: int = 0
    # A new floor (`History.begin_at`), written with the rows.
    floor: int | None = None

    @property
    def first_seq(self) -> int:
        """The first entry's sequence (entries come in log order); a floor alone
        counts as its own."""
        return cast(int, self.events[0][0]) if self.events else self.floor or 0

    def write(self, conn: sqlite3.Connection) -> None:
        """In one transaction."""
        with conn:
            if self.floor is not None:
                conn.execute(_RAISE_FLOOR, (self.floor,))
            conn.executemany(_INSERT_EVENT, self.events)
            conn.executemany(_UPSERT_JOB, self.jobs)
            # In log order: a later entry's view of an attempt overwrites an earlier one's.
            for statement, row in self.attempts:
                conn.execute(statement, row)

    def add(self, record: StateRecord, seq: int) -> None:
        self.last_seq = max(self.last_seq, seq)
        self.events.append(
            (
                seq,
                record.ts,
                record_kind(record),
                record_job_id(record),
                record_node(record),
                _state_of(record),
                _message_of(record),
                record.epoch,
                record.model_dump_json(),
            )
        )
        if isinstance(record, JobChanged):
            self._job(record.job)
            self._requeued(record)

    def _job(self, job: JobRecord) -> None:
        self.jobs.append(
            (
                job.job_id,
                job.tenant,
                job.spec.name,
                job.spec.queue,
                job.spec.gpus,
                job.state.value,
                job.attempt,
                job.submitted_at,
                job.started_at,
                job.finished_at,
                job.exit_code,
                job.signal,
                ",".join(job.nodes),
                job.reason,
                json.dumps(list(job.spec.command)),
                job.spec.array,
            )
        )
        for failure in job.failures:
            self.attempts.append(
                (
                    _UPSERT_FAILED_ATTEMPT,
                    (
                        job.job_id,
                        failure.attempt,
                        ",".join(failure.nodes),
                        failure.at,
                        "FAILED",
                        failure.exit_code,
                        failure.signal,
                        failure.failure_class.value,
                        failure.reason,
                    ),
                )
            )
        if job.attempt >= 1 and job.grants:
            self.attempts.append(
                (
                    _UPSERT_ATTEMPT,
                    (
                        job.job_id,
                        job.attempt,
                        ",".join(job.nodes),
                        json.dumps({g.node: list(g.gpus) for g in job.grants}),
                        job.started_at,
                        job.finished_at,
                        job.state.value,
                        job.exit_code,
                        job.signal,
                        job.reason,
                    ),
                )
            )

    def _requeued(self, record: JobChanged) -> None:
        """RUNNING -> PENDING, not for a failure (whose row `_job` ends as FAILED): the
        attempt ended, and its row says how; else it read RUNNING for ever."""
        job = record.job
        if record.previous is not JobState.RUNNING or job.state is not JobState.PENDING:
            return
        if job.attempt < 1 or (job.failures and job.failures[-1].attempt == job.attempt):
            return
        state = "PREEMPTED" if record.cause.kind is CauseKind.PREEMPTED else "REQUEUED"
        self.attempts.append(
            (
                _END_REQUEUED_ATTEMPT,
                (record.ts, state, record.cause.message, job.job_id, job.attempt),
            )
        )


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
