"""Each node's latest telemetry, packed (brain/telemetry.py): what goes in comes out, read
whole, per GPU or as utilisations alone, and the store holds nothing the cyclic garbage
collector tracks however many batches it keeps."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brain.ingest import NodeIngest
from brain.telemetry import LatestTelemetry
from schemas.base import InvalidMessage, decode
from schemas.telemetry import GpuSample, TelemetryBatch

gauge = st.floats(min_value=0, max_value=1e12, allow_nan=False)
samples = st.builds(
    GpuSample,
    index=st.integers(0, 255),
    util_gpu_pct=st.floats(0, 100),
    util_mem_pct=st.floats(0, 100),
    mem_used_mib=gauge,
    mem_total_mib=gauge,
    power_w=gauge,
    temp_c=st.floats(allow_nan=False, allow_infinity=False),
    sm_clock_mhz=gauge,
    mem_clock_mhz=gauge,
    ecc_dbe_total=st.none() | st.integers(0, 2**64 - 1),
)
batches = st.builds(
    TelemetryBatch,
    node=st.sampled_from(["n1", "gpu-node-7", "rack3_host12"]),
    ts=st.floats(0, 4e9),
    samples=st.lists(samples, max_size=16).map(tuple),
)


@given(st.lists(batches, min_size=1, max_size=6))
def test_the_latest_batch_of_each_node_comes_back_as_it_was_put(put: list[TelemetryBatch]) -> None:
    store = LatestTelemetry()
    latest: dict[str, TelemetryBatch] = {}
    for batch in put:
        store.put(batch)
        latest[batch.node] = batch
    assert dict(store) == latest
    assert sorted(store) == sorted(latest) and len(store) == len(latest)
    for node, batch in latest.items():
        assert store[node].model_dump() == batch.model_dump()
        assert store.utilisations(node) == [s.util_gpu_pct for s in batch.samples]
        readings = store.readings(node)
        assert readings is not None
        assert [(r.gpu, r.mem_used_mib, r.ecc_dbe_total) for r in readings] == [
            (s.index, s.mem_used_mib, s.ecc_dbe_total) for s in batch.samples
        ]
    assert store.utilisations("nowhere") is None and store.readings("nowhere") is None
    assert "nowhere" not in store and store.get("nowhere") is None


def test_a_copy_keeps_the_batches_of_when_it_was_taken() -> None:
    store = LatestTelemetry()
    store.put(TelemetryBatch(node="n1", ts=1.0, samples=()))
    copy = store.copy()
    store.put(TelemetryBatch(node="n1", ts=2.0, samples=()))
    store.put(TelemetryBatch(node="n2", ts=2.0, samples=()))
    assert copy["n1"].ts == 1.0 and "n2" not in copy
    assert store["n1"].ts == 2.0


def test_the_brain_keeps_no_object_the_garbage_collector_tracks_per_batch() -> None:
    """The point of packing: the ingest's latest batches must not feed the collector's
    youngest generation as they are replaced (see brain/telemetry.py's docstring)."""
    sample = GpuSample(
        index=0, util_gpu_pct=50, util_mem_pct=5, mem_used_mib=1_000, mem_total_mib=81_559,
        power_w=300, temp_c=50, sm_clock_mhz=1_400, mem_clock_mhz=1_600,
    )  # fmt: skip
    ingest = NodeIngest(node_timeout_s=5.0)
    gc.collect()
    before = len(gc.get_objects())
    for round_ in range(3):
        for i in range(2_000):
            batch = TelemetryBatch(node=f"n{i}", ts=float(round_), samples=(sample,) * 8)
            ingest.telemetry(batch)
    del batch
    gc.collect()
    # Nothing per node (with batches kept as decoded: 2 objects a node and more).
    assert len(gc.get_objects()) - before < 50
    assert len(ingest.latest_telemetry) == 2_000


def test_an_ecc_count_past_64_bits_is_refused_at_the_edge() -> None:
    raw = (
        b'{"node":"n1","ts":1.0,"samples":[{"index":0,"util_gpu_pct":1,"util_mem_pct":1,'
        b'"mem_used_mib":1,"mem_total_mib":1,"power_w":1,"temp_c":1,"sm_clock_mhz":1,'
        b'"mem_clock_mhz":1,"ecc_dbe_total":18446744073709551616}]}'
    )
    with pytest.raises(InvalidMessage, match="ecc_dbe_total"):
        decode(raw, TelemetryBatch)
    assert decode(raw.replace(b"551616", b"551615"), TelemetryBatch).samples[0].ecc_dbe_total
