"""kill -9 of the brain during a burst of submissions: nothing acknowledged is lost,
nothing is duplicated, everything finishes — after a restart, and after a failover."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.chaos_harness import BrainProcess, burst, leading_brain, wait_all_finished
from tests.conftest import eventually

# Minutes of killed servers and brains: `-m "not slow"` leaves them out.
pytestmark = pytest.mark.slow

BURST = 1000


async def _leader_up(connect) -> None:
    from cli.client import call
    from schemas.api import STATUS_RESULT, StatusRequest

    probe = await connect("probe")

    async def answered() -> bool:
        try:
            await call(probe, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=2)
        except Exception:
            return False
        return True

    await eventually(answered, timeout_s=60, interval_s=0.3)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("recovery", ["restart", "failover"])
async def test_kill_brain_during_burst(
    recovery: str, nats_server, connect, agent_factory, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    brains = [BrainProcess(nats_server.url, home, 1)]
    if recovery == "failover":
        brains.append(BrainProcess(nats_server.url, home, 2))
    try:
        for brain in brains:
            await brain.start()
        await _leader_up(connect)
        for n in range(4):
            await agent_factory(f"n{n}", gpus=8)
        client = await connect("burst")
        third = asyncio.Event()

        def on_progress(acked: int) -> None:
            if acked >= BURST // 3:
                third.set()

        submitting = asyncio.ensure_future(burst(client, BURST, on_progress=on_progress))
        await third.wait()
        # The leader, not brains[0]: with two, either may have won the lease.
        (await leading_brain(client, brains)).kill()
        if recovery == "restart":
            await asyncio.sleep(0.5)
            brains.append(BrainProcess(nats_server.url, home, 3))
            await brains[-1].start()
        result = await submitting
        result = await wait_all_finished(client, result)
        print(
            f"\n{recovery}: submitted {result.submitted}, acknowledged "
            f"{len(result.acknowledged)}, failed {len(result.failed)}, lost {result.lost}, "
            f"duplicated {result.duplicated}, unfinished {result.unfinished}, "
            f"acks in {result.ack_seconds:.1f}s, all done {result.finish_seconds:.1f}s later"
        )
        assert not result.failed
        assert len(result.acknowledged) == BURST
        assert result.lost == 0
        assert result.duplicated == 0
        assert len(result.jobs) == BURST
        assert result.unfinished == 0
    finally:
        for brain in brains:
            brain.kill()
            if brain.process is not None:
                await brain.process.wait()
