"""Job logs read over NATS: a request to the node that ran the attempt, and its answer.

An agent answers on `alnair.node.<node>.logs` for the attempts whose logs it holds
(agents/logserve.py), one bounded chunk at a time: a reader pages through a log by
offset, and follows a running attempt by asking again from where the last chunk ended.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, TypeAdapter

from schemas.base import Message

# The most one answer carries: well under NATS's 1 MiB message limit.
MAX_LOG_CHUNK: Final = 256 * 1024


class LogRequest(Message):
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    # Where to start, in bytes; negative: that many bytes before the end (a tail).
    offset: int = 0
    max_bytes: int = Field(default=64 * 1024, ge=1, le=MAX_LOG_CHUNK)


class LogChunk(Message):
    ok: Literal[True] = True
    node: str
    job_id: str
    attempt: int
    # The chunk covers [offset, next_offset) of a log `size` bytes long so far; ask
    # again from next_offset for more. Where the log's node dropped its oldest part
    # (`alnair agent --job-log-max`), a chunk from there begins with a line saying so,
    # then the kept part.
    offset: int
    next_offset: int
    size: int
    data: str
    # Whether the attempt still runs here (its log may grow).
    running: bool


class LogMissing(Message):
    ok: Literal[False] = False
    node: str
    error: str


LOG_RESULT: Final = TypeAdapter(LogChunk | LogMissing)
