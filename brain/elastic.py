"""The brain's side of elastic jobs: how one is launched, and its resizes as records.

It owns the translation of an elastic JobSpec into the commands the agents run (on the
job's first node the user's training command wrapped by `workloads.supervisor`, which
starts horovodrun in elastic mode and obeys Resize commands on `alnair.job.<job>.cmd`;
on every other node the job's worker host, `workloads/worker_host.py`, through which
horovodrun starts that node's workers), and the pure record changes of a resize, which
is a statement:

- stage: the job's grants hold every GPU of both sizes (a grow's added GPUs at once,
  so nobody else takes them, and a node new to the job gets its worker host launched;
  a shrink's released ones until their workers are gone) and `JobRecord.resize` says
  what was asked, with the command id;
- commit, on the supervisor's `ResizeCompleted` with `ok`: the grants are the target;
  a node the job left keeps its grant, with no GPU, and its worker host, idle until a
  grow comes back or the job ends;
- roll back, on a refusal: the grants are what they were; or, when the supervisor may
  have moved part of the way (it timed out, or refused after trying), a revert to the
  old size is staged instead, like any resize: the job holds every GPU of both sizes
  (a grow's new workers may run on the added ones) until the supervisor confirms it.
  A revert that is rolled back in turn ends holding them all.

A resize grows or shrinks; it never moves a worker. It keeps the job's first node (the
supervisor's: Horovod carries the state over from a host of the old world). A node is
launched on once per attempt (its launch and events are named by job, attempt and
node): a node the job leaves keeps its idle worker host, so a grow back there needs no
launch; a node where the worker host could not start (`drop_node`) is not grown onto
again in the attempt (`JobRecord.barred_nodes`). Everything here is pure (no clock, no
ids, no I/O): the shell (brain/service.py) journals what these return and sends the
commands. It must not import torch or horovod.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from brain.core.model import gpus_said
from schemas.commands import Resize
from schemas.jobs import (
    JobRecord,
    JobSpec,
    JobState,
    NodeGpus,
    NodeGrant,
    StagedResize,
    describe_placement,
    placement_size,
)

# The job's GPUs per node, its first node (the supervisor's) first.
Placement = tuple[NodeGpus, ...]


def launch_command(
    spec: JobSpec,
    granted_gpus: int | None = None,
    *,
    rank: int = 0,
    remote: tuple[tuple[str, int], ...] = (),
) -> tuple[str, ...]:
    """The command an agent runs for `spec`: its own for a rigid job, else supervised.

    `granted_gpus` is the size the job starts at on this node (what placement granted);
    it defaults to the spec's `gpus`. For an elastic job across nodes, `rank` 0 runs
    the supervisor with the other nodes' slots (`remote`), every other rank the node's
    worker host (as does a node a grow adds later).
    """
    if not spec.elastic:
        return spec.command
    if rank > 0:
        return (sys.executable, "-m", "workloads.worker_host")
    low, high = spec.gpu_range
    start = spec.gpus if granted_gpus is None else granted_gpus
    start += sum(slots for _, slots in remote)
    start = min(max(start, low), high)
    return (
        sys.executable,
        "-m",
        "workloads.supervisor",
        f"--min-np={low}",
        f"--max-np={high}",
        f"--np={start}",
        *(f"--remote={node}={slots}" for node, slots in remote),
        "--",
        *spec.command,
    )


@dataclass(frozen=True, slots=True)
class ResizeRefused:
    """Why a resize cannot be staged: `invalid` can never work, `conflict` not now."""

    code: Literal["invalid", "conflict"]
    reason: str


def current_placement(job: JobRecord) -> Placement:
    """The GPUs the job runs on now, per node: before a staged resize, what it had."""
    if job.resize is not None:
        return job.resize.before
    return job.placement


def _by_node(placement: Placement) -> dict[str, set[int]]:
    return {part.node: set(part.gpus) for part in placement}


def same_placement(a: Placement, b: Placement) -> bool:
    return _by_node(a) == _by_node(b)


def check_resize(
    job: JobRecord,
    target: Placement,
    free: Mapping[str, Collection[int]],
    *,
    supervisor_ready: bool,
) -> ResizeRefused | None:
    """Whether `job` may be resized to `target` now; `free` are each ready node's
    schedulable GPUs no job holds; `supervisor_ready` that its supervisor has been heard
    from (it listens for commands before its workers start)."""
    return check_resizable(
        job, placement_size(target), supervisor_ready=supervisor_ready
    ) or check_target(job, target, free)


def not_elastic(job: JobRecord) -> str:
    if job.spec.gpu_milli is not None:
        return (
            f"job {job.job_id} is a share of one GPU ({job.spec.gpu_request}): shares are "
            "not elastic (submit whole GPUs with --elastic --min-gpus --max-gpus to resize)"
        )
    return (
        f"job {job.job_id} is not elastic: it runs on exactly {gpus_said(job.spec.gpus)} "
        "(submit with --elastic --min-gpus --max-gpus to make it resizable)"
    )


def check_resizable(job: JobRecord, size: int, *, supervisor_ready: bool) -> ResizeRefused | None:
    """Whether `job` may run on `size` GPUs, and may be resized now at all."""
    label = f"job {job.job_id}"
    if not job.spec.elastic:
        return ResizeRefused("invalid", not_elastic(job))
    low, high = job.spec.gpu_range
    if not low <= size <= high:
        return ResizeRefused(
            "invalid", f"{label} runs on {low}..{high} GPUs; {size} is outside that range"
        )
    if job.state is not JobState.RUNNING:
        return ResizeRefused("conflict", f"{label} is {job.state.value}, not running")
    if job.resize is not None:
        staged = job.resize
        return ResizeRefused(
            "conflict",
            f"{label} is already resizing {staged.from_size} -> {staged.to_size} "
            f"GPUs (command {staged.command_id}); wait for it to commit or roll back",
        )
    # Parts holding GPUs: an idle worker host that ended only bars its node.
    working = [g for g in job.grants if g.gpus]
    if not working or not all(g.pid is not None and not g.exited for g in working):
        return ResizeRefused("conflict", f"{label} has not started yet")
    if not supervisor_ready:
        return ResizeRefused(
            "conflict", f"{label}'s supervisor has not reported yet; try again in a moment"
        )
    return None


def check_target(
    job: JobRecord, target: Placement, free: Mapping[str, Collection[int]]
) -> ResizeRefused | None:
    """Whether `target` is GPUs the running `job` may hold: its supervisor's node kept;
    on every node some or all of its GPUs (a shrink) or all of them and more (a grow);
    the added ones free, not on a node barred in this attempt (its worker host could not
    start there, or has ended)."""
    label = f"job {job.job_id}"
    first = job.grants[0].node
    nodes = [part.node for part in target]
    if len(set(nodes)) != len(nodes):
        return ResizeRefused("invalid", f"the placement names a node twice: {nodes}")
    if first not in nodes:
        return ResizeRefused(
            "invalid",
            f"{label}'s supervisor runs on node {first}: a resize keeps at least one of "
            f"its GPUs there (asked for {describe_placement(target)})",
        )
    held = _by_node(current_placement(job))
    wanted = _by_node(target)
    grows = all(gpus <= wanted.get(node, set()) for node, gpus in held.items())
    shrinks = all(node in held and gpus <= held[node] for node, gpus in wanted.items())
    if not (grows or shrinks):
        return ResizeRefused(
            "invalid",
            f"{label} holds {describe_placement(current_placement(job))}: a resize keeps "
            f"some or all of its GPUs (a shrink) or all of them and adds others (a grow), "
            f"not {describe_placement(target)}",
        )
    left = sorted(set(wanted) & job.barred_nodes - set(held))
    if left:
        return ResizeRefused(
            "conflict",
            f"{label}'s worker host could not start or has ended on node(s) "
            f"{', '.join(left)}; it grows there again only in its next attempt",
        )
    for node, gpus in wanted.items():
        taken = gpus - held.get(node, set()) - set(free.get(node, ()))
        if taken:
            return ResizeRefused(
                "conflict", f"GPUs {sorted(taken)} of node {node} are not free for {label}"
            )
    return None


def choose_target(
    job: JobRecord, gpus: int, free: Mapping[str, Collection[int]]
) -> Placement | ResizeRefused:
    """The GPUs an operator's `resize JOB N` means.

    A shrink leaves the nodes where the job holds fewest GPUs first (fewer nodes sync
    faster), never the supervisor's last, and keeps the lowest-numbered GPUs of each.
    A grow adds the lowest-numbered free GPUs of the job's own nodes first, then of the
    nodes where its worker host idles, then of those with the most free (not a node
    barred in this attempt)."""
    held = {part.node: sorted(part.gpus) for part in current_placement(job)}
    first = job.grants[0].node
    size = sum(map(len, held.values()))
    if gpus <= size:
        for _ in range(size - gpus):
            node = min(
                (n for n, g in held.items() if g and not (n == first and len(g) == 1)),
                key=lambda n: (n == first, len(held[n]), n),
            )
            held[node].pop()
        return _placement(job, {n: g for n, g in held.items() if g})
    want = gpus - size
    added: dict[str, list[int]] = {}
    # Nodes where its worker host idles first: a grow there needs no launch.
    idle = {g.node for g in job.grants if not g.gpus}
    others = sorted(
        (n for n in free if n not in held and n not in job.barred_nodes),
        key=lambda n: (n not in idle, -len(free[n]), n),
    )
    for node in [*held, *others]:
        extra = sorted(set(free.get(node, ())) - set(held.get(node, ())))[:want]
        if extra:
            added[node] = extra
            want -= len(extra)
        if want == 0:
            break
    if want:
        return ResizeRefused(
            "conflict",
            f"job {job.job_id} can grow to {gpus - want} GPUs at most now: that many are "
            "free on its nodes and the nodes it may grow onto",
        )
    merged = {n: sorted({*held.get(n, ()), *added.get(n, ())}) for n in [*held, *added]}
    return _placement(job, merged)


def _placement(job: JobRecord, gpus: Mapping[str, Collection[int]]) -> Placement:
    """`gpus` per node as a placement: the job's nodes in their order, new ones after."""
    order = {node: i for i, node in enumerate(job.nodes)}
    nodes = sorted(gpus, key=lambda n: (order.get(n, len(order)), n))
    return tuple(NodeGpus(node=n, gpus=tuple(sorted(gpus[n]))) for n in nodes if gpus[n])


def _union(a: Placement, b: Placement) -> dict[str, set[int]]:
    out = _by_node(a)
    for part in b:
        out.setdefault(part.node, set()).update(part.gpus)
    return out


def _with_placement(job: JobRecord, gpus: Mapping[str, Collection[int]]) -> JobRecord:
    """The job's grants holding `gpus`: each node keeps its grant (pid, log), with no
    GPU where `gpus` has none (its worker host stays, idle); a new node gets a grant
    not yet launched."""
    placement = _placement(job, gpus)
    wanted = {part.node: part.gpus for part in placement}
    kept = [g.model_copy(update={"gpus": wanted.get(g.node, ())}) for g in job.grants]
    known = {g.node for g in job.grants}
    added = [NodeGrant(node=p.node, gpus=p.gpus) for p in placement if p.node not in known]
    return job.model_copy(update={"grants": (*kept, *added)})


def joining(job: JobRecord) -> set[str]:
    """The nodes whose worker host a staged grow is launching."""
    staged = job.resize
    if staged is None or staged.reverting:
        return set()
    before = {p.node for p in staged.before}
    return {g.node for g in job.grants if g.pid is None and g.node not in before}


def drop_node(job: JobRecord, node: str) -> JobRecord:
    """The job without its part on `node`, where its worker host could not start or
    that was lost: not grown onto again in this attempt (a second launch there would
    bear the same id)."""
    assert node != job.grants[0].node
    grants = tuple(g for g in job.grants if g.node != node)
    left = (*job.failed_nodes, node) if node not in job.failed_nodes else job.failed_nodes
    return job.model_copy(update={"grants": grants, "failed_nodes": left})


def without_lost(job: JobRecord, node: str) -> Placement | None:
    """The placement `job` keeps without its GPUs on `node` (and, while it sheds other
    lost nodes, without theirs), when it may go on at that size (within its range, its
    supervisor's node kept); else None."""
    if node == job.grants[0].node:
        return None
    staged = job.resize
    ours = staged.after if staged is not None and staged.lost else current_placement(job)
    kept = tuple(part for part in ours if part.node != node)
    low, _ = job.spec.gpu_range
    return kept if kept and placement_size(kept) >= low else None


def stage_lost(
    job: JobRecord, node: str, target: Placement, *, command_id: str, now: float, cause: str
) -> JobRecord:
    """The job with a shrink off lost `node` staged: its part there dropped at once (the
    node's agent has fenced it: nothing runs there that the job may count on) and barred
    for the attempt, as a worker host that could not start is (`drop_node`); the rest of
    its GPUs held as they are. A shrink off lost nodes already staged is superseded by
    one off them all (its supervisor gives the older up)."""
    shedding = job.resize if job.resize is not None and job.resize.lost else None
    staged = StagedResize(
        command_id=command_id,
        node=job.grants[0].node,
        before=current_placement(job),
        after=_placement(job, _by_node(target)),
        staged_at=now,
        cause=cause,
        lost=(node,) if shedding is None else (*shedding.lost, node),
    )
    dropped = drop_node(job, node)
    return dropped.model_copy(
        update={"resize": staged, "reason": f"resizing {describe(staged)}: {cause}"}
    )


def stage(
    job: JobRecord, target: Placement, *, command_id: str, now: float, cause: str
) -> JobRecord:
    """The job with the resize staged: holding every GPU of both sizes."""
    before = current_placement(job)
    staged = StagedResize(
        command_id=command_id,
        node=job.grants[0].node,
        before=before,
        after=_placement(job, _by_node(target)),
        staged_at=now,
        cause=cause,
    )
    held = _with_placement(job, _union(before, target))
    return held.model_copy(
        update={"resize": staged, "reason": f"resizing {describe(staged)}: {cause}"}
    )


def committed_placement(staged: StagedResize, held: Placement) -> Placement:
    """The GPUs the job keeps: those its workers hold, as the supervisor reported them
    (after a shrink Horovod, not the brain, chose the workers to retire), when that
    report has as many GPUs on each node as the target and within what the staged
    resize held there; else the target."""
    ours = _union(staged.before, staged.after)
    target = {part.node: len(part.gpus) for part in staged.after}
    if (
        held
        and {part.node: len(part.gpus) for part in held} == target
        and all(set(part.gpus) <= ours.get(part.node, set()) for part in held)
    ):
        reported = _by_node(held)
        return tuple(
            NodeGpus(node=part.node, gpus=tuple(sorted(reported[part.node])))
            for part in staged.after
        )
    return staged.after


def released(staged: StagedResize, kept: Placement) -> Placement:
    """The GPUs of the placement before that `kept` does not hold."""
    held = _by_node(kept)
    out = (
        NodeGpus(node=p.node, gpus=tuple(sorted(set(p.gpus) - held.get(p.node, set()))))
        for p in staged.before
        if set(p.gpus) - held.get(p.node, set())
    )
    return tuple(out)


def commit(job: JobRecord, message: str, held: Placement = ()) -> JobRecord:
    """The staged resize done: the job holds its target GPUs (or, reported by its
    supervisor, those its workers hold: `committed_placement`)."""
    assert job.resize is not None
    kept = _with_placement(job, _by_node(committed_placement(job.resize, held)))
    return kept.model_copy(update={"resize": None, "reason": message})


def roll_back(job: JobRecord, message: str) -> JobRecord:
    """The staged resize undone: the job holds what it held before; a revert undone
    keeps every GPU of both sizes (a silent supervisor may use any of them)."""
    staged = job.resize
    assert staged is not None
    gpus = _by_node(job.placement) if staged.reverting else _by_node(staged.before)
    return _with_placement(job, gpus).model_copy(update={"resize": None, "reason": message})


def stage_revert(job: JobRecord, message: str, *, now: float) -> JobRecord:
    """A resize rolled back while its supervisor may have moved part of the way: the
    size before, staged as a resize of its own (the grants still hold both sizes)."""
    staged = job.resize
    assert staged is not None
    assert not staged.reverting
    revert = StagedResize(
        command_id=f"{staged.command_id}-revert",
        node=staged.node,
        before=staged.after,
        after=staged.before,
        staged_at=now,
        cause=f"roll back the resize {describe(staged)}"[:1000],
        reverting=True,
    )
    return job.model_copy(update={"resize": revert, "reason": message})


def resize_command(job: JobRecord, *, epoch: int, issued_at: float) -> Resize:
    """The command for the job's staged resize; re-sent unchanged by a new leader (the
    supervisor and JetStream de-duplicate by its id)."""
    assert job.resize is not None
    return Resize(
        command_id=job.resize.command_id,
        epoch=epoch,
        issued_at=issued_at,
        job_id=job.job_id,
        world_size=job.resize.to_size,
        cause=job.resize.cause[:1000],
        placement=job.resize.after,
        lost=job.resize.lost,
    )


def describe(staged: StagedResize, after: Placement | None = None) -> str:
    """`2 -> 4 GPUs (n1:0,1 -> n1:0,1, n2:0,1)`; `after`: the placement it ended with,
    where that is not the target (after a shrink, Horovod chose the workers to retire)."""
    after = staged.after if after is None else after
    nodes = {part.node for part in (*staged.before, *after)}
    sizes = f"{staged.from_size} -> {staged.to_size} GPUs"
    if len(nodes) == 1:
        return f"{sizes} on {staged.node}"
    return f"{sizes} ({describe_placement(staged.before)} -> {describe_placement(after)})"
