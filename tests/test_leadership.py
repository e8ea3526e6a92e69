"""Leadership without a server (brain/leadership.py): an in-memory lease behind the same
narrow protocol as brain/leader.py's, and a tenure that records what it was asked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from brain.leadership import Leadership
from schemas.api import BrainInfo
from tests.conftest import eventually

TTL_S = 0.06


@dataclass
class Store:
    """The lease's bucket: who holds it, at which revision."""

    holder: str | None = None
    revision: int = 0


@dataclass
class MemoryLease:
    store: Store
    name: str
    epoch: int | None = None
    revision: int | None = None
    renewals_fail: bool = False
    # Cut off from the bucket's server: it cannot take the lease.
    cut_off: bool = False
    announced: int = 0

    async def try_acquire(self, info: BrainInfo) -> int | None:
        if self.store.holder is not None or self.cut_off:
            return None
        self.store.holder, self.store.revision = self.name, self.store.revision + 1
        self.epoch = self.revision = self.store.revision
        return self.epoch

    async def renew(self, info: BrainInfo) -> bool:
        if self.renewals_fail:
            raise ConnectionError("cut off")
        if self.store.holder != self.name:
            self.epoch = self.revision = None
            return False
        self.store.revision += 1
        self.revision = self.store.revision
        return True

    async def release(self) -> None:
        if self.store.holder == self.name:
            self.store.holder = None
        self.epoch = self.revision = None

    async def announce(self, info: BrainInfo) -> None:
        self.announced += 1


@dataclass
class RecordingTenure:
    name: str
    calls: list[tuple[object, ...]] = field(default_factory=list)
    # Run inside `begin`, as the bus would be waited on there.
    on_begin: Callable[[], None] | None = None

    def info(self) -> BrainInfo:
        return BrainInfo(brain_id=self.name, host="h", pid=1, since=0.0, leader=False)

    async def catch_up(self) -> int:
        self.calls.append(("catch_up",))
        return 7

    async def begin(self, epoch: int) -> None:
        self.calls.append(("begin", epoch))
        if self.on_begin is not None:
            self.on_begin()
        await asyncio.sleep(0)

    async def take_over(self, epoch: int, caught_up: int) -> None:
        self.calls.append(("take_over", epoch, caught_up))

    async def end(self, reason: str, renewer: asyncio.Task[None] | None) -> None:
        self.calls.append(("end", reason))
        if renewer is not None:
            renewer.cancel()

    def follow(self) -> None:
        self.calls.append(("follow",))


@dataclass
class Brain:
    lease: MemoryLease
    tenure: RecordingTenure
    leadership: Leadership
    closing: list[bool]
    election: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.election = asyncio.ensure_future(self.leadership.elect_forever())

    async def stop(self) -> None:
        self.closing[0] = True
        await self.leadership.stop_leading("test over")
        if self.election is not None:
            self.election.cancel()
            await asyncio.gather(self.election, return_exceptions=True)


def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    return asyncio.ensure_future(coro)


def brain(store: Store, name: str) -> Brain:
    lease, tenure, closing = MemoryLease(store, name), RecordingTenure(name), [False]
    made = Leadership(
        lease,
        tenure,
        spawn=spawn,
        ttl_s=TTL_S,
        monotonic=time.monotonic,
        closing=lambda: closing[0],
    )
    return Brain(lease, tenure, made, closing)


@pytest.fixture
async def brains() -> AsyncIterator[Callable[[Store, str], Brain]]:
    made: list[Brain] = []

    def factory(store: Store, name: str) -> Brain:
        made.append(brain(store, name))
        return made[-1]

    yield factory
    for each in made:
        await each.stop()


async def test_one_brain_takes_the_lease_and_leads_at_its_epoch(brains: Any) -> None:
    store = Store()
    first, second = brains(store, "a"), brains(store, "b")
    first.start()
    await eventually(first.leadership.leading.is_set)
    second.start()
    await eventually(lambda: second.lease.announced >= 3)

    assert first.tenure.calls == [("catch_up",), ("begin", 1), ("take_over", 1, 7)]
    assert not second.leadership.leading.is_set() and second.tenure.calls == []


async def test_a_leader_whose_lease_is_taken_steps_down_and_another_takes_over(
    brains: Any,
) -> None:
    store = Store()
    first = brains(store, "a")
    first.start()
    await eventually(first.leadership.leading.is_set)
    second = brains(store, "b")
    second.start()

    # The lease expired, its holder cut off from it (and so unable to take it back).
    store.holder, first.lease.cut_off = None, True
    await eventually(second.leadership.leading.is_set)
    await eventually(lambda: not first.leadership.leading.is_set())

    assert first.tenure.calls[-2:] == [("end", "the lease was lost"), ("follow",)]
    epoch = second.tenure.calls[1][1]
    assert isinstance(epoch, int) and epoch > 1


async def test_a_lost_lease_is_a_warning_and_a_planned_step_down_is_not(
    brains: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="brain.leadership")
    store = Store()
    first = brains(store, "a")
    first.start()
    await eventually(first.leadership.leading.is_set)
    store.holder, first.lease.cut_off = None, True
    await eventually(lambda: not first.leadership.leading.is_set())
    second = brains(store, "b")
    second.start()
    await eventually(second.leadership.leading.is_set)
    await second.leadership.stop_leading("brain shutting down", planned=True)

    said = {
        r.getMessage().rsplit(": ", 1)[1]: r.levelno
        for r in caplog.records
        if "stops leading" in r.getMessage()
    }
    assert said == {"the lease was lost": logging.WARNING, "brain shutting down": logging.INFO}


async def test_a_lease_lost_while_taking_over_ends_the_tenure_before_its_duties(
    brains: Any,
) -> None:
    store = Store()
    first = brains(store, "a")
    lost = [False]

    def lose_once() -> None:
        if not lost[0]:  # the renewer gave the lease up meanwhile
            lost[0] = True
            first.lease.epoch = None

    first.tenure.on_begin = lose_once
    first.start()
    await eventually(lambda: ("end", "the lease was lost while taking over") in first.tenure.calls)

    assert first.tenure.calls[:4] == [
        ("catch_up",),
        ("begin", 1),
        ("end", "the lease was lost while taking over"),
        ("follow",),
    ]


async def test_a_takeover_that_fails_before_leading_lets_the_lease_go(brains: Any) -> None:
    store = Store()
    first = brains(store, "a")
    failures = [1]

    def fail_once() -> None:
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("subscribe failed")

    first.tenure.on_begin = fail_once
    first.start()
    # Released, then taken again on a later round: leading at the next epoch.
    await eventually(first.leadership.leading.is_set)
    assert first.tenure.calls == [
        ("catch_up",),
        ("begin", 1),
        ("catch_up",),
        ("begin", 2),
        ("take_over", 2, 7),
    ]


async def test_a_lease_unrenewed_past_its_ttl_is_given_up(brains: Any) -> None:
    store = Store()
    first = brains(store, "a")
    first.start()
    await eventually(first.leadership.leading.is_set)

    first.lease.renewals_fail = True
    await eventually(lambda: not first.leadership.leading.is_set())

    assert ("end", "could not renew the lease") in first.tenure.calls
    assert first.lease.epoch is None


async def test_stopping_a_brain_that_does_not_lead_ends_no_tenure(brains: Any) -> None:
    first = brains(Store(holder="someone else"), "a")
    first.start()
    await eventually(lambda: first.lease.announced >= 2)

    await first.leadership.stop_leading("nothing to stop")

    assert first.tenure.calls == []
