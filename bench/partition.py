"""Partitions between real hosts: how soon a cut-off node's job runs elsewhere, and how
soon a cut-off leader brain is replaced.

Builds the multi-host cluster of tests/multihost.py (network namespaces: 3 NATS
servers, 2 brains, 3 agents; needs root) and, per trial:

- **node**: a two-GPU job (it notes its start and stop in a shared file) runs on a
  node; the node's link goes down. Measured from the cut: when its agent's SIGTERM
  reached the job (the fence), and when the job's next attempt started on another
  node (the job's own start line). Target: node timeout + fence margin + 2 s.
- **leader**: the leading brain's link goes down. Measured from the cut: when
  `status` first names another leader (polled every 0.1 s). Target: lease TTL plus
  an election (one renewal period, TTL/3).

    sudo .venv/bin/python bench/partition.py [--trials 3] [--node-timeout 2]
        [--fence-margin 2] [--fence-after 1.5] [--fence-grace 1] [--lease-ttl 3]

Not a test: nothing here asserts; it reports, and writes bench/results/partition-*.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.recording import record  # noqa: E402
from bus.client import Bus, ConnectOptions  # noqa: E402
from cli.client import submit  # noqa: E402
from schemas.nodes import NodeState  # noqa: E402
from tests.conftest import eventually  # noqa: E402
from tests.multihost import MultiHost, Timings, unavailable  # noqa: E402
from tests.test_multihost import (  # noqa: E402
    TENANT,
    cancel,
    intervals,
    node_states,
    ready,
    recorder_spec,
    running_started,
    status,
)


async def node_trial(cluster: MultiHost, bus: Bus, log: Path) -> dict[str, Any]:
    job_id = (await submit(bus, TENANT, recorder_spec(log))).job_id
    first = await running_started(bus, job_id, attempt=1)
    (home,) = first.nodes
    cut_at = time.time()
    cluster.partition(home)
    second = await running_started(bus, job_id, attempt=2)
    await asyncio.sleep(0.5)  # its start line written
    spans = intervals(log)
    fenced = spans[f"{home}/1"]
    restarted = spans[f"{second.nodes[0]}/2"]
    cluster.heal(home)

    async def back() -> bool:
        return (await node_states(bus)).get(home) is NodeState.READY

    await eventually(back, timeout_s=120, interval_s=0.5)
    await cancel(bus, job_id)
    return {
        "trial": "node",
        "node": home,
        "fenced_after_s": round(fenced[1] - cut_at, 3),
        "fence_stopped_cleanly": fenced[2],
        "running_elsewhere_after_s": round(restarted[0] - cut_at, 3),
        "overlap_s": round(max(0.0, fenced[1] - restarted[0]), 3),
    }


async def leader_trial(cluster: MultiHost, bus: Bus) -> dict[str, Any]:
    before = await status(bus)
    assert before is not None, "no leader to cut off"
    leader = before.brain_host
    cut_at = time.time()
    cluster.partition(leader)
    while True:
        now = await status(bus)
        if now is not None and now.brain_host != leader:
            took = time.time() - cut_at
            break
        await asyncio.sleep(0.1)
    cluster.heal(leader)

    async def one_leader() -> bool:
        reply = await status(bus)
        return reply is not None and len(reply.brains) == cluster.brain_count

    await eventually(one_leader, timeout_s=120, interval_s=0.5)
    return {
        "trial": "leader",
        "node": leader,
        "new_leader_after_s": round(took, 3),
        "epoch_before": before.epoch,
        "epoch_after": now.epoch,
    }


async def run(args: argparse.Namespace, cluster: MultiHost, workdir: Path) -> list[dict[str, Any]]:
    bus = await Bus.connect(ConnectOptions(servers=cluster.urls, name="bench"), replicas=3)
    rows: list[dict[str, Any]] = []
    try:
        await ready(bus, cluster)
        for i in range(args.trials):
            rows.append(await node_trial(cluster, bus, workdir / f"node-{i}.log"))
            print(rows[-1], flush=True)
            await ready(bus, cluster)
            rows.append(await leader_trial(cluster, bus))
            print(rows[-1], flush=True)
            await ready(bus, cluster)
    finally:
        await bus.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--node-timeout", type=float, default=2.0)
    parser.add_argument("--fence-margin", type=float, default=2.0)
    parser.add_argument("--fence-after", type=float, default=1.5)
    parser.add_argument("--fence-grace", type=float, default=1.0)
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"partition bench: {why}", file=sys.stderr)
        return 2
    timings = Timings(
        heartbeat_s=args.heartbeat,
        node_timeout_s=args.node_timeout,
        fence_margin_s=args.fence_margin,
        fence_after_s=args.fence_after,
        fence_grace_s=args.fence_grace,
        lease_ttl_s=args.lease_ttl,
    )
    workdir = Path(tempfile.mkdtemp(prefix="alnair-partition-"))
    cluster = MultiHost(workdir / "hosts", timings=timings)
    try:
        cluster.start()
        rows = asyncio.run(run(args, cluster, workdir))
    finally:
        cluster.close()
    node_target = args.node_timeout + args.fence_margin + 2.0
    leader_target = args.lease_ttl + args.lease_ttl / 3
    elsewhere = [r["running_elsewhere_after_s"] for r in rows if r["trial"] == "node"]
    fenced = [r["fenced_after_s"] for r in rows if r["trial"] == "node"]
    leaders = [r["new_leader_after_s"] for r in rows if r["trial"] == "leader"]
    print(
        f"configured: heartbeat {args.heartbeat:g}s, node timeout {args.node_timeout:g}s, "
        f"fence margin {args.fence_margin:g}s, agents fence after {args.fence_after:g}s "
        f"+ grace {args.fence_grace:g}s, lease TTL {args.lease_ttl:g}s"
    )
    print(
        f"partition -> job fenced:            median {statistics.median(fenced):.2f}s "
        f"(max {max(fenced):.2f}s)  [fence after + grace = "
        f"{args.fence_after + args.fence_grace:g}s at most]"
    )
    print(
        f"partition -> job running elsewhere: median {statistics.median(elsewhere):.2f}s "
        f"(max {max(elsewhere):.2f}s)  [target node timeout + margin + 2 = {node_target:g}s]"
    )
    print(
        f"partition -> new leader:            median {statistics.median(leaders):.2f}s "
        f"(max {max(leaders):.2f}s)  [target lease TTL + election = {leader_target:g}s]"
    )
    print(f"overlaps: {sum(r['overlap_s'] > 0 for r in rows if r['trial'] == 'node')}")
    # One CSV header for both kinds of trial: each row has every column.
    columns = list(dict.fromkeys(key for row in rows for key in row))
    rows = [{key: row.get(key) for key in columns} for row in rows]
    json_path, _ = record(
        "partition",
        {
            "settings": {
                **vars(args),
                "node_target_s": node_target,
                "leader_target_s": leader_target,
            },
            "notes": "network namespaces on one 2-core machine; link down as the partition",
        },
        rows,
    )
    print(f"results: {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
