"""Reading the log through a broken connection: every entry, once, in order, and an end.

`Bus.read` is how a brain reads STATE again before leading, and how a stepping-down
brain reloads. A read that skips an entry would lead from a wrong state; one that never
ends leaves the brain stepping down for ever. Its pull consumer delivers without acks,
so what is lost in transit (a connection dropped as a slow consumer, a server
restarted) is gone from that consumer: the reader must notice and read it again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.client
import pytest

from brain.service import Brain
from bus.client import Bus
from schemas import subjects
from schemas.state import STATE_RECORD
from tests.conftest import eventually
from tests.test_group_commit import entries, refuse_a_group, submit

PullSubscription = nats.js.client.JetStreamContext.PullSubscription


async def fill(bus: Bus, count: int) -> None:
    await bus.ensure_streams()
    names = [f"node-{i}" for i in range(count)]
    for start in range(0, count, 100):
        group = entries(names[start : start + 100])
        await bus.append_many(subjects.STREAM_STATE, group, after=start)


def losing(monkeypatch: pytest.MonkeyPatch, *, call: int, keep: int) -> list[int]:
    """Fetch number `call` (from 1) hands the reader only its first `keep` messages, as
    if the rest were lost with a dropped connection; the consumer has sent them all.
    Returns the sequences lost."""
    real = PullSubscription.fetch
    calls = 0
    lost: list[int] = []

    async def fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        msgs = await real(self, *args, **kwargs)
        calls += 1
        if calls == call:
            lost.extend(int(m.metadata.sequence.stream) for m in msgs[keep:])
            return msgs[:keep]
        return msgs

    monkeypatch.setattr(PullSubscription, "fetch", fetch)
    return lost


async def sequences(bus: Bus, **kwargs: Any) -> list[int]:
    async def read() -> list[int]:
        return [seq async for _, seq, _ in bus.read(subjects.STREAM_STATE, STATE_RECORD, **kwargs)]

    return await asyncio.wait_for(read(), timeout=60)  # a guard against a hang, not a speed


async def test_entries_lost_in_transit_are_read_again(connect, monkeypatch) -> None:
    bus = await connect("reader")
    await fill(bus, 300)
    lost = losing(monkeypatch, call=2, keep=40)
    assert await sequences(bus, batch=100) == list(range(1, 301))
    assert lost == list(range(141, 201))


async def test_a_read_whose_last_entries_were_lost_still_ends(connect, monkeypatch) -> None:
    """The old reader waited for the known last entry, which the consumer had already
    delivered, for ever."""
    bus = await connect("reader")
    await fill(bus, 300)
    lost = losing(monkeypatch, call=3, keep=99)
    assert await sequences(bus, batch=100) == list(range(1, 301))
    assert lost == [300]


async def test_a_filtered_read_reads_again_what_it_lost(connect, monkeypatch) -> None:
    bus = await connect("reader")
    await fill(bus, 300)
    lost = losing(monkeypatch, call=1, keep=1)
    got = await sequences(bus, batch=100, filter_subject=subjects.state_node("node-7"))
    assert got == [8]
    assert lost == []  # one entry matches: nothing after it to lose

    losing(monkeypatch, call=1, keep=0)
    got = await sequences(bus, batch=100, filter_subject=f"{subjects.PREFIX}.state.node.*")
    assert got == list(range(1, 301))


@pytest.mark.timeout(120)
async def test_a_read_goes_on_across_a_server_restart(connect, nats_server) -> None:
    """The server killed and started again between two fetches: its ephemeral consumer
    is gone with it, and the reader must read on from where it was."""
    bus = await connect("reader")
    await fill(bus, 1000)
    got: list[int] = []

    async def read() -> None:
        async for _, seq, _ in bus.read(subjects.STREAM_STATE, STATE_RECORD, batch=100):
            got.append(seq)
            if seq == 150:
                nats_server.kill()
                await nats_server.astart()

    await asyncio.wait_for(read(), timeout=90)
    assert got == list(range(1, 1001))


@pytest.mark.timeout(120)
async def test_a_follower_goes_on_across_a_server_restart(connect, nats_server) -> None:
    """A standby brain follows STATE: it must see every entry, those appended after
    the restart included, and each once."""
    reader = await connect("follower")
    await fill(reader, 200)
    got: list[int] = []
    stop = asyncio.Event()

    async def follow() -> None:
        async for _, seq, _ in reader.read(
            subjects.STREAM_STATE, STATE_RECORD, batch=50, follow=True, stop=stop
        ):
            got.append(seq)
            if seq == 120:
                nats_server.kill()
                await nats_server.astart()
            if seq == 300:
                stop.set()

    following = asyncio.ensure_future(follow())
    await eventually(lambda: len(got) >= 200, timeout_s=60)
    writer = await connect("writer")
    names = [f"late-{i}" for i in range(100)]
    await writer.append_many(subjects.STREAM_STATE, entries(names), after=200)
    await asyncio.wait_for(following, timeout=60)
    assert got == list(range(1, 301))


async def test_entries_removed_from_the_stream_are_not_waited_for(connect) -> None:
    """A stream may lose entries to its limits or an operator's delete, the last one
    included: the read skips what is not there and still ends."""
    bus = await connect("reader")
    await fill(bus, 300)
    for seq in (150, 300):
        await bus.js.delete_msg(subjects.STREAM_STATE, seq)
    expected = [seq for seq in range(1, 300) if seq != 150]
    assert await sequences(bus, batch=100) == expected
    assert await sequences(bus, batch=100, start_seq=150) == expected[149:]


@pytest.mark.timeout(120)
async def test_a_step_down_whose_reload_meets_a_server_restart_leads_again(
    brain_factory: Callable[..., Awaitable[Brain]], connect, nats_server, monkeypatch
) -> None:
    """A refused group makes the leader step down and read its state again; the server
    restarts under that read. The reload must end, over the log as stored, and the
    brain lead again: before, a read that lost its entries never ended, and a brain
    that never finished stepping down never stood for election again."""
    brain = await brain_factory()
    for i in range(3):
        await submit(brain, f"before-{i}")
    real_reload = brain.replica.reload
    real_fetch = PullSubscription.fetch
    restarts: list[bool] = []
    reloading = False

    async def reload() -> None:
        nonlocal reloading
        reloading = True
        try:
            await real_reload()
        finally:
            reloading = False

    async def fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        msgs = await real_fetch(self, *args, **kwargs)
        if reloading and not restarts and msgs:
            restarts.append(True)  # these entries are lost with the connection
            nats_server.kill()
            await nats_server.astart()
            return []
        return msgs

    brain.replica.reload = reload  # type: ignore[method-assign]
    monkeypatch.setattr(PullSubscription, "fetch", fetch)
    await refuse_a_group(brain, connect)

    await eventually(lambda: restarts and brain.leading.is_set(), timeout_s=60)
    assert not brain.journal.tainted
    assert "intruder" in brain.state.nodes
    names = sorted(j.spec.name for j in brain.state.jobs.values())
    assert names == ["before-0", "before-1", "before-2"]
    assert brain.state.last_seq == await brain.bus.last_seq(subjects.STREAM_STATE)


async def test_a_read_from_a_time_starts_at_the_first_entry_stored_since(connect) -> None:
    # `alnair events --since 10m`: the server's stored times, not the records' own.
    bus = await connect("reader")
    await fill(bus, 3)
    await asyncio.sleep(0.3)
    between = time.time()
    await asyncio.sleep(0.3)
    await bus.append_many(subjects.STREAM_STATE, entries(["late-0", "late-1"]), after=3)
    assert await bus.first_seq_since(subjects.STREAM_STATE, between - 3600) == 1
    assert await bus.first_seq_since(subjects.STREAM_STATE, between) == 4
    assert await sequences(bus, start_seq=4) == [4, 5]
    # After the last: the next to be stored, so a follower gets only what comes.
    assert await bus.first_seq_since(subjects.STREAM_STATE, time.time() + 60) == 6
