"""The leader's write-ahead journal: records stored as groups, commands sent after them.

A handler (an inbox item, a scheduling pass) *stages* each record it makes: the record
gets the next sequence and is applied to state at once, so the handler reads its own
writes, but nothing outside this process sees it yet. At the end of a unit of work
(one inbox batch, one pass's decisions) `commit` appends everything staged as one
group, pipelined and fenced (`Bus.append_many`), hands the commands the unit queued
with `send_after` to the journal's sender, and writes the group's history rows and
tells the observers (a projection, off the path from a placement to its Launch). So:

- no command, and no reply to a caller, goes out before the records it follows are
  stored (the commit comes first; the shell answers callers after it);
- commands go out in the order their units committed, by a sender task of their own:
  a command stream slow to take them (its leader moving, say) holds up no unit of the
  writer, and so no caller and no read; what the sender has not sent when leadership
  ends is dropped (`stop_sending`), and the next leader sends again what the log says
  is unconfirmed;
- a group is stored contiguously, right after the last stored record, or the commit
  fails; a failed commit leaves state ahead of the log, so the journal is `tainted`
  and the brain must step down and load state from the log again (`Replica.reload`)
  before it may lead: nobody was acknowledged for anything in the group;
- a tainted journal stores nothing more, and sends nothing, until state is loaded
  again: a unit that runs before the step-down (a scheduling pass that was waiting
  for the writer) works on state that holds the refused group, and the fence alone
  would not stop its records: where another writer's entries took as many sequences
  as the refused group, the next group fits right after them (`StateAhead`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

from pydantic import BaseModel

from brain.state import BrainState
from schemas import subjects
from schemas.state import StateRecord

log = logging.getLogger(__name__)

# Commands the sender pipelines in one send at most: the units that queued behind a
# slow stream go out together, this many at a time.
SEND_MAX: Final = 1024
# Commands queued for the sender at most: past it (a command stream down for minutes
# while passes go on placing) the oldest are dropped and counted as unsent.
QUEUED_MAX: Final = 100_000


class StateAhead(RuntimeError):
    """A commit on a tainted journal: state holds records the log refused, so nothing
    derived from it may be stored. Not an ApiError: a unit that meets it is lost whole,
    and the brain steps down (as for the commit that tainted it)."""

    def __init__(self) -> None:
        super().__init__(
            "state is ahead of the log (a group was not stored): nothing more is stored "
            "until it is loaded again"
        )


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
    # Committed units' commands not yet sent, in commit order (the sender's queue).
    unsent: deque[tuple[str, BaseModel, str]] = field(default_factory=deque)
    queued_max: int = QUEUED_MAX
    # Counters for /metrics and benches: groups committed, records in them, commands
    # sent, and commands that did not go out (given up on, or dropped at a step-down).
    groups: int = 0
    records: int = 0
    commands_sent: int = 0
    commands_unsent: int = 0
    _sender: asyncio.Task[None] | None = None
    _in_flight: int = 0  # commands the sender is sending now

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
        """Store what is staged, then queue what the unit would send. Raises what the
        append raised (SequenceConflict, BusTimeout, ...) with the journal tainted, and
        then sends nothing the unit queued. On a tainted journal it stores and sends
        nothing, and raises StateAhead.

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
        if self.tainted and (staged or outbox):
            raise StateAhead()
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
        # The records are stored: their commands may go, by the sender, and the history
        # and the observers may learn of them (neither on the path to a Launch).
        if staged:
            self._project(staged)
        if outbox:
            self._queue(outbox)
            # Let the sender put them on the wire now, before the unit's caller goes
            # on (a pass goes on to its waiting reasons): one turn of the loop.
            await asyncio.sleep(0)

    @property
    def queued(self) -> int:
        """Commands whose records are stored that the command stream has not taken yet:
        the sender's queue and the send in hand."""
        return len(self.unsent) + self._in_flight

    def _queue(self, outbox: list[tuple[str, BaseModel, str]]) -> None:
        unsent = self.unsent
        unsent.extend(outbox)
        if len(unsent) > self.queued_max:
            over = len(unsent) - self.queued_max
            for _ in range(over):
                unsent.popleft()
            self.commands_unsent += over
            log.warning(
                "%d command(s) dropped unsent: %d wait for the command stream already",
                over,
                self.queued_max,
            )
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(
                self._send_queued(), name="journal-sender"
            )

    async def _send_queued(self) -> None:
        """Send the queue, oldest first, until it is empty (then the task ends; the
        next commit with commands starts another)."""
        while self.unsent:
            batch = [self.unsent.popleft() for _ in range(min(SEND_MAX, len(self.unsent)))]
            self._in_flight = len(batch)
            try:
                await self.bus.publish_many_durable(batch)
            except Exception as error:
                self.commands_unsent += len(batch)
                log.warning(
                    "%d command(s) did not go out (%r); what they follow is stored, "
                    "and they are sent again or undone where they are watched",
                    len(batch),
                    error,
                )
            else:
                self.commands_sent += len(batch)
            self._in_flight = 0

    async def sent(self) -> None:
        """Wait until every command committed so far was sent (or given up on)."""
        if self._sender is not None:
            await asyncio.shield(self._sender)

    async def stop_sending(self, grace_s: float = 0.0) -> int:
        """Leadership ends: let the sender finish within `grace_s`, then drop what it
        has not sent (a later leader sends again what the log says is unconfirmed).
        Returns how many commands were dropped."""
        if self._sender is not None and grace_s > 0:
            await asyncio.wait({self._sender}, timeout=grace_s)
        sender, self._sender = self._sender, None
        if sender is not None and not sender.done():
            sender.cancel()
            await asyncio.wait({sender})
        # What the cancelled send had in hand may have reached the stream, or not.
        dropped = self.queued
        if dropped:
            log.warning("%d command(s) not known to have gone out at a step-down", dropped)
            self.commands_unsent += dropped
        self.unsent.clear()
        self._in_flight = 0
        return dropped

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
