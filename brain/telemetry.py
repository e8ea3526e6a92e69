"""Each node's latest telemetry, packed: one bytes object per node.

At 20,000 8-GPU nodes a batch arrives every 50 µs, and each replaces its node's last.
Kept as decoded, each batch is nine pydantic models and their dictionaries and field
sets, twenty objects the cyclic garbage collector tracks. Replacing one frees twenty
old objects as twenty new ones are made, so the collector's allocation count does not
move, and its youngest generation fills with every node's batch until some other
allocation trips a collection over all of them: pauses of 160-300 ms once every node
had joined a 20,000-node flood (a gc callback in the brain). A `bytes` is not tracked,
and holds a batch in about 0.8 KiB rather than 11.5 (bench/telemetry_memory.py).

Readers get what they read: a `GpuReading` per GPU (a named tuple of `GpuSample`'s
fields) for the metrics, the utilisations alone for the census, a `TelemetryBatch`
rebuilt for the API's node pages (`__getitem__`: the store is a read-only mapping of
node name to batch). Batches are validated at the edge before they are put here; a
value the packing cannot hold is refused by the schema (`GpuSample.ecc_dbe_total` is a
64-bit counter, as NVML's is).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import Final, NamedTuple

from schemas.telemetry import TelemetryBatch

# A batch: its time and how many samples follow.
_HEAD: Final = struct.Struct("<dH")
# A sample: the GPU's index, its eight gauges, then whether it has an ECC count and the
# count (a sample without one packs a zero).
_SAMPLE: Final = struct.Struct("<B8dBQ")
# Where a sample's utilisation is within it (right after the index).
_UTIL: Final = struct.Struct("<d")
_UTIL_AT: Final = 1


class GpuReading(NamedTuple):
    """One GPU of a node's latest batch: `GpuSample`'s fields, in a tuple (its index is
    `gpu`: a tuple has an `index` method)."""

    gpu: int
    util_gpu_pct: float
    util_mem_pct: float
    mem_used_mib: float
    mem_total_mib: float
    power_w: float
    temp_c: float
    sm_clock_mhz: float
    mem_clock_mhz: float
    ecc_dbe_total: int | None


# `GpuSample`'s fields, in `GpuReading`'s order.
_SAMPLE_FIELDS: Final = ("index", *GpuReading._fields[1:])


def pack(batch: TelemetryBatch) -> bytes:
    parts = [_HEAD.pack(batch.ts, len(batch.samples))]
    for s in batch.samples:
        ecc = s.ecc_dbe_total
        parts.append(
            _SAMPLE.pack(
                s.index,
                s.util_gpu_pct,
                s.util_mem_pct,
                s.mem_used_mib,
                s.mem_total_mib,
                s.power_w,
                s.temp_c,
                s.sm_clock_mhz,
                s.mem_clock_mhz,
                ecc is not None,
                ecc or 0,
            )
        )
    return b"".join(parts)


def readings(packed: bytes) -> tuple[float, tuple[GpuReading, ...]]:
    """A packed batch's time and its GPUs."""
    ts, _ = _HEAD.unpack_from(packed)
    gpus = tuple(
        GpuReading(gpu, util, mem_util, used, total, power, temp, sm, clock, ecc if has else None)
        for gpu, util, mem_util, used, total, power, temp, sm, clock, has, ecc in (
            _SAMPLE.iter_unpack(memoryview(packed)[_HEAD.size :])
        )
    )
    return ts, gpus


class LatestTelemetry(Mapping[str, TelemetryBatch]):
    """Node name -> its latest batch, held packed (see the module's docstring)."""

    def __init__(self, packed: dict[str, bytes] | None = None) -> None:
        self._packed: dict[str, bytes] = {} if packed is None else packed

    @classmethod
    def of(cls, batches: Mapping[str, TelemetryBatch]) -> LatestTelemetry:
        return cls({node: pack(batch) for node, batch in batches.items()})

    def put(self, batch: TelemetryBatch) -> None:
        self._packed[batch.node] = pack(batch)

    def copy(self) -> LatestTelemetry:
        """The batches as they are now (a copy of the mapping; the bytes are shared)."""
        return LatestTelemetry(dict(self._packed))

    def __getitem__(self, node: str) -> TelemetryBatch:
        ts, gpus = readings(self._packed[node])
        # Validated again rather than constructed: pydantic's validation of the whole
        # batch in one call is faster than `model_construct` of each sample.
        samples = [dict(zip(_SAMPLE_FIELDS, gpu, strict=True)) for gpu in gpus]
        return TelemetryBatch.model_validate({"node": node, "ts": ts, "samples": samples})

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)

    def __contains__(self, node: object) -> bool:
        return node in self._packed

    def readings(self, node: str) -> tuple[GpuReading, ...] | None:
        """The node's GPUs in its latest batch; None if it sent none."""
        packed = self._packed.get(node)
        return None if packed is None else readings(packed)[1]

    def utilisations(self, node: str) -> list[float] | None:
        """The node's GPUs' utilisation in its latest batch, without the rest."""
        packed = self._packed.get(node)
        if packed is None:
            return None
        _, count = _HEAD.unpack_from(packed)
        at, size = _HEAD.size + _UTIL_AT, _SAMPLE.size
        unpack = _UTIL.unpack_from
        return [unpack(packed, at + i * size)[0] for i in range(count)]
