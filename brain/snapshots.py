"""Brain snapshots of any size: chunks in the `SNAPSHOTS` stream, then a manifest.

This module owns the snapshot's format and where it is stored; it does not touch the
brain's state or the STATE log. A snapshot (`BrainSnapshot`) is the fold of the log up
to a sequence. Its body (zlib of JSON lines: the snapshot without its jobs, then the
jobs in slices) is cut into chunks under the bus's message bound and stored first; a
`SnapshotManifest` naming the chunks' stream sequences, the body's size and SHA-256 and
the log sequence it covers is stored last. A reader starts from the latest manifest, so
it never sees a half-written snapshot; a chunk that is gone, or a body that does not
match its manifest, is reported as `SnapshotUnreadable` and the caller replays the log.

Encoding and decoding are pure functions over an immutable `BrainSnapshot`; the brain
runs them in a thread, and they work in slices so that the event loop keeps its turn.
Two generations are kept: a reader that took the previous manifest while the next one
was being written still finds its chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import zlib
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
from pydantic import TypeAdapter

from bus.client import Bus
from schemas import subjects
from schemas.base import MAX_MESSAGE_BYTES, decode, encode
from schemas.errors import InvalidMessage, SnapshotUnreadable
from schemas.jobs import JobRecord
from schemas.state import SNAPSHOT_ENCODING, BrainSnapshot, SnapshotManifest

log = logging.getLogger(__name__)

# Under NATS' default 1 MiB payload, with room for headers.
CHUNK_BYTES: Final = 512 * 1024
MAX_CHUNK_BYTES: Final = MAX_MESSAGE_BYTES - 64 * 1024
# Jobs per JSON line: each line is one serialisation call, short enough that the loop
# thread gets the interpreter between two (about 2 ms each).
JOBS_PER_LINE: Final = 500
# A body that would decompress to more than this is refused, not read into memory.
MAX_SNAPSHOT_BYTES: Final = 16 * 1024**3
GENERATIONS_KEPT: Final = 2

_JOBS: Final[TypeAdapter[tuple[JobRecord, ...]]] = TypeAdapter(tuple[JobRecord, ...])


@dataclass(frozen=True, slots=True)
class EncodedSnapshot:
    """A snapshot's body, ready to store, and what its manifest will say of it."""

    body: bytes
    raw_size: int
    digest: str
    last_seq: int
    epoch: int
    taken_at: float
    jobs: int

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
        view = memoryview(self.body)
        return [bytes(view[i : i + chunk_bytes]) for i in range(0, len(self.body), chunk_bytes)]

    def manifest(self, chunk_seqs: tuple[int, ...]) -> SnapshotManifest:
        return SnapshotManifest(
            last_seq=self.last_seq,
            epoch=self.epoch,
            taken_at=self.taken_at,
            jobs=self.jobs,
            encoding=SNAPSHOT_ENCODING,
            size=len(self.body),
            raw_size=self.raw_size,
            digest=self.digest,
            chunks=chunk_seqs,
        )


def encode_snapshot(snapshot: BrainSnapshot) -> EncodedSnapshot:
    """The body of `snapshot`: zlib (level 1: JSON of job records shrinks ~25x at
    ~40 MB/s) of its header line and its jobs, JOBS_PER_LINE to a line."""
    compressor = zlib.compressobj(level=1)
    parts: list[bytes] = []
    raw_size = 0

    def line(data: bytes) -> None:
        nonlocal raw_size
        raw_size += len(data) + 1
        parts.append(compressor.compress(data + b"\n"))

    line(encode(snapshot.model_copy(update={"jobs": ()})))
    jobs = snapshot.jobs
    for start in range(0, len(jobs), JOBS_PER_LINE):
        line(_JOBS.dump_json(jobs[start : start + JOBS_PER_LINE]))
    parts.append(compressor.flush())
    body = b"".join(parts)
    return EncodedSnapshot(
        body=body,
        raw_size=raw_size,
        digest=hashlib.sha256(body).hexdigest(),
        last_seq=snapshot.last_seq,
        epoch=snapshot.epoch,
        taken_at=snapshot.taken_at,
        jobs=len(jobs),
    )


def decode_snapshot(manifest: SnapshotManifest, body: bytes) -> BrainSnapshot:
    """The snapshot a manifest and its joined chunks hold; SnapshotUnreadable saying
    what does not match otherwise."""

    def unreadable(reason: str) -> SnapshotUnreadable:
        return SnapshotUnreadable(reason, last_seq=manifest.last_seq)

    if len(body) != manifest.size:
        raise unreadable(f"body is {len(body)} bytes, its manifest says {manifest.size}")
    if hashlib.sha256(body).hexdigest() != manifest.digest:
        raise unreadable("body does not match its manifest's SHA-256 digest")
    if manifest.raw_size > MAX_SNAPSHOT_BYTES:
        raise unreadable(f"declares {manifest.raw_size} bytes, over {MAX_SNAPSHOT_BYTES}")
    try:
        raw = zlib.decompressobj().decompress(body, manifest.raw_size + 1)
    except zlib.error as error:
        raise unreadable(f"body is not zlib data: {error}") from None
    if len(raw) != manifest.raw_size:
        raise unreadable(f"body decompresses to {len(raw)} bytes, not {manifest.raw_size}")
    lines = raw.split(b"\n")
    if len(lines) < 2 or lines[-1]:
        raise unreadable("body does not end with a complete line")
    jobs: list[JobRecord] = []
    try:
        header = decode(lines[0], BrainSnapshot, max_bytes=manifest.raw_size)
        for data in lines[1:-1]:
            part: tuple[JobRecord, ...] = decode(data, _JOBS, max_bytes=manifest.raw_size)
            jobs.extend(part)
    except InvalidMessage as error:
        raise unreadable(f"invalid content: {error.reason}") from None
    if header.last_seq != manifest.last_seq or len(jobs) != manifest.jobs:
        raise unreadable(
            f"holds {len(jobs)} jobs at seq {header.last_seq}; its manifest says "
            f"{manifest.jobs} at seq {manifest.last_seq}"
        )
    return header.model_copy(update={"jobs": tuple(jobs)})


class SnapshotStore:
    """Snapshots in the `SNAPSHOTS` stream (created by the first write)."""

    def __init__(self, bus: Bus, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"snapshot chunk_bytes must be 1 to {MAX_CHUNK_BYTES}, not {chunk_bytes}"
            )
        self.bus = bus
        self.chunk_bytes = chunk_bytes

    async def write(self, encoded: EncodedSnapshot) -> SnapshotManifest:
        """Store the chunks, then the manifest; then drop generations before the last.
        The stream is the bus's (`Bus.ensure_streams`, which a leading brain runs)."""
        try:
            previous = await self.latest_manifest()
        except SnapshotUnreadable as error:
            # A manifest this brain cannot read (corrupt, or a newer format) must not
            # stop it from ever writing one: this snapshot replaces it.
            log.warning("writing a snapshot over an unreadable one: %s", error)
            previous = None
        # The same snapshot written twice (a retry) gets the same ids: stored once.
        write_id = f"snapshot-{encoded.last_seq}-{encoded.digest[:16]}"
        seqs: list[int] = []
        for index, chunk in enumerate(encoded.chunks(self.chunk_bytes)):
            ack = await self.bus.js.publish(
                subjects.SNAPSHOT_CHUNKS,
                chunk,
                stream=subjects.STREAM_SNAPSHOTS,
                headers={"Nats-Msg-Id": f"{write_id}-{index}"},
            )
            seqs.append(int(ack.seq))
        manifest = encoded.manifest(tuple(seqs))
        await self.bus.js.publish(
            subjects.SNAPSHOT_MANIFEST,
            encode(manifest),
            stream=subjects.STREAM_SNAPSHOTS,
            headers={"Nats-Msg-Id": f"{write_id}-manifest"},
        )
        if previous is not None and previous.chunks:
            await self.bus.js.purge_stream(
                subjects.STREAM_SNAPSHOTS,
                subject=subjects.SNAPSHOT_CHUNKS,
                seq=min(previous.chunks),
            )
        await self.bus.js.purge_stream(
            subjects.STREAM_SNAPSHOTS, subject=subjects.SNAPSHOT_MANIFEST, keep=GENERATIONS_KEPT
        )
        return manifest

    async def latest_manifest(self) -> SnapshotManifest | None:
        """The newest manifest; None if no snapshot was ever stored here."""
        found = await self._manifest()
        return None if found is None else found[1]

    async def _manifest(
        self, *, first_after: int | None = None
    ) -> tuple[int, SnapshotManifest] | None:
        """The newest manifest, or the first stored after stream seq `first_after` (the
        oldest kept, from 0), with its stream sequence; None if there is none."""
        try:
            if first_after is None:
                msg = await self.bus.js.get_msg(
                    subjects.STREAM_SNAPSHOTS, subject=subjects.SNAPSHOT_MANIFEST
                )
            else:
                msg = await self.bus.js.get_msg(
                    subjects.STREAM_SNAPSHOTS,
                    seq=first_after + 1,
                    subject=subjects.SNAPSHOT_MANIFEST,
                    next=True,
                )
        except nats.js.errors.NotFoundError:  # no stream, or no manifest in it
            return None
        try:
            return int(msg.seq or 0), decode(msg.data or b"", SnapshotManifest)
        except InvalidMessage as error:
            raise SnapshotUnreadable(f"its manifest is invalid: {error.reason}") from None

    async def read(self) -> BrainSnapshot | None:
        """The latest snapshot that can be used: the newest, else the generation before
        it (kept for this: the newest torn or damaged); None if there is none;
        SnapshotUnreadable, with the newest's reason, if neither can be used."""
        newest = await self._manifest()
        if newest is None:
            return None
        try:
            return await self._read(newest[1])
        except SnapshotUnreadable as error:
            unreadable = error
        with contextlib.suppress(SnapshotUnreadable):
            oldest = await self._manifest(first_after=0)
            if oldest is not None and oldest[0] < newest[0]:
                log.error(
                    "%s; reading the snapshot before it, at seq %d", unreadable, oldest[1].last_seq
                )
                return await self._read(oldest[1])
        raise unreadable

    async def _read(self, manifest: SnapshotManifest) -> BrainSnapshot:
        parts: list[bytes] = []
        for index, seq in enumerate(manifest.chunks):
            parts.append(await self._chunk(manifest, index, seq))
        return await asyncio.to_thread(decode_snapshot, manifest, b"".join(parts))

    async def _chunk(self, manifest: SnapshotManifest, index: int, seq: int) -> bytes:
        where = f"chunk {index + 1} of {len(manifest.chunks)} (stream seq {seq})"
        try:
            msg = await self.bus.js.get_msg(subjects.STREAM_SNAPSHOTS, seq=seq, direct=True)
        except nats.js.errors.NotFoundError:
            raise SnapshotUnreadable(f"{where} is gone", last_seq=manifest.last_seq) from None
        except (TimeoutError, nats.errors.Error) as error:
            raise SnapshotUnreadable(
                f"{where} could not be read: {error!r}", last_seq=manifest.last_seq
            ) from None
        if msg.subject != subjects.SNAPSHOT_CHUNKS:
            raise SnapshotUnreadable(
                f"{where} is a message on {msg.subject}", last_seq=manifest.last_seq
            )
        return msg.data or b""
