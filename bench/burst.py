"""Submission burst with the brain killed mid-way: counts and timings, not a test.

    .venv/bin/python bench/burst.py [--jobs 1000 5000] [--recovery restart failover]

Starts a nats-server, brains as real processes (`python -m cli brain`), and four
simulated 8-GPU agents in this process; submits N one-GPU jobs (each with its own
idempotency key, retrying through the outage), SIGKILLs the leading brain after a
third are acknowledged, then either starts a new brain (restart) or lets a standby
take over (failover). Prints a table and writes bench/results/burst-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.agent import Agent, AgentConfig  # noqa: E402
from agents.gpu import SimulatedGpus  # noqa: E402
from bus.client import Bus, ConnectOptions  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from tests.chaos_harness import (  # noqa: E402
    BrainProcess,
    burst,
    leading_brain,
    wait_all_finished,
)


async def leader_answers(bus: Bus, timeout_s: float = 60.0) -> float:
    from cli.client import call
    from schemas.api import STATUS_RESULT, StatusRequest

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(Exception):
            await call(bus, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=1)
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise RuntimeError("no brain answered")


async def run_one(jobs: int, recovery: str, work: Path) -> dict[str, object]:
    server = EmbeddedNats(data_dir=work / "nats")
    server.start()
    brains = [BrainProcess(server.url, work, 1)]
    if recovery == "failover":
        brains.append(BrainProcess(server.url, work, 2))
    agents: list[Agent] = []
    buses: list[Bus] = []
    try:
        for brain in brains:
            await brain.start()
        client = await Bus.connect(ConnectOptions(servers=(server.url,), name="bench"))
        buses.append(client)
        await leader_answers(client)
        for n in range(4):
            bus = await Bus.connect(ConnectOptions(servers=(server.url,), name=f"agent:n{n}"))
            buses.append(bus)
            agent = Agent(
                bus,
                AgentConfig(node=f"n{n}", data_dir=work / f"n{n}"),
                SimulatedGpus(f"n{n}", 8, "H100"),
            )
            await agent.start()
            agents.append(agent)
        third = asyncio.Event()
        acked_now = [0]

        def on_progress(acked: int) -> None:
            acked_now[0] = acked
            if acked >= jobs // 3:
                third.set()

        task = asyncio.ensure_future(burst(client, jobs, on_progress=on_progress, retry_for_s=120))
        waiting = asyncio.ensure_future(third.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not third.is_set():
            waiting.cancel()
            result = await task
            raise RuntimeError(
                f"the burst ended before a third was acknowledged ({len(result.acknowledged)} "
                f"of {jobs}; failures: {list(result.failed.values())[:3]}): nothing was killed"
            )
        # The leader, whichever brain won the lease: killing brains[0] when the other
        # leads kills a standby, and the burst never notices.
        victim = await leading_brain(client, brains)
        victim.kill()
        killed_at = [time.monotonic()]
        acked_at_kill = acked_now[0]
        if recovery == "restart":
            brains.append(BrainProcess(server.url, work, 3))
            await brains[-1].start()
        await leader_answers(client)
        takeover_s = time.monotonic() - killed_at[0]
        result = await wait_all_finished(client, await task, timeout_s=900)
        return {
            "jobs": jobs,
            "recovery": recovery,
            "acknowledged": len(result.acknowledged),
            "failed": len(result.failed),
            "lost": result.lost,
            "duplicated": result.duplicated,
            "unfinished": result.unfinished,
            "ack_s": round(result.ack_seconds, 1),
            "submit_rate_per_s": round(len(result.acknowledged) / result.ack_seconds, 1),
            "killed": f"brain-{victim.index} (leader) at {acked_at_kill} acknowledged",
            "api_back_after_kill_s": round(takeover_s, 2),
            "all_done_after_acks_s": round(result.finish_seconds, 1),
        }
    finally:
        for agent in agents:
            await agent.stop()
        for brain in brains:
            brain.kill()
        for bus in buses:
            await bus.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--recovery", nargs="+", default=["restart", "failover"])
    args = parser.parse_args()
    rows = []
    for jobs in args.jobs:
        for recovery in args.recovery:
            with tempfile.TemporaryDirectory() as work:
                rows.append(asyncio.run(run_one(jobs, recovery, Path(work))))
                print(json.dumps(rows[-1]), flush=True)
    keys = [
        "jobs",
        "recovery",
        "acknowledged",
        "lost",
        "duplicated",
        "unfinished",
        "submit_rate_per_s",
        "api_back_after_kill_s",
        "all_done_after_acks_s",
    ]
    print("\n" + "  ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print("  ".join(f"{row[k]!s:>14}" for k in keys))
    out = ROOT / "bench" / "results" / f"burst-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
