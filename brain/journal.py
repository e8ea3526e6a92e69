"""The leader's write-ahead journal: records stored as groups, commands sent after them.

A handler (an inbox item, a scheduling pass) *stages* each record it makes: the record
gets the next sequence and is applied to state at once, so the handler reads its own
writes, but nothing outside this process sees it yet. At the end of a unit of work
(one inbox batch, one pass's decisions) `commit` appends everything staged as one
group, pipelined and fenced (`Bus.append_many`), then publishes the commands the unit
queued with `send_after`, and only then writes the group's history rows in one sqlite
transaction and tells the observers (a projection, off the path from a placement to its
Launch). So:

- no command, and no reply to a caller, goes out before the records it follows are
  stored (the commit comes first; the shell answers callers after it);
- a group is stored contiguously, right after the last stored record, or the commit
  fails; a failed commit leaves state ahead of the log, so the journal is `tainted`
  and the brain must step down and load state from the log again (`Replica.reload`)
  before it may lead: nobody was acknowledged for anything in the group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from brain.state import BrainState
from schemas import subjects
from schemas.state import StateRecord

log = logging.getLogger(__name__)


class Log(Protocol):
    """What the journal needs of the bus (bus.client.Bus is one)."""

    async def append_many(
        self, stream: str, entries: list[tuple[str, BaseModel, str]], *, after: int
    ) -> int: ...

    async def publish_many_durable(self, messages: list[tuple[str, BaseModel, str]]) -> None: ...


class Projection(Protocol):
    """Where stored records are written for queries (brain.history.History is one)."""

    def record_many(self, entries: Iterable[tuple[StateRecord, int]]) -> None: ...


@dataclass
class Journal:
    bus: Log
    history: Projection
    # The state records are applied to (the replica's: it is replaced on a reload).
    state: Callable[[], BrainState]
    observers: list[Callable[[StateRecord, int], None]]
    staged: list[tuple[str, StateRecord, int]] = field(default_factory=list)
    outbox: list[tuple[str, BaseModel, str]] = field(default_factory=list)
    tainted: bool = False
    # Counters for /metrics and benches: groups committed, records in them, and
    # commands that did not go out.
    groups: int = 0
    records: int = 0
    commands_unsent: int = 0

    def stage(self, record: StateRecord, subject: str) -> int:
        """Apply `record` now; it is stored at the next commit. Returns its sequence."""
        state = self.state()
        seq = state.last_seq + 1
        state.apply(record, seq)
        self.staged.append((subject, record, seq))
        return seq

    def send_after(self, subject: str, message: BaseModel, msg_id: str) -> None:
        """Publish `message` durably once everything staged so far is stored."""
        self.outbox.append((subject, message, msg_id))

    @property
    def dirty(self) -> bool:
        return bool(self.staged or self.outbox)

    async def commit(self) -> None:
        """Store what is staged, then send what is queued. Raises what the append
        raised (SequenceConflict, BusTimeout, ...) with the journal tainted.

        Commands that do not go out (the bus retries them for half a minute) fail
        nothing: the records they follow are stored, so the callers who staged them are
        answered, and each kind of command is sent again or undone where it is
        watched: a launch no node confirms is requeued after its TTL (brain/liveness.py),
        a job a node runs that the brain does not hold is stopped by the reconciler, and
        a node that counts other GPUs for an elastic attempt than its grant is regranted
        by it (brain/reconciler.py), a resize that is not confirmed rolls back
        (brain/resizes.py)."""
        staged, self.staged = self.staged, []
        outbox, self.outbox = self.outbox, []
        if staged:
            first = staged[0][2]
            try:
                await self.bus.append_many(
                    subjects.STREAM_STATE,
                    [(subject, record, record.record_id) for subject, record, _ in staged],
                    after=first - 1,
                )
            except BaseException:
                self.tainted = True
                raise
            self.groups += 1
            self.records += len(staged)
        try:
            # The records are stored: their commands may go. The history and the
            # observers come after, off the path from a placement to its Launch.
            if outbox:
                await self.bus.publish_many_durable(outbox)
        except Exception as error:
            self.commands_unsent += len(outbox)
            log.warning(
                "%d command(s) did not go out (%r); what they follow is stored, and "
                "they are sent again or undone where they are watched",
                len(outbox),
                error,
            )
        finally:
            if staged:
                self._project(staged)

    def _project(self, staged: list[tuple[str, StateRecord, int]]) -> None:
        """Write stored records to the history and tell the observers."""
        entries = [(record, seq) for _, record, seq in staged]
        try:
            self.history.record_many(entries)
        except Exception:
            log.exception(
                "history write failed for seq %d to %d; the log has them",
                entries[0][1],
                entries[-1][1],
            )
        for record, seq in entries:
            for observer in self.observers:
                try:
                    observer(record, seq)
                except Exception:
                    log.exception("observer %r failed", observer)

    def discard(self) -> None:
        """Drop what is staged and queued (state is reloaded from the log after this)."""
        if self.staged or self.outbox:
            self.tainted = True
        self.staged.clear()
        self.outbox.clear()
