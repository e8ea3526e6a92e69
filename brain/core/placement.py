"""Placement plugins: which GPUs a job gets, given what is free.

A placement sees a `FreeGpus` ledger, which the decision cycle stages grants on, so
that jobs placed earlier in the same cycle are accounted for (all-or-nothing: a
placement that cannot take every GPU it needs takes none).

Locality follows Philly: a job first asks for its preferred placement (one node, or
the fewest nodes under one switch); a job that could not start that way within the
policy's back-off may spread wider, except a network-sensitive job, which keeps strict
consolidation. The pipeline decides `may_spread`; the plugin only obeys it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from brain.core.model import Grant, NodeView


class FreeGpus:
    """A staging ledger of free GPUs per node, for one decision cycle."""

    def __init__(self, nodes: Iterable[NodeView]) -> None:
        self._free: dict[str, list[int]] = {n.name: sorted(n.free) for n in nodes}
        self._switch: dict[str, str] = {}
        self._capacity: dict[str, int] = {}
        self._by_switch: dict[str, list[str]] = {}
        for n in nodes:
            self._switch[n.name] = n.switch
            self._capacity[n.name] = len(n.gpus)
            self._by_switch.setdefault(n.switch, []).append(n.name)

    def free_on(self, node: str) -> int:
        return len(self._free[node])

    def nodes(self) -> list[str]:
        return list(self._free)

    def switch_of(self, node: str) -> str:
        return self._switch[node]

    def total_free(self) -> int:
        return sum(len(v) for v in self._free.values())

    def total_capacity(self) -> int:
        return sum(self._capacity.values())

    def largest_node(self) -> int:
        return max(self._capacity.values(), default=0)

    def switches(self) -> dict[str, list[str]]:
        return self._by_switch

    def all_free(self, grants: Iterable[Grant]) -> bool:
        """Whether every GPU of these grants is still free in this ledger."""
        for grant in grants:
            free = self._free.get(grant.node)
            if free is None or any(gpu not in free for gpu in grant.gpus):
                return False
        return True

    def take(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            free = self._free[grant.node]
            for gpu in grant.gpus:
                free.remove(gpu)

    def give(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            if grant.node in self._free:
                self._free[grant.node] = sorted({*self._free[grant.node], *grant.gpus})

    def lowest(self, node: str, count: int) -> tuple[int, ...]:
        return tuple(self._free[node][:count])

    def excluding(self, avoid: frozenset[str]) -> FreeGpus:
        """A copy without the `avoid` nodes, for a job retried away from where it failed.
        Placing on the copy takes nothing: the cycle takes the fit on its own ledger."""
        view = FreeGpus(())
        for name, free in self._free.items():
            if name in avoid:
                continue
            view._free[name] = list(free)
            view._switch[name] = self._switch[name]
            view._capacity[name] = self._capacity[name]
            view._by_switch.setdefault(self._switch[name], []).append(name)
        return view


@dataclass(frozen=True, slots=True)
class Fit:
    grants: tuple[Grant, ...]


@dataclass(frozen=True, slots=True)
class NoFit:
    reason: str


PlacementResult = Fit | NoFit


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    gpus: int
    # False: only the preferred locality (fewest nodes under one switch) will do.
    may_spread: bool = True


Placement = Callable[[PlacementRequest, FreeGpus], PlacementResult]


def _fewest_nodes(gpus: int, free: FreeGpus, candidates: list[str]) -> tuple[Grant, ...] | None:
    """Greedy by most free GPUs: minimal node count for a gang across nodes."""
    ordered = sorted(candidates, key=lambda n: (-free.free_on(n), n))
    grants: list[Grant] = []
    needed = gpus
    for node in ordered:
        if needed == 0:
            break
        take = min(needed, free.free_on(node))
        if take == 0:
            break
        grants.append(Grant(node, free.lowest(node, take)))
        needed -= take
    return tuple(grants) if needed == 0 else None


def _preferred_node_count(gpus: int, free: FreeGpus) -> int:
    """The fewest nodes the job could ever use: its GPUs over the largest nodes."""
    largest = free.largest_node()
    return -(-gpus // largest) if largest > 0 else gpus


def consolidate(request: PlacementRequest, free: FreeGpus) -> PlacementResult:
    """Pack a job on one node if any fits (best fit), else on the fewest nodes of one
    switch; once it may spread, on the fewest nodes anywhere."""
    gpus = request.gpus
    single = [n for n in free.nodes() if free.free_on(n) >= gpus]
    if single:
        # Best fit: the fullest node that still fits, to keep whole nodes free for
        # large jobs.
        node = min(single, key=lambda n: (free.free_on(n), n))
        return Fit((Grant(node, free.lowest(node, gpus)),))
    best: tuple[Grant, ...] | None = None
    by_switch = free.switches()
    for switch in sorted(by_switch):
        grants = _fewest_nodes(gpus, free, by_switch[switch])
        if grants is not None and (best is None or len(grants) < len(best)):
            best = grants
    preferred = _preferred_node_count(gpus, free)
    if best is not None and (request.may_spread or len(best) <= preferred):
        return Fit(best)
    if request.may_spread:
        anywhere = _fewest_nodes(gpus, free, free.nodes())
        if anywhere is not None:
            return Fit(anywhere)
    elif free.total_free() >= gpus:
        return NoFit(
            f"waiting for {gpus} GPUs on {preferred} node(s) under one switch "
            f"({free.total_free()} free, but scattered)"
        )
    return NoFit(
        f"needs {gpus} GPUs; {free.total_free()} free of {free.total_capacity()} schedulable"
    )


PLACEMENTS: Final[dict[str, Placement]] = {"consolidate": consolidate}
