"""Every GPU of the cluster counted by what it is doing: the cluster at a glance.

`alnair status`, `/v1/status` and the dashboard's summary show it; at thousands of nodes
it is what an operator reads first (the node listing pages, and the dashboard draws only
the first nodes). Counting is one pass over the nodes (set operations on each node's
GPUs) and over READY nodes' latest samples: about 100 ms of CPU at 20,000 8-GPU nodes,
half of it reading the samples. So the live brain counts at most every CENSUS_TTL_S,
however many dashboards poll, in the background (a status request is answered with the
last count), and yields to its loop every CENSUS_CHUNK nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

from brain.state import BrainState
from brain.telemetry import LatestTelemetry
from schemas.api import UTILISATION_BUCKETS, GpuCensus
from schemas.jobs import JobState
from schemas.nodes import NodeRecord, NodeState

log = logging.getLogger(__name__)

# How long a census is shown again before it is counted anew.
CENSUS_TTL_S: Final = 5.0
# Nodes counted between two yields to the brain's loop (a few milliseconds).
CENSUS_CHUNK: Final = 2_000
# A utilisation's bucket, by its whole percent (100 % goes in the last bucket).
_BUCKET: Final = tuple(min(UTILISATION_BUCKETS - 1, pct // 10) for pct in range(101))
_NOTHING: Final[frozenset[int]] = frozenset()


class _Tally:
    """A census being counted, node by node."""

    def __init__(self, state: BrainState, telemetry: LatestTelemetry) -> None:
        self._state = state
        self._telemetry = telemetry
        self._held = state.allocated()
        self._shared: dict[str, set[int]] = {}
        for job in state.jobs_in(JobState.RUNNING):
            if job.spec.gpu_milli is not None:
                for grant in job.grants:
                    self._shared.setdefault(grant.node, set()).update(grant.gpus)
        self.busy = self.shared = self.free = self.drained = 0
        self.unavailable = self.unreported = 0
        self.utilisation = [0] * UTILISATION_BUCKETS
        self.nodes_by_state = dict.fromkeys((s.value for s in NodeState), 0)

    def add(self, nodes: Iterable[tuple[str, NodeRecord]]) -> None:
        state, held, shared, telemetry = self._state, self._held, self._shared, self._telemetry
        utilisation = self.utilisation
        for name, node in nodes:
            self.nodes_by_state[node.state] += 1
            count = len(node.gpus)
            if node.state is NodeState.LOST:
                self.unavailable += count
                continue
            if node.state is NodeState.DRAINED:
                self.drained += count
                continue
            schedulable = state.schedulable_set(node)
            shared_here = schedulable.intersection(shared.get(name, _NOTHING))
            taken = len(schedulable.intersection(held.get(name, _NOTHING)) - shared_here)
            self.drained += count - len(schedulable)
            self.shared += len(shared_here)
            self.busy += taken
            self.free += len(schedulable) - len(shared_here) - taken
            utils = telemetry.utilisations(name)
            if utils is None:
                self.unreported += count
                continue
            for util in utils:
                utilisation[_BUCKET[int(util)]] += 1
            self.unreported += max(0, count - len(utils))

    def census(self) -> GpuCensus:
        return GpuCensus(
            busy=self.busy,
            shared=self.shared,
            free=self.free,
            drained=self.drained,
            unavailable=self.unavailable,
            utilisation=tuple(self.utilisation),
            unreported=self.unreported,
            nodes_by_state=self.nodes_by_state,
        )


def gpu_census(state: BrainState, telemetry: LatestTelemetry) -> GpuCensus:
    """Each GPU in one of busy, shared, free, drained, unavailable; READY nodes' GPUs
    by their latest utilisation."""
    tally = _Tally(state, telemetry)
    tally.add(state.nodes.items())
    return tally.census()


class CensusCache:
    """The last census, counted anew in the background once it is CENSUS_TTL_S old:
    callers get the last one at once (only the very first waits for a count), so a
    count never adds to a request's latency; one count at a time, in chunks of
    CENSUS_CHUNK nodes with the loop let through between them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._census: GpuCensus | None = None
        self._at = 0.0
        self._counting: asyncio.Task[GpuCensus] | None = None

    async def get(self, state: BrainState, telemetry: LatestTelemetry) -> GpuCensus:
        stale = self._census is None or self._clock() - self._at >= CENSUS_TTL_S
        if stale and self._counting is None:
            self._counting = asyncio.ensure_future(self._count(state, telemetry))
            self._counting.add_done_callback(self._counted)
        if self._census is None:
            assert self._counting is not None
            return await asyncio.shield(self._counting)
        return self._census

    def _counted(self, task: asyncio.Task[GpuCensus]) -> None:
        self._counting = None
        if not task.cancelled() and task.exception() is not None:
            log.error("counting the GPUs failed", exc_info=task.exception())

    async def _count(self, state: BrainState, telemetry: LatestTelemetry) -> GpuCensus:
        at = self._clock()
        tally = _Tally(state, telemetry)
        nodes = list(state.nodes.items())  # the nodes may change while the loop runs
        for start in range(0, len(nodes), CENSUS_CHUNK):
            if start:
                await asyncio.sleep(0)
            tally.add(nodes[start : start + CENSUS_CHUNK])
        self._census, self._at = tally.census(), at
        return self._census
