"""Hypothesis fuzz of the API: whatever arrives on `alnair.api.<tenant>.<verb>`, the
brain answers with a well-formed reply, and goes on serving."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brain.service import Brain, BrainConfig
from bus.client import Bus, ConnectOptions
from bus.server import EmbeddedNats
from schemas.api import API_VERBS

ERROR_CODES = {"invalid", "not_found", "conflict", "unavailable", "forbidden", "unauthorized"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
spec_fields = st.sampled_from(
    [
        "name",
        "command",
        "gpus",
        "queue",
        "priority",
        "env",
        "cwd",
        "elastic",
        "min_gpus",
        "max_gpus",
    ]
)
near_valid = st.fixed_dictionaries(
    {
        "v": st.sampled_from([1, 1, 2, "1"]),
        "spec": st.dictionaries(spec_fields, json_values, max_size=6),
        "job_id": st.text(max_size=8),
    }
).map(lambda d: json.dumps(d).encode())
payloads = st.one_of(
    st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()), near_valid
)
verbs = st.one_of(st.sampled_from([*API_VERBS, "history", "blacklist"]), st.text(max_size=6))


class LiveBrain:
    """A real brain on a real nats-server, on a loop in a thread of its own, so that
    hypothesis can drive it from plain synchronous examples."""

    def __init__(self, home: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = EmbeddedNats(data_dir=home / "nats")
        self.home = home

    def run(self, coro: Any, timeout_s: float = 30.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    def start(self) -> None:
        self.server.start()
        self.thread.start()

        async def up() -> None:
            options = ConnectOptions(servers=(self.server.url,), name="brain")
            self.brain = Brain(
                await Bus.connect(options),
                BrainConfig(lease_ttl_s=2.0, tick_s=0.2, history_path=self.home / "h.db"),
            )
            await self.brain.start()
            await asyncio.wait_for(self.brain.leading.wait(), timeout=30)
            self.client = await Bus.connect(
                ConnectOptions(servers=(self.server.url,), name="fuzzer")
            )

        self.run(up(), timeout_s=60)

    def stop(self) -> None:
        async def down() -> None:
            await self.brain.stop()
            await self.brain.bus.close()
            await self.client.close()

        self.run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()
        self.server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveBrain]:
    live = LiveBrain(tmp_path_factory.mktemp("fuzz"))
    live.start()
    try:
        yield live
    finally:
        live.stop()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(verb=verbs, payload=payloads)
def test_any_request_gets_a_well_formed_answer(live: LiveBrain, verb: str, payload: bytes) -> None:
    token = "".join(c for c in verb if c.isalnum()) or "x"
    reply = live.run(live.client.nc.request(f"alnair.api.fuzz.{token}", payload, timeout=10))
    answer = json.loads(reply.data)
    assert answer["v"] == 1
    if answer["ok"] is False:
        assert answer["code"] in ERROR_CODES, answer
        assert answer["error"]


def test_still_serving_after_the_fuzz(live: LiveBrain) -> None:
    reply = live.run(live.client.nc.request("alnair.api.fuzz.status", b'{"v": 1}', timeout=10))
    assert json.loads(reply.data)["ok"] is True
