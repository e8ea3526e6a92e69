"""The policy core's own view of the cluster: a frozen snapshot in, decisions out.

These types are deliberately not the wire schemas: the live brain builds a snapshot
from its records, the simulator builds one from a trace, and neither leaks into the
other. Everything here is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Grant:
    """GPUs of one node given to a job."""

    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    # GPUs the scheduler may use (healthy, not drained), and those of them not allocated.
    gpus: tuple[int, ...]
    free: frozenset[int]
    # Locality group: nodes under one switch (or rack) talk faster to each other.
    switch: str = "default"


@dataclass(frozen=True, slots=True)
class JobView:
    job_id: str
    gpus: int
    submitted_at: float
    queue: str = "default"
    priority: int = 0
    # Set for running jobs.
    grants: tuple[Grant, ...] = ()
    started_at: float | None = None
    # The reason the job currently waits, as last recorded; lets the shell skip
    # recording an unchanged reason.
    waiting_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    nodes: tuple[NodeView, ...]
    pending: tuple[JobView, ...]
    running: tuple[JobView, ...] = ()


@dataclass(frozen=True, slots=True)
class Place:
    """Start a pending job on these GPUs (a gang: every grant or none)."""

    job_id: str
    grants: tuple[Grant, ...]
    cause: str


@dataclass(frozen=True, slots=True)
class Wait:
    """The job stays pending; `reason` tells its owner why."""

    job_id: str
    reason: str


Action = Place | Wait


@dataclass(frozen=True, slots=True)
class Decisions:
    actions: tuple[Action, ...] = field(default=())

    @property
    def placements(self) -> tuple[Place, ...]:
        return tuple(a for a in self.actions if isinstance(a, Place))

    @property
    def waits(self) -> tuple[Wait, ...]:
        return tuple(a for a in self.actions if isinstance(a, Wait))
