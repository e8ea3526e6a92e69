"""Reading a job attempt's log from the node that holds it, over NATS (the client half
of agents/logserve.py), for `alnair logs` and the brain's `GET /v1/jobs/{id}/logs`.

Which node ran which attempt is the caller's business (the brain's history says); this
module asks that node and pages through the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats.errors

from bus.client import Bus
from schemas import subjects
from schemas.base import decode, encode
from schemas.errors import AlnairError
from schemas.logs import LOG_RESULT, LogChunk, LogMissing, LogRequest


class LogUnavailable(AlnairError):
    """The node that holds the log does not answer, or has no such log."""

    def __init__(self, node: str, reason: str, *, answered: bool = False) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason
        # The node answered, and has no such log (else it did not answer at all).
        self.answered = answered


async def read_chunk(
    bus: Bus, node: str, request: LogRequest, *, timeout_s: float = 5.0
) -> LogChunk:
    subject = subjects.node(node, "logs")
    try:
        msg = await bus.nc.request(subject, encode(request), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise LogUnavailable(
            node, f"node {node} does not answer for its logs (its agent is down or cut off)"
        ) from None
    except nats.errors.TimeoutError:
        raise LogUnavailable(node, f"node {node} did not answer within {timeout_s:g}s") from None
    answer = decode(msg.data, LOG_RESULT)
    if isinstance(answer, LogMissing):
        raise LogUnavailable(node, answer.error, answered=True)
    return answer


async def copy_log(
    bus: Bus,
    node: str,
    job_id: str,
    attempt: int,
    write: Callable[[str], object],
    *,
    follow: bool = False,
    poll_s: float = 0.5,
    chunk_bytes: int = 64 * 1024,
) -> int:
    """Write the whole log (and, with `follow`, what it grows by while the attempt
    runs); returns the bytes read."""
    offset = 0
    while True:
        chunk = await read_chunk(
            bus,
            node,
            LogRequest(job_id=job_id, attempt=attempt, offset=offset, max_bytes=chunk_bytes),
        )
        if chunk.data:
            write(chunk.data)
        offset = chunk.next_offset
        if offset < chunk.size:
            continue  # more already there
        if not (follow and chunk.running):
            return offset
        await asyncio.sleep(poll_s)


def attempt_nodes(
    attempts: list[tuple[int, str]], current: tuple[int, tuple[str, ...]], wanted: int | None
) -> tuple[int, tuple[str, ...]]:
    """The attempt to read (`wanted`, else the latest) and the nodes it ran on, from the
    brain's history rows (attempt, "n1,n2") and the job's current (attempt, nodes)."""
    attempt = wanted if wanted is not None else max([current[0], *(a for a, _ in attempts)])
    if attempt == current[0] and current[1]:
        return attempt, current[1]
    for number, nodes in attempts:
        if number == attempt and nodes:
            return attempt, tuple(n for n in nodes.split(",") if n)
    raise LogUnavailable("", f"attempt {attempt} never ran on any node", answered=True)
