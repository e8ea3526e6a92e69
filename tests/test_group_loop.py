"""The inbox loop (brain/inbox.py `GroupLoop`) without a server: what is queued is
handled as one unit, its callers answered only once the unit's commit is through, each
with its own result or error; a group the log did not take answers everyone
`unavailable`; a step-down mid-group answers the group in hand."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from brain.inbox import GroupLoop, Item
from schemas.errors import ApiError


@dataclass
class Work(Item):
    """An item whose handling returns `name`, or raises `fails`."""

    name: str
    fails: Exception | None = None


class Log:
    """Stands for the journal: what the units committed, in groups."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self.staged: list[str] = []
        self.refuses: Exception | None = None
        self.tainted = False
        self.hold: asyncio.Event | None = None
        self.handling = asyncio.Event()

    async def handle(self, item: Item) -> object:
        assert isinstance(item, Work)
        self.handling.set()
        if self.hold is not None:
            await self.hold.wait()
        if item.fails is not None:
            raise item.fails
        self.staged.append(item.name)
        return item.name.upper()

    @contextlib.asynccontextmanager
    async def unit(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            staged, self.staged = self.staged, []
            if self.refuses is not None:
                self.tainted = True
                raise self.refuses
            self.groups.append(staged)


def loop_for(log: Log, group_max: int = 256) -> GroupLoop:
    return GroupLoop(
        handle=log.handle, unit=log.unit, tainted=lambda: log.tainted, group_max=group_max
    )


async def test_what_is_queued_together_is_one_group_and_answered_once_committed() -> None:
    log = Log()
    loop = loop_for(log, group_max=3)
    calls = [asyncio.ensure_future(loop.submit(Work(name))) for name in "abcde"]
    await asyncio.sleep(0)  # all five queued before the loop first comes round
    running = asyncio.ensure_future(loop.run())
    assert await asyncio.gather(*calls) == ["A", "B", "C", "D", "E"]
    assert log.groups == [["a", "b", "c"], ["d", "e"]]
    await asyncio.sleep(0)
    assert loop.idle.is_set()  # waiting, with nothing queued
    running.cancel()


async def test_an_item_s_error_is_its_caller_s_alone() -> None:
    log = Log()
    loop = loop_for(log)
    refused = ApiError("invalid", "gpus: too many")
    futures = [
        asyncio.ensure_future(loop.submit(item))
        for item in (
            Work("a"),
            Work("b", fails=refused),
            Work("c", fails=RuntimeError("a bug")),
            Work("d"),
        )
    ]
    await loop.put(Work("nobody waits"))
    await asyncio.sleep(0)
    running = asyncio.ensure_future(loop.run())
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[0] == "A" and results[3] == "D"
    assert results[1] is refused
    assert isinstance(results[2], RuntimeError)
    assert log.groups == [["nobody waits", "a", "d"]]
    running.cancel()


async def test_a_group_the_log_did_not_take_acknowledges_nobody_and_ends_the_loop() -> None:
    log = Log()
    log.refuses = TimeoutError("no acknowledgement")
    loop = loop_for(log, group_max=2)
    futures = [asyncio.ensure_future(loop.submit(Work(name))) for name in "abc"]
    await asyncio.sleep(0)
    error = await loop.run()
    assert error is log.refuses
    for future in futures[:2]:
        with pytest.raises(ApiError) as answer:
            await future
        assert (answer.value.code, answer.value.message) == ("unavailable", "brain lost leadership")
    # The next group was never taken: the brain answers it as it steps down.
    assert not futures[2].done()
    loop.refuse_waiting("brain stepped down: the log did not take a group")
    with pytest.raises(ApiError, match="brain stepped down"):
        await futures[2]
    assert log.groups == []


async def test_an_item_failing_once_a_commit_within_its_unit_failed_fails_the_group() -> None:
    log = Log()
    loop = loop_for(log)
    futures = [
        asyncio.ensure_future(loop.submit(Work("a"))),
        asyncio.ensure_future(loop.submit(Work("b", fails=RuntimeError("append timed out")))),
    ]
    log.tainted = True  # as the journal is once a commit within the unit failed
    await asyncio.sleep(0)
    error = await loop.run()
    assert isinstance(error, RuntimeError)
    for future in futures:
        with pytest.raises(ApiError, match="brain lost leadership"):
            await future


async def test_a_step_down_mid_group_answers_the_group_in_hand() -> None:
    log = Log()
    log.hold = asyncio.Event()
    loop = loop_for(log)
    futures = [asyncio.ensure_future(loop.submit(Work(name))) for name in "ab"]
    await asyncio.sleep(0)
    running = asyncio.ensure_future(loop.run())
    await log.handling.wait()
    running.cancel()
    for future in futures:
        with pytest.raises(ApiError, match="brain stepped down mid-group"):
            await future
    with pytest.raises(asyncio.CancelledError):
        await running
