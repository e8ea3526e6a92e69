"""The GPU series of `/metrics` are written by the brain itself (brain/metrics.py,
`_gpu_chunks`), for speed: byte for byte what prometheus_client writes for the same
families, checked here against it, with values and labels that need care; and gzipped
a family at a time when the scraper asks."""

from __future__ import annotations

import gzip
import math
import multiprocessing
import os
import signal
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from brain.metrics import (
    _GPU_SERIES,
    GPU_LABELS,
    _exposition,
    _GpuView,
    _node_labels,
    _Renderer,
)
from brain.telemetry import LatestTelemetry
from schemas.nodes import NodeRecord, NodeState
from schemas.telemetry import GpuInfo, GpuSample, TelemetryBatch


def _shown(records: dict[str, NodeRecord]) -> dict[str, tuple[str, dict[int, tuple[str, str]]]]:
    shown = {name: _node_labels(record) for name, record in records.items()}
    return {name: labels for name, labels in shown.items() if labels is not None}


class _Reference(Collector):
    """The same series through prometheus_client's families, from the node records:
    the oracle."""

    def __init__(self, view: _GpuView, records: dict[str, NodeRecord]) -> None:
        self.view = view
        self.records = records

    def collect(self) -> Iterator[Metric]:
        view = self.view
        families = [GaugeMetricFamily(name, doc, labels=GPU_LABELS) for name, doc, _ in _GPU_SERIES]
        for name in sorted(view.telemetry):
            node = self.records.get(name)
            if node is None or node.state is NodeState.LOST:
                continue
            infos = {gpu.index: gpu for gpu in node.gpus}
            for r in view.telemetry.readings(name) or ():
                info = infos.get(r.gpu)
                labels = [
                    str(r.gpu),
                    info.uuid if info else "",
                    f"nvidia{r.gpu}",
                    info.model if info else "",
                    node.hostname,
                    name,
                    view.holders.get((name, r.gpu), ""),
                ]
                xid = view.last_xid.get((name, r.gpu), 0)
                for family, (_, _, value_of) in zip(families, _GPU_SERIES, strict=True):
                    value = value_of(r, xid)
                    if value is not None:
                        family.add_metric(labels, value)
        yield from families


def _reference(view: _GpuView, records: dict[str, NodeRecord]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Reference(view, records))
    return generate_latest(registry)


gauge = st.one_of(
    st.floats(min_value=0, max_value=1e15, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 81_559.0, 1e7, 12_345_678.0, 0.1, 1e-9, 99.99]),
)
texts = st.text(alphabet=st.sampled_from(list('ab-_ "\\\n\u00e9H100')), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["n1", "n2", "gpu-node-3", "zz"]),
            st.sampled_from(list(NodeState)),
            texts,
            st.lists(st.tuples(st.integers(0, 9), gauge, st.none() | st.integers(0, 2**64 - 1))),
            st.booleans(),
        ),
        max_size=4,
    ),
    st.floats(-50, 150) | st.sampled_from([math.inf, -math.inf, math.nan, -1e-7, 1e6]),
)
def test_the_gpu_series_are_prometheus_clients_bytes(
    nodes: list[tuple[str, NodeState, str, list[tuple[int, float, int | None]], bool]],
    temp: float,
) -> None:
    telemetry, records = {}, {}
    holders: dict[tuple[str, int], str] = {}
    last_xid: dict[tuple[str, int], int] = {}
    for name, state, text, gpus, known in nodes:
        samples = tuple(
            GpuSample(
                index=index,
                util_gpu_pct=min(value, 100.0),
                util_mem_pct=0.5,
                mem_used_mib=value,
                mem_total_mib=81_559.0,
                power_w=value,
                temp_c=temp,
                sm_clock_mhz=1_980.0,
                mem_clock_mhz=value,
                ecc_dbe_total=ecc,
            )
            for index, value, ecc in gpus
        )
        telemetry[name] = TelemetryBatch(node=name, ts=1.0, samples=samples)
        if known:
            records[name] = NodeRecord(
                name=name,
                state=state,
                hostname=f"host-{text}",
                backend="sim",
                instance="i",
                # Some GPUs reported are not in the inventory: their labels are empty.
                gpus=tuple(
                    GpuInfo(index=i, uuid=f"GPU-{text}-{i}", model=text, memory_mib=1)
                    for i in range(0, 10, 2)
                ),
                joined_at=1.0,
            )
        for index, _, ecc in gpus[:2]:
            holders[(name, index)] = f"job-{text}"
            last_xid[(name, index)] = 79 if ecc else 0
    view = _GpuView(
        telemetry=LatestTelemetry.of(telemetry),
        nodes=_shown(records),
        holders=holders,
        last_xid=last_xid,
    )
    assert _exposition(b"", view, gzip=False) == _reference(view, records)


def test_the_exposition_is_gzipped_a_family_at_a_time_when_asked() -> None:
    sample = GpuSample(
        index=0, util_gpu_pct=50, util_mem_pct=5, mem_used_mib=1_000, mem_total_mib=81_559,
        power_w=300, temp_c=50, sm_clock_mhz=1_400, mem_clock_mhz=1_600,
    )  # fmt: skip
    batches = {f"n{i}": TelemetryBatch(node=f"n{i}", ts=1.0, samples=(sample,)) for i in range(50)}
    records = {
        name: NodeRecord(
            name=name,
            state=NodeState.READY,
            hostname=name,
            backend="sim",
            instance="i",
            gpus=(GpuInfo(index=0, uuid=f"GPU-{name}", model="H100", memory_mib=1),),
            joined_at=1.0,
        )
        for name in batches
    }
    view = _GpuView(LatestTelemetry.of(batches), _shown(records), holders={}, last_xid={})
    scheduler = b"# HELP alnair_x x\n# TYPE alnair_x gauge\nalnair_x 1.0\n"
    plain = _exposition(scheduler, view, gzip=False)
    assert plain == scheduler + _reference(view, records)
    zipped = _exposition(scheduler, view, gzip=True)
    assert gzip.decompress(zipped) == plain and len(zipped) < len(plain) / 5


async def test_a_scrape_outlives_its_rendering_process() -> None:
    """The exposition is rendered in a process of its own; killed, that scrape is
    rendered in a thread and the next starts another process."""
    batches = {"n1": TelemetryBatch(node="n1", ts=1.0, samples=())}
    view = _GpuView(LatestTelemetry.of(batches), {}, holders={}, last_xid={})
    renderer = _Renderer()
    others = set(multiprocessing.active_children())
    try:
        first = await renderer.render(b"x 1.0\n", view, gzip=False)
        (process,) = set(multiprocessing.active_children()) - others
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
        assert await renderer.render(b"x 1.0\n", view, gzip=False) == first
        assert await renderer.render(b"x 1.0\n", view, gzip=False) == first
        (again,) = set(multiprocessing.active_children()) - others
        assert again.pid != process.pid
    finally:
        renderer.close()
