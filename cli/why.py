"""`alnair why JOB`: the latest decisions about a job, each with its cause.

Where it was placed and why, what it waits for, who preempted it and on what grounds
(a quota reclaim or a better-ranked job), its LAS band changes and its retries: the
job's records in the brain's history, which holds every STATE entry with its cause.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from brain.core.ordering import ORDERINGS
from cli import format as fmt
from cli.arguments import whole_number
from cli.client import call
from schemas.api import WHY_RESULT, WhyEntry, WhyReply, WhyRequest
from schemas.jobs import JobState
from schemas.state import CauseKind

WithBus = Callable[[argparse.Namespace, Callable[[Any], Awaitable[int]]], Awaitable[int]]
ClientArgs = Callable[[argparse.ArgumentParser], None]
# WhyRequest's bound.
MAX_LIMIT: Final = 1000


def _change(entry: WhyEntry) -> str:
    if entry.previous is None:
        return f"new {entry.state.value}"
    if entry.previous is entry.state:
        return entry.state.value
    return f"{entry.previous.value}->{entry.state.value}"


def _detail(entry: WhyEntry) -> str:
    cause = entry.cause
    if cause.kind is CauseKind.SERVICE_LEVEL:
        return f"band {entry.service_level}: {cause.message}"
    if cause.kind is CauseKind.PLACED:
        return f"attempt {entry.attempt}: {cause.message}"
    return cause.message


def _summary(reply: WhyReply) -> list[str]:
    job = reply.job
    spec = job.spec
    lines = [
        f"job {job.job_id} ({spec.name}), queue {spec.queue}, {spec.gpu_request}: "
        f"{job.state.value}, attempt {job.attempt}",
    ]
    if job.reason:
        lines.append(f"  why now:  {job.reason}")
    # To the reply's time: a running job's record counts only what ended before its run.
    attained = reply.attained_gpu_seconds
    executed = reply.executed_seconds
    service = (
        f"  service:  {job.attained_gpu_seconds if attained is None else attained:.1f} GPU-s "
        f"over {job.executed_seconds if executed is None else executed:.1f} s run"
    )
    order = ORDERINGS.get(reply.order) if reply.order is not None else None
    if order is None or order.banded:
        service += f"; LAS band {job.service_level}"
    else:
        service += f"; queue order {order.name} (no bands)"
    lines.append(service)
    hints = []
    if spec.declared_duration_s is not None:
        hints.append(f"declared duration {spec.declared_duration_s:g} s")
    hints += [
        f"runs once job{'s' if len(ids) > 1 else ''} {', '.join(ids)} "
        f"{'have' if len(ids) > 1 else 'has'} {what}"
        for ids, what in ((spec.after, "SUCCEEDED"), (spec.after_any, "ended"))
        if ids
    ]
    if spec.array is not None:
        index = "" if spec.array_index is None else f" index {spec.array_index} of"
        limit = "" if spec.array_limit is None else f", at most {spec.array_limit} at once"
        hints.append(f"{index} array {spec.array}{limit}".lstrip())
    if spec.time_limit_s is not None:
        ran = job.executed_seconds if executed is None else executed
        limit = f"time limit {fmt.duration(spec.time_limit_s)}"
        if not job.state.terminal:
            limit += f", {fmt.duration(max(0.0, spec.time_limit_s - ran))} left"
        hints.append(limit)
    if spec.network_sensitive:
        hints.append("network-sensitive (never spread over switches)")
    if spec.elastic:
        low, high = spec.gpu_range
        size = f"elastic {low}..{high} GPUs"
        # The header says what it asked to start at; the policy may have moved it since.
        if job.state is JobState.RUNNING:
            size += f", on {sum(len(g.gpus) for g in job.grants if not g.exited)} now"
        elif job.state.terminal and job.grants:
            size += f", on {sum(len(g.gpus) for g in job.grants)} at the end"
        if job.pinned_gpus is None:
            hints.append(f"{size}, sized by the policy")
        else:
            hints.append(
                f"{size}, pinned at {job.pinned_gpus} by `alnair resize` "
                "(`alnair resize JOB auto` hands it back)"
            )
    if hints:
        lines.append(f"  hints:    {'; '.join(hints)}")
    return lines


def render(reply: WhyReply) -> str:
    rows = [
        [
            str(e.seq),
            time.strftime("%H:%M:%S", time.localtime(e.ts)),
            _change(e),
            e.cause.kind.value,
            _detail(e),
        ]
        for e in reply.decisions
    ]
    lines = _summary(reply)
    lines.append("")
    if reply.truncated:
        lines.append(f"(the latest {len(rows)} changes; --limit N for more)")
    lines.append(fmt.table(["SEQ", "TIME", "CHANGE", "CAUSE", "DETAIL"], rows))
    return "\n".join(lines)


async def _why(args: argparse.Namespace, bus: Any) -> int:
    request = WhyRequest(job_id=args.job, limit=args.limit)
    reply = await call(bus, args.tenant, "why", request, WHY_RESULT)
    if args.json:
        print(json.dumps(reply.model_dump(mode="json"), indent=2))
    else:
        print(render(reply))
    return 0


_limit = whole_number(1, MAX_LIMIT, f"a whole number from 1 to {MAX_LIMIT}")


def add_command(sub: Any, client_args: ClientArgs, with_bus: WithBus) -> None:
    """Register `alnair why` on the `alnair` parser."""

    async def run(args: argparse.Namespace) -> int:
        return await with_bus(args, lambda bus: _why(args, bus))

    p = sub.add_parser(
        "why", help="why a job is where it is: its latest decisions, each with its cause"
    )
    client_args(p)
    p.add_argument("job")
    p.add_argument("--limit", type=_limit, default=20, help="at most this many changes, the newest")
    p.add_argument("--json", action="store_true", help="the reply as JSON")
    p.set_defaults(fn=run)
