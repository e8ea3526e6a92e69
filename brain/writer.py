"""What the brain's parts need of the writer: narrow protocols, so each part (the
scheduling pass, launches, submissions, liveness, attempts, the blacklist, resizes, the
reconciler) is tested without NATS.

`Brain` (brain/service.py) implements them all: a change staged here is applied to
state at once and stored at the end of the writer's unit (brain/journal.py); a command
goes out only after it. The parts read state (`Callable[[], BrainState]`, since a reload
replaces it) and never write it but through these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from schemas.commands import NodeCommand
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeRecord, NodeState
from schemas.state import BlacklistEntry, Cause

# Seconds: wall-clock time (`time.time`) or monotonic time, as each part says.
Clock = Callable[[], float]


class JobRecords(Protocol):
    async def job_changed(
        self, job: JobRecord, previous: JobState | None, cause: Cause
    ) -> None: ...


class NodeRecords(Protocol):
    async def node_changed(
        self, node: NodeRecord, previous: NodeState | None, cause: Cause
    ) -> None: ...


class BlacklistRecords(Protocol):
    async def blacklist_changed(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None: ...


class Stops(Protocol):
    """Stop a job's process on a node (sent after the unit's records are stored)."""

    async def stop(self, job_id: str, node: str, reason: str, attempt: int | None) -> None: ...

    async def stop_parts(
        self, job: JobRecord, reason: str, *, except_node: str | None = None
    ) -> None: ...


class NodeCommands(Protocol):
    """A command to a node, stamped with the leader's epoch."""

    @property
    def epoch(self) -> int: ...

    async def command(self, node: str, command: NodeCommand) -> None: ...


class Commands(NodeCommands, Stops, Protocol):
    """Every command to nodes: stops, launches (brain/launches.py) and the rest."""

    async def send_launches(self, job: JobRecord) -> None: ...
