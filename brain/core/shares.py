"""Live placement of jobs with a `Demand` (a share of one GPU, GPU types or memory,
CPUs, memory) through the sharing ledger and its plugins (brain/core/sharing.py).

The decision cycle keeps whole GPUs in `FreeGpus` (brain/core/placement.py). A GPU
that jobs share is held there, not free, while any share of it is held; its free
share and memory are reckoned here from the jobs holding it. `SharePlacer` keeps a
`SharedCluster` for the cycle, reckoned from the cycle's free ledger, the shares held
and the CPUs and memory reserved (by running jobs and by those placed earlier in the
cycle), and redoes only the nodes that changed before each job with a demand; it asks
the policy's sharing plugin. A job with a demand runs on one node, but for whole GPUs
asking no CPUs or memory (`spreads`), which the whole-GPU placement puts on several
nodes of the kind it asks where none has room. Jobs without a demand never come here.

A shared GPU serves one tenant (MPS serves one Unix user at a time, and confined jobs
run as their tenant's user): each GPU that shares or a shareable job with room hold is
bound, in the ledger, to their `JobView.tenant`, and a share goes only onto a GPU of its
own tenant or one that no share holds.

Also what the brain refuses at submission: a demand no registered node could ever
satisfy (`never_fits`). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Final

from brain.core.model import (
    ClusterSnapshot,
    Demand,
    Grant,
    JobView,
    MemoryPressure,
    NodeView,
    NoFit,
    Preempt,
    gpus_said,
)
from brain.core.ordering import job_sequence
from brain.core.placement import Fit, FreeGpus, PlacementResult
from brain.core.sharing import (
    GPU_MILLI,
    SHARING_PLUGINS,
    SharedCluster,
    SharedNode,
    SharedTask,
    SharingPlugin,
    TaskMix,
    TaskShape,
    Unschedulable,
    share_memory_mib,
)

_MODEL_WORDS: Final = re.compile(r"[\s\-_/]+")
# Co-location (`JobSpec.shareable`): a running whole-GPU job whose profile's p95 and
# forecast utilisation are at most this lets shares use the rest of its GPUs (each
# holding its memory limit, or its share of the GPU's memory: `share_memory_mib`). It
# is reckoned to need its utilisation's share of the GPU and this margin over its peak
# (or forecast) memory.
COLOCATE_MAX_UTIL_PCT: Final = 50.0
HOST_MEMORY_MARGIN: Final = 1.25
# A co-located GPU forecast to use this share of its memory moves a share off it.
MEMORY_PRESSURE: Final = 0.9


def model_matches(model: str, wanted: str) -> bool:
    """Whether a GPU model (as NVML names it) is of a type a job asked for: the whole
    name or one of its words, ignoring case (`H100` is `NVIDIA H100 80GB HBM3`)."""
    name, want = model.lower(), wanted.lower().strip()
    return name == want or want in _MODEL_WORDS.split(name)


def allowed_models(types: Sequence[str], models: Iterable[str]) -> frozenset[str]:
    """The models among `models` that any of `types` names."""
    return frozenset(m for m in models if any(model_matches(m, t) for t in types))


def spreads(demand: Demand, gpus: int) -> bool:
    """Whether a job with this demand may run on several nodes: whole GPUs, more than
    one, and nothing asked of a node's CPUs or memory (how a job's would divide among
    its nodes is not said). Its GPU types and GPU memory then narrow the nodes."""
    return gpus > 1 and not demand.fractional and not demand.cpu_milli and not demand.memory_mib


def _gpus_asked(demand: Demand, gpus: int) -> str:
    if demand.fractional:
        return f"{demand.gpu_milli / GPU_MILLI:g} of a GPU"
    return gpus_said(gpus)


def describe_demand(job: JobView, plugin: str) -> str:
    """`a 0.5 share of its GPU with 20480 MiB, placed by fgd`: what a placement of a job
    with a demand gave it, for its cause."""
    demand = job.demand or Demand()
    parts = [
        f"a {demand.gpu_milli / GPU_MILLI:g} share of its GPU"
        if demand.fractional
        else f"{job.gpus} whole GPU{'s' if job.gpus != 1 else ''}"
    ]
    if demand.gpu_memory_mib:
        parts.append(f"{demand.gpu_memory_mib} MiB of GPU memory")
    if demand.gpu_types:
        parts.append(f"type {'|'.join(demand.gpu_types)}")
    if demand.cpu_milli:
        parts.append(f"{demand.cpu_milli / 1000:g} CPUs")
    if demand.memory_mib:
        parts.append(f"{demand.memory_mib} MiB of memory")
    return f"{', '.join(parts)}, placed by {plugin}"


def never_fits(demand: Demand, gpus: int, nodes: Sequence[NodeView]) -> str | None:
    """Why no node of `nodes` (every GPU each has, whatever its state) could ever run a
    job asking this, naming the field; None when one could. Each constraint narrows
    the nodes that satisfy those before it, so the field named is the first that no
    node satisfies together with the others."""
    if not nodes:
        return None  # nothing registered yet: a cluster still starting
    candidates = list(nodes)
    if demand.gpu_types:
        models = sorted({n.model for n in nodes})
        candidates = [n for n in candidates if allowed_models(demand.gpu_types, (n.model,))]
        if not candidates:
            return (
                f"gpu_types: no node has GPUs of type {'|'.join(demand.gpu_types)} "
                f"(models here: {', '.join(models) or 'none'})"
            )
    if spreads(demand, gpus):
        # Whole GPUs on as many nodes as it takes, of those whose GPUs satisfy it.
        if demand.gpu_memory_mib:
            most = max(n.gpu_memory_mib for n in candidates)
            candidates = [n for n in candidates if n.gpu_memory_mib >= demand.gpu_memory_mib]
            if not candidates:
                return (
                    f"gpu_memory_mib: asks {demand.gpu_memory_mib} MiB per GPU; the most a "
                    f"node that fits the rest has is {most} MiB per GPU"
                )
        held = sum(len(n.gpus) for n in candidates)
        if held < gpus:
            return f"gpus: asks {gpus_said(gpus)}; the nodes that fit the rest have {held} in all"
        return None
    need = 1 if demand.fractional else gpus
    # (field, asked, what a node has, how to say an amount of it)
    checks: tuple[tuple[str, int, Callable[[NodeView], int], Callable[[int], str]], ...] = (
        ("gpus", need, lambda n: len(n.gpus), gpus_said),
        (
            "gpu_memory_mib",
            demand.gpu_memory_mib,
            lambda n: n.gpu_memory_mib,
            "{} MiB per GPU".format,
        ),
        ("cpus", demand.cpu_milli, lambda n: n.cpu_milli or 0, lambda m: f"{m / 1000:g} CPUs"),
        ("memory_mib", demand.memory_mib, lambda n: n.memory_mib or 0, "{} MiB of memory".format),
    )
    for name, asked, has, amount in checks:
        if not asked:
            continue
        most = max(has(n) for n in candidates)
        candidates = [n for n in candidates if has(n) >= asked]
        if not candidates:
            alone = (
                " (a job that asks CPUs or memory, or a share, runs on one node)"
                if name == "gpus"
                else ""
            )
            return (
                f"{name}: asks {amount(asked)}{alone}; the most a node that fits the rest "
                f"has is {amount(most)}"
            )
    return None


def shares_by_gpu(
    jobs: Sequence[JobView], ledger: FreeGpus
) -> dict[tuple[str, int], list[JobView]]:
    """The schedulable GPUs (`FreeGpus.within`) that running shares hold and no whole-GPU
    job holds (a co-located GPU is its host's), each with the shares on it, in the order
    of `jobs`: the GPUs that come back whole once every share on them has gone."""
    on: dict[tuple[str, int], list[JobView]] = {}
    for job in jobs:
        if job.shared:
            for grant in ledger.within(job.grants):
                for gpu in grant.gpus:
                    on.setdefault((grant.node, gpu), []).append(job)
    if on:
        for job in jobs:
            if not job.shared:
                for grant in job.grants:
                    for gpu in grant.gpus:
                        on.pop((grant.node, gpu), None)
    return on


def shared_gpus_held(jobs: Sequence[JobView], ledger: FreeGpus) -> int:
    """Distinct schedulable GPUs that running jobs hold shares of and no whole-GPU job
    holds (`shares_by_gpu`; a co-located GPU counts once, for its host)."""
    return len(shares_by_gpu(jobs, ledger))


def hosting(jobs: Sequence[JobView]) -> frozenset[str]:
    """Running whole-GPU jobs with shares beside them on their GPUs: never preemption
    victims (giving their GPUs back would give away GPUs the shares still use)."""
    shared = {(g.node, gpu) for job in jobs if job.shared for g in job.grants for gpu in g.gpus}
    if not shared:
        return frozenset()
    return frozenset(
        job.job_id
        for job in jobs
        if job.shareable and not job.shared
        for g in job.grants
        if shared.intersection((g.node, gpu) for gpu in g.gpus)
    )


def host_room(job: JobView, at: tuple[str, int] | None = None) -> tuple[int, float] | None:
    """What a running shareable job is reckoned to need of its GPU `at` (node, index;
    None: of its busiest), in thousandths and MiB, when its profile leaves room for
    shares beside it; None when it does not."""
    profile = job.profile
    if not job.shareable or job.shared or not job.grants or profile is None:
        return None
    util = max(profile.p95_util_pct, profile.forecast_util_pct)
    if util > COLOCATE_MAX_UTIL_PCT:
        return None
    used = (
        profile.memory_on(*at)
        if at is not None
        else max(profile.mem_peak_mib, profile.forecast_mem_mib)
    )
    return min(GPU_MILLI, math.ceil(util * GPU_MILLI / 100)), used * HOST_MEMORY_MARGIN


def memory_pressure(snapshot: ClusterSnapshot) -> list[Preempt]:
    """Shares to move off co-located GPUs before they run out of memory.

    A host's profile is its own memory on each of its GPUs (brain/profiles.py leaves
    its guests' out; `UtilizationProfile.memory_on`), and each guest may use its
    `share_memory_mib`: what admission reckoned it at, and what MPS holds it to. Per
    GPU of a running shareable job, while the host's peak or forecast there reaches
    `MEMORY_PRESSURE` of what its guests leave of the GPU, the guest that came last
    moves (ties: the later job, as every order breaks them). Moving below admission's
    reckoning (1 / `HOST_MEMORY_MARGIN` of the same) keeps a guest from coming back to
    a GPU it would be moved off again."""
    hosts = [j for j in snapshot.running if j.shareable and not j.shared and j.profile]
    if not hosts:
        return []
    memory = {n.name: n.gpu_memory_mib for n in snapshot.nodes}
    guests: dict[tuple[str, int], list[JobView]] = {}
    for job in snapshot.running:
        if job.shared:
            for grant in job.grants:
                for gpu in grant.gpus:
                    guests.setdefault((grant.node, gpu), []).append(job)
    moves: list[Preempt] = []
    moved: set[str] = set()
    for host in hosts:
        assert host.profile is not None
        for grant in host.grants:
            total = memory.get(grant.node, 0)
            for gpu in grant.gpus:
                forecast = host.profile.memory_on(grant.node, gpu)
                here = [g for g in guests.get((grant.node, gpu), ()) if g.job_id not in moved]
                if not here or not total:
                    continue
                here.sort(key=lambda g: (g.started_at or 0.0, job_sequence(g.job_id)))
                held = {g.job_id: _share_memory(g, total) for g in here}
                beside = sum(held.values())
                while here and forecast >= MEMORY_PRESSURE * (total - beside):
                    last = here.pop()
                    moved.add(last.job_id)
                    cause = MemoryPressure(host.job_id, grant.node, gpu, forecast, total, beside)
                    moves.append(Preempt(last.job_id, last.grants, cause))
                    beside -= held[last.job_id]
    return moves


def _share_memory(job: JobView, gpu_mib: int) -> int:
    """The GPU memory a running share holds (`share_memory_mib`)."""
    assert job.demand is not None
    return share_memory_mib(job.demand.gpu_milli, job.demand.gpu_memory_mib, gpu_mib)


class _KeptCluster:
    """`SharePlacer`'s sharing ledger across a cycle's jobs, and what it was built from:
    the free ledger (and its epoch), its change mark, whether it was set for a guest
    share, and the nodes changed since that the free ledger does not say."""

    def __init__(self, cluster: SharedCluster, ledger: FreeGpus, epoch: int, guest: bool) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.epoch = epoch
        self.guest = guest
        self.mark = 0
        self.dirty: set[str] = set()
        self.position = {node.name: i for i, node in enumerate(cluster.nodes)}


class SharePlacer:
    """Places one cycle's jobs with a demand; built when the cycle meets the first."""

    def __init__(self, snapshot: ClusterSnapshot, plugin: str, *, seed: int = 0) -> None:
        self._nodes = snapshot.nodes
        self._models = frozenset(n.model for n in snapshot.nodes)
        # (demand, grants, tenant) of every job with a demand that holds GPUs: running
        # ones, then those placed in this cycle.
        self._held: list[tuple[Demand, tuple[Grant, ...], str | None]] = [
            (j.demand, j.grants, j.tenant)
            for j in snapshot.running
            if j.demand is not None and j.grants
        ]
        # GPUs running whole-GPU jobs hold (shares beside them only on a host's).
        self._whole = {
            (g.node, gpu)
            for j in snapshot.running
            if not j.shared
            for g in j.grants
            for gpu in g.gpus
        }
        # GPUs of running shareable jobs with room beside them: (node, gpu) -> (job,
        # thousandths and MiB it is reckoned to need, its tenant: its guests' too).
        self._hosts: dict[tuple[str, int], tuple[str, int, float, str | None]] = {}
        for job in snapshot.running:
            if host_room(job) is None:
                continue
            for grant in job.grants:
                for gpu in grant.gpus:
                    room = host_room(job, (grant.node, gpu))
                    assert room is not None
                    self._hosts[(grant.node, gpu)] = (job.job_id, *room, job.tenant)
        # Running shareable jobs, to say why a share that waits is not beside them.
        self._shareable = sorted(
            j.job_id for j in snapshot.running if j.shareable and not j.shared and j.grants
        )
        self._plugin: SharingPlugin = SHARING_PLUGINS[plugin](self._mix(snapshot), seed)
        # The held jobs on each node, in `_held`'s order, and the nodes with a host.
        self._held_on: dict[str, list[tuple[Demand, tuple[Grant, ...], str | None]]] = {}
        for held in self._held:
            self._hold(held)
        self._host_nodes = {node for node, _ in self._hosts}
        self._kept: _KeptCluster | None = None
        self._unfit: dict[tuple[tuple[str, ...], int], frozenset[str]] = {}
        # `narrowed`'s copies: (copy, the ledger and its epoch, its change mark).
        self._narrowed: dict[frozenset[str], tuple[FreeGpus, FreeGpus, int, int]] = {}

    def _mix(self, snapshot: ClusterSnapshot) -> TaskMix:
        """The workload fgd weighs fragment against, as the FGD authors take it from
        history: what the jobs that finished lately asked (`recent_asks`) and every job
        held, running or pending. Whole-GPU jobs count too, most of a cluster's often:
        left out, an idle GPU would be no more worth keeping whole than a half-used one.
        A job without a demand is its GPU count alone."""
        held = (*snapshot.running, *snapshot.pending)
        counts = Counter(self._task(j).shape for j in held if j.demand is not None)
        # Most jobs: counted by GPUs alone, in one pass the Counter makes in C.
        plain = Counter([j.gpus for j in held if j.demand is None])
        for gpus, n in plain.items():
            counts[self._shape(gpus, None, None)] += n
        for ask, n in snapshot.recent_asks:
            counts[self._shape(ask.gpus, ask.demand, ask.tenant)] += n
        return TaskMix.counted(counts)

    def _task(self, job: JobView) -> SharedTask:
        return self._shared_task(job.job_id, job.gpus, job.demand, job.tenant)

    def _shape(self, gpus: int, demand: Demand | None, tenant: str | None) -> TaskShape:
        return self._shared_task("", gpus, demand, tenant).shape

    def _shared_task(
        self, name: str, gpus: int, demand: Demand | None, tenant: str | None
    ) -> SharedTask:
        demand = demand or Demand()
        types = allowed_models(demand.gpu_types, self._models) if demand.gpu_types else frozenset()
        return SharedTask(
            name=name,
            cpu_milli=demand.cpu_milli,
            memory_mib=demand.memory_mib,
            gpus=1 if demand.fractional else gpus,
            gpu_milli=demand.gpu_milli,
            gpu_memory_mib=demand.gpu_memory_mib,
            gpu_types=types,
            tenant=tenant,
        )

    def _not_beside(self) -> str:
        """Why a share that fits nowhere is not beside the running shareable jobs."""
        shown = self._shareable[:3]
        more = f" and {len(self._shareable) - 3} more" if len(self._shareable) > 3 else ""
        jobs = f"job{'s' if len(self._shareable) > 1 else ''} {', '.join(shown)}{more}"
        return (
            f"no room beside shareable {jobs}: a profile's utilisation over "
            f"{COLOCATE_MAX_UTIL_PCT:g} % leaves none, and its memory is reckoned at "
            f"{HOST_MEMORY_MARGIN:g} x its peak or forecast"
        )

    def narrowed(self, ledger: FreeGpus, without: frozenset[str]) -> FreeGpus:
        """The free ledger without these nodes, for a job placed as one without a
        demand on the nodes that fit it (`spreads`): a copy kept for the cycle per set
        left out, brought up to date with what `ledger` changed since (`follow`)."""
        kept = self._narrowed.get(without)
        if kept is not None and kept[1] is ledger and kept[2] == ledger.epoch:
            copy, _, _, mark = kept
            copy.follow(ledger, dict.fromkeys(ledger.changed_since(mark)))
        else:
            copy = ledger.excluding(without)
        self._narrowed[without] = (copy, ledger, ledger.epoch, ledger.changes())
        return copy

    def unfit(self, demand: Demand) -> frozenset[str]:
        """The nodes whose GPUs a job with this demand may not have: of another type,
        or with less memory than it asks per GPU (kept per demand for the cycle)."""
        key = (demand.gpu_types, demand.gpu_memory_mib)
        found = self._unfit.get(key)
        if found is None:
            found = self._unfit[key] = frozenset(
                n.name
                for n in self._nodes
                if n.gpu_memory_mib < demand.gpu_memory_mib
                or (demand.gpu_types and not allowed_models(demand.gpu_types, (n.model,)))
            )
        return found

    def placed(self, job: JobView, grants: tuple[Grant, ...]) -> None:
        if job.demand is not None:
            held = (job.demand, grants, job.tenant)
            self._held.append(held)
            self._hold(held)
            if self._kept is not None:
                self._kept.dirty.update(g.node for g in grants)

    def _hold(self, held: tuple[Demand, tuple[Grant, ...], str | None]) -> None:
        for node in dict.fromkeys(g.node for g in held[1]):
            self._held_on.setdefault(node, []).append(held)

    def colocated_with(self, grants: tuple[Grant, ...]) -> str | None:
        """`co-located with job 3 (reckoned to use 0.2 of the GPU and 9000 MiB)` when
        these grants are a share on a shareable job's GPU."""
        for grant in grants:
            for gpu in grant.gpus:
                host = self._hosts.get((grant.node, gpu))
                if host is not None:
                    return (
                        f"co-located with job {host[0]}, whose profile leaves room "
                        f"(reckoned at {host[1] / GPU_MILLI:g} of the GPU and {host[2]:.0f} MiB)"
                    )
        return None

    def _node_state(
        self, view: NodeView, ledger: FreeGpus, guest: bool, hidden: AbstractSet[int]
    ) -> tuple[int, int, list[int], list[int], dict[int, str | None]]:
        """What node `view` offers a job now, as `SharedCluster.set_free` takes it: the
        CPUs and memory that held jobs leave, each GPU's free thousandths and memory,
        and the tenant each bound GPU serves. `guest`: the job is a share (only a share
        may join a shareable job's GPU); `hidden`: free GPUs not for it."""
        name = view.name
        cpu, mem = view.cpu_milli or 0, view.memory_mib or 0
        # The thousandths and MiB of each shared GPU, and the tenant it serves (one per
        # GPU: the ledger kept it so).
        shares: dict[int, tuple[int, int]] = {}
        serves: dict[int, str | None] = {}
        for demand, grants, tenant in self._held_on.get(name, ()):
            if not demand.fractional and ledger.all_free(grants):
                continue  # a victim released in this cycle: it reserves nothing now
            for grant in grants:
                if grant.node != name:
                    continue
                cpu -= demand.cpu_milli
                mem -= demand.memory_mib
                if demand.fractional:
                    for gpu in grant.gpus:
                        serves[gpu] = tenant
                        milli, memory = shares.get(gpu, (0, 0))
                        memory += share_memory_mib(
                            demand.gpu_milli, demand.gpu_memory_mib, view.gpu_memory_mib
                        )
                        shares[gpu] = (milli + demand.gpu_milli, memory)
        free = set(ledger.lowest(name, ledger.free_on(name))) - hidden
        gpu_free: list[int] = []
        gpu_mem: list[int] = []
        # The tenant each GPU serves, by its shareable job or its shares.
        bound: dict[int, str | None] = {}
        for position, gpu in enumerate(view.gpus):
            held = shares.get(gpu)
            host = self._hosts.get((name, gpu))
            if gpu in serves:
                bound[position] = serves[gpu]
            if host is not None:
                bound[position] = host[3]
                # A shareable job's GPU: room only for a share.
                guests = held or (0, 0)
                gpu_free.append(max(0, GPU_MILLI - host[1] - guests[0]) if guest else 0)
                gpu_mem.append(
                    max(0, int(view.gpu_memory_mib - host[2]) - guests[1]) if guest else 0
                )
            elif gpu in free:
                gpu_free.append(GPU_MILLI)
                gpu_mem.append(view.gpu_memory_mib)
            elif held is not None and (name, gpu) not in self._whole:
                gpu_free.append(max(0, GPU_MILLI - held[0]))
                gpu_mem.append(max(0, view.gpu_memory_mib - held[1]))
            else:
                gpu_free.append(0)
                gpu_mem.append(0)
        return max(0, cpu), max(0, mem), gpu_free, gpu_mem, bound

    def _cluster(
        self,
        job: JobView,
        ledger: FreeGpus,
        avoid: frozenset[str],
        hidden: AbstractSet[tuple[str, int]],
    ) -> tuple[SharedCluster, Sequence[NodeView]]:
        """The sharing ledger as it stands for this job. The cycle's common case (no
        node to avoid, no GPU hidden) keeps one and redoes only the nodes changed since
        the last job: those the free ledger changed, those a job was placed on, and
        those of shareable jobs when whether the job may join them changed. So the
        plugin's scores of the other nodes stand (`ScoringPlugin`), and a job costs
        what changed, not the cluster."""
        # Only a share may join a shareable job's GPU.
        guest = job.shared
        if avoid or hidden:
            views = [n for n in self._nodes if n.name not in avoid]
            return self._built(views, ledger, guest, hidden), views
        kept = self._kept
        if kept is None or kept.ledger is not ledger or kept.epoch != ledger.epoch:
            cluster = self._built(self._nodes, ledger, guest, frozenset())
            kept = self._kept = _KeptCluster(cluster, ledger, ledger.epoch, guest)
        else:
            dirty = kept.dirty
            dirty.update(ledger.changed_since(kept.mark))
            if guest != kept.guest:
                dirty |= self._host_nodes
            # (A held job that reserves nothing once its GPUs are free gave them back on
            # every node it holds: a change there is the ledger's.)
            position = kept.position
            for node in dirty:
                i = position.get(node)
                if i is not None:
                    kept.cluster.set_free(
                        i, *self._node_state(self._nodes[i], ledger, guest, frozenset())
                    )
            dirty.clear()
            kept.guest = guest
        kept.mark = ledger.changes()
        return kept.cluster, self._nodes

    def _built(
        self,
        views: Sequence[NodeView],
        ledger: FreeGpus,
        guest: bool,
        hidden: AbstractSet[tuple[str, int]],
    ) -> SharedCluster:
        cluster = SharedCluster(
            [
                SharedNode(
                    name=v.name,
                    cpu_milli=v.cpu_milli or 0,
                    memory_mib=v.memory_mib or 0,
                    gpus=len(v.gpus),
                    model=v.model,
                    gpu_memory_mib=v.gpu_memory_mib,
                )
                for v in views
            ]
        )
        for i, view in enumerate(views):
            here = {gpu for node, gpu in hidden if node == view.name} if hidden else frozenset()
            cluster.set_free(i, *self._node_state(view, ledger, guest, here))
        return cluster

    def place(
        self,
        job: JobView,
        ledger: FreeGpus,
        avoid: frozenset[str],
        hidden: AbstractSet[tuple[str, int]] = frozenset(),
    ) -> PlacementResult:
        """Where the job fits now, on one node, not on a `hidden` GPU that is free
        (one a victim ranked ahead of it gave back). A share on a GPU already shared
        takes nothing from the free ledger (`Fit.takes`); any other takes its GPUs."""
        demand = job.demand or Demand()
        if demand.gpu_types and not allowed_models(demand.gpu_types, self._models):
            return NoFit(
                f"no schedulable GPU of type {'|'.join(demand.gpu_types)} now", kind="no_gpu_type"
            )
        cluster, views = self._cluster(job, ledger, avoid, hidden)
        outcome = self._plugin.choose(self._task(job), cluster)
        if isinstance(outcome, Unschedulable):
            asked = _gpus_asked(demand, job.gpus)
            reason = f"{outcome.reason} (asks {asked} on one node)"
            if avoid:
                reason += f" (avoiding {', '.join(sorted(avoid))}, where it failed)"
            if demand.fractional and self._shareable:
                reason += "; " + self._not_beside()
            return NoFit(reason, kind="no_share_fits")
        view = views[outcome.node]
        gpus = tuple(sorted(view.gpus[p] for p in outcome.gpus))
        grants = (Grant(view.name, gpus),)
        free = set(ledger.lowest(view.name, ledger.free_on(view.name)))
        taken = tuple(g for g in gpus if g in free)
        return Fit(grants, takes=(Grant(view.name, taken),) if taken else ())
