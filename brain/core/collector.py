"""Pausing Python's cyclic garbage collector around work that allocates many
long-lived or acyclic objects (a decision cycle, loading the state log).

The collector is process-wide: a pause here pauses it for every thread. What runs
inside must create no reference cycles worth collecting, and should be short.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
