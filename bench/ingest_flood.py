"""Node flood: how many 1 Hz nodes a brain holds with none of them declared LOST.

    .venv/bin/python bench/ingest_flood.py [--nodes 1000 2000 4000] [--seconds 30]
        [--brain-tree DIR] [--label NAME]

For each node count N: an embedded nats-server, a brain as a real process
(`python -m cli brain`, from `--brain-tree`, default this checkout: point it at an
exported older commit to measure before and after on the same machine), and a
publisher process playing N fake 8-GPU nodes straight onto the bus with nats-py: one
heartbeat and one telemetry batch per node per second, spread over the second. Once the
brain knows every node (or `--join-timeout` passed), it measures for `--seconds`: nodes
declared LOST (from the STATE log), whether the brain kept its lease, the API's status
latency, the brain's CPU and memory. A raw nats-py subscriber (another process, counting
messages, decoding nothing) takes the same flood in the same window: the baseline; a raw
fenced JetStream append (one at a time, as the brain's) is the baseline for what follows.
Then,
with the flood going on, `--jobs` one-GPU submissions from each of `--clients` concurrent
clients: answered per second, and submit -> Launch latency (the Launch command seen on
the bus). Last, where the brain exports them, its totals of heartbeats received and
forwarded to its decision loop and of telemetry shed (read from /metrics after the
window: rendering every GPU's series holds the brain's loop for seconds).
`--profile PREFIX` runs the brain under cProfile.

Prints a table and writes bench/results/ingest_flood-<stamp>.json. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import nats  # noqa: E402

from bench.recording import record  # noqa: E402
from bus.client import Bus, ConnectOptions  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from schemas import subjects  # noqa: E402
from schemas.base import encode  # noqa: E402
from schemas.telemetry import GpuInfo, GpuSample, Heartbeat, TelemetryBatch  # noqa: E402

GPUS_PER_NODE = 8
NODE_TIMEOUT_S = 5.0
TICKS = os.sysconf("SC_CLK_TCK")


# -- the fake nodes (a process of their own) ------------------------------------------


def _templates(node: str) -> tuple[bytes, bytes, bytes, bytes]:
    """A node's heartbeat and telemetry as JSON split around their time (and sequence),
    so each send costs a format, not a pydantic encode."""
    gpus = tuple(
        GpuInfo(index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_mib=81920)
        for i in range(GPUS_PER_NODE)
    )
    beat = encode(
        Heartbeat(
            node=node,
            ts=0.0,
            seq=0,
            instance=f"{node}-flood",
            hostname=node,
            backend="sim",
            interval_s=1.0,
            gpus=gpus,
        )
    )
    samples = tuple(
        GpuSample(
            index=i,
            util_gpu_pct=37.5,
            util_mem_pct=20.0,
            mem_used_mib=10240.0,
            mem_total_mib=81920.0,
            power_w=300.0,
            temp_c=55.0,
            sm_clock_mhz=1755.0,
            mem_clock_mhz=2619.0,
        )
        for i in range(GPUS_PER_NODE)
    )
    batch = encode(TelemetryBatch(node=node, ts=0.0, samples=samples))
    beat_head, beat_tail = beat.split(b'"ts":0.0,"seq":0,')
    batch_head, batch_tail = batch.split(b'"ts":0.0,')
    return beat_head, beat_tail, batch_head, batch_tail


async def _publish(url: str, nodes: int, seconds: float, out: Path) -> None:
    nc = await nats.connect(url, name="flood", pending_size=256 * 1024 * 1024)
    names = [f"f{n:05d}" for n in range(nodes)]
    templates = [_templates(name) for name in names]
    beat_subjects = [subjects.node(name, "heartbeat").encode() for name in names]
    started = time.monotonic()
    slices = 20  # each second's sends in 20 slices: a steady rate, not a burst
    sent = 0
    late_s = 0.0
    seq = 0
    while time.monotonic() - started < seconds:
        seq += 1
        second = time.monotonic()
        for part in range(slices):
            for n in range(part, nodes, slices):
                beat_head, beat_tail, batch_head, batch_tail = templates[n]
                ts = time.time()
                await nc.publish(
                    beat_subjects[n].decode(),
                    beat_head + f'"ts":{ts},"seq":{seq},'.encode() + beat_tail,
                )
                await nc.publish(
                    subjects.node(names[n], "telemetry"),
                    batch_head + f'"ts":{ts},'.encode() + batch_tail,
                )
                sent += 2
            due = second + (part + 1) / slices
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                late_s = max(late_s, -wait)
        # Every second: the bench may stop this process once it has what it needs.
        elapsed = time.monotonic() - started
        out.write_text(json.dumps({"sent": sent, "seconds": elapsed, "late_s": late_s}))
    await nc.flush()
    await nc.close()
    elapsed = time.monotonic() - started
    out.write_text(json.dumps({"sent": sent, "seconds": elapsed, "late_s": late_s}))


# -- the raw baseline (a process of its own) ------------------------------------------


async def _raw_subscribe(url: str, seconds: float, out: Path) -> None:
    nc = await nats.connect(url, name="raw-baseline")
    count = [0, 0]

    async def on_message(msg: Any) -> None:
        count[0] += 1
        count[1] += len(msg.data)

    await nc.subscribe(subjects.ALL_HEARTBEATS, cb=on_message)
    await nc.subscribe(subjects.ALL_TELEMETRY, cb=on_message)
    await nc.flush()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - started
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    received = count[0]
    await nc.close()
    out.write_text(json.dumps({"received": received, "seconds": elapsed, "cpu_s": cpu}))


# -- the brain under test ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _scrape(port: int, token: str) -> dict[str, float]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    values: dict[str, float] = {}
    with contextlib.suppress(Exception), urllib.request.urlopen(request, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(("alnair_ingest", "alnair_telemetry_shed", "alnair_heartbeats")):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
    return values


async def _status_ms(bus: Bus) -> tuple[float, int, bool]:
    from cli.client import call
    from schemas.api import STATUS_RESULT, StatusRequest

    started = time.monotonic()
    status = await call(bus, "default", "status", StatusRequest(), STATUS_RESULT, timeout_s=5)
    leader = any(b.leader for b in status.brains)
    return (time.monotonic() - started) * 1000, status.epoch, leader


async def _start_brain(
    url: str, nodes: int, args: argparse.Namespace, work: Path, port: int
) -> asyncio.subprocess.Process:
    """The brain under test, from `--brain-tree`, serving /metrics on `port` (operator
    token in `work/token`)."""
    from brain.http.auth import TokenEntry, TokenFile

    token = "bench-operator-token-" + "x" * 24
    (work / "token").write_text(token)
    tokens = work / "tokens.json"
    entry = TokenEntry(token=token, tenant="operator", operator=True)
    tokens.write_text(TokenFile(tokens=(entry,)).model_dump_json())
    tree = Path(args.brain_tree).resolve()
    env = {**os.environ, "ALNAIR_HOME": str(work), "PYTHONPATH": str(tree)}
    # Under cProfile when asked: stopped with SIGTERM at the end, so the profile is written.
    profile = ("-m", "cProfile", "-o", f"{args.profile}-{nodes}.prof") if args.profile else ()
    with (work / "brain.log").open("wb") as brain_log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *profile,
            "-m",
            "cli",
            "brain",
            "--nats",
            url,
            "--history",
            str(work / "history.db"),
            "--node-timeout",
            str(NODE_TIMEOUT_S),
            "--lease-ttl",
            "5",
            "--http",
            f"127.0.0.1:{port}",
            "--http-tokens",
            str(tokens),
            cwd=tree,
            env=env,
            stdout=brain_log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )


async def _until_leading(client: Bus, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if (await _status_ms(client))[2]:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no brain led within {timeout_s:g} s")


async def _window(client: Bus, brain_pid: int, seconds: float) -> dict[str, Any]:
    """Ask the API for status four times a second; the brain's CPU over the window."""
    cpu_before, started = _cpu_s(brain_pid), time.monotonic()
    latencies: list[float] = []
    epochs: set[int] = set()
    leading = True
    while time.monotonic() - started < seconds:
        try:
            ms, epoch, leader = await _status_ms(client)
            latencies.append(ms)
            epochs.add(epoch)
            leading = leading and leader
        except Exception:
            latencies.append(5000.0)  # the request's timeout
            leading = False
        await asyncio.sleep(0.25)
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "lease_kept": leading and len(epochs) == 1,
        "api_p50_ms": round(statistics.median(latencies), 1),
        "api_p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 1),
        "brain_cpu_pct": round(100 * (_cpu_s(brain_pid) - cpu_before) / elapsed),
        "brain_rss_mib": round(_rss_mib(brain_pid)),
    }


async def _submissions(client: Bus, clients: int, jobs: int, tag: str) -> dict[str, Any]:
    """`jobs` one-GPU submissions from `clients` concurrent clients, each waiting for its
    answer before the next: answered per second, and submit -> Launch command latency
    (the Launch seen on the bus: the fake nodes never start anything)."""
    from cli.client import submit
    from schemas.jobs import JobSpec

    sent_at: dict[str, float] = {}
    launched_ms: list[float] = []
    pending_ids: dict[str, float] = {}

    async def on_command(msg: Any) -> None:
        command = json.loads(msg.data)
        if command.get("kind") == "launch":
            at = pending_ids.pop(command["job_id"], None)
            if at is not None:
                launched_ms.append((time.monotonic() - at) * 1000)

    sub = await client.nc.subscribe(subjects.ALL_NODE_COMMANDS, cb=on_command)
    spec = JobSpec(name="flood-submit", command=("true",), gpus=1)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(jobs):
        queue.put_nowait(i)

    failed = [0]
    answered = [0]
    started = time.monotonic()

    async def worker() -> None:
        # At most a minute per phase: a brain that answers a few a second gets a rate.
        while not queue.empty() and time.monotonic() - started < 60:
            i = queue.get_nowait()
            key = f"{tag}-{i}"
            sent_at[key] = time.monotonic()
            try:
                job = await submit(client, "default", spec, idempotency_key=key, retry_for_s=10)
            except Exception:
                failed[0] += 1
                continue
            answered[0] += 1
            # A Launch can only follow the answer's job id; the clock started at the send.
            pending_ids[job.job_id] = sent_at[key]

    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 30
    while pending_ids and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await sub.unsubscribe()
    launched_ms.sort()
    n = len(launched_ms)
    return {
        f"submit_c{clients}_per_s": round(answered[0] / elapsed),
        f"submit_c{clients}_failed": failed[0],
        f"launch_c{clients}_p50_ms": round(launched_ms[n // 2], 1) if n else "n/a",
        f"launch_c{clients}_p99_ms": round(launched_ms[min(n - 1, int(n * 0.99))], 1)
        if n
        else "n/a",
    }


async def _raw_fenced_appends(client: Bus, seconds: float = 3.0) -> int:
    """The baseline for an append: a raw nats-py JetStream publish of a ~930-byte record,
    fenced with Nats-Expected-Last-Sequence as the brain's are, one at a time, into a
    stream of its own on the same server during the flood. Appends per second."""
    from nats.js.api import StreamConfig

    await client.js.add_stream(StreamConfig(name="FLOODBENCH", subjects=["floodbench.append"]))
    payload = b"x" * 930
    last = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        headers = {"Nats-Expected-Last-Sequence": str(last)}
        ack = await client.js.publish("floodbench.append", payload, headers=headers)
        last = int(ack.seq)
    rate = round(last / (time.monotonic() - started))
    await client.js.delete_stream("FLOODBENCH")
    return rate


async def _child(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, __file__, *argv)


async def run_one(nodes: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    server = EmbeddedNats(data_dir=work / "nats")
    server.start()
    port = _free_port()
    brain = await _start_brain(server.url, nodes, args, work, port)
    children: list[asyncio.subprocess.Process] = [brain]
    client = await Bus.connect(ConnectOptions(servers=(server.url,), name="bench"))
    joined: set[str] = set()
    lost: list[str] = []

    async def on_state(msg: Any) -> None:
        entry = json.loads(msg.data)
        kind = entry.get("cause", {}).get("kind")
        if kind == "node_joined":
            joined.add(entry["node"]["name"])
        elif kind == "node_lost":
            lost.append(entry["node"]["name"])

    try:
        await client.nc.subscribe(f"{subjects.PREFIX}.state.node.>", cb=on_state)
        await _until_leading(client)
        published, raw_out = work / "published.json", work / "raw.json"
        total_s = args.join_timeout + args.seconds + 60 * len(args.clients) + 5
        children.append(
            await _child("--publisher", server.url, str(nodes), str(total_s), str(published))
        )
        flood_started = time.monotonic()
        while len(joined) < nodes and time.monotonic() - flood_started < args.join_timeout:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        join_s = time.monotonic() - flood_started
        # The window: nothing the join did counts. /metrics is read only after it (its
        # rendering of every GPU's series takes the brain's loop for seconds).
        children.append(
            await _child("--raw-subscriber", server.url, str(args.seconds), str(raw_out))
        )
        lost_before = len(lost)
        window = await _window(client, brain.pid, args.seconds)
        submitted: dict[str, Any] = {"raw_appends_per_s": await _raw_fenced_appends(client)}
        for clients in args.clients:
            submitted |= await _submissions(client, clients, args.jobs, f"c{clients}")
        metrics = _scrape(port, (work / "token").read_text())
        await children[2].wait()
        raw = json.loads(raw_out.read_text())
        sent = json.loads(published.read_text())
        return {
            "nodes": nodes,
            "brain": args.label,
            "msgs_per_s": round(sent["sent"] / sent["seconds"]),
            "publisher_late_s": round(sent["late_s"], 2),
            "joined": len(joined),
            "join_s": round(join_s, 1),
            "lost_in_window": len(lost) - lost_before,
            "lost_total": len(lost),
            **window,
            "heartbeats": metrics.get("alnair_ingest_heartbeats_total", "n/a"),
            "forwarded": metrics.get("alnair_ingest_heartbeats_forwarded_total", "n/a"),
            "telemetry_shed": metrics.get("alnair_telemetry_shed_total", "n/a"),
            "raw_msgs_per_s": round(raw["received"] / raw["seconds"]),
            "raw_cpu_pct": round(100 * raw["cpu_s"] / raw["seconds"]),
            **submitted,
        }
    finally:
        if args.profile and brain.returncode is None:
            brain.terminate()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(brain.wait(), timeout=30)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.wait(), timeout=10)
        kept = Path(tempfile.gettempdir()) / f"ingest_flood-brain-{args.label}-{nodes}.log"
        with contextlib.suppress(OSError):
            kept.write_bytes((work / "brain.log").read_bytes())
        await client.close()
        server.stop()


COLUMNS = (
    "nodes",
    "brain",
    "msgs_per_s",
    "join_s",
    "lost_in_window",
    "lease_kept",
    "api_p50_ms",
    "api_p99_ms",
    "brain_cpu_pct",
    "brain_rss_mib",
    "forwarded",
    "telemetry_shed",
    "raw_msgs_per_s",
    "raw_cpu_pct",
)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publisher":
        url, nodes, seconds, out = sys.argv[2:6]
        asyncio.run(_publish(url, int(nodes), float(seconds), Path(out)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-subscriber":
        url, seconds, out = sys.argv[2:5]
        asyncio.run(_raw_subscribe(url, float(seconds), Path(out)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window")
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument(
        "--clients", type=int, nargs="*", default=[8, 64], help="then submit with this many"
    )
    parser.add_argument("--jobs", type=int, default=400, help="submissions per client count")
    parser.add_argument("--brain-tree", default=str(REPO), help="run the brain from here")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--profile", metavar="PREFIX", help="cProfile the brain to PREFIX-N.prof")
    args = parser.parse_args()
    rows = []
    for nodes in args.nodes:
        with tempfile.TemporaryDirectory() as work:
            rows.append(asyncio.run(run_one(nodes, args, Path(work))))
        print(json.dumps(rows[-1]), flush=True)
    columns = [*COLUMNS, *(k for k in rows[0] if k.startswith(("submit_", "launch_", "raw_app")))]
    print("\n" + "  ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]!s:>14}" for c in columns))
    notes = {
        "node_timeout_s": NODE_TIMEOUT_S,
        "gpus_per_node": GPUS_PER_NODE,
        "window_s": args.seconds,
        "brain_tree": args.brain_tree,
        "cpus": os.cpu_count(),
    }
    json_path, _ = record("ingest_flood", notes, rows)
    print(f"\nwritten {json_path}")


if __name__ == "__main__":
    main()
