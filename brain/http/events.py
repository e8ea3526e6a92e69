"""`/v1/events`: the STATE log as a stream, NDJSON or Server-Sent Events (Nomad's model).

Each client reads the log itself from a sequence (`since`, `tail`, or SSE's
`Last-Event-ID`), so a reconnecting client resumes exactly where it stopped and no
brain-side buffer can overflow. Lines are the ones `alnair events --json` prints:
`{"seq": ..., "subject": ..., <the record>}`. While nothing happens a heartbeat (`{}`
in NDJSON, a comment in SSE) keeps proxies from closing the connection and tells the
server when the client has gone.

A tenant sees node records and its own jobs' records; an operator sees everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from aiohttp import web

from brain.http.auth import Caller
from bus.client import Bus
from schemas import subjects
from schemas.errors import InvalidMessage
from schemas.jobs import JobRecord
from schemas.state import (
    STATE_RECORD,
    JobChanged,
    StateRecord,
    record_job_id,
    record_kind,
    record_kinds,
    record_node,
)

log = logging.getLogger(__name__)

EventFormat = Literal["ndjson", "sse"]
NDJSON: Final = "application/x-ndjson"
SSE: Final = "text/event-stream"
# Entries read ahead of a slow client at most; the reader then waits for it.
READ_AHEAD: Final = 1024


class BadEventQuery(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EventQuery:
    since: int | None = None
    tail: int | None = None
    follow: bool = True
    format: EventFormat = "ndjson"
    job: str | None = None
    node: str | None = None
    kinds: frozenset[str] = frozenset()

    def matches(self, record: StateRecord) -> bool:
        if self.job is not None and record_job_id(record) != self.job:
            return False
        if self.node is not None and record_node(record) != self.node:
            return False
        return not self.kinds or record_kind(record) in self.kinds


def parse_query(request: web.Request) -> EventQuery:
    """Query parameters (and SSE's `Last-Event-ID`) to a query; errors name the parameter."""
    query = request.query
    since = _int_param(query.get("since"), "since", minimum=1)
    last_event = _int_param(
        request.headers.get("Last-Event-ID") or None, "Last-Event-ID", minimum=0
    )
    if last_event is not None:
        # A browser reconnecting an EventSource: resume after the last entry it saw.
        since = last_event + 1
    wants_sse = query.get("format") == "sse" or (
        "format" not in query and SSE in request.headers.get("Accept", "")
    )
    if query.get("format") not in (None, "ndjson", "sse"):
        raise BadEventQuery(f"format must be ndjson or sse, not {query.get('format')!r}")
    follow = query.get("follow", "true")
    if follow not in ("true", "false"):
        raise BadEventQuery(f"follow must be true or false, not {follow!r}")
    kinds = frozenset(k for k in query.getall("kind", []) if k)
    unknown = sorted(kinds - set(record_kinds()))
    if unknown:
        raise BadEventQuery(f"no kind {unknown[0]!r}; the kinds are {', '.join(record_kinds())}")
    return EventQuery(
        since=since,
        tail=_int_param(query.get("tail"), "tail", minimum=0),
        follow=follow == "true",
        format="sse" if wants_sse else "ndjson",
        job=query.get("job") or None,
        node=query.get("node") or None,
        kinds=kinds,
    )


def _int_param(value: str | None, name: str, *, minimum: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise BadEventQuery(f"{name} must be an integer, not {value!r}") from None
    if number < minimum:
        raise BadEventQuery(f"{name} must be at least {minimum}, not {number}")
    return number


def visible(record: StateRecord, caller: Caller, jobs: Mapping[str, JobRecord]) -> bool:
    if caller.operator:
        return True
    if isinstance(record, JobChanged):
        return record.job.tenant == caller.tenant
    job_id = record_job_id(record)
    if job_id is None:
        return True  # about a node: every tenant sees the nodes
    job = jobs.get(job_id)
    return job is not None and job.tenant == caller.tenant


def render(record: StateRecord, seq: int, subject: str, fmt: EventFormat) -> bytes:
    body = json.dumps({"seq": seq, "subject": subject, **record.model_dump(mode="json")})
    if fmt == "sse":
        return f"id: {seq}\nevent: {record.kind}\ndata: {body}\n\n".encode()
    return (body + "\n").encode()


def heartbeat(fmt: EventFormat) -> bytes:
    return b": keepalive\n\n" if fmt == "sse" else b"{}\n"


@dataclass(frozen=True, slots=True)
class _End:
    error: Exception | None = None


Entry = tuple[StateRecord | InvalidMessage, int, str]


async def stream(
    request: web.Request,
    *,
    bus: Bus,
    caller: Caller,
    jobs: Callable[[], Mapping[str, JobRecord]],
    query: EventQuery,
    heartbeat_s: float,
) -> web.StreamResponse:
    start = query.since if query.since is not None else 1
    if query.tail is not None and query.since is None:
        start = max(1, await bus.last_seq(subjects.STREAM_STATE) - query.tail + 1)
    response = web.StreamResponse(
        headers={
            "Content-Type": SSE if query.format == "sse" else NDJSON,
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: do not hold the stream back
        }
    )
    await response.prepare(request)
    if query.format == "sse":
        await response.write(b"retry: 2000\n\n")
    entries: asyncio.Queue[Entry | _End] = asyncio.Queue(maxsize=READ_AHEAD)
    reader = asyncio.ensure_future(_read(bus, start, query.follow, entries))
    try:
        while True:
            try:
                entry = await asyncio.wait_for(entries.get(), timeout=heartbeat_s)
            except TimeoutError:
                await response.write(heartbeat(query.format))
                continue
            if isinstance(entry, _End):
                break
            item, seq, subject = entry
            if isinstance(item, InvalidMessage):
                log.error("STATE entry %d on %s is unreadable: %s", seq, subject, item.reason)
                continue
            if query.matches(item) and visible(item, caller, jobs()):
                await response.write(render(item, seq, subject, query.format))
    except (ConnectionResetError, ConnectionError):
        pass  # the client went away: nothing to tell it
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
    with contextlib.suppress(ConnectionResetError, ConnectionError):
        await response.write_eof()
    return response


async def _read(bus: Bus, start: int, follow: bool, entries: asyncio.Queue[Entry | _End]) -> None:
    try:
        async for entry in bus.read(
            subjects.STREAM_STATE, STATE_RECORD, start_seq=start, follow=follow
        ):
            await entries.put(entry)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        log.warning("event stream stopped reading the log: %r", error)
        await entries.put(_End(error))
    else:
        await entries.put(_End())
