"""The indexed placement ledger against a brute-force reading of the same free GPUs.

`FreeGpus` keeps nodes bucketed by free-GPU count (cluster-wide and per switch) so that a
placement never scans the cluster. These properties check, on small random clusters
after random takes and gives, that it answers exactly what scanning every node would,
and that preemption in `decide` frees no more than the placements it makes use.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import Grant, NodeView, Policy, decide
from brain.core.model import NoFit, gpus_said
from brain.core.placement import (
    Fit,
    FreeGpus,
    PlacementRequest,
    PlacementResult,
    consolidate,
)
from tests.test_policy_properties import World, final_allocation, policies, worlds


@dataclass
class Reference:
    """The ledger as plain dicts, read by scanning every node (the pre-index algorithm)."""

    free: dict[str, list[int]]
    switch: dict[str, str]
    capacity: dict[str, int]

    def total_free(self) -> int:
        return sum(len(v) for v in self.free.values())

    def fewest_nodes(self, gpus: int, candidates: list[str]) -> tuple[Grant, ...] | None:
        ordered = sorted(candidates, key=lambda n: (-len(self.free[n]), n))
        grants: list[Grant] = []
        needed = gpus
        for node in ordered:
            take = min(needed, len(self.free[node]))
            if needed == 0 or take == 0:
                break
            grants.append(Grant(node, tuple(self.free[node][:take])))
            needed -= take
        return tuple(grants) if needed == 0 else None

    def consolidate(self, request: PlacementRequest) -> PlacementResult:
        gpus = request.gpus
        single = [n for n in self.free if len(self.free[n]) >= gpus]
        if single:
            node = min(single, key=lambda n: (len(self.free[n]), n))
            return Fit((Grant(node, tuple(self.free[node][:gpus])),))
        best: tuple[Grant, ...] | None = None
        for switch in sorted(set(self.switch.values())):
            members = [n for n in self.free if self.switch[n] == switch]
            grants = self.fewest_nodes(gpus, members)
            if grants is not None and (best is None or len(grants) < len(best)):
                best = grants
        largest = max(self.capacity.values(), default=0)
        preferred = -(-gpus // largest) if largest > 0 else gpus
        if best is not None and (request.may_spread or len(best) <= preferred):
            return Fit(best)
        total = self.total_free()
        if request.may_spread:
            anywhere = self.fewest_nodes(gpus, list(self.free))
            if anywhere is not None:
                return Fit(anywhere)
        elif total >= gpus:
            return NoFit(
                f"waiting for {gpus_said(gpus)} on {preferred} node(s) under one switch "
                f"({total} free, but scattered)",
                kind="scattered",
            )
        capacity = sum(self.capacity.values())
        return NoFit(
            f"needs {gpus_said(gpus)}; {total} free of {capacity} schedulable", kind="too_few_free"
        )


@dataclass(frozen=True)
class Case:
    nodes: tuple[NodeView, ...]
    # (node, GPUs, give?) applied in order after the ledger is built.
    moves: tuple[tuple[str, tuple[int, ...], bool], ...]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    nodes: list[NodeView] = []
    for i in range(draw(st.integers(1, 14))):
        gpus = tuple(range(draw(st.integers(1, 8))))
        free = frozenset(g for g in gpus if draw(st.booleans()))
        switch = f"s{draw(st.integers(0, 2))}"
        nodes.append(NodeView(f"n{draw(st.integers(0, 99))}-{i}", gpus, free, switch))
    free_now = {n.name: set(n.free) for n in nodes}
    moves: list[tuple[str, tuple[int, ...], bool]] = []
    for _ in range(draw(st.integers(0, 12))):
        node = draw(st.sampled_from(nodes))
        give = draw(st.booleans())
        pool = sorted(set(node.gpus) - free_now[node.name] if give else free_now[node.name])
        if not pool:
            continue
        picked = tuple(sorted(draw(st.sets(st.sampled_from(pool), min_size=1))))
        if give:
            free_now[node.name] |= set(picked)
        else:
            free_now[node.name] -= set(picked)
        moves.append((node.name, picked, give))
    return Case(tuple(nodes), tuple(moves))


def start(case: Case) -> tuple[FreeGpus, Reference]:
    ledger = FreeGpus(case.nodes)
    reference = Reference(
        {n.name: sorted(n.free) for n in case.nodes},
        {n.name: n.switch for n in case.nodes},
        {n.name: len(n.gpus) for n in case.nodes},
    )
    return ledger, reference


def move(
    ledger: FreeGpus, reference: Reference, node: str, gpus: tuple[int, ...], give: bool
) -> None:
    if give:
        ledger.give((Grant(node, gpus),))
        reference.free[node] = sorted({*reference.free[node], *gpus})
    else:
        ledger.take((Grant(node, gpus),))
        reference.free[node] = [g for g in reference.free[node] if g not in gpus]


def build(case: Case) -> tuple[FreeGpus, Reference]:
    ledger, reference = start(case)
    for node, gpus, give in case.moves:
        move(ledger, reference, node, gpus, give)
    return ledger, reference


def a_request(data: st.DataObject, reference: Reference) -> PlacementRequest:
    """Mostly jobs that fit no single node but may fit a switch: the multi-node paths,
    which a request of any size would rarely reach."""
    most = max((len(v) for v in reference.free.values()), default=0)
    total = reference.total_free()
    gpus = data.draw(st.integers(most + 1, total + 2) | st.integers(1, max(most, 1)))
    return PlacementRequest(gpus, data.draw(st.booleans()))


@settings(max_examples=400, deadline=None)
@given(cases(), st.data())
def test_indexed_placement_agrees_with_a_scan_of_every_node(
    case: Case, data: st.DataObject
) -> None:
    ledger, reference = build(case)
    request = a_request(data, reference)
    assert ledger.total_free() == reference.total_free()
    assert ledger.most_free() == max((len(v) for v in reference.free.values()), default=0)
    for node, free in reference.free.items():
        assert ledger.free_on(node) == len(free)
        assert ledger.lowest(node, 8) == tuple(free[:8])
    assert consolidate(request, ledger) == reference.consolidate(request)


@settings(max_examples=200, deadline=None)
@given(cases(), st.data())
def test_placements_between_changes_agree_with_a_scan(case: Case, data: st.DataObject) -> None:
    """A switch's node buckets are rebuilt when read after a change, and switches are
    counted by free GPUs as they change: a placement asked between every two changes
    sees what a scan sees."""
    ledger, reference = start(case)
    for node, gpus, give in case.moves:
        request = a_request(data, reference)
        assert consolidate(request, ledger) == reference.consolidate(request)
        move(ledger, reference, node, gpus, give)
    request = a_request(data, reference)
    assert consolidate(request, ledger) == reference.consolidate(request)


@settings(max_examples=300, deadline=None)
@given(cases(), st.data())
def test_a_placement_keeps_its_promises(case: Case, data: st.DataObject) -> None:
    ledger, reference = build(case)
    request = a_request(data, reference)
    result = consolidate(request, ledger)
    fits_one_node = any(len(v) >= request.gpus for v in reference.free.values())
    if request.may_spread or fits_one_node:
        # A job that fits somewhere (anywhere, or on one node) is placed.
        assert isinstance(result, Fit) == (reference.total_free() >= request.gpus)
    if not isinstance(result, Fit):
        return
    granted = [(g.node, gpu) for g in result.grants for gpu in g.gpus]
    # Exactly its size, no GPU twice, every one of them free.
    assert len(granted) == len(set(granted)) == request.gpus
    assert ledger.all_free(result.grants)
    if fits_one_node:
        # Locality: one node when one node will do, the fullest that does.
        assert len(result.grants) == 1
        fullest = min(len(v) for v in reference.free.values() if len(v) >= request.gpus)
        assert len(reference.free[result.grants[0].node]) == fullest
    if not request.may_spread:
        # Strict consolidation: one switch, and no more nodes than the job's size needs.
        assert len({reference.switch[g.node] for g in result.grants}) == 1
        largest = max(reference.capacity.values())
        assert len(result.grants) <= -(-request.gpus // largest)
    # Taking it leaves the ledger consistent with a scan.
    ledger.take(result.grants)
    for grant in result.grants:
        reference.free[grant.node] = [g for g in reference.free[grant.node] if g not in grant.gpus]
    assert ledger.total_free() == reference.total_free()
    assert consolidate(request, ledger) == reference.consolidate(request)


@settings(max_examples=200, deadline=None)
@given(cases(), st.sets(st.integers(0, 13), max_size=3), st.data())
def test_a_view_without_some_nodes_places_as_a_scan_of_the_others(
    case: Case, dropped: set[int], data: st.DataObject
) -> None:
    ledger, reference = build(case)
    avoid = frozenset(n.name for i, n in enumerate(case.nodes) if i in dropped)
    for name in avoid:
        del reference.free[name], reference.switch[name], reference.capacity[name]
    request = a_request(data, reference)
    view = ledger.excluding(avoid)
    assert consolidate(request, view) == reference.consolidate(request)


def test_nodes_with_the_same_free_count_are_tried_by_name() -> None:
    nodes = [NodeView(name, (0, 1, 2, 3), frozenset({0, 1}), "s") for name in ("b", "c", "a")]
    ledger = FreeGpus(nodes)
    assert consolidate(PlacementRequest(2), ledger) == Fit((Grant("a", (0, 1)),))
    assert consolidate(PlacementRequest(5), ledger) == Fit(
        (Grant("a", (0, 1)), Grant("b", (0, 1)), Grant("c", (0,)))
    )


@settings(max_examples=200, deadline=None)
@given(worlds(), policies)
def test_preemption_frees_no_more_than_the_placements_use(world: World, policy: Policy) -> None:
    decisions = decide(world.snapshot, world.now, policy)
    placed = {(g.node, gpu) for p in decisions.placements for g in p.grants for gpu in g.gpus}
    for preemption in decisions.preemptions:
        # A victim is preempted only when a placement of this cycle takes its GPUs; one
        # whose GPUs nobody took keeps running.
        freed = {(g.node, gpu) for g in preemption.grants for gpu in g.gpus}
        assert freed & placed, preemption
    # And nothing placed lands on a job that keeps running.
    kept = final_allocation(world, decisions)
    placed_ids = {p.job_id for p in decisions.placements}
    for job_id, gpus in kept.items():
        if job_id not in placed_ids:
            assert not gpus & placed


def test_a_job_asking_for_no_gpu_is_refused_by_name() -> None:
    from brain.core import ClusterSnapshot, JobView
    from brain.core.decide import InvalidSnapshot

    snapshot = ClusterSnapshot(
        (NodeView("n0", (0, 1), frozenset({0, 1})),), (JobView("7", 0, submitted_at=0.0),)
    )
    with pytest.raises(InvalidSnapshot, match="job 7 asks for 0 GPUs"):
        decide(snapshot, 1.0)


def test_taking_gpus_that_are_not_free_is_refused() -> None:
    ledger = FreeGpus([NodeView("a", (0, 1, 2, 3), frozenset({2}), "s")])
    # One GPU free, another asked for: the single-GPU comparison, not a sorted copy.
    with pytest.raises(ValueError, match="not all free"):
        ledger.take((Grant("a", (1,)),))
    ledger.give((Grant("a", (0,)),))
    with pytest.raises(ValueError, match="not all free"):
        ledger.take((Grant("a", (0, 1)),))
    # A GPU given to a node with none free, and taken back, leaves it as it was.
    ledger.take((Grant("a", (0, 2)),))
    ledger.give((Grant("a", (3,)),))
    assert ledger.free_on("a") == 1 and ledger.best_fit(1) == "a"
    ledger.take((Grant("a", (3,)),))
    assert ledger.free_on("a") == 0 and ledger.best_fit(1) is None
