"""Leadership: the brain's part that takes the lease, keeps it, and begins and ends its
tenures in the right order.

Every brain runs the election: while it does not lead, it tries to take the lease
(brain/leader.py) every tenth of its TTL and announces itself. Once it has the lease it
renews it every third of the TTL, from the moment it took it, however long taking over
lasts; a renewal refused, or none for a whole TTL, ends the tenure. Taking over reads
the log to its end, begins the tenure at the lease's epoch (the shell's subscriptions,
consumer and loops), marks the brain leading, and only then does the takeover's duties;
a lease lost meanwhile ends the tenure at once. Stepping down holds the election off
until the tenure's parts are let go, so a tenure begun meanwhile keeps its own. What a
tenure is made of is the shell's (`Tenure`, brain/service.py); this owns the order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from brain.writer import Clock
from schemas.api import BrainInfo

log = logging.getLogger(__name__)


class LeaderLease(Protocol):
    """brain.leader.Lease is one: `epoch` is the revision it was taken at, None when
    this brain does not hold it."""

    epoch: int | None
    revision: int | None

    async def try_acquire(self, info: BrainInfo) -> int | None: ...

    async def renew(self, info: BrainInfo) -> bool: ...

    async def release(self) -> None: ...

    async def announce(self, info: BrainInfo) -> None: ...


class Tenure(Protocol):
    """What the brain does as a tenure begins and ends (brain.service.Brain is one)."""

    def info(self) -> BrainInfo: ...

    async def catch_up(self) -> int:
        """Stop following the log and read it to its end (all of it again if state ran
        ahead of it): the entries read."""
        ...

    async def begin(self, epoch: int) -> None:
        """Act as the leader at `epoch`: subscriptions, the event consumer, the loops."""
        ...

    async def take_over(self, epoch: int, caught_up: int) -> None:
        """The takeover's duties, once leading: what a predecessor journaled and may not
        have sent."""
        ...

    async def end(self, reason: str, renewer: asyncio.Task[None] | None) -> None:
        """Let the tenure's parts go, with `renewer` (taken before the first await: a
        tenure begun meanwhile keeps its own), answer whoever waits `unavailable`, and
        drop what was staged."""
        ...

    def follow(self) -> None:
        """Follow the log as a standby (unless state must be read again first)."""
        ...


Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]


class Leadership:
    def __init__(
        self,
        lease: LeaderLease,
        tenure: Tenure,
        *,
        spawn: Spawn,
        ttl_s: float,
        monotonic: Clock,
        closing: Callable[[], bool],
    ) -> None:
        self._lease = lease
        self._tenure = tenure
        self._spawn = spawn
        self._ttl_s = ttl_s
        self._monotonic = monotonic
        self._closing = closing
        self.leading = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._taking_over = False
        self._stepping_down = False

    async def elect_forever(self) -> None:
        while not self._closing():
            try:
                idle = not (self._taking_over or self._stepping_down)
                if not self.leading.is_set() and idle:
                    epoch = await self._lease.try_acquire(self._tenure.info())
                    if epoch is not None:
                        # Renew from now on, however long taking over lasts.
                        self._renewer = self._spawn(self.renew_forever(), "lease")
                        self._taking_over = True
                        try:
                            await self.lead(epoch)
                        except Exception:
                            if not self.leading.is_set():
                                # Not leading after all: let the lease go, or nobody
                                # would lead while this brain's renewer kept it.
                                await self.let_lease_go()
                            raise
                        finally:
                            self._taking_over = False
                await self._lease.announce(self._tenure.info())
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("election round failed: %r", error)
            await asyncio.sleep(self._ttl_s / 10)

    async def renew_forever(self) -> None:
        renewed_at = self._monotonic()
        while self._lease.epoch is not None and not self._closing():
            await asyncio.sleep(self._ttl_s / 3)
            try:
                if not await self._lease.renew(self._tenure.info()):
                    await self.stop_leading("the lease was lost")
                    return
                renewed_at = self._monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("lease renewal failed: %r", error)
                if self._monotonic() - renewed_at > self._ttl_s:
                    # Unrenewed past its TTL the lease is surely gone: stop acting now.
                    self._lease.epoch = self._lease.revision = None
                    await self.stop_leading("could not renew the lease")
                    return

    async def let_lease_go(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()
        await self._lease.release()

    async def lead(self, epoch: int) -> None:
        caught_up = await self._tenure.catch_up()
        await self._tenure.begin(epoch)
        self.leading.set()
        if self._lease.epoch != epoch:
            # The renewer gave the lease up while this takeover waited on the bus.
            await self.stop_leading("the lease was lost while taking over")
            return
        await self._tenure.take_over(epoch, caught_up)

    async def stop_leading(self, reason: str, *, planned: bool = False) -> None:
        """Step down for `reason`; a `planned` step-down (the brain stopping) is no
        warning."""
        if not self.leading.is_set():
            if self._renewer is not None and self._renewer is not asyncio.current_task():
                self._renewer.cancel()
            self._renewer = None
            return
        level = logging.INFO if planned else logging.WARNING
        log.log(level, "brain %s stops leading: %s", self._tenure.info().brain_id, reason)
        self.leading.clear()
        # Take this tenure's parts before the first await, and hold the election off
        # until they are let go: otherwise a tenure begun meanwhile (the lease came
        # back) would have its own parts torn down and keep this one's loop at epoch 0.
        self._stepping_down = True
        renewer, self._renewer = self._renewer, None
        try:
            await self._tenure.end(reason, renewer)
        finally:
            self._stepping_down = False
        self._tenure.follow()
