"""Node-loss failover: from a lost node's last heartbeat to its job running elsewhere.

Starts an embedded nats-server, a brain and two simulated agents (real processes for
the job), runs a one-GPU job on n1, then cuts n1 off at once (`Agent.crash`: no more
heartbeats, the job left running) and measures, per trial, the time from n1's last
heartbeat to the job's start on n2 (its `JobStarted` reaching the brain). The target at
1 Hz heartbeats is at most 5 s plus the fence margin; it is the node timeout plus the
fence margin (the brain waits for the node's agent to have fenced the job: see
docs/operations.md, "Partitions") plus the first retry's back-off plus a launch.

    .venv/bin/python bench/failover_node_loss.py [--trials 5] [--heartbeat-s 1]
        [--missed 3] [--fence-margin-s 5] [--backoff-s 0.5]

Not a test: nothing here asserts; it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agents.agent import Agent, AgentConfig  # noqa: E402
from agents.gpu import SimulatedGpus  # noqa: E402
from brain.core.failures import FailurePolicy  # noqa: E402
from brain.service import Brain, BrainConfig  # noqa: E402
from bus.client import Bus, ConnectOptions  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas.api import JobReply, SubmitRequest  # noqa: E402
from schemas.jobs import JobSpec, JobState  # noqa: E402


async def _until(condition: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not get there in time")
        await asyncio.sleep(0.01)


async def trial(url: str, home: Path, args: argparse.Namespace, index: int) -> float:
    async def bus(name: str) -> Bus:
        return await Bus.connect(ConnectOptions(servers=(url,), name=name))

    brain = Brain(
        await bus("brain"),
        BrainConfig(
            node_timeout_s=args.heartbeat_s * args.missed,
            fence_margin_s=args.fence_margin_s,
            tick_s=0.1,
            history_path=home / f"history-{index}.db",
            failures=FailurePolicy(backoff_base_s=args.backoff_s),
        ),
    )
    await brain.start()
    await asyncio.wait_for(brain.leading.wait(), timeout=30)
    agents = []
    for name in ("n1", "n2"):
        config = AgentConfig(
            node=f"{name}t{index}",
            data_dir=home / f"{name}-{index}",
            heartbeat_s=args.heartbeat_s,
            telemetry_s=5.0,
            stop_grace_s=1.0,
        )
        agents.append(Agent(await bus(name), config, SimulatedGpus(config.node, 1, "A100")))
    first, second = agents
    beats: list[float] = []
    original = first.heartbeat

    async def timed_heartbeat() -> None:
        await original()
        beats.append(time.monotonic())

    first.heartbeat = timed_heartbeat  # type: ignore[method-assign]
    await first.start()
    await _until(lambda: len(brain.state.nodes) == 1)
    spec = JobSpec(command=(sys.executable, "-c", "import time; time.sleep(600)"), gpus=1)
    reply = await brain.api.handle("bench", SubmitRequest(spec=spec))
    assert isinstance(reply, JobReply)
    job_id = reply.job.job_id
    await _until(lambda: first.launcher.find(job_id))
    await second.start()
    await _until(lambda: len(brain.state.nodes) == 2)
    orphans = await first.crash()
    last_beat = beats[-1]

    def running_elsewhere() -> bool:
        job = brain.state.jobs[job_id]
        return (
            job.state is JobState.RUNNING
            and job.nodes == (second.node,)
            and all(g.pid is not None for g in job.grants)
        )

    await _until(running_elsewhere)
    elapsed = time.monotonic() - last_beat
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    await second.stop()
    await brain.stop()
    for component in (first, second):
        await component.bus.close()
    await brain.bus.close()
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--missed", type=int, default=3, help="intervals before LOST")
    parser.add_argument("--backoff-s", type=float, default=0.5, help="first retry back-off")
    parser.add_argument(
        "--fence-margin-s", type=float, default=5.0, help="the brain's wait after LOST"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        times = []
        for i in range(args.trials):
            # A fresh server per trial: the STATE log must not carry the last trial's nodes.
            server = EmbeddedNats(data_dir=home / f"nats-{i}")
            server.start()
            try:
                times.append(await trial(server.url, home, args, i))
            finally:
                server.stop()
    print(
        f"heartbeat {args.heartbeat_s:g}s, LOST after {args.missed} missed "
        f"({args.heartbeat_s * args.missed:g}s), fence margin {args.fence_margin_s:g}s, "
        f"first retry back-off {args.backoff_s:g}s"
    )
    target = 5.0 + args.fence_margin_s
    print("last heartbeat -> running on another node (s): " + ", ".join(f"{t:.2f}" for t in times))
    print(
        f"median {statistics.median(times):.2f}s, max {max(times):.2f}s "
        f"(target <= {target:g} s: {'met' if max(times) <= target else 'NOT met'})"
    )


if __name__ == "__main__":
    asyncio.run(main())
