"""The GPU census (brain/census.py): every GPU counted once, by what it is doing, the
same whether counted at once or in chunks; a node's new record is seen; the live count
is kept for CENSUS_TTL_S and then counted anew while the last one is answered."""

from __future__ import annotations

import asyncio

from brain.census import CENSUS_CHUNK, CENSUS_TTL_S, CensusCache, gpu_census
from brain.state import BrainState
from brain.telemetry import LatestTelemetry
from schemas.nodes import DrainedGpu, NodeState
from schemas.telemetry import GpuSample, TelemetryBatch
from tests.statelog import START_TS, node_record


def cluster(nodes: int) -> BrainState:
    state = BrainState()
    for i in range(nodes):
        state.apply(node_record(f"n{i}", 8), i + 1)
    return state


def telemetry(state: BrainState, util: float, missing: str | None = None) -> LatestTelemetry:
    """Every node's batch at `util`, but `missing`'s."""

    def sample(index: int) -> GpuSample:
        return GpuSample(
            index=index, util_gpu_pct=util, util_mem_pct=0, mem_used_mib=0,
            mem_total_mib=81_559, power_w=0, temp_c=30, sm_clock_mhz=0, mem_clock_mhz=0,
        )  # fmt: skip

    return LatestTelemetry.of(
        {
            name: TelemetryBatch(node=name, ts=START_TS, samples=tuple(map(sample, range(8))))
            for name in state.nodes
            if name != missing
        }
    )


def replace(brain_state: BrainState, name: str, seq: int, **changes: object) -> None:
    """The node's record replaced by one with `changes`, as the log would replace it."""
    entry = node_record(name, 8)
    node = entry.node.model_copy(update=changes)
    brain_state.apply(entry.model_copy(update={"node": node}), seq)


async def test_counted_in_chunks_as_at_once() -> None:
    state = cluster(CENSUS_CHUNK + 500)
    seq = len(state.nodes)
    replace(state, "n3", seq + 1, drained_gpus=(DrainedGpu(index=2, reason="fan", at=START_TS),))
    replace(state, "n4", seq + 2, state=NodeState.LOST)
    replace(state, "n5", seq + 3, state=NodeState.DRAINED, drain_reason="rack work")
    samples = telemetry(state, 100.0, missing="n6")
    chunked = await CensusCache().get(state, samples)
    assert chunked == gpu_census(state, samples)
    gpus = 8 * len(state.nodes)
    assert chunked.unavailable == 8 and chunked.drained == 8 + 1
    assert chunked.free == gpus - 8 - 9 and chunked.busy == chunked.shared == 0
    assert chunked.nodes_by_state == {"READY": len(state.nodes) - 2, "LOST": 1, "DRAINED": 1}
    # 100 % is in the last bucket; READY nodes without a sample are not reported.
    ready = len(state.nodes) - 2
    assert chunked.utilisation == (0,) * 9 + (8 * (ready - 1),)
    assert chunked.unreported == 8


async def test_a_census_is_kept_for_its_ttl() -> None:
    now = [0.0]
    cache = CensusCache(clock=lambda: now[0])
    state = cluster(3)
    first = await cache.get(state, LatestTelemetry())
    replace(state, "n0", 4, drained_gpus=(DrainedGpu(index=0, reason="fan", at=START_TS),))
    assert await cache.get(state, LatestTelemetry()) is first
    # Stale: the last one is answered at once, and counted anew meanwhile.
    now[0] = CENSUS_TTL_S
    assert await cache.get(state, LatestTelemetry()) is first
    await asyncio.sleep(0)
    again = await cache.get(state, LatestTelemetry())
    assert (first.drained, again.drained) == (0, 1)
