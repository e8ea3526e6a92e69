"""The leader's journal on its own, without a server: an in-memory log behind the
same narrow protocol the bus serves."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel

from brain.journal import Journal
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


async def test_commands_alone_go_out_without_an_append() -> None:
    made, _, log, history, _ = journal()
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    await made.commit()
    assert log.calls == [("command", "s-1")] and log.appends == 0
    assert history.transactions == 0


async def test_discard_drops_what_a_unit_cut_short_staged() -> None:
    made, _, log, _, _ = journal()
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.discard()
    assert made.tainted and not made.dirty
    await made.commit()
    assert log.calls == []


async def test_commands_go_out_before_the_history_is_written() -> None:
    """The history is a projection: a placement's Launch waits for the log's
    acknowledgement only, not for the sqlite write after it."""
    made, _, _, history, seen = journal()
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    await made.commit()
    assert history.seen_calls == [[("append", 1), ("command", "s-1")]]
    assert seen == [1]


async def test_stored_records_reach_the_history_even_when_their_commands_fail() -> None:
    made, _, log, history, seen = journal()

    async def unreachable(messages: list[tuple[str, BaseModel, str]]) -> None:
        raise TimeoutError("no stream answered")

    log.publish_many_durable = unreachable  # type: ignore[method-assign]
    made.stage(node_record("a", 8), "alnair.state.node.a")
    made.send_after("alnair.node.a.cmd", stop("s-1"), "s-1")
    with pytest.raises(TimeoutError):
        await made.commit()
    # The record is in the log: its projection and observers have it, and the log
    # is not ahead of state (nothing to load again).
    assert history.rows == [1] and seen == [1] and not made.tainted
