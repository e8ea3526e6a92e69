"""`decide(snapshot, now)`: the brain's whole policy, as one pure function.

Synchronous, deterministic, no I/O, no clock and no randomness of its own: the live
brain and the trace simulator call this very function. The pipeline is fixed
(ordering -> placement); which ordering and which placement run are plugins named in
the `Policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from brain.core.model import Action, ClusterSnapshot, Decisions, Place, Wait
from brain.core.ordering import ORDERINGS
from brain.core.placement import PLACEMENTS, Fit, FreeGpus
from schemas.errors import AlnairError


class UnknownPlugin(AlnairError, KeyError):
    def __init__(self, stage: str, name: str, known: list[str]) -> None:
        super().__init__(f"unknown {stage} policy {name!r}; known: {', '.join(sorted(known))}")
        self.stage = stage
        self.name = name


@dataclass(frozen=True, slots=True)
class Policy:
    order: str = "fifo"
    placement: str = "consolidate"

    def validate(self) -> Policy:
        if self.order not in ORDERINGS:
            raise UnknownPlugin("order", self.order, list(ORDERINGS))
        if self.placement not in PLACEMENTS:
            raise UnknownPlugin("placement", self.placement, list(PLACEMENTS))
        return self

    def describe(self) -> str:
        return f"order={self.order} placement={self.placement}"


DEFAULT_POLICY = Policy()


def decide(snapshot: ClusterSnapshot, now: float, policy: Policy = DEFAULT_POLICY) -> Decisions:
    order = ORDERINGS[policy.order]
    place = PLACEMENTS[policy.placement]
    free = FreeGpus(snapshot.nodes)
    capacity = free.total_capacity()
    ordered = order(snapshot.pending, now)
    actions: list[Action] = []
    blocked_by: str | None = None
    for job in ordered.jobs:
        if job.gpus > capacity:
            # Never satisfiable as the cluster stands; it must not block the queue.
            actions.append(
                Wait(job.job_id, f"needs {job.gpus} GPUs; the cluster has {capacity} schedulable")
            )
            continue
        if blocked_by is not None:
            actions.append(Wait(job.job_id, f"queued behind job {blocked_by} ({policy.order})"))
            continue
        result = place(job.gpus, free)
        if isinstance(result, Fit):
            free.take(result.grants)
            where = ", ".join(f"{g.node}[{','.join(map(str, g.gpus))}]" for g in result.grants)
            actions.append(Place(job.job_id, result.grants, f"placed on {where} ({policy.order})"))
            continue
        actions.append(Wait(job.job_id, result.reason))
        if ordered.head_of_line_blocking:
            blocked_by = job.job_id
    return Decisions(tuple(actions))
