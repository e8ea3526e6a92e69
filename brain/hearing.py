"""Whether this brain has been able to hear heartbeats: its ingest connection answers.

Heartbeats are core NATS: while the connection they arrive on is broken (its server cut
off, say) they are lost, and every node falls silent at once through no fault of its
own. The leader PINGs that connection every tick; until it has answered for a whole node
timeout since it last did not, silence proves nothing and no node is judged lost
(brain/liveness.py, `check_nodes`). Without this, a deaf brain would run elsewhere the
jobs of nodes whose agents, hearing NATS fine, never fenced them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from bus.client import Bus
from bus.ping import round_trip


class Hearing:
    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        # When the connection last failed to answer (or was down); -inf: never.
        self.deaf_at = -math.inf

    def deaf_within(self, window_s: float) -> bool:
        return self._monotonic() - self.deaf_at < window_s

    async def watch(self, bus: Bus, *, every_s: float, timeout_s: float = 1.0) -> None:
        while True:
            if not await round_trip(bus.nc, timeout_s):
                self.deaf_at = self._monotonic()
            await asyncio.sleep(every_s)
