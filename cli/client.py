"""The operator's side of the API: connect, ask the brain, turn refusals into errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pydantic import TypeAdapter

from bus.client import Bus, ConnectOptions
from schemas import subjects
from schemas.api import ErrorReply
from schemas.base import Message
from schemas.errors import ApiError

R = TypeVar("R")


async def open_bus(servers: Sequence[str], *, name: str, credentials: str | None) -> Bus:
    return await Bus.connect(
        ConnectOptions(
            servers=tuple(servers),
            name=name,
            credentials=credentials,
            # An operator command should fail fast, not wait for ever for a server.
            max_reconnect_attempts=3,
        )
    )


async def call(
    bus: Bus,
    tenant: str,
    verb: str,
    request: Message,
    reply: TypeAdapter[ErrorReply | R],
    *,
    timeout_s: float = 10.0,
) -> R:
    result = await bus.request(subjects.api(tenant, verb), request, reply, timeout_s=timeout_s)
    if isinstance(result, ErrorReply):
        raise ApiError(result.code, result.error)
    return result
