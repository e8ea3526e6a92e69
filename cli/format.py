"""Plain-text tables and durations for the operator commands (squeue/sinfo style)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from schemas.api import GpuCensus, QueueStatus, utilisation_bucket
from schemas.jobs import JobRecord, clock_text
from schemas.nodes import NodeRecord, NodeStatus
from schemas.state import JobChanged, NodeChanged, NodeEventRecorded, StateRecord
from schemas.telemetry import GpuShares


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    return "-" if seconds is None else clock_text(seconds)


def job_time(job: JobRecord, now: float) -> str:
    if job.started_at is None:
        return duration(now - job.submitted_at) if not job.state.terminal else "-"
    end = job.finished_at if job.finished_at is not None else now
    return duration(end - job.started_at)


def grants_text(job: JobRecord) -> str:
    """Each node's GPUs, `n1[0,1]`; `n2[idle]` where an elastic job that shrank off a
    node keeps its worker host there, with no GPU, until it ends (docs/elastic.md)."""
    return ",".join(f"{g.node}[{','.join(map(str, g.gpus)) or 'idle'}]" for g in job.grants) or "-"


def gpus_text(job: JobRecord) -> str:
    """GPUs asked for; an elastic job's size and range (`3[1..4]`: the size it holds, or
    held last once ended), `3>2[1..4]` while a resize from 3 to 2 is in flight, and
    `pin=2` while an operator pins it."""
    if job.spec.shared:
        memory = job.spec.gpu_memory_mib
        return f"{(job.spec.gpu_milli or 0) / 1000:g}" + (f"({memory}MiB)" if memory else "")
    if not job.spec.elastic:
        return str(job.spec.gpus)
    low, high = job.spec.gpu_range
    staged = job.resize
    if staged is not None:
        size = f"{staged.from_size}>{staged.to_size}"
    elif job.grants:
        size = str(job.gpu_count)
    else:
        size = str(job.spec.gpus)
    pin = "" if job.pinned_gpus is None else f" pin={job.pinned_gpus}"
    return f"{size}[{low}..{high}]{pin}"


def jobs_table(jobs: Sequence[JobRecord]) -> str:
    now = time.time()
    rows = [
        [
            j.job_id,
            j.spec.name[:20],
            j.spec.queue,
            j.state.value,
            gpus_text(j),
            grants_text(j),
            str(j.attempt),
            "-"
            if j.exit_code is None and j.signal is None
            else (str(j.exit_code) if j.signal is None else f"sig{j.signal}"),
            job_time(j, now),
            (j.reason or "")[:60],
        ]
        for j in jobs
    ]
    return table(
        ["JOBID", "NAME", "QUEUE", "STATE", "GPUS", "NODES", "ATTEMPT", "EXIT", "TIME", "REASON"],
        rows,
    )


def nodes_table(nodes: Sequence[NodeStatus]) -> str:
    rows = []
    for n in nodes:
        r = n.record
        models = sorted({g.model for g in r.gpus}) or ["-"]
        rows.append(
            [
                r.name,
                r.state.value,
                f"{len(n.allocated_gpus)}/{len(r.gpus)}",
                ",".join(models)[:40],
                r.backend,
                "-" if n.last_seen_s_ago is None else f"{n.last_seen_s_ago:.1f}s",
                ",".join(n.jobs) or "-",
                shares_text(n.shares),
                _drained(r),
            ]
        )
    return table(
        [
            "NODE",
            "STATE",
            "GPUS(A/T)",
            "MODEL",
            "BACKEND",
            "SEEN",
            "JOBS",
            "SHARED (JOB=SHARE/LIMIT)",
            "DRAINED (REASON)",
        ],
        rows,
    )


def queues_table(queues: Sequence[QueueStatus]) -> str:
    """Each queue's guarantee beside what its jobs hold (BORROWED: beyond the guarantee,
    preemptible for a queue owed its own) and ask; an unlisted queue is marked. With no
    queue configured at all, no queue is owed anything, so nothing is borrowed (`-`)."""
    configured = any(q.listed for q in queues)
    rows = [
        [
            q.name if q.listed else f"{q.name} (not listed)",
            q.job_class,
            str(q.guaranteed_gpus),
            f"{q.running_jobs}/{q.running_gpus:g}",
            f"{q.borrowed_gpus:g}" if configured else "-",
            f"{q.pending_jobs}/{q.pending_gpus:g}",
        ]
        for q in queues
    ]
    return table(
        ["QUEUE", "CLASS", "GUARANTEED", "RUNNING(JOBS/GPUS)", "BORROWED", "PENDING(JOBS/GPUS)"],
        rows,
    )


def census_lines(census: GpuCensus) -> list[str]:
    """`alnair status`'s count of every GPU, and of READY nodes' GPUs by utilisation
    (buckets of 10 %, the empty ones left out)."""
    gpus = (
        f"gpus:    busy {census.busy}, shared {census.shared}, free {census.free}, "
        f"drained {census.drained}, on lost nodes {census.unavailable}"
    )
    buckets = [
        f"{utilisation_bucket(i)}% {count}" for i, count in enumerate(census.utilisation) if count
    ]
    if census.unreported:
        buckets.append(f"not reported {census.unreported}")
    return [gpus, "util:    " + (", ".join(buckets) or "no GPUs")]


def shares_text(shares: Sequence[GpuShares]) -> str:
    """`gpu0[mps]: job-1=0.5/20480MiB used 812, job-2=0.5/-`: each shared GPU, its
    jobs' shares, GPU memory limits and use, and whether MPS enforces them."""
    parts = []
    for gpu in shares:
        jobs = ", ".join(
            f"{u.job_id}={u.gpu_milli / 1000:g}/"
            + ("-" if u.memory_limit_mib is None else f"{u.memory_limit_mib}MiB")
            + ("" if u.memory_used_mib is None else f" used {u.memory_used_mib:.0f}")
            for u in gpu.jobs
        )
        problem = f" ({gpu.mps_problem})" if gpu.mps_problem else ""
        parts.append(f"gpu{gpu.index}[{gpu.enforcement}{problem}]: {jobs}")
    return "; ".join(parts) or "-"


def _drained(node: NodeRecord) -> str:
    """Drained capacity and why, like `sinfo -R`."""
    if node.drain_reason is not None:
        return f"all {len(node.gpus)}: {node.drain_reason}"[:80]
    parts = [f"gpu{d.index}: {d.reason}" for d in node.drained_gpus]
    return "; ".join(parts)[:80] or "-"


def _change(previous: str | None, current: str) -> str:
    return current if previous in (None, current) else f"{previous}->{current}"


def record_line(record: StateRecord, seq: int) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(record.ts))
    head = f"{seq:>6} {when}"
    if isinstance(record, JobChanged):
        job = record.job
        previous = record.previous.value if record.previous else None
        change = _change(previous, job.state.value)
        what = f"job {job.job_id:<6} {change:<20}"
    elif isinstance(record, NodeChanged):
        node = record.node
        previous = record.previous.value if record.previous else None
        what = f"node {node.name:<5} {_change(previous, node.state.value):<20}"
    elif isinstance(record, NodeEventRecorded):
        return f"{head} node {record.event.node:<5} {'event':<20} {_event_text(record)}"
    else:
        what = f"blacklist ({len(record.entries)} inputs)".ljust(32)
    return f"{head} {what} {record.cause.kind.value}: {record.cause.message}"


def _event_text(record: NodeEventRecorded) -> str:
    """`resize_completed: job_id=2 ... duration_s=2.82 placement=node-1[0,1,2]`: the
    event's fields as an operator reads them (none of Python's reprs)."""
    event = record.event
    fields = event.model_dump(exclude={"v", "event_id", "node", "ts", "kind", "log_tail"})
    detail = " ".join(f"{k}={_field_text(v)}" for k, v in fields.items() if v not in (None, (), ""))
    return f"{event.kind}: {detail}"


def _field_text(value: object) -> str:
    """Seconds and MiB to two decimals at most, GPU indices as `0,1`, a placement as
    `n1[0,1],n2[2]` (as `alnair jobs` writes grants)."""
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    if isinstance(value, tuple):
        return ",".join(
            f"{item['node']}[{','.join(map(str, item['gpus']))}]"
            if isinstance(item, dict)
            else str(item)
            for item in value
        )
    return str(value)
