"""Pausing Python's cyclic garbage collector around work that allocates many
long-lived or acyclic objects (a decision cycle, loading the state log).

The collector is process-wide: a pause here pauses it for every thread. What runs
inside must create no reference cycles worth collecting, and should be short.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Final


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside; left as it was found (on or off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# For a process that holds a large, long-lived state and takes in a stream of
# short-lived messages (the brain): collect the young generation every 20,000 net
# allocations, not CPython's 700. A full collection is considered once per ten of the
# middle generation's, and each walks every tracked object of the state; at the default
# threshold, the objects of each second's telemetry batches made one due every few
# seconds at 10,000 nodes (40-70 ms each at 1,000 nodes and 10,000 pending), and they
# were most of the API's p99 (`docs/architecture.md`). Young cycles are still collected
# within 20,000 allocations.
SERVICE_THRESHOLDS: Final = (20_000, 10, 10)


def tune_for_a_service() -> None:
    """Set `SERVICE_THRESHOLDS` for this process (the brain's, at its start)."""
    gc.set_threshold(*SERVICE_THRESHOLDS)
