"""A brain's copy of the STATE log: snapshot, replay, follow, compact.

Every brain, leader or standby, keeps a `BrainState` equal to the fold of the log: it
loads the latest snapshot (brain/snapshots.py; else one left by an older version in the
object store `alnair_snapshots`), replays the log after it, and, while standing by,
follows new entries as the leader appends them, so that taking over needs only the last
few. The sqlite history is filled from the same entries.

The log is compacted behind snapshots: once a snapshot is stored, the brain that wrote it
purges the entries before the snapshot it knew of before (a generation that brains still
read), keeping at least the latest `keep_entries`. A read that begins later than it asked
(`LogCompacted`) has fallen behind that: a standby, or a leader taking over, loads the
latest snapshot again; a brain that has no readable snapshot to start from cannot build
its state, and says so rather than lead with a partial one. A history filled from a
compacted log holds every entry from the first the log still had (`History.begin_at`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Final

import nats.errors
import nats.js.errors

from brain.core.collector import collector_paused
from brain.history import History
from brain.snapshots import MAX_SNAPSHOT_BYTES, SnapshotStore, encode_snapshot
from brain.state import BrainState
from bus.client import Bus
from schemas import subjects
from schemas.base import decode
from schemas.errors import AlnairError, InvalidMessage, SnapshotUnreadable
from schemas.state import STATE_RECORD, BrainSnapshot, StateRecord

log = logging.getLogger(__name__)

# Where brains before brain/snapshots.py kept one snapshot as one object: still read
# when no newer snapshot exists, never written.
LEGACY_SNAPSHOT_BUCKET: Final = "alnair_snapshots"
LEGACY_SNAPSHOT_NAME: Final = "brain-state"
LEGACY_READ_TIMEOUT_S: Final = 60.0
# Log entries written to the sqlite history in one transaction while replaying.
HISTORY_BATCH: Final = 512
# After a failed snapshot, the next is not tried for this long (each costs the encoding).
SNAPSHOT_RETRY_S: Final = 30.0
# The latest entries a compaction always keeps (`Replica.keep_entries`): about 1.2 KB
# each, about 6 to a job.
LOG_KEEP_ENTRIES: Final = 1_000_000


class LogCompacted(AlnairError, RuntimeError):
    """A read of the STATE log began later than it asked: the entries before were
    compacted behind snapshots."""

    def __init__(self, wanted: int, first: int, last_seq: int) -> None:
        super().__init__(
            f"the STATE log begins at seq {first} (the entries before were compacted behind "
            f"snapshots), and this brain's state (at seq {last_seq}) needs them from seq "
            f"{wanted}: it must start from a snapshot that covers them"
        )


def snapshot_due(entries_since: int, jobs: int, every: int) -> bool:
    """Is a snapshot due, `entries_since` log entries after the last, with `jobs` jobs to
    hold? After `every` entries, or as many as the jobs if that is more: encoding a job
    costs about 9 us, and at 10,000 pending and 64 submitting clients a snapshot every
    1,000 entries was one every 0.7 s of 11,000-26,000 jobs, 100-230 ms each, a fifth
    of a core spent in a thread that the loop then waited on for the GIL. So a snapshot
    costs at most about one job encoded per entry appended, and a restart replays at
    most `max(every, jobs)` entries."""
    return entries_since >= max(every, jobs)


class Replica:
    def __init__(
        self, bus: Bus, history: History, *, keep_entries: int | None = LOG_KEEP_ENTRIES
    ) -> None:
        """`keep_entries`: compact the log behind snapshots, keeping at least this many
        of the latest entries; None: never compact."""
        if keep_entries is not None and keep_entries < 1:
            raise ValueError(f"keep_entries must be at least 1, not {keep_entries}")
        self.bus = bus
        self.history = history
        self.keep_entries = keep_entries
        self.state = BrainState()
        self.snapshots = SnapshotStore(bus)
        # The sequence the latest snapshot read or written covers, and how many log
        # entries `load` replayed (into state or history) after the one it read.
        self.snapshot_seq = 0
        self.replayed_at_load = 0
        self._writing: asyncio.Task[None] | None = None
        self._retry_snapshot_at = 0.0
        self._follower: asyncio.Task[None] | None = None
        self._stop_following = asyncio.Event()

    async def load(self) -> None:
        """Start from the latest snapshot that fits the log, then replay the rest."""
        began = time.monotonic()
        # Loading creates millions of objects that live on (a snapshot's, a replay's
        # records): the cyclic collector would scan them again and again (more than half
        # of decoding a snapshot of 50,000 jobs), then in every full collection for the
        # brain's lifetime. They hold no cycles; reference counts free what is dropped.
        with collector_paused():
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
            del snapshot
            loaded = time.monotonic()
            # The history may be behind the snapshot (a new or lost sqlite file): fill it
            # from the log, folding into state only what the snapshot lacks.
            start = min(self.history.rewind(), self.state.last_seq) + 1
            replayed = await self._replay(start)
            gc.freeze()
        self.replayed_at_load = replayed
        log.info(
            "state at seq %d: snapshot %d (read in %.2f s) + %d entries replayed (in %.2f s)",
            self.state.last_seq,
            self.snapshot_seq,
            loaded - began,
            replayed,
            time.monotonic() - loaded,
        )

    async def reload(self) -> None:
        """Forget state and load it from the latest snapshot and the log again (after
        state ran ahead of the log: a group the leader applied was not stored)."""
        self.state = BrainState()
        self.snapshot_seq = 0
        await self.load()

    async def catch_up(self) -> int:
        """Replay what state lacks, and what the history lacks (a group whose write
        failed: `History.last_seq`), from the earlier of the two. A history that cannot
        be read is left as it is: it is a projection, and a takeover does not wait on it."""
        try:
            written = self.history.rewind()
        except Exception:
            log.exception("reading the history failed; what it lacks is not written now")
            written = self.state.last_seq
        try:
            return await self._replay(min(written, self.state.last_seq) + 1)
        except LogCompacted as error:
            log.warning("%s; loading the latest snapshot", error)
            await self.reload()
            return self.replayed_at_load

    async def _replay(self, start: int) -> int:
        count = 0
        history: list[tuple[StateRecord, int]] = []
        async for item, seq, subject in self._read(start):
            self._take(item, seq, subject, history=history)
            count += 1
            if len(history) >= HISTORY_BATCH:
                self._write_history(history)
        self._write_history(history)
        return count

    async def _read(
        self, start: int, *, follow: bool = False, stop: asyncio.Event | None = None
    ) -> AsyncIterator[tuple[StateRecord | InvalidMessage, int, str]]:
        """The log's entries from `start` on (`Bus.read`). Where the first comes later,
        the log was compacted past `start`: the history holds what it can from there
        on (`History.begin_at`), and state, if it lacked any entry skipped, cannot be
        rebuilt from the log (`LogCompacted`, before anything is folded in)."""
        first = True
        async for item, seq, subject in self.bus.read(
            subjects.STREAM_STATE, STATE_RECORD, start_seq=start, follow=follow, stop=stop
        ):
            if first and seq > start:
                if seq > self.state.last_seq + 1:
                    raise LogCompacted(self.state.last_seq + 1, seq, self.state.last_seq)
                if seq > self.history.last_seq_seen + 1:
                    log.warning(
                        "the history lacks seq %d to %d, which the log no longer holds "
                        "(compacted behind snapshots): it holds every entry from %d on",
                        self.history.last_seq_seen + 1,
                        seq - 1,
                        seq,
                    )
                    self.history.begin_at(seq)
            first = False
            yield item, seq, subject

    def _take(
        self,
        item: StateRecord | InvalidMessage,
        seq: int,
        subject: str,
        *,
        history: list[tuple[StateRecord, int]] | None = None,
    ) -> None:
        """Fold one entry; its history row is written now, or added to `history` for
        the caller to write with others."""
        if isinstance(item, InvalidMessage):
            log.error("STATE entry %d on %s is unreadable: %s", seq, subject, item.reason)
            return
        if seq > self.history.last_seq_seen:
            if history is None:
                self._write_history([(item, seq)])
            else:
                history.append((item, seq))
        if seq > self.state.last_seq:
            self.state.apply(item, seq)

    def _write_history(self, entries: list[tuple[StateRecord, int]]) -> None:
        if not entries:
            return
        try:
            self.history.record_many(entries)
        except Exception:
            log.exception("history write failed for seq %d to %d", entries[0][1], entries[-1][1])
        entries.clear()

    def follow(self) -> None:
        """Apply new entries as they are appended (while standing by)."""
        if self._follower is None or self._follower.done():
            self._stop_following = asyncio.Event()
            self._follower = asyncio.ensure_future(self._follow(self._stop_following))

    async def _follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self.bus.nc.is_closed:
            try:
                async for item, seq, subject in self._read(
                    self.state.last_seq + 1, follow=True, stop=stop
                ):
                    self._take(item, seq, subject)
            except asyncio.CancelledError:
                raise
            except LogCompacted as error:
                # Fell behind a compaction (cut off for long, say): start again from the
                # snapshot that covers what was compacted.
                log.warning("%s; loading the latest snapshot", error)
                try:
                    await self.reload()
                except Exception as reload_error:
                    log.error("loading the latest snapshot failed (%r); retrying", reload_error)
                    await asyncio.sleep(1.0)
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
            snapshot = await self.snapshots.read()
        except SnapshotUnreadable as error:
            log.error("snapshot unreadable, replaying the whole log: %s", error)
            return None
        return snapshot if snapshot is not None else await self._read_legacy_snapshot()

    async def _read_legacy_snapshot(self) -> BrainSnapshot | None:
        try:
            store = await self.bus.js.object_store(LEGACY_SNAPSHOT_BUCKET)
            result = await asyncio.wait_for(
                store.get(LEGACY_SNAPSHOT_NAME), timeout=LEGACY_READ_TIMEOUT_S
            )
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.ObjectNotFoundError):
            return None
        except (TimeoutError, nats.errors.Error) as error:
            log.error("old-format snapshot unreadable, replaying the whole log: %r", error)
            return None
        if not result.data:
            return None
        try:
            # Stored as one object, so not bound by the bus's message size.
            return decode(result.data, BrainSnapshot, max_bytes=MAX_SNAPSHOT_BYTES)
        except InvalidMessage as error:
            log.error("snapshot unreadable, replaying the whole log: %s", error.reason)
            return None

    async def write_snapshot(self, *, taken_at: float, epoch: int) -> int:
        """Store the fold as it is now; returns the sequence it covers.

        The snapshot is taken at once (an immutable copy); encoding it runs in a thread.
        """
        return await self._store(self.state.to_snapshot(taken_at=taken_at, epoch=epoch))

    async def _store(self, snapshot: BrainSnapshot) -> int:
        encoded = await asyncio.to_thread(encode_snapshot, snapshot)
        manifest = await self.snapshots.write(encoded)
        before, self.snapshot_seq = self.snapshot_seq, max(self.snapshot_seq, snapshot.last_seq)
        log.info(
            "snapshot at seq %d: %d jobs, %d bytes (%d raw) in %d chunks",
            manifest.last_seq,
            manifest.jobs,
            manifest.size,
            manifest.raw_size,
            len(manifest.chunks),
        )
        await self._compact(before, snapshot.last_seq)
        return snapshot.last_seq

    async def _compact(self, before: int, covered: int) -> None:
        """Purge the log's entries up to `before` (the snapshot this brain knew of
        before the one just stored at `covered`), keeping the latest `keep_entries`:
        a brain that cannot read the newest snapshot (torn by a crash, say) starts from
        the one before, which every generation kept (brain/snapshots.py) covers. A
        purge that fails is logged; the next snapshot tries again."""
        if self.keep_entries is None or before < 1:
            return
        keep_from = min(before + 1, covered + 1 - self.keep_entries)
        if keep_from <= 1:
            return
        try:
            await self.bus.js.purge_stream(subjects.STREAM_STATE, seq=keep_from)
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("compacting the log before seq %d failed (%r)", keep_from, error)
            return
        log.info("log compacted: entries before seq %d purged", keep_from)

    def write_snapshot_soon(self, *, taken_at: float, epoch: int) -> bool:
        """Take a snapshot of the fold now and store it in the background, unless one is
        being stored already; True if one was started. A failure is logged, and a call
        SNAPSHOT_RETRY_S later tries again.

        The caller has every record applied to the fold stored (the writer, just after a
        commit). The copy is taken here, not when the task first runs: by then the writer
        may have applied records the log has not stored yet (and may never store, if the
        append fails), and a snapshot covering them would make a brain that loads it
        skip the records the log holds at those sequences."""
        if self._writing is not None and not self._writing.done():
            return False
        if time.monotonic() < self._retry_snapshot_at:
            return False
        snapshot = self.state.to_snapshot(taken_at=taken_at, epoch=epoch)

        async def write() -> None:
            try:
                await self._store(snapshot)
            except asyncio.CancelledError:
                raise
            except Exception:
                self._retry_snapshot_at = time.monotonic() + SNAPSHOT_RETRY_S
                log.exception(
                    "snapshot failed; replay stays longer until the next one (in %g s)",
                    SNAPSHOT_RETRY_S,
                )

        self._writing = self.bus.spawn(write(), name="snapshot")
        return True

    async def snapshot_written(self) -> None:
        """Wait for the snapshot being stored, if any."""
        if self._writing is not None:
            await asyncio.wait({self._writing})
