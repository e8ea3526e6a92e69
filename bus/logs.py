"""Reading a job attempt's log from the node that holds it, over NATS (the client half
of agents/logserve.py), for `alnair logs` and the brain's `GET /v1/jobs/{id}/logs`.

Which node ran which attempt is the caller's business (the brain's history says); this
module asks that node and pages through the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus.client import Bus
from schemas import subjects
from schemas.errors import AlnairError, BrainUnavailable, BusDenied, BusTimeout
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
        answer = await bus.request(subject, request, LOG_RESULT, timeout_s=timeout_s)
    except BrainUnavailable:  # no responders, whoever was asked
        raise LogUnavailable(
            node, f"node {node} does not answer for its logs (its agent is down or cut off)"
        ) from None
    except BusTimeout:
        raise LogUnavailable(node, f"node {node} did not answer within {timeout_s:g}s") from None
    except BusDenied:
        # Said at once, not after the timeout: under --secure only the operator and the
        # brain ask nodes for logs; a tenant reads its jobs' through the brain.
        raise LogUnavailable(
            node,
            f"this identity may not ask node {node} for logs: read a job's log through the "
            "HTTP API (GET /v1/jobs/{id}/logs, with the tenant's token) or as the operator",
        ) from None
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
