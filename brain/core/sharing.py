"""Placement of tasks on shared, typed GPUs: the ledger, and the plugins that choose.

A node has CPU (milli-cores), memory (MiB) and GPUs of one model; each GPU has a free
share in thousandths (`gpu_milli`, 1000 = the whole GPU) and free GPU memory. A task
asks CPU and memory, and either no GPU, a share of one GPU (`gpus=1, gpu_milli<1000`)
or N whole GPUs, optionally only of some models. `SharedCluster` is the ledger: it
refuses any placement that would give a GPU more than 1000 thousandths or more memory
than it has, over-commit a node's CPU or memory, break a type constraint, or put a
share on a GPU that serves another tenant's shares (a bug in a plugin raises
`OverCommitted`, it is never silently applied).

A shared GPU serves one tenant: on a real GPU its shares run under one MPS control
daemon, which serves one Unix user at a time, and each tenant's jobs run as their own
user (docs/security.md). A GPU with no share is open to any tenant; its first share
binds it to that share's tenant until the last share leaves. A task's tenant is None
where it is not known (a trace without users): all such tasks are one tenant.

Plugins (objects behind `SharingPlugin.choose`) decide where a task goes:

- `fgd`: fragmentation gradient descent, after the idea of Weng et al. (ATC'23,
  "Beware of Fragmentation"): the free GPU share of a node counts as *fragment* for a
  task shape when that shape could not use it there; a node's expected fragmentation
  weighs each shape by its share of the workload (`TaskMix`). A task goes where the
  cluster's expected fragmentation grows least (steepest descent). Two terms the
  paper's measure leaves out are added: free GPUs that the node's free CPU and memory
  could not back at the workload's mean CPU and memory per GPU, and the GPUs of models
  that type-constrained shapes need (`type_pressure`).
- `fgd-paper`: the paper's measure alone.
- `best-fit`: the node (and GPU) left with the least free resources, normalised.
- `dot-product`: Tetris' alignment of the task's demand with the node's free vector.
- `gpu-packing`: a share goes to a GPU already in use, then to a node already in use,
  then to an idle node (best-fit within each tier).
- `random`: a feasible node uniformly at random, from a seeded generator.

Pure: no I/O, no clock; the random plugin owns a seeded generator. The live brain
places jobs that ask a share, a GPU type, CPUs or memory through it
(brain/core/shares.py, docs/sharing.md).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from schemas.errors import AlnairError

GPU_MILLI: Final = 1000


def share_memory_mib(gpu_milli: int, limit_mib: int, gpu_mib: int) -> int:
    """The GPU memory a share of `gpu_milli` thousandths holds on a GPU of `gpu_mib`: its
    limit, or, without one, its share of the GPU's memory. Rounded down, so that shares
    that fit a GPU together never ask more memory than it has; every share then holds a
    limit (the agent gives it to MPS), and limits on one GPU never sum past it."""
    return limit_mib if limit_mib > 0 else gpu_milli * gpu_mib // GPU_MILLI


class InvalidShare(AlnairError, ValueError):
    """A task or node that cannot be described: names the field."""

    def __init__(self, name: str, field_name: str, reason: str) -> None:
        super().__init__(f"{name}: {field_name}: {reason}")
        self.name = name
        self.field = field_name
        self.reason = reason


class OverCommitted(AlnairError, RuntimeError):
    """A placement the ledger refuses: a plugin bug, never an expected outcome."""


@dataclass(frozen=True, slots=True)
class SharedNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    # Per GPU; 0 where it is not known (then no task asking GPU memory fits here).
    gpu_memory_mib: int = 0

    def __post_init__(self) -> None:
        for name in ("cpu_milli", "memory_mib", "gpus", "gpu_memory_mib"):
            if getattr(self, name) < 0:
                raise InvalidShare(self.name, name, "cannot be negative")


@dataclass(frozen=True, slots=True)
class TaskShape:
    """What placement reads of a task: equal shapes place alike."""

    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_milli: int
    gpu_memory_mib: int
    gpu_types: frozenset[str]
    # A share goes only on a GPU open to its tenant (module docstring).
    tenant: str | None = None

    @property
    def fractional(self) -> bool:
        return self.gpus == 1 and self.gpu_milli < GPU_MILLI

    @property
    def gpu_milli_total(self) -> int:
        return self.gpus * self.gpu_milli

    def allows(self, model: str) -> bool:
        return not self.gpu_types or model in self.gpu_types


@dataclass(frozen=True, slots=True)
class SharedTask:
    name: str
    cpu_milli: int
    memory_mib: int
    # 0: CPU only; 1 with gpu_milli < 1000: a share of one GPU; N: N whole GPUs.
    gpus: int = 0
    gpu_milli: int = GPU_MILLI
    # GPU memory per GPU the task needs (a share's limit); 0: none asked.
    gpu_memory_mib: int = 0
    # Allowed GPU models; empty: any.
    gpu_types: frozenset[str] = frozenset()
    # Whose share it is: a shared GPU serves one tenant. None: not known (one tenant).
    tenant: str | None = None
    shape: TaskShape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("cpu_milli", "memory_mib", "gpus", "gpu_memory_mib"):
            if getattr(self, name) < 0:
                raise InvalidShare(self.name, name, "cannot be negative")
        milli = self.gpu_milli
        if self.gpus == 0:
            milli = 0
        elif not 0 < milli <= GPU_MILLI:
            raise InvalidShare(self.name, "gpu_milli", f"{milli} is not in 1..{GPU_MILLI}")
        elif self.gpus > 1 and milli != GPU_MILLI:
            raise InvalidShare(
                self.name, "gpu_milli", "a share below 1000 is for one GPU only (gpus=1)"
            )
        shape = TaskShape(
            self.cpu_milli,
            self.memory_mib,
            self.gpus,
            milli,
            self.gpu_memory_mib if self.gpus else 0,
            self.gpu_types if self.gpus else frozenset(),
            # Only a share is bound by tenant; whole GPUs and CPU tasks place alike.
            self.tenant if self.gpus == 1 and milli < GPU_MILLI else None,
        )
        object.__setattr__(self, "gpu_milli", milli)
        object.__setattr__(self, "shape", shape)


@dataclass(frozen=True, slots=True)
class SharePlacement:
    """Where a task went: a node and its GPUs, each giving `gpu_milli` thousandths."""

    task: SharedTask
    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Unschedulable:
    task: SharedTask
    reason: str


class SharedCluster:
    """The mutable ledger of what is free, node by node and GPU by GPU.

    `version[i]` changes whenever node i does, so that plugins may remember what they
    computed for a node until it changes.
    """

    def __init__(self, nodes: Sequence[SharedNode]) -> None:
        self.nodes: tuple[SharedNode, ...] = tuple(nodes)
        self.cpu_free = [n.cpu_milli for n in self.nodes]
        self.mem_free = [n.memory_mib for n in self.nodes]
        self.gpu_free = [[GPU_MILLI] * n.gpus for n in self.nodes]
        self.gpu_mem_free = [[n.gpu_memory_mib] * n.gpus for n in self.nodes]
        self.version = [0] * len(self.nodes)
        # The tenant each GPU's shares belong to, and how many shares (or holders
        # given by `set_free`) bind it: 0, the GPU is open to any tenant.
        self.gpu_tenant: list[list[str | None]] = [[None] * n.gpus for n in self.nodes]
        self.gpu_binds = [[0] * n.gpus for n in self.nodes]
        # Bound GPUs per tenant: while every bound GPU is the asking task's tenant's,
        # no GPU is closed to it and the per-GPU check is skipped.
        self._bound: Counter[str | None] = Counter()
        self.gpu_capacity_milli = GPU_MILLI * sum(n.gpus for n in self.nodes)
        self.gpu_allocated_milli = 0
        # The largest node's CPU and GPUs: the packing baselines' scale (`_remaining`).
        self.cpu_scale = max((n.cpu_milli for n in self.nodes), default=0) or 1
        self.gpu_scale = GPU_MILLI * max((n.gpus for n in self.nodes), default=0) or 1
        # Placements applied and not yet released (a multiset: equal tasks may share a
        # placement), so that a release of one that is not held changes nothing.
        self._held: Counter[SharePlacement] = Counter()
        # Each node's make, all a plugin reads of it beyond what is free (`state`), and
        # its state as of its version.
        self._make = [(n.model, n.cpu_milli, n.memory_mib, n.gpus, n.gpu_memory_mib) for n in nodes]
        self._states: list[tuple[int, tuple[object, ...]] | None] = [None] * len(self.nodes)
        # Every change of a node, its index in the order they came (`changed_since`).
        self._log: list[int] = []

    def changes(self) -> int:
        """How many node changes this ledger has seen: a mark for `changed_since`."""
        return len(self._log)

    def changed_since(self, mark: int) -> list[int]:
        """The nodes changed (with repeats) since `changes()` said `mark`."""
        return self._log[mark:]

    def state(self, i: int) -> tuple[object, ...]:
        """All a plugin's score of node i may read besides the task's shape: the node's
        make (not its name) and what is free on it now, GPU by GPU, with the tenant
        each GPU serves. Nodes alike score alike (`ScoringPlugin`)."""
        kept = self._states[i]
        if kept is not None and kept[0] == self.version[i]:
            return kept[1]
        state = (
            self._make[i],
            self.cpu_free[i],
            self.mem_free[i],
            tuple(self.gpu_free[i]),
            tuple(self.gpu_mem_free[i]),
            tuple(self.gpu_binds[i]),
            tuple(self.gpu_tenant[i]),
        )
        self._states[i] = (self.version[i], state)
        return state

    def set_free(
        self,
        i: int,
        cpu_milli: int,
        memory_mib: int,
        gpu_free: list[int],
        gpu_mem: list[int],
        gpu_tenants: Mapping[int, str | None] | None = None,
    ) -> None:
        """Start node i from what is free there now (the live brain's cycle, where jobs
        hold parts of it already); only before any placement on this ledger.
        `gpu_tenants`: the GPUs (positions on the node) that serve a tenant already, by
        the shares or the shareable job held there, and whose; the others are open."""
        node = self.nodes[i]
        if len(gpu_free) != node.gpus or len(gpu_mem) != node.gpus:
            raise OverCommitted(f"{node.name}: {node.gpus} GPUs, given {len(gpu_free)}")
        if not all(0 <= f <= GPU_MILLI for f in gpu_free):
            raise OverCommitted(f"{node.name}: a GPU's free share is outside 0..{GPU_MILLI}")
        bound = gpu_tenants or {}
        if any(not 0 <= g < node.gpus for g in bound):
            raise OverCommitted(f"{node.name}: a bound GPU is not one of its {node.gpus}")
        for g in range(node.gpus):
            if self.gpu_binds[i][g]:
                self._bound[self.gpu_tenant[i][g]] -= 1
            self.gpu_binds[i][g] = 1 if g in bound else 0
            self.gpu_tenant[i][g] = bound.get(g)
            if g in bound:
                self._bound[bound[g]] += 1
        self.gpu_allocated_milli += sum(self.gpu_free[i]) - sum(gpu_free)
        self.cpu_free[i] = cpu_milli
        self.mem_free[i] = memory_mib
        self.gpu_free[i] = list(gpu_free)
        self.gpu_mem_free[i] = list(gpu_mem)
        self.version[i] += 1
        self._log.append(i)

    def fits(self, shape: TaskShape, i: int, *, any_tenant: bool = False) -> bool:
        """Whether node i can take a task of this shape now (on some GPUs); with
        `any_tenant`, were no GPU closed to its tenant."""
        node = self.nodes[i]
        if self.cpu_free[i] < shape.cpu_milli or self.mem_free[i] < shape.memory_mib:
            return False
        if shape.gpus == 0:
            return True
        if not shape.allows(node.model):
            return False
        return len(self.fitting_gpus(shape, i, any_tenant=any_tenant)) >= shape.gpus

    def closed_to_some(self, tenant: str | None) -> bool:
        """Whether any GPU serves a tenant other than this one (and is closed to it)."""
        bound = self._bound
        return any(n for t, n in bound.items() if t != tenant) if bound else False

    def fitting_gpus(self, shape: TaskShape, i: int, *, any_tenant: bool = False) -> list[int]:
        """GPUs of node i that could give this shape its per-GPU share (a share: only
        GPUs open to its tenant, unless `any_tenant`)."""
        free = self.gpu_free[i]
        mem = self.gpu_mem_free[i]
        if shape.fractional:
            need = shape.gpu_milli
            need_mem = share_memory_mib(need, shape.gpu_memory_mib, self.nodes[i].gpu_memory_mib)
            fitting = [g for g in range(len(free)) if free[g] >= need and mem[g] >= need_mem]
            if any_tenant or not fitting or not self.closed_to_some(shape.tenant):
                return fitting
            binds, tenants = self.gpu_binds[i], self.gpu_tenant[i]
            return [g for g in fitting if not binds[g] or tenants[g] == shape.tenant]
        full = self.nodes[i].gpu_memory_mib
        if shape.gpu_memory_mib > full:
            return []
        return [g for g in range(len(free)) if free[g] == GPU_MILLI]

    def _check(self, placement: SharePlacement) -> None:
        task, i = placement.task, placement.node
        shape = task.shape
        node = self.nodes[i]
        if self.cpu_free[i] < shape.cpu_milli or self.mem_free[i] < shape.memory_mib:
            raise OverCommitted(f"{task.name} on {node.name}: CPU or memory over-committed")
        if len(placement.gpus) != shape.gpus or len(set(placement.gpus)) != shape.gpus:
            raise OverCommitted(f"{task.name} on {node.name}: wants {shape.gpus} distinct GPUs")
        if shape.gpus and not shape.allows(node.model):
            raise OverCommitted(f"{task.name} on {node.name}: {node.model} not allowed")
        allowed = set(self.fitting_gpus(shape, i))
        for g in placement.gpus:
            if g not in allowed:
                binds, tenants = self.gpu_binds[i], self.gpu_tenant[i]
                if shape.fractional and binds[g] and tenants[g] != shape.tenant:
                    raise OverCommitted(
                        f"{task.name} on {node.name}: GPU {g} serves tenant {tenants[g]}'s "
                        f"shares, not {shape.tenant}'s"
                    )
                raise OverCommitted(f"{task.name} on {node.name}: GPU {g} has not enough free")

    def apply(self, placement: SharePlacement) -> None:
        self._check(placement)
        shape, i = placement.task.shape, placement.node
        self.cpu_free[i] -= shape.cpu_milli
        self.mem_free[i] -= shape.memory_mib
        whole = not shape.fractional
        held = share_memory_mib(shape.gpu_milli, shape.gpu_memory_mib, self.nodes[i].gpu_memory_mib)
        for g in placement.gpus:
            self.gpu_free[i][g] -= shape.gpu_milli
            # A whole GPU is the task's, memory and all.
            self.gpu_mem_free[i][g] = 0 if whole else self.gpu_mem_free[i][g] - held
            if not whole:
                self._bind(i, g, shape.tenant)
        self.gpu_allocated_milli += shape.gpu_milli_total
        self._held[placement] += 1
        self.version[i] += 1
        self._log.append(i)

    def release(self, placement: SharePlacement) -> None:
        shape, i = placement.task.shape, placement.node
        node = self.nodes[i]
        if self._held[placement] == 0:
            del self._held[placement]
            raise OverCommitted(
                f"{placement.task.name} is not held on {node.name}: never applied, or released"
            )
        self._held[placement] -= 1
        self.cpu_free[i] += shape.cpu_milli
        self.mem_free[i] += shape.memory_mib
        whole = not shape.fractional
        held = share_memory_mib(shape.gpu_milli, shape.gpu_memory_mib, node.gpu_memory_mib)
        for g in placement.gpus:
            self.gpu_free[i][g] += shape.gpu_milli
            free_mem = self.gpu_mem_free[i][g]
            self.gpu_mem_free[i][g] = node.gpu_memory_mib if whole else free_mem + held
            if not whole:
                self._unbind(i, g)
        self.gpu_allocated_milli -= shape.gpu_milli_total
        self.version[i] += 1
        self._log.append(i)

    def _bind(self, i: int, g: int, tenant: str | None) -> None:
        if not self.gpu_binds[i][g]:
            self.gpu_tenant[i][g] = tenant
            self._bound[tenant] += 1
        self.gpu_binds[i][g] += 1

    def _unbind(self, i: int, g: int) -> None:
        self.gpu_binds[i][g] -= 1
        if not self.gpu_binds[i][g]:
            tenant = self.gpu_tenant[i][g]
            self._bound[tenant] -= 1
            if not self._bound[tenant]:
                del self._bound[tenant]
            self.gpu_tenant[i][g] = None

    def place(self, task: SharedTask, plugin: SharingPlugin) -> SharePlacement | Unschedulable:
        """Ask the plugin, and apply what it chose."""
        outcome = plugin.choose(task, self)
        if isinstance(outcome, SharePlacement):
            self.apply(outcome)
        return outcome

    def unallocated_gpus(self) -> float:
        return (self.gpu_capacity_milli - self.gpu_allocated_milli) / GPU_MILLI


class SharingPlugin(Protocol):
    name: str

    def choose(self, task: SharedTask, cluster: SharedCluster) -> SharePlacement | Unschedulable:
        """Where this task should go now (nothing is applied)."""
        ...


def no_fit(task: SharedTask, cluster: SharedCluster) -> Unschedulable:
    """Why nothing takes the task now; says so when GPUs with room for a share serve
    other tenants' shares (it would fit were they open to its tenant)."""
    shape = task.shape
    if shape.gpus == 0:
        gpu = "no GPU"
    elif shape.fractional:
        gpu = f"{shape.gpu_milli / GPU_MILLI:g} of a GPU"
    else:
        gpu = f"{shape.gpus} whole GPU{'s' if shape.gpus > 1 else ''}"
    if shape.gpu_types:
        gpu += f" of type {'|'.join(sorted(shape.gpu_types))}"
    if shape.gpu_memory_mib:
        each = " each" if shape.gpus > 1 else ""
        gpu += f" with {shape.gpu_memory_mib} MiB of GPU memory{each}"
    # What it asks, naming only what it asks for (a job that asked no CPUs asks none).
    parts = [
        *([f"{shape.cpu_milli} CPU milli"] if shape.cpu_milli else []),
        *([f"{shape.memory_mib} MiB of memory"] if shape.memory_mib else []),
        gpu,
    ]
    asked = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    reason = f"no node has {asked} free"
    if (
        shape.fractional
        and cluster.closed_to_some(shape.tenant)
        and any(cluster.fits(shape, i, any_tenant=True) for i in range(len(cluster.nodes)))
    ):
        tenant = "an unnamed tenant" if shape.tenant is None else f"tenant {shape.tenant}"
        reason += (
            f" on a GPU open to {tenant}: the GPUs with room serve other tenants' shares "
            "(a shared GPU serves one tenant: MPS serves one Unix user at a time)"
        )
    return Unschedulable(task, reason)


def tightest(cluster: SharedCluster, shape: TaskShape, i: int, gpus: list[int]) -> tuple[int, ...]:
    """The GPUs a best-fit would take: for a share, the fullest GPU that fits; for whole
    GPUs, the first free ones (all alike)."""
    if shape.fractional:
        free = cluster.gpu_free[i]
        return (min(gpus, key=lambda g: (free[g], g)),)
    return tuple(gpus[: shape.gpus])


# What a scoring plugin says of one node: lower is better; and the GPUs it would take.
Scored = tuple[float, tuple[int, ...]] | None


# Scores a plugin remembers by node state, per shape, before it forgets them all.
STATES_KEPT: Final = 100_000


class ScoringPlugin:
    """A plugin that scores each node alone; the lowest score wins (ties: lower index).

    Scores depend only on the task's shape and the node's state (`SharedCluster.state`),
    so one is remembered per (shape, state), unless `remember_states` is off: a shape
    first seen is scored once for each state its nodes are in (a cluster of few node
    makes, mostly idle, has few), not once per node. `choose` keeps a heap of scores
    per shape and brings it up to date with the nodes changed since (`best`): after the
    first, a task costs what changed, not the cluster. `scores` lists every node's,
    kept per (shape, node) until the node changes, for a plugin that reads them all.
    """

    name = "scoring"
    # Whether scores are remembered by node state: not worth the state's hash where a
    # score costs less (`random`).
    remember_states = True

    def __init__(self) -> None:
        self._bound: SharedCluster | None = None
        self._memo: dict[TaskShape, list[tuple[int, Scored]]] = {}
        self._by_state: dict[TaskShape, dict[tuple[object, ...], Scored]] = {}
        self._ranked: dict[TaskShape, _Ranked] = {}

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        raise NotImplementedError

    def _bind(self, cluster: SharedCluster) -> None:
        if cluster is not self._bound:
            self._bound, self._memo, self._by_state, self._ranked = cluster, {}, {}, {}

    def _states(self, shape: TaskShape) -> dict[tuple[object, ...], Scored]:
        by_state = self._by_state.get(shape)
        if by_state is None or len(by_state) > STATES_KEPT:
            by_state = self._by_state[shape] = {}
        return by_state

    def _scored(
        self,
        shape: TaskShape,
        cluster: SharedCluster,
        i: int,
        by_state: dict[tuple[object, ...], Scored],
    ) -> Scored:
        state = cluster.state(i) if self.remember_states else None
        if state is not None and state in by_state:
            return by_state[state]
        scored = None
        if cluster.fits(shape, i):
            scored = self.score(shape, cluster, i, cluster.fitting_gpus(shape, i))
        if state is not None:
            by_state[state] = scored
        return scored

    def scores(self, shape: TaskShape, cluster: SharedCluster) -> list[tuple[int, Scored]]:
        """(node version, score) of every node for this shape, None where it does not
        fit; refreshed only for nodes that changed since last asked."""
        self._bind(cluster)
        memo = self._memo.get(shape)
        if memo is None:
            memo = self._memo[shape] = [(-1, None)] * len(cluster.nodes)
        by_state = self._states(shape)
        version = cluster.version
        for i in range(len(memo)):
            if memo[i][0] != version[i]:
                memo[i] = (version[i], self._scored(shape, cluster, i, by_state))
        return memo

    def best(self, shape: TaskShape, cluster: SharedCluster) -> tuple[int, tuple[int, ...]] | None:
        """The node with the lowest score for this shape (ties: the lower index) and the
        GPUs it would take; None where none fits. A heap of scores per shape, brought up
        to date with the nodes changed since the shape was last asked: a task costs what
        changed, not the cluster."""
        self._bind(cluster)
        by_state = self._states(shape)
        version = cluster.version
        ranked = self._ranked.get(shape)
        if ranked is None or len(ranked.heap) > 4 * len(cluster.nodes):
            heap: list[tuple[float, int, int, tuple[int, ...]]] = []
            for i in range(len(cluster.nodes)):
                scored = self._scored(shape, cluster, i, by_state)
                if scored is not None:
                    heap.append((scored[0], i, version[i], scored[1]))
            heapq.heapify(heap)
            ranked = self._ranked[shape] = _Ranked(heap, cluster.changes())
        else:
            heap = ranked.heap
            for i in set(cluster.changed_since(ranked.mark)):
                scored = self._scored(shape, cluster, i, by_state)
                if scored is not None:
                    heapq.heappush(heap, (scored[0], i, version[i], scored[1]))
            ranked.mark = cluster.changes()
        # An entry from before its node last changed says nothing now.
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        return (heap[0][1], heap[0][3]) if heap else None

    def choose(self, task: SharedTask, cluster: SharedCluster) -> SharePlacement | Unschedulable:
        best = self.best(task.shape, cluster)
        if best is None:
            return no_fit(task, cluster)
        return SharePlacement(task, best[0], best[1])


class _Ranked:
    """A shape's heap of (score, node, node version, GPUs), and the change mark it is
    up to date with."""

    __slots__ = ("heap", "mark")

    def __init__(self, heap: list[tuple[float, int, int, tuple[int, ...]]], mark: int) -> None:
        self.heap = heap
        self.mark = mark


def _remaining(cluster: SharedCluster, shape: TaskShape, i: int) -> float:
    """Free CPU and GPU left on node i after this task, as amounts over the largest
    node's (the measure of best-fit in the FGD authors' simulator): the node left with
    the least free is the tightest, whatever its size, so small nodes fill before large
    ones and a large node stays whole for a large task. Memory is not weighed (its
    fit is still checked). Measured against shares of each node's own capacity with
    memory (docs/sharing.md): fewer GPUs unallocated on five of the six Alibaba
    variants, for best-fit and gpu-packing alike."""
    cpu = (cluster.cpu_free[i] - shape.cpu_milli) / cluster.cpu_scale
    gpu = (sum(cluster.gpu_free[i]) - shape.gpu_milli_total) / cluster.gpu_scale
    return cpu + gpu


class BestFit(ScoringPlugin):
    name = "best-fit"

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        return _remaining(cluster, shape, i), tightest(cluster, shape, i, gpus)


class DotProduct(ScoringPlugin):
    """Tetris: the node whose free vector lines up best with the task's demand."""

    name = "dot-product"

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        node = cluster.nodes[i]
        gpu_cap = node.gpus * GPU_MILLI
        dot = 0.0
        if node.cpu_milli:
            dot += shape.cpu_milli * cluster.cpu_free[i] / node.cpu_milli**2
        if node.memory_mib:
            dot += shape.memory_mib * cluster.mem_free[i] / node.memory_mib**2
        if gpu_cap:
            dot += shape.gpu_milli_total * sum(cluster.gpu_free[i]) / gpu_cap**2
        return -dot, tightest(cluster, shape, i, gpus)


class GpuPacking(ScoringPlugin):
    """A share on a GPU already shared, else a node already in use, else an idle one."""

    name = "gpu-packing"

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        chosen = tightest(cluster, shape, i, gpus)
        free = cluster.gpu_free[i]
        node = cluster.nodes[i]
        if shape.fractional and free[chosen[0]] < GPU_MILLI:
            tier = 0
        elif (
            sum(free) < node.gpus * GPU_MILLI
            or cluster.cpu_free[i] < node.cpu_milli
            or cluster.mem_free[i] < node.memory_mib
        ):
            tier = 1
        else:
            tier = 2
        return 10.0 * tier + _remaining(cluster, shape, i), chosen


class RandomFit(ScoringPlugin):
    """A feasible node, uniformly at random (seeded: the same seed, the same choices);
    a share goes to a random GPU that fits. (It scores only to remember which nodes fit.)"""

    name = "random"
    remember_states = False

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        return 0.0, tuple(gpus)

    def choose(self, task: SharedTask, cluster: SharedCluster) -> SharePlacement | Unschedulable:
        shape = task.shape
        feasible = [
            (i, scored[1])
            for i, (_, scored) in enumerate(self.scores(shape, cluster))
            if scored is not None
        ]
        if not feasible:
            return no_fit(task, cluster)
        i, gpus = self._rng.choice(feasible)
        if shape.fractional:
            return SharePlacement(task, i, (self._rng.choice(gpus),))
        return SharePlacement(task, i, gpus[: shape.gpus])


@dataclass(frozen=True, slots=True)
class TaskMix:
    """The workload's task shapes and the share of tasks each is (summing to 1)."""

    shapes: tuple[tuple[TaskShape, float], ...]

    @staticmethod
    def of(tasks: Iterable[SharedTask]) -> TaskMix:
        return TaskMix.counted(Counter(t.shape for t in tasks))

    @staticmethod
    def counted(counts: Counter[TaskShape]) -> TaskMix:
        """The mix of these shapes, each seen so many times."""
        total = sum(counts.values())
        if not total:
            return TaskMix(())
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], repr(kv[0])))
        return TaskMix(tuple((shape, n / total) for shape, n in ordered))


class _FragmentWeights:
    """Per-GPU fragment weights: a GPU's free share counts, for each shape of the mix,
    as fragment when that shape could not use it on this node, weighted by the shape's
    popularity. What decides it for one GPU is coarse (the node's model, which demand
    levels its free CPU and memory reach, how many of its GPUs are whole, and which
    share and GPU-memory levels this GPU reaches), so weights are remembered by that.
    """

    def __init__(self, mix: TaskMix) -> None:
        shapes = [s for s, _ in mix.shapes]
        self.cpu_levels = sorted({s.cpu_milli for s in shapes})
        self.mem_levels = sorted({s.memory_mib for s in shapes})
        self.milli_levels = sorted({s.gpu_milli for s in shapes if s.fractional})
        self.gmem_levels = sorted({s.gpu_memory_mib for s in shapes})
        self._shapes = [
            (
                s,
                p,
                bisect.bisect_left(self.cpu_levels, s.cpu_milli),
                bisect.bisect_left(self.mem_levels, s.memory_mib),
                bisect.bisect_left(self.milli_levels, s.gpu_milli) if s.fractional else -1,
                bisect.bisect_left(self.gmem_levels, s.gpu_memory_mib),
            )
            for s, p in mix.shapes
        ]
        self._memo: dict[tuple[str, int, int, int, int, bool, int], float] = {}

    def node_key(self, model: str, cpu_free: int, mem_free: int) -> tuple[str, int, int]:
        return (
            model,
            bisect.bisect_right(self.cpu_levels, cpu_free),
            bisect.bisect_right(self.mem_levels, mem_free),
        )

    def gpu_weight(
        self, node: tuple[str, int, int], whole_gpus: int, free: int, gpu_mem_free: int
    ) -> float:
        key = (
            node[0],
            node[1],
            node[2],
            whole_gpus,
            bisect.bisect_right(self.milli_levels, free),
            free >= GPU_MILLI,
            bisect.bisect_right(self.gmem_levels, gpu_mem_free),
        )
        weight = self._memo.get(key)
        if weight is None:
            weight = self._memo[key] = self._weigh(key)
        return weight

    def _weigh(self, key: tuple[str, int, int, int, int, bool, int]) -> float:
        model, cpu_b, mem_b, whole_gpus, milli_b, is_whole, gmem_b = key
        weight = 0.0
        for shape, p, cpu_i, mem_i, milli_i, gmem_i in self._shapes:
            usable = (
                shape.gpus > 0
                and shape.allows(model)
                and cpu_i < cpu_b
                and mem_i < mem_b
                and gmem_i < gmem_b
                and (
                    milli_i < milli_b if shape.fractional else is_whole and whole_gpus >= shape.gpus
                )
            )
            if not usable:
                weight += p
        return weight


# Far below any gradient between two placements (a shape of 1 task in 10,000 on 1
# thousandth of a GPU weighs 1e-4), and `_remaining` is at most 2.
TIE_BREAK: Final = 1e-6


def type_pressure(mix: TaskMix, nodes: Sequence[SharedNode]) -> dict[str, float]:
    """For each GPU model, the share of its GPUs that the mix's type-constrained shapes
    need, at most 1. Each constrained shape's GPU demand, scaled as if the mix filled the
    cluster's GPUs, is spread over the GPUs of the models it allows in proportion to
    their number; shapes that allow any model need no model in particular."""
    capacity: Counter[str] = Counter()
    for node in nodes:
        capacity[node.model] += node.gpus
    asked = sum(p * s.gpu_milli_total for s, p in mix.shapes)
    need = dict.fromkeys(capacity, 0.0)
    if not asked:
        return need
    for shape, p in mix.shapes:
        if not shape.gpu_types or not shape.gpus:
            continue
        allowed = [m for m in capacity if capacity[m] and shape.allows(m)]
        room = sum(capacity[m] for m in allowed)
        if not room:
            continue
        # GPUs of the cluster this shape asks, over the GPUs it may use.
        share = p * shape.gpu_milli_total / asked * capacity.total() / room
        for model in allowed:
            need[model] += share
    return {model: min(1.0, need[model]) for model in capacity}


class Fgd(ScoringPlugin):
    """Fragmentation gradient descent: the node and GPU where the expected fragmentation
    (thousandths of GPU, over the mix's shapes) grows least.

    The paper's measure (`paper=True`, plugin `fgd-paper`) asks, for one arriving task of
    each shape, which free GPU shares it could not use. Two costs are beyond it, and
    `fgd` adds both, in the same thousandths of a GPU:

    - **Unbacked GPUs.** It judges each free GPU against the node's whole free CPU and
      memory, as if one task were to come; the next tasks share them. A node's free GPUs
      beyond what its free CPU and memory back at the mix's mean CPU and memory per GPU
      (of the shapes asking GPUs) count as fragment: tasks that need more CPU than a
      node has per GPU go to nodes rich in CPU.
    - **Scarce types.** Taking a GPU of a model that constrained shapes need
      (`type_pressure`) costs that pressure for each thousandth taken: a task that may
      go anywhere leaves such GPUs to those that may not.

    Both are derived from the mix and the cluster; neither has a weight to tune."""

    name = "fgd"

    def __init__(self, mix: TaskMix, *, paper: bool = False) -> None:
        super().__init__()
        self._weights = _FragmentWeights(mix)
        self.paper = paper
        if paper:
            self.name = "fgd-paper"
        self._mix = mix
        asked = sum(p * s.gpu_milli_total for s, p in mix.shapes)
        gpu_shapes = [(s, p) for s, p in mix.shapes if s.gpus]
        # CPU (milli) and memory (MiB) per thousandth of a GPU asked, over the mix.
        self._cpu_per_milli = sum(p * s.cpu_milli for s, p in gpu_shapes) / asked if asked else 0.0
        self._mem_per_milli = sum(p * s.memory_mib for s, p in gpu_shapes) / asked if asked else 0.0
        self._pressure: dict[str, float] = {}
        self._pressure_of: SharedCluster | None = None

    def fragmentation(
        self,
        model: str,
        cpu_free: int,
        mem_free: int,
        free: Sequence[int],
        gmem: Sequence[int],
        pressure: float = 0.0,
    ) -> float:
        """Expected fragmentation of a node in this state, in thousandths of a GPU;
        `pressure`: its model's (`type_pressure`), ignored by the paper's measure."""
        weights = self._weights
        node = weights.node_key(model, cpu_free, mem_free)
        whole = sum(1 for f in free if f >= GPU_MILLI)
        fragment = sum(
            f * weights.gpu_weight(node, whole, f, m) for f, m in zip(free, gmem, strict=True) if f
        )
        if self.paper:
            return fragment
        total = sum(free)
        backed = float(total)
        if self._cpu_per_milli:
            backed = min(backed, cpu_free / self._cpu_per_milli)
        if self._mem_per_milli:
            backed = min(backed, mem_free / self._mem_per_milli)
        # Free GPUs count against a scarce model's pressure: taking them costs it.
        return fragment + (total - max(0.0, backed)) - pressure * total

    def pressure(self, cluster: SharedCluster, i: int) -> float:
        """Node i's model's `type_pressure` (worked out once per cluster, whoever asks:
        `score` may be called on a cluster the plugin has not scored before)."""
        if self.paper:
            return 0.0
        if cluster is not self._pressure_of:
            self._pressure_of = cluster
            self._pressure = type_pressure(self._mix, cluster.nodes)
        return self._pressure.get(cluster.nodes[i].model, 0.0)

    def node_fragmentation(self, cluster: SharedCluster, i: int) -> float:
        return self.fragmentation(
            cluster.nodes[i].model,
            cluster.cpu_free[i],
            cluster.mem_free[i],
            cluster.gpu_free[i],
            cluster.gpu_mem_free[i],
            self.pressure(cluster, i),
        )

    def _after(
        self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: tuple[int, ...]
    ) -> float:
        free = list(cluster.gpu_free[i])
        gmem = list(cluster.gpu_mem_free[i])
        for g in gpus:
            free[g] -= shape.gpu_milli
            gmem[g] = gmem[g] - shape.gpu_memory_mib if shape.fractional else 0
        return self.fragmentation(
            cluster.nodes[i].model,
            cluster.cpu_free[i] - shape.cpu_milli,
            cluster.mem_free[i] - shape.memory_mib,
            free,
            gmem,
            self.pressure(cluster, i),
        )

    def score(self, shape: TaskShape, cluster: SharedCluster, i: int, gpus: list[int]) -> Scored:
        before = self.node_fragmentation(cluster, i)
        # Among equal gradients, the tighter node (best-fit): measured to strand fewer
        # GPUs on the Alibaba trace (docs/sharing.md).
        tie_break = TIE_BREAK * _remaining(cluster, shape, i)
        if not shape.fractional:
            chosen = tuple(gpus[: shape.gpus])
            return self._after(shape, cluster, i, chosen) - before + tie_break, chosen
        # A share: try each distinct GPU state once (GPUs alike in state score alike);
        # among equal gradients, the fuller GPU.
        free, gmem = cluster.gpu_free[i], cluster.gpu_mem_free[i]
        tried: set[tuple[int, int]] = set()
        best: tuple[float, int, int] | None = None
        for g in gpus:
            state = (free[g], gmem[g])
            if state in tried:
                continue
            tried.add(state)
            delta = self._after(shape, cluster, i, (g,)) - before
            if best is None or (delta, free[g]) < (best[0], best[1]):
                best = (delta, free[g], g)
        return None if best is None else (best[0] + tie_break, (best[2],))


def cluster_fragmentation(cluster: SharedCluster, mix: TaskMix) -> float:
    """The cluster's expected fragmentation under this mix, in GPUs, as the FGD paper
    measures it (`fgd-paper`)."""
    fgd = Fgd(mix, paper=True)
    return sum(fgd.node_fragmentation(cluster, i) for i in range(len(cluster.nodes))) / GPU_MILLI


# Plugins by name; each factory takes the workload's mix (read by fgd) and a seed
# (read by random).
SHARING_PLUGINS: Final[dict[str, Callable[[TaskMix, int], SharingPlugin]]] = {
    "fgd": lambda mix, seed: Fgd(mix),
    "fgd-paper": lambda mix, seed: Fgd(mix, paper=True),
    "best-fit": lambda mix, seed: BestFit(),
    "dot-product": lambda mix, seed: DotProduct(),
    "gpu-packing": lambda mix, seed: GpuPacking(),
    "random": lambda mix, seed: RandomFit(seed),
}
# The packing-based baselines FGD is compared with (random is a baseline, not packing).
PACKING_PLUGINS: Final = ("best-fit", "dot-product", "gpu-packing")
