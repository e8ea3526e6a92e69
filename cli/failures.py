"""`alnair inject | drain | resume | blacklist | history`: the failure-handling commands.

Drain, resume and blacklist edits are an operator's, so they ask as tenant `operator`
(NATS permissions decide whether this identity may). `inject` goes straight to the
node's agent, which refuses it for real GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import TypeAdapter

from brain.core.failures import FailurePolicy, InvalidFailurePolicy
from cli import format as fmt
from cli.arguments import positive_number
from cli.client import call
from schemas import subjects
from schemas.api import (
    BLACKLIST_RESULT,
    HISTORY_RESULT,
    NODE_RESULT,
    NODES_RESULT,
    OPERATOR_TENANT,
    BlacklistRequest,
    DrainRequest,
    HistoryRequest,
    ListNodesRequest,
    ResumeRequest,
)
from schemas.base import check_name
from schemas.commands import InjectFault, InjectFaultReply
from schemas.errors import AlnairError
from schemas.nodes import NodeStatus

WithBus = Callable[[argparse.Namespace, Callable[[Any], Awaitable[int]]], Awaitable[int]]
ClientArgs = Callable[[argparse.ArgumentParser], None]

INJECT_REPLY: TypeAdapter[InjectFaultReply] = TypeAdapter(InjectFaultReply)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """`alnair brain`'s failure-policy flags (docs/failures.md)."""
    from brain.core.failures import DEFAULT_FAILURE_POLICY as d

    g = p.add_argument_group("failure policy")
    g.add_argument(
        "--infra-retries",
        type=int,
        default=d.infrastructure_retries,
        metavar="N",
        help=f"retries after infrastructure failures (default {d.infrastructure_retries})",
    )
    g.add_argument(
        "--backoff",
        type=float,
        default=d.backoff_base_s,
        metavar="S",
        help=f"first retry back-off, doubled per retry (default {d.backoff_base_s:g}s)",
    )
    g.add_argument(
        "--backoff-max",
        type=float,
        default=d.backoff_max_s,
        metavar="S",
        help=f"longest retry back-off (default {d.backoff_max_s:g}s)",
    )
    g.add_argument(
        "--user-retries",
        action="append",
        default=[],
        metavar="[QUEUE=]N",
        help="retries after user errors, for every queue or one (repeat); default 0",
    )
    g.add_argument(
        "--input-retries",
        type=int,
        default=d.input_retries,
        metavar="N",
        help=f"retries of a job that failed on a blacklisted input (default {d.input_retries})",
    )
    g.add_argument(
        "--blacklist-after",
        type=int,
        default=d.blacklist_after_jobs,
        metavar="K",
        help=f"blacklist an input after K distinct jobs fail on it "
        f"(default {d.blacklist_after_jobs})",
    )
    g.add_argument(
        "--black-hole-after",
        type=int,
        default=d.black_hole_after,
        metavar="N",
        help="drain a node once infrastructure failures of two or more jobs were blamed on it "
        f"in N separate incidents within --black-hole-window (default {d.black_hole_after}; "
        "0: never)",
    )
    g.add_argument(
        "--black-hole-window",
        type=float,
        default=d.black_hole_window_s,
        metavar="S",
        help=f"the black-hole rule's window (default {d.black_hole_window_s:g}s)",
    )
    g.add_argument(
        "--prerun",
        action="append",
        default=[],
        metavar="QUEUE",
        help="run large jobs of this queue on one GPU first, to fail fast (repeat)",
    )
    g.add_argument(
        "--prerun-min-gpus",
        type=int,
        default=d.prerun_min_gpus,
        metavar="N",
        help=f"pre-run jobs asking for at least N GPUs (default {d.prerun_min_gpus})",
    )
    g.add_argument(
        "--prerun-seconds",
        type=float,
        default=d.prerun_s,
        metavar="S",
        help=f"how long a pre-run must survive (default {d.prerun_s:g}s)",
    )


def policy_of(args: argparse.Namespace) -> FailurePolicy:
    """The failure policy `add_policy_args`' flags describe; errors name the flag."""
    everywhere = 0
    per_queue: dict[str, int] = {}
    for item in args.user_retries:
        queue, sep, count = item.rpartition("=")
        if not count.strip().lstrip("-").isdigit() or (sep and not queue.strip()):
            raise InvalidFailurePolicy(f"--user-retries takes N or QUEUE=N, not {item!r}")
        if sep:
            per_queue[check_name("queue", queue.strip())] = int(count)
        else:
            everywhere = int(count)
    return FailurePolicy(
        infrastructure_retries=args.infra_retries,
        backoff_base_s=args.backoff,
        backoff_max_s=args.backoff_max,
        user_retries=everywhere,
        queue_user_retries=tuple(sorted(per_queue.items())),
        input_retries=args.input_retries,
        blacklist_after_jobs=args.blacklist_after,
        prerun_queues=tuple(check_name("queue", q) for q in args.prerun),
        prerun_min_gpus=args.prerun_min_gpus,
        prerun_s=args.prerun_seconds,
        black_hole_after=args.black_hole_after,
        black_hole_window_s=args.black_hole_window,
    ).validate()


def _fault_of(args: argparse.Namespace) -> InjectFault:
    if args.xid is not None:
        return InjectFault(gpu=args.gpu, fault="xid", xid=args.xid)
    if args.ecc:
        return InjectFault(gpu=args.gpu, fault="ecc_dbe")
    if args.lost:
        return InjectFault(gpu=args.gpu, fault="lost")
    if args.retired_pages:
        return InjectFault(gpu=args.gpu, fault="retired_pages")
    return InjectFault(gpu=args.gpu, fault="row_remap_failure")


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


Body = Callable[[argparse.Namespace, Any], Awaitable[int]]


async def _inject(args: argparse.Namespace, bus: Any) -> int:
    reply = await bus.request(subjects.node(args.node, "inject"), _fault_of(args), INJECT_REPLY)
    print(("injected: " if reply.ok else "refused: ") + reply.detail)
    return 0 if reply.ok else 1


async def _drain(args: argparse.Namespace, bus: Any) -> int:
    request = DrainRequest(node=args.node, reason=args.reason, gpu=args.gpu, requeue=args.requeue)
    reply = await call(bus, OPERATOR_TENANT, "drain", request, NODE_RESULT)
    print(fmt.nodes_table((reply.node,)))
    if args.wait is None:
        return 0
    # Until nothing runs on what was drained (its jobs ended, or were stopped and
    # requeued): then the node, or the GPU, may be taken down.
    deadline = time.monotonic() + args.wait
    status = reply.node
    ask = ListNodesRequest(name=args.node)
    while busy := _still_running(status, args.gpu):
        if time.monotonic() >= deadline:
            raise AlnairError(
                f"{_drained_what(args)} still runs {busy} after {args.wait:g}s "
                "(`alnair nodes`; `--requeue` stops what runs there)"
            )
        await asyncio.sleep(1.0)
        (status,) = (await call(bus, args.tenant, "nodes", ask, NODES_RESULT)).nodes
    print(f"{_drained_what(args)} runs nothing now")
    return 0


def _drained_what(args: argparse.Namespace) -> str:
    return f"node {args.node}" if args.gpu is None else f"node {args.node} GPU {args.gpu}"


def _still_running(node: NodeStatus, gpu: int | None) -> str:
    """What still runs on a drained node, or on its drained GPU: "" when nothing. The
    jobs the brain gives it, and the processes its agent reports (a job stopped there
    runs until its process has exited)."""
    jobs = set(node.jobs if gpu is None else ())
    jobs.update(p.job_id for p in node.running if gpu is None or gpu in p.gpus)
    if gpu is not None and gpu in node.allocated_gpus and not jobs:
        return "a job"
    return f"job{'s' if len(jobs) > 1 else ''} {', '.join(sorted(jobs))}" if jobs else ""


async def _resume(args: argparse.Namespace, bus: Any) -> int:
    reply = await call(bus, OPERATOR_TENANT, "resume", ResumeRequest(node=args.node), NODE_RESULT)
    print(fmt.nodes_table((reply.node,)))
    return 0


async def _blacklist(args: argparse.Namespace, bus: Any) -> int:
    if args.action == "list" and args.uri is not None:
        raise AlnairError(f"blacklist list takes no input, not {args.uri!r}")
    request = BlacklistRequest(action=args.action, uri=args.uri, reason=args.reason)
    tenant = args.tenant if args.action == "list" else OPERATOR_TENANT
    reply = await call(bus, tenant, "blacklist", request, BLACKLIST_RESULT)
    if args.json:
        print(reply.model_dump_json(indent=2))
        return 0
    rows = [
        [e.uri, e.added_by, _when(e.added_at), ",".join(e.jobs) or "-", e.reason[:60]]
        for e in reply.entries
    ]
    print(fmt.table(["INPUT", "BY", "ADDED", "JOBS", "REASON"], rows))
    if reply.suspects:
        print("\nnot blacklisted yet (jobs that failed on it):")
        for uri, jobs in sorted(reply.suspects.items()):
            print(f"  {uri}: {', '.join(jobs)}")
    return 0


async def _history(args: argparse.Namespace, bus: Any) -> int:
    reply = await call(bus, args.tenant, "history", HistoryRequest(job_id=args.job), HISTORY_RESULT)
    if args.json:
        print(json.dumps(reply.model_dump(mode="json"), indent=2))
        return 0
    job = reply.job
    print(f"job {job.job_id} {job.state.value} after {job.attempt} attempt(s)")
    rows = [
        [
            str(a.attempt),
            a.nodes or "-",
            _when(a.started_at),
            _when(a.ended_at),
            a.state,
            a.failure_class.value if a.failure_class else "-",
            (a.reason or "")[:70],
        ]
        for a in reply.attempts
    ]
    print(fmt.table(["ATTEMPT", "NODES", "START", "END", "STATE", "CLASS", "REASON"], rows))
    return 0


def add_commands(sub: Any, client_args: ClientArgs, with_bus: WithBus) -> None:
    """Register the failure-handling subcommands on the `alnair` parser."""

    def runner(body: Body) -> Callable[[argparse.Namespace], Awaitable[int]]:
        async def run(args: argparse.Namespace) -> int:
            return await with_bus(args, lambda bus: body(args, bus))

        return run

    p = sub.add_parser("inject", help="make a simulated GPU suffer a fault (XID, ECC, lost)")
    client_args(p)
    p.add_argument("node")
    p.add_argument("--gpu", type=int, required=True, help="GPU index on the node")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--xid", type=int, help="an XID error number (79: fallen off the bus)")
    kind.add_argument("--ecc", action="store_true", help="a double-bit ECC error")
    kind.add_argument("--lost", action="store_true", help="the GPU stops answering")
    kind.add_argument("--retired-pages", action="store_true", help="pages retired (pending)")
    kind.add_argument("--row-remap-failure", action="store_true", help="row remapping failed")
    p.set_defaults(fn=runner(_inject))

    p = sub.add_parser("drain", help="take a node (or one GPU) out of scheduling")
    client_args(p)
    p.add_argument("node")
    p.add_argument("--gpu", type=int, help="drain only this GPU")
    p.add_argument("--reason", required=True, help="why (shown by `alnair nodes`)")
    p.add_argument(
        "--requeue",
        action="store_true",
        help="also stop what runs there and put it back in its queue (not a failure: "
        "as a preemption, it starts again elsewhere from its checkpoint)",
    )
    p.add_argument(
        "--wait",
        type=positive_number,
        nargs="?",
        const=3600.0,
        metavar="SECONDS",
        help="then wait until nothing runs there (at most SECONDS, default 3600): the "
        "node may then be taken down",
    )
    p.set_defaults(fn=runner(_drain))

    p = sub.add_parser("resume", help="give a drained node's GPUs back to scheduling")
    client_args(p)
    p.add_argument("node")
    p.set_defaults(fn=runner(_resume))

    p = sub.add_parser("blacklist", help="the cluster-wide input blacklist: list|add|remove")
    client_args(p)
    p.add_argument("action", choices=("list", "add", "remove"), nargs="?", default="list")
    p.add_argument("uri", nargs="?")
    p.add_argument("--reason", default="blacklisted by an operator")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=runner(_blacklist))

    p = sub.add_parser("history", help="every attempt of a job, with its failure class")
    client_args(p)
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=runner(_history))
