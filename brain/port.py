"""What the API needs of the brain: a narrow port, so brain/api.py does not import
the service (brain/service.py `Brain` is the one implementation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from brain.core import Policy, QueueQuota
from brain.history import History
from brain.inbox import WriteRequest
from brain.leader import Lease
from brain.profiles import Profiler
from brain.state import BrainState
from brain.telemetry import LatestTelemetry
from bus.client import Bus
from schemas.api import BrainInfo
from schemas.jobs import JobRecord
from schemas.telemetry import GpuShares


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
    history: History
    lease: Lease
    profiles: Profiler
    epoch: int
    instance: str
    host: str
    started_at: float
    # The brain's clock (wall seconds): what its records' times are in.
    clock: Callable[[], float]

    @property
    def config(self) -> BrainConfigView: ...

    @property
    def state(self) -> BrainState: ...

    @property
    def telemetry(self) -> LatestTelemetry: ...

    @property
    def pid(self) -> int: ...

    def info(self) -> BrainInfo: ...

    async def job_record(self, job_id: str) -> JobRecord | None: ...

    def last_seen_ago(self, node: str) -> float | None: ...

    def shares(self, node: str) -> tuple[GpuShares, ...]:
        """The node's shared GPUs, as its latest heartbeat said."""
        ...

    async def call(
        self, tenant: str, request: WriteRequest, *, operator: bool = False
    ) -> object: ...
