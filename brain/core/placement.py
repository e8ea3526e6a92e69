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

import bisect
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Final

from brain.core.model import Grant, JobView, NodeView, NoFit, gpus_said
from brain.core.record import record


class _Buckets:
    """Node names by how many GPUs they have free: for each count from 1 up, the names
    in sorted order. Nodes with nothing free are not kept: no placement wants them.

    Sorted lists rather than sets, so that the tie-breaks placement promises (by node
    name) cost nothing to find; an insert or a removal is a binary search and a short
    memmove, never a scan of the cluster.
    """

    __slots__ = ("rows",)

    def __init__(self) -> None:
        # `rows[count]`: the nodes with `count` GPUs free, by name. Read and moved in
        # place by `FreeGpus` on its hot paths (a move is one deletion and one insort,
        # written out there rather than behind a call).
        self.rows: list[list[str]] = [[]]

    def load(self, free_counts: Iterable[tuple[str, int]]) -> None:
        """Fill an empty index in one go (a sort per count, not an insert per node)."""
        for name, count in free_counts:
            if count > 0:
                self._row(count).append(name)
        for row in self.rows:
            row.sort()

    def _row(self, count: int) -> list[str]:
        while len(self.rows) <= count:
            self.rows.append([])
        return self.rows[count]

    def most_free(self) -> int:
        for count in range(len(self.rows) - 1, 0, -1):
            if self.rows[count]:
                return count
        return 0

    def nodes_for(self, gpus: int) -> int:
        """How many nodes, roomiest first, it takes to gather `gpus` free GPUs; 0 when
        these nodes do not have that many."""
        needed = gpus
        nodes = 0
        for count in range(len(self.rows) - 1, 0, -1):
            have = len(self.rows[count])
            if have * count >= needed:
                return nodes + -(-needed // count)
            needed -= have * count
            nodes += have
        return 0


class FreeGpus:
    """A staging ledger of free GPUs per node, for one decision cycle.

    Indexed so that a placement never scans the cluster: nodes are bucketed by their
    free-GPU count, cluster-wide (kept as GPUs are taken and given) and per switch
    (rebuilt when read after a change: O(nodes of the switch)), and the totals are kept.
    Building one is O(nodes log nodes); every other operation costs what it touches.
    """

    def __init__(self, nodes: Iterable[NodeView]) -> None:
        by_name = {n.name: n for n in nodes}
        # Every change since it was built or reset, the node's name in the order they
        # came: what `KeptLedger` restores (`touched`), and what a reader that keeps its
        # own view of the ledger redoes (`changed_since`); `epoch` moves on at `reset`.
        self._log: list[str] = []
        self.epoch = 0
        # Most nodes of a busy cluster have nothing free: an empty list, not a sort.
        self._free: dict[str, list[int]] = {
            name: sorted(n.free) if n.free else [] for name, n in by_name.items()
        }
        # Each node's schedulable GPUs: a running job may hold others (drained since, or
        # faulty), which are never given to the ledger (`give`). Nodes alike (most are)
        # share one set: a look-up, not a set built for each node.
        alike: dict[tuple[int, ...], frozenset[int]] = {}
        self._gpus: dict[str, frozenset[int]] = {}
        for name, n in by_name.items():
            schedulable = alike.get(n.gpus)
            if schedulable is None:
                schedulable = alike[n.gpus] = frozenset(n.gpus)
            self._gpus[name] = schedulable
        self._switch: dict[str, str] = {name: n.switch for name, n in by_name.items()}
        self._capacity: dict[str, int] = {name: len(n.gpus) for name, n in by_name.items()}
        self._by_switch: dict[str, list[str]] = {}
        for name, switch in self._switch.items():
            self._by_switch.setdefault(switch, []).append(name)
        self._index()

    def _index(self) -> None:
        # Counts by `map`, at C speed: no generator resumed for each of the nodes.
        self._total_free = sum(map(len, self._free.values()))
        self._total_capacity = sum(self._capacity.values())
        self._largest = max(self._capacity.values(), default=0)
        self._all = _Buckets()
        self._all.load(zip(self._free, map(len, self._free.values()), strict=True))
        self._switch_order = sorted(self._by_switch)
        self._switch_free: dict[str, int] = {
            switch: sum(map(len, map(self._free.__getitem__, names)))
            for switch, names in self._by_switch.items()
        }
        # A switch's buckets are built when first read and dropped when one of its
        # nodes changes: only multi-node gangs read them, and only for switches with
        # enough GPUs free, while every take and give changes a node.
        self._switch_nodes: dict[str, _Buckets] = {}
        # How many switches have each count of free GPUs, and the largest count: a gang
        # no switch has room for is refused without a look at any switch.
        most = max(self._switch_free.values(), default=0)
        self._switches_by_free = [0] * (most + 1)
        for count in self._switch_free.values():
            self._switches_by_free[count] += 1
        self._switch_most = most

    def free_on(self, node: str) -> int:
        """Free GPUs on `node`; none on a node not schedulable (drained, lost)."""
        free = self._free.get(node)
        return 0 if free is None else len(free)

    def schedulable(self, node: str, gpu: int) -> bool:
        """Is this GPU one the ledger may hand out (not drained, faulty or lost)?"""
        gpus = self._gpus.get(node)
        return gpus is not None and gpu in gpus

    def nodes(self) -> list[str]:
        return list(self._free)

    def total_free(self) -> int:
        return self._total_free

    def total_capacity(self) -> int:
        return self._total_capacity

    def largest_node(self) -> int:
        return self._largest

    def within(self, grants: Iterable[Grant]) -> tuple[Grant, ...]:
        """The part of these grants on this ledger's schedulable GPUs: a running job's
        grants without what it holds on a drained or faulty GPU, or on a node not here
        (drained, lost)."""
        part: list[Grant] = []
        for grant in grants:
            schedulable = self._gpus.get(grant.node)
            if schedulable is None:
                continue
            if schedulable.issuperset(grant.gpus):
                part.append(grant)
                continue
            gpus = tuple(gpu for gpu in grant.gpus if gpu in schedulable)
            if gpus:
                part.append(Grant(grant.node, gpus))
        return tuple(part)

    def held_outside(self, jobs: Iterable[JobView]) -> dict[str, int]:
        """Of these running jobs, those holding GPUs that are not schedulable here
        (`within`), and how many: they hold them outside the cluster's capacity. A walk
        over every grant, each one set test: nearly always it finds none."""
        gpus = self._gpus
        outside: dict[str, int] = {}
        for job in jobs:
            for grant in job.grants:
                schedulable = gpus.get(grant.node)
                if schedulable is None or not schedulable.issuperset(grant.gpus):
                    held = sum(len(g.gpus) for g in job.grants)
                    outside[job.job_id] = held - sum(len(g.gpus) for g in self.within(job.grants))
                    break
        return outside

    def all_free(self, grants: Iterable[Grant]) -> bool:
        """Whether every GPU of these grants is still free in this ledger.

        Asked of every victim a cycle releases, and most are not: plain loops, as a
        generator left early is closed with an exception (a frame object and a
        traceback each)."""
        for grant in grants:
            free = self._free.get(grant.node)
            if free is None:
                return False
            for gpu in grant.gpus:
                if gpu not in free:
                    return False
        return True

    def _changed(self, node: str, before: int, after: int) -> None:
        """Keep the indexes after `node` went from `before` to `after` free GPUs.

        Runs twice for every preemption a cycle makes (the victim's GPUs given, a
        winner's taken): the move between `_Buckets` rows, written out here."""
        self._log.append(node)
        if before == after:
            return
        delta = after - before
        self._total_free += delta
        rows = self._all.rows
        if before > 0:
            row = rows[before]
            del row[bisect.bisect_left(row, node)]
        if after > 0:
            while len(rows) <= after:
                rows.append([])
            bisect.insort(rows[after], node)
        switch = self._switch[node]
        switch_free = self._switch_free
        was = switch_free[switch]
        now = switch_free[switch] = was + delta
        self._switch_nodes.pop(switch, None)
        counts = self._switches_by_free
        counts[was] -= 1
        if len(counts) <= now:
            counts.extend([0] * (now + 1 - len(counts)))
        counts[now] += 1
        most = self._switch_most
        if now > most:
            self._switch_most = now
        elif was == most and not counts[most]:
            while most > 0 and not counts[most]:
                most -= 1
            self._switch_most = most

    def touched(self) -> AbstractSet[str]:
        """The nodes taken from or given to since it was built or last reset."""
        return set(self._log)

    def changes(self) -> int:
        """How many changes this epoch has seen: a mark for `changed_since`."""
        return len(self._log)

    def changed_since(self, mark: int) -> list[str]:
        """The nodes changed (with repeats) since `changes()` said `mark`, this epoch."""
        return self._log[mark:]

    def follow(self, source: FreeGpus, nodes: Iterable[str]) -> None:
        """Take these nodes' free GPUs from `source` (the ledger this one was copied
        from with `excluding`; its excluded nodes stay out): a copy kept across a cycle
        catches up with what changed, not the cluster."""
        free = self._free
        for node in nodes:
            mine = free.get(node)
            if mine is None:
                continue
            before = len(mine)
            free[node] = list(source._free[node])
            self._changed(node, before, len(free[node]))

    def reset(self, views: Iterable[NodeView]) -> None:
        """Set these nodes' free GPUs to their views' (the same nodes: the same GPUs and
        switch as when built), and forget what was touched."""
        free = self._free
        for view in views:
            before = len(free[view.name])
            free[view.name] = sorted(view.free)
            self._changed(view.name, before, len(view.free))
        self._log.clear()
        self.epoch += 1

    def _nodes_of(self, switch: str) -> _Buckets:
        """The switch's nodes by free GPUs (built now if a change dropped them)."""
        buckets = self._switch_nodes.get(switch)
        if buckets is None:
            buckets = self._switch_nodes[switch] = _Buckets()
            buckets.load((name, len(self._free[name])) for name in self._by_switch[switch])
        return buckets

    def take(self, grants: Iterable[Grant]) -> None:
        free_of = self._free
        for grant in grants:
            node, gpus = grant.node, grant.gpus
            free = free_of[node]
            before = len(free)
            if len(gpus) == before:
                # The whole node's free GPUs (the common gang): check, then clear. (One
                # GPU, the commonest, needs no sorted copy to compare.)
                whole = gpus[0] == free[0] if before == 1 else sorted(gpus) == free
                if not whole:
                    raise ValueError(f"GPUs {gpus} of {node} are not all free")
                free.clear()
            else:
                for gpu in gpus:
                    free.remove(gpu)
            self._changed(node, before, len(free))

    def give(self, grants: Iterable[Grant]) -> None:
        """Free these GPUs; those that are not schedulable (`within`) stay out.

        Runs for every victim a cycle releases: one GPU given to a node with none free
        (the commonest) is appended, not sorted."""
        free_of, schedulable_of = self._free, self._gpus
        for grant in grants:
            node = grant.node
            free = free_of.get(node)
            if free is None:
                continue
            gpus = grant.gpus
            schedulable = schedulable_of[node]
            if not schedulable.issuperset(gpus):
                gpus = tuple(gpu for gpu in gpus if gpu in schedulable)
            before = len(free)
            if before:
                free = free_of[node] = sorted({*free, *gpus})
            elif len(gpus) == 1:
                free.append(gpus[0])
            else:
                free.extend(sorted(set(gpus)))
            self._changed(node, before, len(free))

    def lowest(self, node: str, count: int) -> tuple[int, ...]:
        free = self._free[node]
        # One GPU, the commonest ask, without a slice and a call to `tuple`.
        return (free[0],) if count == 1 and free else tuple(free[:count])

    def best_fit(self, gpus: int) -> str | None:
        """The node with the fewest free GPUs that has at least `gpus` (ties: by name),
        or None. Asked for every placement: the buckets' rows walked by index, not over a
        slice of them (a list built at every placement)."""
        rows = self._all.rows
        count = gpus if gpus > 1 else 1
        while count < len(rows):
            row = rows[count]
            if row:
                return row[0]
            count += 1
        return None

    def most_free(self) -> int:
        """The most GPUs free on any one node."""
        return self._all.most_free()

    def gather(self, gpus: int, switch: str | None = None) -> tuple[Grant, ...] | None:
        """`gpus` GPUs on the fewest nodes (of one switch, or anywhere): the roomiest
        nodes first, ties by name, the lowest GPUs of each; None if they are not free."""
        buckets = self._all if switch is None else self._nodes_of(switch)
        free_of = self._free
        grants: list[Grant] = []
        needed = gpus
        # Roomiest first, ties by name: the rows walked in plain loops, as a generator
        # left early is closed with an exception (a frame object and a traceback), at
        # every gang placed; and without `lowest` or `min`, calls for each node.
        for row in reversed(buckets.rows):
            for node in row:
                if needed == 0:
                    return tuple(grants)
                free = free_of[node]
                take = needed if needed < len(free) else len(free)
                grants.append(Grant(node, tuple(free[:take])))
                needed -= take
        return tuple(grants) if needed == 0 else None

    def fewest_nodes_in_a_switch(self, gpus: int) -> tuple[Grant, ...] | None:
        """`gather` within the switch that needs the fewest nodes for `gpus` (ties: the
        first switch by name), or None if no switch has that many free."""
        most = self.most_free()
        if most == 0 or self._switch_most < gpus:
            return None
        # No switch can do better than the roomiest node allows.
        bound = -(-gpus // most)
        best: str | None = None
        best_nodes = 0
        for switch in self._switch_order:
            if self._switch_free[switch] < gpus:
                continue
            nodes = self._nodes_of(switch).nodes_for(gpus)
            if best is None or nodes < best_nodes:
                best, best_nodes = switch, nodes
                if nodes <= bound:
                    break
        return None if best is None else self.gather(gpus, best)

    def excluding(
        self, avoid: frozenset[str], adding: Mapping[str, Iterable[int]] | None = None
    ) -> FreeGpus:
        """A copy without the `avoid` nodes, for a job retried away from where it failed,
        with the schedulable GPUs of `adding` (by node) free too: what a placement could
        have were they given back. Placing on the copy takes nothing: the cycle takes
        the fit on its own ledger. O(nodes): retried jobs are few."""
        view = FreeGpus(())
        for name, free in self._free.items():
            if name in avoid:
                continue
            extra = adding.get(name) if adding else None
            if extra:
                view._free[name] = sorted({*free, *(g for g in extra if g in self._gpus[name])})
            else:
                view._free[name] = list(free)
            view._gpus[name] = self._gpus[name]
            view._switch[name] = self._switch[name]
            view._capacity[name] = self._capacity[name]
            view._by_switch.setdefault(self._switch[name], []).append(name)
        view._index()
        return view


class KeptLedger:
    """A ledger kept by a caller from one cycle to the next (the live brain), so that a
    cycle after a few nodes changed does not build one for the whole cluster again.

    `for_nodes` hands out the ledger of these nodes: the last one handed out, its
    changes since undone and the nodes whose views are other objects now brought up to
    date (O(nodes) identity checks at C speed, then what changed), or, when the nodes
    are not the same names in the same order with the same GPUs and switches, or the
    last cycle did not end (`done`), a new one. A cycle's decisions are the same either
    way. Not for two cycles at once."""

    def __init__(self) -> None:
        self._ledger: FreeGpus | None = None
        self._nodes: tuple[NodeView, ...] = ()
        self._position: dict[str, int] = {}  # each node's place in `_nodes`
        self._in_use = False
        # Counters for tests and benches: ledgers built, and reused.
        self.built = 0
        self.reused = 0

    def for_nodes(self, nodes: tuple[NodeView, ...]) -> FreeGpus:
        ledger = self._ledger
        if ledger is None or self._in_use or not self._bring_up_to_date(ledger, nodes):
            ledger = self._ledger = FreeGpus(nodes)
            self._position = {view.name: i for i, view in enumerate(nodes)}
            self.built += 1
        else:
            self.reused += 1
        self._nodes = nodes
        self._in_use = True
        return ledger

    def done(self) -> None:
        """The cycle that used the ledger ended: it may be handed out again."""
        self._in_use = False

    def _bring_up_to_date(self, ledger: FreeGpus, nodes: tuple[NodeView, ...]) -> bool:
        before = self._nodes
        if len(before) != len(nodes):
            return False
        changed = (
            []
            if before is nodes
            else [(old, new) for old, new in zip(before, nodes, strict=True) if old is not new]
        )
        for old, new in changed:
            if old.name != new.name or old.switch != new.switch or old.gpus != new.gpus:
                return False
        by_name = {new.name: new for _, new in changed}
        # What the last cycle took and gave is undone: back to these nodes' views.
        position = self._position
        for name in ledger.touched():
            if name not in by_name:
                by_name[name] = nodes[position[name]]
        ledger.reset(by_name.values())
        return True


@record
class Fit:
    grants: tuple[Grant, ...]
    # What to take from the free ledger, when not every GPU of `grants`: a share on a
    # GPU already shared takes nothing (brain/core/shares.py). None: all of them.
    takes: tuple[Grant, ...] | None = None


PlacementResult = Fit | NoFit


@record
class PlacementRequest:
    gpus: int
    # False: only the preferred locality (fewest nodes under one switch) will do.
    may_spread: bool = True


Placement = Callable[[PlacementRequest, FreeGpus], PlacementResult]


def _preferred_node_count(gpus: int, free: FreeGpus) -> int:
    """The fewest nodes the job could ever use: its GPUs over the largest nodes."""
    largest = free.largest_node()
    return -(-gpus // largest) if largest > 0 else gpus


def consolidate(request: PlacementRequest, free: FreeGpus) -> PlacementResult:
    """Pack a job on one node if any fits (best fit), else on the fewest nodes of one
    switch; once it may spread, on the fewest nodes anywhere.

    Multi-node gangs take the roomiest nodes first (ties by name), the lowest GPUs of
    each. Every step is an index look-up (`FreeGpus`): a job that cannot fit costs
    no scan of the cluster."""
    gpus = request.gpus
    # Best fit: the fullest node that still fits, to keep whole nodes free for large
    # jobs.
    node = free.best_fit(gpus)
    if node is not None:
        return Fit((Grant(node, free.lowest(node, gpus)),))
    total = free.total_free()
    preferred = _preferred_node_count(gpus, free)
    # No node fits, so a switch needs two nodes or more: a job that must stay on one
    # node (`preferred` 1) and may not spread has nothing to look for.
    if total >= gpus and (request.may_spread or preferred > 1):
        best = free.fewest_nodes_in_a_switch(gpus)
        if best is not None and (request.may_spread or len(best) <= preferred):
            return Fit(best)
        if request.may_spread:
            anywhere = free.gather(gpus)
            if anywhere is not None:
                return Fit(anywhere)
    if not request.may_spread and total >= gpus:
        return NoFit(
            f"waiting for {gpus_said(gpus)} on {preferred} node(s) under one switch "
            f"({total} free, but scattered)",
            kind="scattered",
        )
    return NoFit(
        f"needs {gpus_said(gpus)}; {total} free of {free.total_capacity()} schedulable",
        kind="too_few_free",
    )


PLACEMENTS: Final[dict[str, Placement]] = {"consolidate": consolidate}
