"""What the API needs of the brain: a narrow port, so brain/api.py does not import
the service (brain/service.py `Brain` is the one implementation)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from brain.core import Policy, QueueQuota
from brain.history import FinishedQuery
from brain.inbox import WriteRequest
from brain.state import BrainState
from brain.telemetry import LatestTelemetry
from bus.client import Bus
from schemas.api import BrainInfo
from schemas.jobs import JobRecord
from schemas.profiles import JobProfile
from schemas.state import JobChanged
from schemas.telemetry import GpuShares, RunningJob


class HistoryReads(Protocol):
    """The history's queries the API makes (brain/history.py), off the brain's loop."""

    async def read_attempts(self, job_id: str) -> list[dict[str, Any]]: ...

    async def read_job_changes(
        self, job_id: str, limit: int
    ) -> tuple[list[tuple[int, JobChanged]], bool]: ...

    async def read_finished_ids(self, query: FinishedQuery) -> list[str]: ...

    async def read_last_jobs(self, job_ids: Iterable[str]) -> list[JobRecord]: ...


class ProfileReads(Protocol):
    """Jobs' utilisation profiles as they stand (brain/profiles.py)."""

    def job_profile(self, job_id: str) -> JobProfile | None: ...

    def live_profiles(self, job_ids: Iterable[str]) -> tuple[JobProfile, ...]: ...


class BrainsSeen(Protocol):
    """The brains announced in the lease bucket (brain/leader.py)."""

    async def brains(self, *, timeout_s: float = ...) -> list[BrainInfo]: ...


class BrainConfigView(Protocol):
    @property
    def policy(self) -> Policy: ...

    @property
    def queues(self) -> tuple[QueueQuota, ...]: ...

    @property
    def strict_queues(self) -> bool: ...


class BrainPort(Protocol):
    """Reads are of state as it stands (between the writer's units); writes go through
    `call`, handled by the writer in order and answered once stored."""

    bus: Bus
    epoch: int
    instance: str
    host: str
    started_at: float
    # The brain's clock (wall seconds): what its records' times are in.
    clock: Callable[[], float]

    @property
    def config(self) -> BrainConfigView: ...

    @property
    def history(self) -> HistoryReads: ...

    @property
    def lease(self) -> BrainsSeen: ...

    @property
    def profiles(self) -> ProfileReads: ...

    @property
    def state(self) -> BrainState: ...

    @property
    def telemetry(self) -> LatestTelemetry: ...

    @property
    def pid(self) -> int: ...

    def info(self) -> BrainInfo: ...

    async def settled(self) -> None:
        """Returns once no unit of work is under way: state then holds only what is
        stored. A read answers from state right after, without awaiting in between.
        Raises ApiError `unavailable` while state is ahead of the log (a group it did
        not take, until the brain reads it again)."""
        ...

    async def job_record(self, job_id: str) -> JobRecord | None: ...

    def last_seen_ago(self, node: str) -> float | None: ...

    def shares(self, node: str) -> tuple[GpuShares, ...]:
        """The node's shared GPUs, as its latest heartbeat said."""
        ...

    def processes(self, node: str) -> tuple[RunningJob, ...]:
        """What the node's latest heartbeat said runs there."""
        ...

    def commands_queued(self) -> int:
        """Commands whose records are stored that the command stream has not taken yet."""
        ...

    async def call(
        self, tenant: str, request: WriteRequest, *, operator: bool = False
    ) -> object: ...
