"""The leader's journal on its own, without a server: an in-memory log behind the
same narrow protocol the bus serves; and the snapshots taken beside it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

from brain.history import History
from brain.journal import Journal, StateAhead
from brain.replica import Replica
from brain.snapshots import EncodedSnapshot
from brain.state import BrainState
from schemas.commands import Stop
from schemas.errors import SequenceConflict
from schemas.state import StateRecord
from tests.statelog import node_record


@dataclass
class MemoryLog:
    entries: list[tuple[str, BaseModel, str]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    appends: int = 0
    refuse: bool = False
    # What the bus saw, in order: ("append", n) and ("command", id).
    calls: list[tuple[str, object]] = field(default_factory=list)

    async def append_many(
        self, stream: str, entries: list[tuple[str, BaseModel, str]], *, after: int
    ) -> int:
        self.appends += 1
        if self.refuse or after != len(self.entries):
            raise SequenceConflict(stream, after)
        self.entries += entries
        self.calls.append(("append", len(entries)))
        return len(self.entries)

    async def publish_many_durable(self, messages: list[tuple[str, BaseModel, str]]) -> None:
        for _, _, msg_id in messages:
            self.commands.append(msg_id)
            self.calls.append(("command", msg_id))


@dataclass
class MemoryHistory:
    rows: list[int] = field(default_factory=list)
    transactions: int = 0
    # The log's calls when each transaction was written (what had gone out before it).
    log: MemoryLog | None = None
    seen_calls: list[list[tuple[str, object]]] = field(default_factory=list)

    def record_many(self, entries: Iterable[tuple[StateRecord, int]]) -> None:
        self.transactions += 1
        self.rows += [seq for _, seq in entries]
        if self.log is not None:
            self.seen_calls.append(list(self.log.calls))


def stop(command_id: str) -> Stop:
    return Stop(command_id=command_id, epoch=1, issued_at=0.0, job_id="1", attempt=1, reason="test")


def journal() -> tuple[Journal, BrainState, MemoryLog, MemoryHistory, list[int]]:
    state, log, seen = BrainState(), MemoryLog(), []
    history = MemoryHistory(log=log)
    made = Journal(log, history, lambda: state, [lambda record, seq: seen.append(seq)])
    return made, state, log, history, seen


async def test_staged_records_are_read_at_once_and_stored_as_one_group() -> None:
    made, state, log, history, seen = journal()
    for name in ("a", "b", "c"):
        made.stage(node_record(name, 8), f"alnair.state.node.{name}")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    # Read-your-writes within the unit; nothing has left the process.
    assert set(state.nodes) == {"a", "b", "c"} and state.last_seq == 3
    assert log.calls == [] and seen == []

    await made.commit()
    await made.sent()

    assert log.appends == 1 and log.calls == [("append", 3), ("command", "s-1")]
    assert history.transactions == 1 and history.rows == [1, 2, 3]
    assert seen == [1, 2, 3]
    assert (made.groups, made.records, made.dirty, made.tainted) == (1, 3, False, False)


async def test_a_refused_group_taints_the_journal_and_sends_nothing() -> None:
    made, state, log, history, seen = journal()
    log.refuse = True
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    with pytest.raises(SequenceConflict):
        await made.commit()
    # State ran ahead of the log: the brain must load it again before leading.
    assert made.tainted and "a" in state.nodes
    assert log.commands == [] and history.rows == [] and seen == []


async def test_a_tainted_journal_stores_nothing_more_though_the_fence_fits() -> None:
    """Another writer took as many sequences as the refused group: a unit that ran
    before the step-down (a pass waiting for the writer) stages its records right after
    them, and the fence alone would take them. The log would then hold records made
    from state it never stored (the refused group's job, noted as waiting)."""
    made, _, log, history, seen = journal()
    log.entries.append(("alnair.state.node.rival", node_record("rival", 8), "rival"))
    made.stage(node_record("refused", 8), "alnair.state.node.refused")  # seq 1, refused
    with pytest.raises(SequenceConflict):
        await made.commit()
    made.stage(node_record("derived", 8), "alnair.state.node.derived")  # seq 2: fits
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    with pytest.raises(StateAhead):
        await made.commit()
    await made.sent()
    assert [msg_id for _, _, msg_id in log.entries] == ["rival"]
    assert log.commands == [] and history.rows == [] and seen == []
    assert made.tainted and not made.dirty


async def test_commands_alone_go_out_without_an_append() -> None:
    made, _, log, history, _ = journal()
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    await made.commit()
    await made.sent()
    assert log.calls == [("command", "s-1")] and log.appends == 0
    assert history.transactions == 0


async def test_discard_drops_what_a_unit_cut_short_staged() -> None:
    made, _, log, _, _ = journal()
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.discard()
    assert made.tainted and not made.dirty
    await made.commit()
    assert log.calls == []


async def test_the_history_is_written_without_waiting_for_commands() -> None:
    """The history is a projection, and commands have a sender of their own: a
    placement's Launch waits for the log's acknowledgement only, and the group's
    history rows for neither the sqlite write nor the command stream."""
    made, log, history, seen = stalled_journal()
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    await made.commit()
    assert history.seen_calls == [[("append", 1)]] and seen == [1]
    log.go.set()
    await made.sent()
    assert log.calls == [("append", 1), ("command", "s-1")]


async def test_commands_that_do_not_go_out_fail_nothing_that_was_stored() -> None:
    """Their records are stored: the unit's callers are answered, the history and the
    observers have them, and nothing is ahead of the log. The commands are counted."""
    made, _, log, history, seen = journal()

    async def unreachable(messages: list[tuple[str, BaseModel, str]]) -> None:
        raise TimeoutError("no stream answered")

    log.publish_many_durable = unreachable  # type: ignore[method-assign]
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    await made.commit()
    await made.sent()
    assert history.rows == [1] and seen == [1] and not made.tainted
    assert (made.groups, made.commands_sent, made.commands_unsent) == (1, 0, 1)


@dataclass
class StalledLog(MemoryLog):
    """A command stream that takes nothing until `go` is set (its leader moving, say);
    each send it is asked for is kept, in order."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    sends: list[list[str]] = field(default_factory=list)

    async def publish_many_durable(self, messages: list[tuple[str, BaseModel, str]]) -> None:
        self.sends.append([msg_id for _, _, msg_id in messages])
        await self.go.wait()
        await super().publish_many_durable(messages)


def stalled_journal() -> tuple[Journal, StalledLog, MemoryHistory, list[int]]:
    state, log, seen = BrainState(), StalledLog(), []
    history = MemoryHistory(log=log)
    made = Journal(log, history, lambda: state, [lambda record, seq: seen.append(seq)])
    return made, log, history, seen


async def test_a_command_stream_that_takes_nothing_holds_no_unit_and_keeps_the_order() -> None:
    """Units commit (and their callers are answered) while the commands of an earlier
    one wait for the stream; once it takes them, every unit's commands go out in the
    order the units committed, those that queued meanwhile in one send."""
    made, log, _, _ = stalled_journal()
    for unit in range(1, 4):
        made.stage(node_record(f"n{unit}", 8), f"alnair.state.node.n{unit}")
        made.send_after("alnair.node.a.cmd", stop(f"s-{unit}a"), f"s-{unit}a")
        made.send_after("alnair.node.b.cmd", stop(f"s-{unit}b"), f"s-{unit}b")
        await made.commit()
        await asyncio.sleep(0)  # the sender takes the first unit's commands
    assert made.groups == 3 and list(log.entries) and log.commands == []
    assert log.sends == [["s-1a", "s-1b"]] and len(made.unsent) == 4
    log.go.set()
    await made.sent()
    assert log.sends == [["s-1a", "s-1b"], ["s-2a", "s-2b", "s-3a", "s-3b"]]
    assert log.commands == ["s-1a", "s-1b", "s-2a", "s-2b", "s-3a", "s-3b"]
    assert (made.commands_sent, made.commands_unsent) == (6, 0)


async def test_stepping_down_drops_what_the_sender_has_not_sent() -> None:
    """Leadership ends: the commands still queued (and the send in hand) are dropped
    and counted; a later tenure's commands go out from an empty queue."""
    made, log, _, _ = stalled_journal()
    for unit in range(1, 3):
        made.send_after("alnair.node.a.cmd", stop(f"s-{unit}"), f"s-{unit}")
        await made.commit()
        await asyncio.sleep(0)
    assert await made.stop_sending(grace_s=0.01) == 2
    assert (made.commands_sent, made.commands_unsent, len(made.unsent)) == (0, 2, 0)
    await made.sent()  # nothing is waited for
    log.go.set()
    made.send_after("alnair.node.a.cmd", stop("s-3"), "s-3")
    await made.commit()
    await made.sent()
    assert log.commands == ["s-3"] and made.commands_sent == 1


class SlowLog(MemoryLog):
    """An append that waits for the stream's acknowledgement (the loop turns meanwhile)
    and then is refused."""

    async def append_many(
        self, stream: str, entries: list[tuple[str, BaseModel, str]], *, after: int
    ) -> int:
        await asyncio.sleep(0.01)
        raise TimeoutError("no acknowledgement")


@dataclass
class MemorySnapshots:
    written: list[int] = field(default_factory=list)

    async def write(self, encoded: EncodedSnapshot) -> SimpleNamespace:
        self.written.append(encoded.last_seq)
        return SimpleNamespace(last_seq=encoded.last_seq, jobs=0, size=0, raw_size=0, chunks=())


class Spawner:
    def spawn(self, coroutine: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        return asyncio.ensure_future(coroutine)


async def test_a_snapshot_covers_only_what_was_stored_when_it_was_asked_for() -> None:
    """The writer asks for a snapshot right after a commit; the next unit stages a
    record, whose append waits and then fails. The snapshot stored in the background
    must not cover that record: a brain loading it would skip whatever the log holds
    at its sequence."""
    replica = Replica(Spawner(), History(None))  # type: ignore[arg-type]
    snapshots = replica.snapshots = MemorySnapshots()  # type: ignore[assignment]
    made = Journal(SlowLog(), MemoryHistory(), lambda: replica.state, [])

    assert replica.write_snapshot_soon(taken_at=0.0, epoch=1)
    made.stage(node_record("a", 8), "alnair.state.node.a")
    with pytest.raises(TimeoutError):
        await made.commit()
    await replica.snapshot_written()

    assert made.tainted and replica.state.last_seq == 1
    assert snapshots.written == [0]


async def test_the_sender_queue_is_bounded_by_dropping_the_oldest() -> None:
    """A command stream down while units go on committing: past `queued_max` the
    oldest queued commands are dropped and counted (each is sent again or undone where
    it is watched); the newest go out once the stream is back."""
    made, log, _, _ = stalled_journal()
    made.queued_max = 3
    for unit in range(1, 7):
        made.send_after("alnair.node.a.cmd", stop(f"s-{unit}"), f"s-{unit}")
        await made.commit()
        await asyncio.sleep(0)
    assert [msg_id for _, _, msg_id in made.unsent] == ["s-4", "s-5", "s-6"]
    assert made.commands_unsent == 2  # s-2 and s-3; s-1 is in hand
    log.go.set()
    await made.sent()
    assert log.commands == ["s-1", "s-4", "s-5", "s-6"]
