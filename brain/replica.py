"""A brain's copy of the STATE log: snapshot, replay, follow.

Every brain, leader or standby, keeps a `BrainState` equal to the fold of the log: it
loads the latest snapshot (object store `alnair_snapshots`), replays the log after it,
and, while standing by, follows new entries as the leader appends them, so that taking
over needs only the last few. The sqlite history is filled from the same entries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import nats.js.errors

from brain.history import History
from brain.state import BrainState
from bus.client import Bus
from schemas import subjects
from schemas.base import decode, encode
from schemas.errors import InvalidMessage
from schemas.state import STATE_RECORD, BrainSnapshot, StateRecord

log = logging.getLogger(__name__)

SNAPSHOT_BUCKET: Final = "alnair_snapshots"
SNAPSHOT_NAME: Final = "brain-state"


class Replica:
    def __init__(self, bus: Bus, history: History) -> None:
        self.bus = bus
        self.history = history
        self.state = BrainState()
        self.snapshot_seq = 0
        self._follower: asyncio.Task[None] | None = None
        self._stop_following = asyncio.Event()

    async def load(self) -> None:
        """Start from the latest snapshot that fits the log, then replay the rest."""
        snapshot = await self._read_snapshot()
        log_end = await self.bus.last_seq(subjects.STREAM_STATE)
        if snapshot is not None and snapshot.last_seq <= log_end:
            self.state = BrainState.from_snapshot(snapshot)
            self.snapshot_seq = snapshot.last_seq
        elif snapshot is not None:
            log.warning(
                "snapshot at seq %d is ahead of the log (ends at %d): ignoring it",
                snapshot.last_seq,
                log_end,
            )
        # The history may be behind the snapshot (a new or lost sqlite file): fill it
        # from the log, folding into state only what the snapshot lacks.
        start = min(self.history.last_seq(), self.state.last_seq) + 1
        replayed = await self._replay(start)
        log.info(
            "state at seq %d: snapshot %d + %d entries replayed",
            self.state.last_seq,
            self.snapshot_seq,
            replayed,
        )

    async def catch_up(self) -> int:
        return await self._replay(self.state.last_seq + 1)

    async def _replay(self, start: int) -> int:
        count = 0
        async for item, seq, subject in self.bus.read(
            subjects.STREAM_STATE, STATE_RECORD, start_seq=start
        ):
            self._take(item, seq, subject)
            count += 1
        return count

    def _take(self, item: StateRecord | InvalidMessage, seq: int, subject: str) -> None:
        if isinstance(item, InvalidMessage):
            log.error("STATE entry %d on %s is unreadable: %s", seq, subject, item.reason)
            return
        if seq > self.history.last_seq_seen:
            try:
                self.history.record(item, seq)
            except Exception:
                log.exception("history write failed for seq %d", seq)
        if seq > self.state.last_seq:
            self.state.apply(item, seq)

    def follow(self) -> None:
        """Apply new entries as they are appended (while standing by)."""
        if self._follower is None or self._follower.done():
            self._stop_following = asyncio.Event()
            self._follower = asyncio.ensure_future(self._follow(self._stop_following))

    async def _follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self.bus.nc.is_closed:
            try:
                async for item, seq, subject in self.bus.read(
                    subjects.STREAM_STATE,
                    STATE_RECORD,
                    start_seq=self.state.last_seq + 1,
                    follow=True,
                    stop=stop,
                ):
                    self._take(item, seq, subject)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if stop.is_set():
                    return
                log.warning("following STATE failed (%r); resuming", error)
                await asyncio.sleep(1.0)

    async def stop_following(self) -> None:
        """Stop applying new entries; returns once the follower has let go.

        Cooperative: the follower notices the stop between fetches. Cancelling a
        task inside nats-py's fetch can take the fetch's whole lifetime to end.
        """
        follower, self._follower = self._follower, None
        if follower is None:
            return
        self._stop_following.set()
        done, _ = await asyncio.wait({follower}, timeout=5.0)
        if not done:
            follower.cancel()
            await asyncio.wait({follower}, timeout=1.0)

    async def _read_snapshot(self) -> BrainSnapshot | None:
        try:
            store = await self.bus.js.object_store(SNAPSHOT_BUCKET)
            result = await store.get(SNAPSHOT_NAME)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return None
        if not result.data:
            return None
        try:
            return decode(result.data, BrainSnapshot)
        except InvalidMessage as error:
            log.error("snapshot unreadable, replaying the whole log: %s", error.reason)
            return None

    async def write_snapshot(self, *, taken_at: float, epoch: int) -> int:
        """Store the fold as it is now; returns the sequence it covers."""
        snapshot = self.state.to_snapshot(taken_at=taken_at, epoch=epoch)
        data = encode(snapshot)
        try:
            store = await self.bus.js.object_store(SNAPSHOT_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            store = await self.bus.js.create_object_store(
                SNAPSHOT_BUCKET, replicas=self.bus.replicas
            )
        await store.put(SNAPSHOT_NAME, data)
        self.snapshot_seq = snapshot.last_seq
        log.info("snapshot at seq %d (%d bytes)", snapshot.last_seq, len(data))
        return snapshot.last_seq
