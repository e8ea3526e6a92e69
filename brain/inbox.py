"""The brain's inbox: typed units of work that change state, handled in order.

Everything that may change state reaches the writer as one of these (brain/service.py
`Brain._handle` matches on the type): a heartbeat with news, a node event, a tick, or an
API call that writes. The inbox loop handles what is queued as one unit and commits its
records as one group (brain/journal.py); `done` resolves once that group is stored.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from brain.ingest import NodeNews
from schemas.api import (
    BlacklistRequest,
    CancelRequest,
    DrainRequest,
    ResizeRequest,
    ResumeRequest,
    SubmitRequest,
)
from schemas.events import NodeEvent

# The API requests that change state: each is handled by the writer, in order.
WriteRequest = (
    SubmitRequest | CancelRequest | ResizeRequest | DrainRequest | ResumeRequest | BlacklistRequest
)


@dataclass
class Item:
    # Resolves with the handler's result (or its error) once the item's group is stored;
    # None for items nobody waits on.
    done: asyncio.Future[object] | None = field(default=None, init=False, repr=False)


@dataclass
class HeartbeatNews(Item):
    """A heartbeat that changed something (ingest kept the rest out)."""

    news: NodeNews


@dataclass
class EventArrived(Item):
    event: NodeEvent


@dataclass
class Tick(Item):
    """Time passed: liveness, reconciliation, timeouts, snapshots."""


@dataclass
class ApiCall(Item):
    """A request that writes, from `tenant` (authenticated by its transport); an
    operator may act on every tenant's jobs."""

    tenant: str
    request: WriteRequest
    operator: bool = False
