"""Leadership among brains: a lease in a JetStream KV bucket.

The lease is the key `leader` in a bucket whose entries expire after `ttl_s`. A brain
takes it with create-if-absent and keeps it by compare-and-set on the revision every
third of the TTL; a leader that dies stops renewing, the entry expires, and a standby
creates it. The revision at which a brain took the lease is its **epoch**: revisions
only grow, so a newer leader always has a larger epoch, and agents refuse commands
from an older one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Final

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from bus.client import Bus
from schemas.api import BrainInfo

log = logging.getLogger(__name__)

LEASE_BUCKET: Final = "alnair_leader"
LEASE_KEY: Final = "leader"
BRAINS_BUCKET: Final = "alnair_brains"
# The brains read from the bucket are shown again for this long: `status` (asked every
# 2 s by each dashboard) then costs no round trip to the bucket.
BRAINS_FRESH_S: Final = 1.0


async def _bucket(bus: Bus, name: str, ttl_s: float) -> KeyValue:
    try:
        return await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return await bus.js.create_key_value(
            bucket=name, ttl=ttl_s, history=1, replicas=bus.replicas
        )


class Lease:
    def __init__(self, bus: Bus, *, ttl_s: float = 5.0) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self.revision: int | None = None
        self.epoch: int | None = None
        self._kv: KeyValue | None = None
        self._brains: KeyValue | None = None
        self._known: list[BrainInfo] = []
        self._known_at = -math.inf
        self._reading: asyncio.Future[None] | None = None

    async def open(self) -> None:
        self._kv = await _bucket(self.bus, LEASE_BUCKET, self.ttl_s)
        self._brains = await _bucket(self.bus, BRAINS_BUCKET, self.ttl_s * 3)

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "Lease.open() first"
        return self._kv

    async def try_acquire(self, info: BrainInfo) -> int | None:
        """Take the lease if nobody holds it; return the epoch, or None."""
        try:
            revision = await self.kv.create(LEASE_KEY, info.model_dump_json().encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        self.revision = self.epoch = int(revision)
        return self.epoch

    async def renew(self, info: BrainInfo) -> bool:
        """Keep the lease; False when it was lost (expired and taken, or deleted)."""
        if self.revision is None:
            return False
        try:
            self.revision = int(
                await self.kv.update(LEASE_KEY, info.model_dump_json().encode(), last=self.revision)
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            self.revision = self.epoch = None
            return False
        return True

    async def release(self) -> None:
        """Give the lease up at once, so a standby need not wait for it to expire."""
        if self.revision is not None:
            with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError, Exception):
                await self.kv.delete(LEASE_KEY, last=self.revision)
        self.revision = self.epoch = None

    async def announce(self, info: BrainInfo) -> None:
        """Say this brain is alive (leader or standby), for `alnair status`."""
        if self._brains is not None:
            await self._brains.put(info.brain_id, info.model_dump_json().encode())

    async def brains(self, *, timeout_s: float = 2.0) -> list[BrainInfo]:
        """Every brain announced within its TTL, as last read from the bucket: read again
        in the background once BRAINS_FRESH_S old, so that `status` (asked every 2 s by
        each dashboard) waits on no round trip; only the first call waits for a read.
        When the bucket does not answer in time (its stream leader moving to another
        server, say) the list read last stays: `alnair status` must answer while the
        cluster heals."""
        stale = time.monotonic() - self._known_at >= BRAINS_FRESH_S
        if stale and self._reading is None:
            self._reading = asyncio.ensure_future(self._read_again(timeout_s))
            self._reading.add_done_callback(self._read_done)
        if self._known_at == -math.inf and self._reading is not None:
            await asyncio.shield(self._reading)
        return list(self._known)

    async def _read_again(self, timeout_s: float) -> None:
        try:
            self._known = await asyncio.wait_for(self._read_brains(), timeout_s)
        except (TimeoutError, nats.errors.Error) as e:
            log.warning("brains bucket did not answer (%s); showing the last list read", e)
        self._known_at = time.monotonic()

    def _read_done(self, task: asyncio.Future[None]) -> None:
        self._reading = None
        if not task.cancelled() and task.exception() is not None:
            log.error("reading the brains bucket failed", exc_info=task.exception())

    async def _read_brains(self) -> list[BrainInfo]:
        # Keys from the stream's subject list, one bounded request; KeyValue.keys() runs
        # a watcher that waits without limit for a stream leader that may be gone.
        if self._brains is None:
            return []
        prefix = f"$KV.{BRAINS_BUCKET}."
        info = await self.bus.js.stream_info(f"KV_{BRAINS_BUCKET}", subjects_filter=f"{prefix}>")
        out = []
        for subject in sorted(info.state.subjects or {}):
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):  # deleted, or expired
                entry = await self._brains.get(subject.removeprefix(prefix))
                if entry.value:
                    out.append(BrainInfo.model_validate_json(entry.value))
        return out
