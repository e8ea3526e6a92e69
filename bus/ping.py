"""Whether a NATS server answers right now: one PING, its PONG within a timeout.

Used where silence must be told apart from deafness: an agent that fences its jobs when
its heartbeats stop reaching NATS (agents/fence.py), and a brain that judges no node lost
while its own heartbeat connection is not hearing (brain/hearing.py).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class _Pinger(Protocol):
    @property
    def is_connected(self) -> bool: ...

    async def _send_ping(self, future: asyncio.Future[bool] | None = None) -> None: ...


async def round_trip(nc: _Pinger, timeout_s: float) -> bool:
    """Whether the server answered a PING within `timeout_s`.

    Not `Client.flush(timeout)`: on a timeout it cancels the future it queued for the
    PONG, and a PONG arriving after a partition heals then meets a cancelled future,
    which ends nats-py's read loop without a reconnect (nats-py 2.16,
    `_process_pong`). The future here is left pending instead: a late PONG resolves it
    harmlessly, and a reconnect drops it.
    """
    if not nc.is_connected:
        return False
    pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    try:
        await nc._send_ping(pong)
    except Exception:  # any failure to send is "no contact"
        return False
    done, _ = await asyncio.wait({pong}, timeout=timeout_s)
    return bool(done)
