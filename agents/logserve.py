"""An agent serves its jobs' logs over NATS, so `alnair logs` works from any host.

It answers `alnair.node.<node>.logs` requests (schemas/logs.py) from the per-attempt
log files the launcher writes (`<data_dir>/logs/<job>/attempt-<n>.log`), one chunk of
at most `MAX_LOG_CHUNK` bytes per request, and no faster than `bytes_per_s` over all
readers together: answers wait their turn, so a reader paging through a large log
cannot crowd out the agent's heartbeats. It reads files and nothing else.

A log over its node's cap has lost its oldest part (agents/joblogs.py): a chunk asked
from there begins with a line saying how much was dropped, then the kept part.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from agents.joblogs import data_start, dropped_note
from bus.client import Bus
from schemas import subjects
from schemas.base import check_name, decode, encode
from schemas.errors import InvalidMessage, InvalidName
from schemas.logs import LogChunk, LogMissing, LogRequest

DEFAULT_BYTES_PER_S: Final = 4 * 1024 * 1024


def _utf8_prefix(data: bytes) -> tuple[str, int]:
    """The longest prefix that ends on a character boundary, decoded, and its length
    in bytes: a character split between two chunks comes whole in the second."""
    for cut in range(min(4, len(data))):
        with contextlib.suppress(UnicodeDecodeError):
            return data[: len(data) - cut].decode("utf-8"), len(data) - cut
    return data.decode("utf-8", "replace"), len(data)


class LogServer:
    def __init__(
        self,
        node: str,
        log_dir: Path,
        running: Callable[[str, int], bool],
        *,
        bytes_per_s: float = DEFAULT_BYTES_PER_S,
        monotonic: Callable[[], float] = time.monotonic,
        keep_days: float | None = None,
        max_total: int | None = None,
    ) -> None:
        """`keep_days`: how long the agent keeps a log after its attempt, and
        `max_total` what they may hold together (said to a reader who asks for one
        that is not there)."""
        self.node = node
        kept = [] if keep_days is None else [f"logs are kept {keep_days:g} days"]
        if max_total is not None:
            kept.append(f"the oldest are removed once all hold over {max_total >> 20} MiB")
        self._kept = f" ({'; '.join(kept)})" if kept else ""
        self.log_dir = log_dir
        self._running = running
        self.bytes_per_s = bytes_per_s
        self._monotonic = monotonic
        # Bytes that may go out now (a token bucket holding one chunk at most).
        self._allowance = float(bytes_per_s)
        self._refilled_at = monotonic()
        self._subscription: Subscription | None = None

    async def serve(self, bus: Bus) -> None:
        self._subscription = await bus.nc.subscribe(
            subjects.node(self.node, "logs"), cb=self._on_request
        )

    async def close(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
            self._subscription = None

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        answer = self.read_request(msg.data)
        if isinstance(answer, LogChunk):
            # What goes out, not the offsets it spans (a dropped part spans gigabytes).
            await self._wait_for_allowance(len(answer.data.encode()))
        with contextlib.suppress(Exception):  # the reader gave up: nothing to do
            await msg.respond(encode(answer))

    async def _wait_for_allowance(self, size: int) -> None:
        now = self._monotonic()
        cap = max(self.bytes_per_s, float(size))
        self._allowance = min(cap, self._allowance + (now - self._refilled_at) * self.bytes_per_s)
        self._refilled_at = now
        self._allowance -= size
        if self._allowance < 0:
            await asyncio.sleep(-self._allowance / self.bytes_per_s)

    def read_request(self, data: bytes) -> LogChunk | LogMissing:
        try:
            request = decode(data, LogRequest)
        except InvalidMessage as error:
            return LogMissing(node=self.node, error=f"invalid log request: {error.reason}")
        return self.read(request)

    def path(self, job_id: str, attempt: int) -> Path | None:
        """Where the attempt's log is, if the job id names a file under the log dir."""
        try:
            check_name("job", job_id)
        except InvalidName:
            return None
        path = self.log_dir / job_id / f"attempt-{attempt}.log"
        return path if path.resolve().is_relative_to(self.log_dir.resolve()) else None

    def read(self, request: LogRequest) -> LogChunk | LogMissing:
        path = self.path(request.job_id, request.attempt)
        where = f"job {request.job_id} attempt {request.attempt}"
        if path is None:
            return LogMissing(node=self.node, error=f"invalid job id {request.job_id!r}")
        try:
            with path.open("rb") as log:
                size = os.fstat(log.fileno()).st_size
                start = max(0, size + request.offset) if request.offset < 0 else request.offset
                start = min(start, size)
                # Past the part of a capped log its node dropped (agents/joblogs.py).
                kept = data_start(log.fileno(), start)
                log.seek(kept)
                raw = log.read(min(request.max_bytes, size - kept))
        except FileNotFoundError:
            return LogMissing(
                node=self.node, error=f"no log of {where} on node {self.node}{self._kept}"
            )
        except OSError as error:
            return LogMissing(node=self.node, error=f"cannot read the log of {where}: {error}")
        if kept > start:
            # The kept part begins at a block, in a line: from the next whole one.
            cut = raw.find(b"\n") + 1
            if 0 < cut < len(raw):
                raw, kept = raw[cut:], kept + cut
        text, used = _utf8_prefix(raw)
        if kept > start:
            text = dropped_note(kept, self.node) + text
        return LogChunk(
            node=self.node,
            job_id=request.job_id,
            attempt=request.attempt,
            offset=start,
            next_offset=kept + used,
            size=size,
            data=text,
            running=self._running(request.job_id, request.attempt),
        )
