"""The brain's side of elastic jobs: how one is launched, and its resizes as records.

It owns the translation of an elastic JobSpec into the command the agent runs (the
user's training command wrapped by `workloads.supervisor`, which starts horovodrun in
elastic mode and obeys Resize commands on `alnair.job.<job>.cmd`), and the pure
record changes of a resize, which is a statement:

- stage: the job's grants hold every GPU of both sizes (a grow's added GPUs at once,
  so nobody else takes them; a shrink's released ones until their workers are gone)
  and `JobRecord.resize` says what was asked, with the command id;
- commit, on the supervisor's `ResizeCompleted` with `ok`: the grants are the target;
- roll back, on a refusal: the grants are what they were; or, when the supervisor may
  have moved part of the way (it timed out, or refused after trying), a revert to the
  old size is staged instead, like any resize: the job holds every GPU of both sizes
  (a grow's new workers may run on the added ones) until the supervisor confirms it.
  A revert that is rolled back in turn ends holding them all.

Everything here is pure (no clock, no ids, no I/O): the shell (brain/service.py)
journals what these return and sends the commands. It must not import torch or
horovod.

An elastic job runs on one node, where its supervisor starts every worker, and changes
size there; except one that asks to start on more GPUs than any node has
(`spans_nodes`): it is placed across nodes like a rigid job, at that size, which it
keeps. Its supervisor runs on the first node and starts the workers of the others
through their worker hosts (`workloads/worker_host.py`, each node's process of the job).
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from schemas.commands import Resize
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant, StagedResize


def spans_nodes(job: JobRecord, largest_node_gpus: int) -> bool:
    """Whether the elastic `job` runs (or is to run) across nodes, at a fixed size: it
    was placed so, or it asks to start on more GPUs than the largest node has."""
    if not job.spec.elastic:
        return False
    return len(job.grants) > 1 or job.spec.gpus > largest_node_gpus


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
    worker host.
    """
    if not spec.elastic:
        return spec.command
    if rank > 0:
        return (sys.executable, "-m", "workloads.worker_host")
    low, high = spec.gpu_range
    start = spec.gpus if granted_gpus is None else granted_gpus
    if remote:
        # A fixed size across nodes: Horovod may go on with fewer after a failure.
        total = start + sum(slots for _, slots in remote)
        low, high, start = min(low, total), total, total
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


@dataclass(frozen=True, slots=True)
class ResizeTarget:
    """The GPUs of the job's one node it is to run on."""

    node: str
    gpus: tuple[int, ...]


def current_gpus(job: JobRecord) -> tuple[int, ...]:
    """The GPUs the job runs on now: before a staged resize, what it had."""
    if job.resize is not None:
        return job.resize.from_gpus
    return tuple(gpu for grant in job.grants for gpu in grant.gpus)


def check_resize(
    job: JobRecord, target: ResizeTarget, free: Collection[int], *, supervisor_ready: bool
) -> ResizeRefused | None:
    """Whether `job` may be resized to `target` now; `free` are its node's schedulable
    GPUs no job holds; `supervisor_ready` that its supervisor has been heard from (it
    listens for commands before its workers start)."""
    return check_resizable(
        job, len(target.gpus), supervisor_ready=supervisor_ready
    ) or check_target(job, target, free)


def check_resizable(job: JobRecord, size: int, *, supervisor_ready: bool) -> ResizeRefused | None:
    """Whether `job` may run on `size` GPUs, and may be resized now at all."""
    label = f"job {job.job_id}"
    if not job.spec.elastic:
        return ResizeRefused(
            "invalid",
            f"{label} is not elastic: it runs on exactly {job.spec.gpus} GPUs "
            "(submit with --elastic --min-gpus --max-gpus to make it resizable)",
        )
    low, high = job.spec.gpu_range
    if not low <= size <= high:
        return ResizeRefused(
            "invalid", f"{label} runs on {low}..{high} GPUs; {size} is outside that range"
        )
    if job.state is not JobState.RUNNING:
        return ResizeRefused("conflict", f"{label} is {job.state.value}, not running")
    if len(job.grants) > 1:
        return ResizeRefused(
            "invalid",
            f"{label} runs across nodes {', '.join(job.nodes)}: it keeps the size it started "
            "at (resizing across nodes is not built)",
        )
    if job.resize is not None:
        staged = job.resize
        return ResizeRefused(
            "conflict",
            f"{label} is already resizing {len(staged.from_gpus)} -> {len(staged.to_gpus)} "
            f"GPUs (command {staged.command_id}); wait for it to commit or roll back",
        )
    if len(job.grants) != 1 or not all(g.pid is not None and not g.exited for g in job.grants):
        return ResizeRefused("conflict", f"{label} has not started yet")
    if not supervisor_ready:
        return ResizeRefused(
            "conflict", f"{label}'s supervisor has not reported yet; try again in a moment"
        )
    return None


def check_target(
    job: JobRecord, target: ResizeTarget, free: Collection[int]
) -> ResizeRefused | None:
    """Whether `target` is GPUs the running `job` may hold: on its node, keeping some
    or all of its GPUs, the others free."""
    label = f"job {job.job_id}"
    size = len(target.gpus)
    grant = job.grants[0]
    if target.node != grant.node:
        return ResizeRefused(
            "invalid",
            f"{label} runs on node {grant.node}; an elastic job stays on one node "
            f"(asked for {target.node})",
        )
    if len(set(target.gpus)) != size:
        return ResizeRefused("invalid", f"GPUs {list(target.gpus)} name one GPU twice")
    # Workers keep their GPUs: a shrink keeps some of them, a grow all of them.
    held = set(grant.gpus)
    wanted = set(target.gpus)
    if not (wanted <= held or held <= wanted):
        return ResizeRefused(
            "invalid",
            f"{label} holds GPUs {sorted(held)}: a resize keeps some or all of them, "
            f"not {sorted(wanted)}",
        )
    taken = set(target.gpus) - held - set(free)
    if taken:
        return ResizeRefused(
            "conflict", f"GPUs {sorted(taken)} of node {grant.node} are not free for {label}"
        )
    return None


def choose_target(job: JobRecord, gpus: int, free: Collection[int]) -> ResizeTarget | ResizeRefused:
    """The GPUs an operator's `resize JOB N` means: a shrink keeps the lowest-numbered
    GPUs it holds, a grow adds the lowest-numbered free ones of its node."""
    if len(job.grants) != 1:
        return ResizeRefused("conflict", f"job {job.job_id} is not running on one node")
    grant = job.grants[0]
    held = current_gpus(job)
    if gpus <= len(held):
        return ResizeTarget(grant.node, tuple(sorted(held)[:gpus]))
    extra = sorted(set(free) - set(held))[: gpus - len(held)]
    if len(held) + len(extra) < gpus:
        return ResizeRefused(
            "conflict",
            f"job {job.job_id} can grow to {len(held) + len(extra)} GPUs at most now: "
            f"node {grant.node} has {len(extra)} free and an elastic job stays on one node",
        )
    return ResizeTarget(grant.node, tuple(sorted((*held, *extra))))


def _with_gpus(job: JobRecord, gpus: tuple[int, ...]) -> tuple[NodeGrant, ...]:
    return tuple(g.model_copy(update={"gpus": tuple(sorted(gpus))}) for g in job.grants)


def stage(
    job: JobRecord, target: ResizeTarget, *, command_id: str, now: float, cause: str
) -> JobRecord:
    """The job with the resize staged: holding every GPU of both sizes."""
    before = current_gpus(job)
    staged = StagedResize(
        command_id=command_id,
        node=target.node,
        from_gpus=before,
        to_gpus=tuple(sorted(target.gpus)),
        staged_at=now,
        cause=cause,
    )
    held = tuple(sorted({*before, *target.gpus}))
    return job.model_copy(
        update={
            "grants": _with_gpus(job, held),
            "resize": staged,
            "reason": f"resizing {describe(staged)}: {cause}",
        }
    )


def committed_gpus(staged: StagedResize, held: Collection[int]) -> tuple[int, ...]:
    """The GPUs the job keeps: those its workers hold, as the supervisor reported them
    (after a shrink Horovod, not the brain, chose the workers to retire), when that
    report is the right size and within what the staged resize held; else the target."""
    ours = {*staged.from_gpus, *staged.to_gpus}
    if held and len(set(held)) == len(staged.to_gpus) and set(held) <= ours:
        return tuple(sorted(set(held)))
    return staged.to_gpus


def commit(job: JobRecord, message: str, held: Collection[int] = ()) -> JobRecord:
    """The staged resize done: the job holds its target GPUs (or, reported by its
    supervisor, those its workers hold: `committed_gpus`)."""
    assert job.resize is not None
    gpus = committed_gpus(job.resize, held)
    return job.model_copy(
        update={"grants": _with_gpus(job, gpus), "resize": None, "reason": message}
    )


def roll_back(job: JobRecord, message: str) -> JobRecord:
    """The staged resize undone: the job holds what it held before; a revert undone
    keeps every GPU of both sizes (a silent supervisor may use any of them)."""
    staged = job.resize
    assert staged is not None
    gpus = job.grants[0].gpus if staged.reverting else staged.from_gpus
    return job.model_copy(
        update={"grants": _with_gpus(job, gpus), "resize": None, "reason": message}
    )


def stage_revert(job: JobRecord, message: str, *, now: float) -> JobRecord:
    """A resize rolled back while its supervisor may have moved part of the way: the
    size before, staged as a resize of its own (the grants still hold both sizes)."""
    staged = job.resize
    assert staged is not None
    assert not staged.reverting
    revert = StagedResize(
        command_id=f"{staged.command_id}-revert",
        node=staged.node,
        from_gpus=staged.to_gpus,
        to_gpus=staged.from_gpus,
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
        world_size=len(job.resize.to_gpus),
        cause=job.resize.cause[:1000],
        gpus=job.resize.to_gpus,
    )


def describe(staged: StagedResize) -> str:
    return f"{len(staged.from_gpus)} -> {len(staged.to_gpus)} GPUs on {staged.node}"
