"""The cluster key (brain/secrets.py) on a real nats-server: read or made once, and
asked for again while JetStream cannot answer (a bucket's stream electing its leader,
a server restarting), within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from brain import secrets
from bus.client import Bus
from bus.server import EmbeddedNats


async def test_the_key_is_made_once_and_read_after(
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    first, second = await connect("brain-1"), await connect("brain-2")
    key = await secrets.exec_key(first)
    assert len(key) == 32
    assert await secrets.exec_key(second) == key


async def test_the_key_is_asked_for_again_while_jetstream_does_not_answer(
    connect: Callable[[str], Awaitable[Bus]], nats_server: EmbeddedNats
) -> None:
    bus = await connect("brain")
    key = await secrets.exec_key(bus)
    nats_server.stop()
    # Within its bound it waits out the restart, and reads the key that was made.
    asking = asyncio.create_task(secrets.exec_key(bus, retry_for_s=30.0))
    await asyncio.sleep(1.5)
    assert not asking.done()
    await nats_server.restart()
    assert await asking == key
    # Past its bound it gives up with what JetStream last answered.
    nats_server.stop()
    with pytest.raises(secrets.NOT_ANSWERING):
        await secrets.exec_key(bus, retry_for_s=1.0)
    await nats_server.restart()
