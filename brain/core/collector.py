"""Pausing Python's cyclic garbage collector around work that allocates many
long-lived or acyclic objects (a decision cycle and the pass that applies its
decisions, loading the state log).

The collector is process-wide: a pause here pauses it for every thread and task. What
runs inside must create no reference cycles worth collecting, and should be bounded
(a pass, a load); what it made and freed by then is never walked, what it made and
kept is walked once, at the first collection after.
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
# short-lived messages (the brain). A young collection every 2,000 net allocations, a
# middle one every ten of those: each walks what was allocated since (a node joining
# makes about 60 tracked objects), so at 20,000 allocations, ten times this, the middle
# collections of a mass join walked 250,000-300,000 objects, 80-265 ms each (a gc
# callback in a 20,000-node flood). A full collection walks every tracked object of the
# state (about 0.7-1 s at 20,000 nodes): it is considered once per hundred middle
# collections, 2,000,000 net allocations (CPython's default: once per 70,000, which
# made one due every few seconds at 10,000 nodes). Telemetry does not count: it is
# kept where the collector does not track it (brain/telemetry.py, brain/profiles.py).
SERVICE_THRESHOLDS: Final = (2_000, 10, 100)


def tune_for_a_service() -> None:
    """Set `SERVICE_THRESHOLDS` for this process (the brain's, at its start)."""
    gc.set_threshold(*SERVICE_THRESHOLDS)
