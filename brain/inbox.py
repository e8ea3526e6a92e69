"""The brain's inbox: typed units of work that change state, handled in order.

Everything that may change state reaches the writer as one of these (brain/service.py
`Brain._handle` matches on the type): a heartbeat with news, a node event, a tick, or an
API call that writes. The inbox loop (`GroupLoop`) handles what is queued as one unit and
commits its records as one group (brain/journal.py); `done` resolves once that group is
stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Final

from brain.ingest import NodeNews
from schemas.api import (
    BlacklistRequest,
    CancelRequest,
    DrainRequest,
    ResizeRequest,
    ResumeRequest,
    SubmitRequest,
    ThrottleRequest,
)
from schemas.errors import ApiError
from schemas.events import NodeEvent

log = logging.getLogger(__name__)

# The API requests that change state: each is handled by the writer, in order.
WriteRequest = (
    SubmitRequest
    | CancelRequest
    | ResizeRequest
    | DrainRequest
    | ResumeRequest
    | BlacklistRequest
    | ThrottleRequest
)


@dataclass
class Item:
    # Resolves with the handler's result (or its error) once the item's group is stored;
    # None for items nobody waits on.
    done: asyncio.Future[object] | None = field(default=None, init=False, repr=False)


@dataclass
class HeartbeatNews(Item):
    """A heartbeat that changed something (ingest kept the rest out)."""

    news: NodeNews


@dataclass
class EventArrived(Item):
    event: NodeEvent


@dataclass
class Tick(Item):
    """Time passed: liveness, reconciliation, timeouts, snapshots."""


@dataclass
class ApiCall(Item):
    """A request that writes, from `tenant` (authenticated by its transport); an
    operator may act on every tenant's jobs."""

    tenant: str
    request: WriteRequest
    operator: bool = False


# Inbox items handled as one unit, their records stored as one group: enough to carry
# a burst of submissions in a few round trips, few enough that the first caller in a
# group is not kept waiting long for the last.
GROUP_MAX: Final = 256


class GroupLoop:
    """The inbox and the loop that empties it in groups: what is queued when the loop
    comes round (up to `group_max` items) is handled as one unit (`unit`: the writer's,
    whose exit commits what the items staged as one group), and only then is each
    caller answered, with its own result or error. A group the log did not take
    answers every one of its callers `unavailable` and ends the loop.

    The brain (brain/service.py) gives it `handle` (an item's work), `unit` and
    `tainted` (its journal's: a commit within the unit failed, so the item's error is
    the group's); it is tested without a server (tests/test_group_loop.py)."""

    def __init__(
        self,
        *,
        handle: Callable[[Item], Awaitable[object]],
        unit: Callable[[], AbstractAsyncContextManager[None]],
        tainted: Callable[[], bool],
        after_group: Callable[[], None] = lambda: None,
        group_max: int = GROUP_MAX,
    ) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        # Set while the loop waits for an item with none queued.
        self.idle = asyncio.Event()
        self._handle = handle
        self._unit = unit
        self._tainted = tainted
        self._after_group = after_group
        self._group_max = group_max

    async def put(self, item: Item) -> None:
        """Queue an item nobody waits on."""
        await self.queue.put(item)

    async def submit(self, item: Item) -> object:
        """Queue an item and wait for its result, once its group is stored."""
        item.done = asyncio.get_running_loop().create_future()
        await self.queue.put(item)
        return await item.done

    def refuse_waiting(self, reason: str) -> None:
        """Take every queued item off, answering its caller `unavailable`."""
        waiting: list[Item] = []
        while not self.queue.empty():
            waiting.append(self.queue.get_nowait())
        refuse(waiting, reason)

    async def run(self) -> Exception:
        """Handle groups until one is not stored: returns what its commit failed with
        (a cancellation, when leadership ends mid-group, answers the group's callers
        and goes on as one)."""
        queue = self.queue
        while True:
            if queue.empty():
                self.idle.set()
            batch = [await queue.get()]
            self.idle.clear()
            while len(batch) < self._group_max and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                async with self._unit():
                    outcomes = [await self._outcome(item) for item in batch]
            except asyncio.CancelledError:
                # Leadership ended mid-group (the brain cancels this loop): the group is
                # discarded, and its callers, off the queue already, hear so now.
                refuse(batch, "brain stepped down mid-group")
                raise
            except Exception as error:
                # The group was not stored (or not known to be): nobody is acknowledged.
                refuse(batch, "brain lost leadership")
                return error
            for item, (result, failure) in zip(batch, outcomes, strict=True):
                if item.done is None or item.done.done():
                    continue
                if failure is None:
                    item.done.set_result(result)
                else:
                    item.done.set_exception(failure)
            self._after_group()

    async def _outcome(self, item: Item) -> tuple[object, BaseException | None]:
        """Handle one item of a group: its result, or what it failed with."""
        try:
            return await self._handle(item), None
        except ApiError as error:
            return None, error
        except Exception as error:
            if self._tainted():
                raise  # a commit within the unit failed: the whole group is lost
            log.exception("brain failed handling %s", type(item).__name__)
            return None, error


def refuse(items: Iterable[Item], reason: str) -> None:
    """Answer every caller of these items still waiting: unavailable, for `reason`
    (its records, if any, were not stored, or not known to be: a retry with the same
    idempotency key finds out which)."""
    for item in items:
        if item.done is not None and not item.done.done():
            item.done.set_exception(ApiError("unavailable", reason))
