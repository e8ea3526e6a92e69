"""Shared, typed GPU placement (brain.core.sharing) and the Alibaba trace reader.

Pure: small clusters built in the test, no bus, no clock.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core.sharing import (
    GPU_MILLI,
    SHARING_PLUGINS,
    Fgd,
    InvalidShare,
    OverCommitted,
    ScoringPlugin,
    SharedCluster,
    SharedNode,
    SharedTask,
    SharePlacement,
    SharingPlugin,
    TaskMix,
    Unschedulable,
    share_memory_mib,
    type_pressure,
)
from brain.sim import cli
from brain.sim.sharing import (
    check_types,
    draw,
    inflate,
    load_nodes,
    load_tasks,
    replay,
    unallocated_floor,
)
from brain.sim.trace import TraceError

PLUGINS = sorted(SHARING_PLUGINS)


def node(
    name: str,
    gpus: int = 1,
    model: str = "T4",
    *,
    cpu: int = 32_000,
    mem: int = 65_536,
    gpu_mem: int = 16_384,
) -> SharedNode:
    return SharedNode(name, cpu, mem, gpus, model, gpu_mem)


def task(
    name: str,
    gpus: int = 1,
    milli: int = GPU_MILLI,
    *,
    cpu: int = 1_000,
    mem: int = 1_024,
    gpu_mem: int = 0,
    types: tuple[str, ...] = (),
    tenant: str | None = None,
) -> SharedTask:
    return SharedTask(name, cpu, mem, gpus, milli, gpu_mem, frozenset(types), tenant)


def plugin_for(name: str, tasks: list[SharedTask]) -> SharingPlugin:
    return SHARING_PLUGINS[name](TaskMix.of(tasks), 7)


def place_all(
    nodes: list[SharedNode], tasks: list[SharedTask], plugin_name: str
) -> tuple[SharedCluster, list[SharePlacement | Unschedulable]]:
    cluster = SharedCluster(nodes)
    plugin = plugin_for(plugin_name, tasks)
    return cluster, [cluster.place(t, plugin) for t in tasks]


def placed(outcome: SharePlacement | Unschedulable) -> SharePlacement:
    assert isinstance(outcome, SharePlacement), outcome
    return outcome


# (nodes, tasks, which tasks must be unschedulable): for every plugin.
TABLE = {
    "two halves share a GPU, a third does not fit": (
        [node("a")],
        [task("h1", milli=500), task("h2", milli=500), task("h3", milli=500)],
        {"h3"},
    ),
    "GPU memory limits a share even with share left": (
        [node("a", gpu_mem=16_384)],
        [task("m1", milli=300, gpu_mem=10_000), task("m2", milli=300, gpu_mem=10_000)],
        {"m2"},
    ),
    "a whole GPU needs one nobody shares": (
        [node("a", 2)],
        [task("s", milli=100), task("w2", 2), task("w1")],
        {"w2"},
    ),
    "a type constraint holds": (
        [node("t4", model="T4"), node("v100", model="V100M16")],
        [task("v1", types=("V100M16",)), task("v2", types=("V100M16",))],
        {"v2"},
    ),
    "CPU is never over-committed": (
        [node("a", 2, cpu=4_000)],
        [task("c1", cpu=3_000), task("c2", cpu=3_000)],
        {"c2"},
    ),
    "memory is never over-committed": (
        [node("a", 2, mem=8_192)],
        [task("r1", mem=5_000), task("r2", milli=100, mem=5_000)],
        {"r2"},
    ),
    "a CPU-only task needs no GPU": (
        [node("a", 1)],
        [task("w"), task("cpu", 0)],
        set(),
    ),
}


@pytest.mark.parametrize("plugin_name", PLUGINS)
@pytest.mark.parametrize("case", sorted(TABLE))
def test_placement_table(case: str, plugin_name: str) -> None:
    nodes, tasks, refused = TABLE[case]
    cluster, outcomes = place_all(nodes, tasks, plugin_name)
    assert {o.task.name for o in outcomes if isinstance(o, Unschedulable)} == refused
    for outcome in outcomes:
        if isinstance(outcome, SharePlacement):
            n = cluster.nodes[outcome.node]
            assert not outcome.task.gpu_types or n.model in outcome.task.gpu_types
    assert_consistent(cluster, [o for o in outcomes if isinstance(o, SharePlacement)])


def test_an_unschedulable_task_says_what_it_asked() -> None:
    _, (outcome,) = place_all([node("a")], [task("big", 4)], "fgd")
    assert isinstance(outcome, Unschedulable)
    assert "4 whole GPUs" in outcome.reason


def test_a_release_of_what_is_not_held_changes_nothing() -> None:
    cluster, (held,) = place_all([node("a")], [task("half", milli=500)], "fgd")
    assert isinstance(held, SharePlacement)

    def free() -> tuple[list[int], list[list[int]]]:
        return list(cluster.cpu_free), [list(g) for g in cluster.gpu_free]

    before = free()
    with pytest.raises(OverCommitted, match="not held"):  # never applied
        cluster.release(SharePlacement(task("other", milli=500), held.node, held.gpus))
    assert free() == before
    cluster.release(held)
    released = free()
    with pytest.raises(OverCommitted, match="not held"):  # released already
        cluster.release(held)
    assert free() == released


def test_fgd_fills_a_half_used_gpu_before_breaking_an_idle_one() -> None:
    tasks = [task("first", milli=500), task("second", milli=500), task("whole")]
    cluster = SharedCluster([node("a"), node("b")])
    fgd = Fgd(TaskMix.of(tasks))
    first = placed(cluster.place(tasks[0], fgd))
    second = placed(cluster.place(tasks[1], fgd))
    assert (second.node, second.gpus) == (first.node, first.gpus)
    # The whole-GPU shape still finds an idle GPU: nothing was fragmented.
    placed(cluster.place(tasks[2], fgd))


def test_fgd_keeps_whole_gpus_whole_where_a_share_fits_a_shared_one() -> None:
    # Node a: one GPU 700 used (300 free), one idle; a 0.3 share fits the used one.
    cluster = SharedCluster([node("a", 2)])
    tasks = [task("big", milli=700), task("small", milli=300), task("whole")]
    fgd = Fgd(TaskMix.of(tasks))
    big = placed(cluster.place(tasks[0], fgd))
    small = placed(cluster.place(tasks[1], fgd))
    assert small.gpus == big.gpus
    placed(cluster.place(tasks[2], fgd))


@pytest.mark.parametrize(
    ("plugin_name", "chosen"),
    [
        # The paper's measure: either node could take one more task of each shape,
        # so the gradients tie and the tighter node (a) wins.
        ("fgd-paper", "a"),
        # fgd: on a, 8 cores would be left for 2 GPUs, short of the mix's 4.5 cores
        # per GPU (0.22 of a GPU unbacked); on b, 40 cores back both.
        ("fgd", "b"),
    ],
)
def test_fgd_sends_a_cpu_hungry_task_where_the_cpu_left_backs_the_gpus_left(
    plugin_name: str, chosen: str
) -> None:
    hungry, light = task("hungry", cpu=8_000, mem=0), task("light", cpu=1_000, mem=0)
    cluster = SharedCluster([node("a", 3, cpu=16_000), node("b", 3, cpu=48_000)])
    plugin = plugin_for(plugin_name, [hungry, light])
    assert cluster.nodes[placed(cluster.place(hungry, plugin)).node].name == chosen


def test_fgd_unbacked_gpus_are_what_the_mean_cpu_per_gpu_leaves_without_cpu() -> None:
    # Mix: 8 and 1 cores per GPU, equally often: 4.5 cores per GPU on average.
    mix = TaskMix.of([task("hungry", cpu=8_000, mem=0), task("light", cpu=1_000, mem=0)])
    fgd, paper = Fgd(mix), Fgd(mix, paper=True)
    state = ("T4", 8_000, 65_536, [GPU_MILLI, GPU_MILLI], [16_384, 16_384])
    # 8 cores back 8 / 4.5 = 1.78 of the 2 idle GPUs.
    assert fgd.fragmentation(*state) - paper.fragmentation(*state) == pytest.approx(
        2_000 - 8_000 / 4.5
    )
    rich = ("T4", 9_000, 65_536, [GPU_MILLI, GPU_MILLI], [16_384, 16_384])
    assert fgd.fragmentation(*rich) == paper.fragmentation(*rich)


@pytest.mark.parametrize(
    ("nodes", "tasks", "expected"),
    [
        # No shape names a type: no model is needed by any in particular.
        ([node("t", 2, "T4"), node("g", 6, "G2")], [task("any")], {"T4": 0.0, "G2": 0.0}),
        # A quarter of the GPUs asked are T4-only; filling 8 GPUs, that is 2 GPUs, the
        # T4s' 2: all of them.
        (
            [node("t", 2, "T4"), node("g", 6, "G2")],
            [task("t4", types=("T4",)), *(task(f"any{i}") for i in range(3))],
            {"T4": 1.0, "G2": 0.0},
        ),
        # Half the GPUs asked may run on T4 or P100 (4 of 8): spread over their 4 GPUs
        # by number, each model's GPUs are all needed; more than there is counts 1.
        (
            [node("t", 1, "T4"), node("p", 3, "P100"), node("g", 4, "G2")],
            [task("tp", types=("T4", "P100")), task("any")],
            {"T4": 1.0, "P100": 1.0, "G2": 0.0},
        ),
        # A share asks its thousandths: a 0.5 share T4-only beside a whole GPU of
        # any model is a third of the GPUs asked; 2 of 6 GPUs, on the T4s' 4: half.
        (
            [node("t", 4, "T4"), node("g", 2, "G2")],
            [task("half", milli=500, types=("T4",)), task("any")],
            {"T4": 0.5, "G2": 0.0},
        ),
    ],
)
def test_type_pressure_is_the_share_of_a_models_gpus_that_constrained_shapes_need(
    nodes: list[SharedNode], tasks: list[SharedTask], expected: dict[str, float]
) -> None:
    assert type_pressure(TaskMix.of(tasks), nodes) == pytest.approx(expected)


@pytest.mark.parametrize(("plugin_name", "chosen"), [("fgd-paper", "t"), ("fgd", "g")])
def test_fgd_leaves_the_gpus_of_a_needed_model_to_tasks_that_may_run_nowhere_else(
    plugin_name: str, chosen: str
) -> None:
    # Mix: T4-only 1-GPU tasks (2 in 8), 1-GPU tasks of any model (5), a 4-GPU task (1).
    # The paper's measure keeps the 4-GPU node whole for the rare 4-GPU shape: on t the
    # gradient is -125 (a GPU the 4-GPU shape could never use is taken), on g +125.
    # fgd adds that T4-only tasks need 0.55 of the T4s' GPUs (+545 on t): the task
    # that may run anywhere leaves them.
    t4_only, free_to_go, four = task("t4", types=("T4",)), task("any"), task("four", 4)
    cluster = SharedCluster([node("t", 2, "T4"), node("g", 4, "G2")])
    plugin = plugin_for(plugin_name, [t4_only] * 2 + [free_to_go] * 5 + [four])
    assert cluster.nodes[placed(cluster.place(free_to_go, plugin)).node].name == chosen


def test_best_fit_measures_what_is_left_in_amounts_so_a_large_node_stays_whole() -> None:
    # An 8-GPU node half used and an idle 2-GPU node. As shares of each node, the
    # 8-GPU node is the tighter (3/8 left against 1/2) and a 1-GPU task there leaves
    # no node with 4 GPUs; as amounts (the FGD authors' best-fit), the small node is.
    tasks = [task("four", 4), task("one"), task("four again", 4)]
    cluster = SharedCluster([node("large", 8), node("small", 2)])
    best_fit = plugin_for("best-fit", tasks)
    assert placed(cluster.place(tasks[0], best_fit)).node == 0
    assert placed(cluster.place(tasks[1], best_fit)).node == 1
    assert placed(cluster.place(tasks[2], best_fit)).node == 0


def test_random_is_seeded() -> None:
    nodes = [node(f"n{i}", 4) for i in range(20)]
    tasks = [task(f"t{i}", milli=250) for i in range(30)]

    def run(seed: int) -> list[tuple[int, tuple[int, ...]]]:
        cluster = SharedCluster(nodes)
        plugin = SHARING_PLUGINS["random"](TaskMix.of(tasks), seed)
        return [(p.node, p.gpus) for p in map(placed, (cluster.place(t, plugin) for t in tasks))]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_the_ledger_refuses_an_over_commit() -> None:
    cluster = SharedCluster([node("a")])
    cluster.apply(SharePlacement(task("x", milli=600), 0, (0,)))
    with pytest.raises(OverCommitted):
        cluster.apply(SharePlacement(task("y", milli=600), 0, (0,)))
    with pytest.raises(OverCommitted):
        cluster.apply(SharePlacement(task("z", types=("A100",)), 0, (0,)))


def test_a_share_without_a_limit_holds_its_share_of_the_gpus_memory() -> None:
    """MPS limits a share that asked no memory to its share of the GPU's: beside a 0.5
    share without a limit, a share whose limit is over the other half does not fit
    (its limit could not hold), and three thirds still fill a GPU."""
    cluster = SharedCluster([node("a")])
    held = SharePlacement(task("s", milli=500), 0, (0,))
    cluster.apply(held)
    assert cluster.gpu_mem_free[0][0] == 8_192
    assert cluster.fitting_gpus(task("over", milli=400, gpu_mem=10_000).shape, 0) == []
    assert cluster.fitting_gpus(task("under", milli=400, gpu_mem=8_000).shape, 0) == [0]
    cluster.release(held)
    assert cluster.gpu_mem_free[0][0] == 16_384
    for name, milli in (("a", 333), ("b", 333), ("c", 334)):
        cluster.apply(SharePlacement(task(name, milli=milli), 0, (0,)))
    assert (cluster.gpu_free[0][0], cluster.gpu_mem_free[0][0]) == (0, 2)


def test_a_task_that_cannot_be_described_names_its_field() -> None:
    with pytest.raises(InvalidShare, match="gpu_milli"):
        task("x", 2, 500)
    with pytest.raises(InvalidShare, match="gpu_milli"):
        task("x", 1, 1_500)
    with pytest.raises(InvalidShare, match="cpu_milli"):
        task("x", cpu=-1)


@pytest.mark.parametrize("plugin_name", PLUGINS)
def test_a_shared_gpu_serves_one_tenant(plugin_name: str) -> None:
    tasks = [task("a1", milli=300, tenant="a"), task("b1", milli=300, tenant="b")]
    tasks += [task("a2", milli=300, tenant="a"), task("b2", milli=300, tenant="b")]
    cluster, outcomes = place_all([node("n", 2)], tasks, plugin_name)
    gpu = {o.task.name: o.gpus for o in outcomes if isinstance(o, SharePlacement)}
    assert len(gpu) == 4
    assert gpu["a1"] == gpu["a2"] != gpu["b1"] == gpu["b2"]
    assert sorted(t for row in cluster.gpu_tenant for t in row) == ["a", "b"]
    # Room is left on both GPUs, but each serves another tenant: c waits, and says so.
    refused = cluster.place(task("c", milli=300, tenant="c"), plugin_for(plugin_name, tasks))
    assert isinstance(refused, Unschedulable)
    assert "on a GPU open to tenant c: the GPUs with room serve other tenants' shares" in (
        refused.reason
    )
    # Whole GPUs and tasks of no GPU are not bound by tenant.
    assert cluster.fits(task("cpu", 0, tenant="c").shape, 0)


def test_a_gpu_opens_to_any_tenant_once_its_last_share_leaves() -> None:
    cluster = SharedCluster([node("n")])
    first = SharePlacement(task("a1", milli=500, tenant="a"), 0, (0,))
    second = SharePlacement(task("a2", milli=200, tenant="a"), 0, (0,))
    cluster.apply(first)
    cluster.apply(second)
    other = SharePlacement(task("b", milli=200, tenant="b"), 0, (0,))
    with pytest.raises(OverCommitted, match="serves tenant a's shares, not b's"):
        cluster.apply(other)
    cluster.release(first)
    with pytest.raises(OverCommitted, match="serves tenant a's"):
        cluster.apply(other)
    cluster.release(second)
    cluster.apply(other)
    assert cluster.gpu_tenant == [["b"]]


def test_tasks_of_no_known_tenant_are_one_tenant() -> None:
    cluster, outcomes = place_all(
        [node("n", 2)], [task("x", milli=400), task("y", milli=400)], "best-fit"
    )
    assert [o.gpus for o in outcomes if isinstance(o, SharePlacement)] == [(0,), (0,)]
    assert not cluster.closed_to_some(None)
    # A named tenant's share does not join them.
    named = placed(cluster.place(task("t", milli=100, tenant="t"), plugin_for("best-fit", [])))
    assert named.gpus == (1,)


def test_a_node_started_from_what_is_held_keeps_its_gpus_tenants() -> None:
    cluster = SharedCluster([node("n", 3)])
    cluster.set_free(0, 32_000, 65_536, [500, 800, 1000], [16_384] * 3, {0: "a", 1: None})
    for tenant, gpus in (("a", [0, 2]), (None, [1, 2]), ("b", [2])):
        assert cluster.fitting_gpus(task("s", milli=100, tenant=tenant).shape, 0) == gpus
    with pytest.raises(OverCommitted, match="bound GPU"):
        cluster.set_free(0, 1, 1, [1000] * 3, [1] * 3, {3: "a"})


def assert_consistent(cluster: SharedCluster, held: list[SharePlacement]) -> None:
    """The ledger equals what the held placements add up to, nothing exceeds, and each
    shared GPU's shares are one tenant's."""
    for i, n in enumerate(cluster.nodes):
        mine = [p for p in held if p.node == i]
        assert cluster.cpu_free[i] == n.cpu_milli - sum(p.task.cpu_milli for p in mine) >= 0
        assert cluster.mem_free[i] == n.memory_mib - sum(p.task.memory_mib for p in mine) >= 0
        for g in range(n.gpus):
            on_gpu = [p.task for p in mine if g in p.gpus]
            share = sum(t.gpu_milli for t in on_gpu)
            assert share <= GPU_MILLI
            assert cluster.gpu_free[i][g] == GPU_MILLI - share
            whole = [t for t in on_gpu if t.gpu_milli == GPU_MILLI]
            assert len(whole) <= 1 and (not whole or len(on_gpu) == 1)
            memory = (
                n.gpu_memory_mib
                if whole
                else sum(
                    share_memory_mib(t.gpu_milli, t.gpu_memory_mib, n.gpu_memory_mib)
                    for t in on_gpu
                )
            )
            assert memory <= n.gpu_memory_mib
            assert cluster.gpu_mem_free[i][g] == n.gpu_memory_mib - memory
            for t in on_gpu:
                assert not t.gpu_types or n.model in t.gpu_types
            shared = [t for t in on_gpu if t.gpu_milli < GPU_MILLI]
            assert len({t.tenant for t in shared}) <= 1, f"GPU {g} of {n.name}: two tenants"
            assert cluster.gpu_binds[i][g] == len(shared)
            assert cluster.gpu_tenant[i][g] == (shared[0].tenant if shared else None)


task_strategy = st.builds(
    lambda gpus, milli, cpu, mem, gpu_mem, types, tenant: SharedTask(
        "t", cpu, mem, gpus, milli if gpus == 1 else GPU_MILLI, gpu_mem, frozenset(types), tenant
    ),
    gpus=st.sampled_from([0, 1, 1, 1, 2, 4]),
    milli=st.sampled_from([100, 250, 300, 470, 500, 810, 1000]),
    cpu=st.integers(0, 16_000),
    mem=st.integers(0, 40_000),
    gpu_mem=st.sampled_from([0, 0, 4_000, 9_000]),
    types=st.sampled_from([(), (), ("T4",), ("V100M16",), ("T4", "V100M16")]),
    tenant=st.sampled_from([None, "a", "b"]),
)
# A step: place a task, or release the held placement at some index.
steps = st.lists(st.one_of(task_strategy, st.integers(0, 50)), min_size=1, max_size=60)


@pytest.mark.parametrize("plugin_name", PLUGINS)
def test_nodes_alike_but_for_the_tenant_their_gpus_serve_score_apart(plugin_name: str) -> None:
    # Scores are remembered by node state: x and y differ only in whose shares they hold.
    b_half = task("b", milli=500, tenant="b")
    a_half, a_quarter = task("a", milli=500, tenant="a"), task("a2", milli=250, tenant="a")
    cluster = SharedCluster([node("x"), node("y")])
    cluster.apply(SharePlacement(b_half, 0, (0,)))
    cluster.apply(SharePlacement(a_half, 1, (0,)))
    plugin = plugin_for(plugin_name, [b_half, a_half, a_quarter])
    assert placed(cluster.place(a_quarter, plugin)).node == 1


def _best_now(
    plugin_name: str, tasks: list[SharedTask], task: SharedTask, cluster: SharedCluster
) -> tuple[int, tuple[int, ...]] | None:
    """The lowest score (ties: the lower index) of a fresh plugin over every node."""
    fresh = plugin_for(plugin_name, tasks)
    assert isinstance(fresh, ScoringPlugin)
    best: tuple[float, int, tuple[int, ...]] | None = None
    for i in range(len(cluster.nodes)):
        if cluster.fits(task.shape, i):
            scored = fresh.score(task.shape, cluster, i, cluster.fitting_gpus(task.shape, i))
            if scored is not None and (best is None or scored[0] < best[0]):
                best = (scored[0], i, scored[1])
    return None if best is None else (best[1], best[2])


@pytest.mark.parametrize("plugin_name", PLUGINS)
@settings(max_examples=40, deadline=None)
@given(ops=steps)
def test_no_gpu_over_committed_whatever_the_sequence(
    plugin_name: str, ops: list[SharedTask | int]
) -> None:
    nodes = [
        node("a", 2, "T4", cpu=16_000, mem=32_768),
        node("b", 4, "V100M16", cpu=24_000, mem=65_536),
        node("c", 1, "T4", cpu=8_000, mem=16_384, gpu_mem=8_000),
    ]
    tasks = [op for op in ops if isinstance(op, SharedTask)]
    cluster = SharedCluster(nodes)
    plugin = plugin_for(plugin_name, tasks)
    held: list[SharePlacement] = []
    for op in ops:
        if isinstance(op, int):
            if held:
                cluster.release(held.pop(op % len(held)))
        else:
            if isinstance(plugin, ScoringPlugin):
                # What its heap, kept across changes, says is best: what a fresh
                # plugin scoring every node now says.
                assert plugin.best(op.shape, cluster) == _best_now(plugin_name, tasks, op, cluster)
            outcome = cluster.place(op, plugin)
            if isinstance(outcome, SharePlacement):
                held.append(outcome)
            else:
                # Refused only when no node could take it now.
                assert not any(cluster.fits(op.shape, i) for i in range(len(nodes)))
        assert_consistent(cluster, held)
    for placement in held:
        cluster.release(placement)
    assert_consistent(cluster, [])


# --- the trace reader -------------------------------------------------------------

NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,T4\nn1,64000,131072,1,V100M16\n"
TASKS_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
)
GOOD_TASK = "p0,4000,8192,1,500,,LS,Running,0,100,0\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ("p1,4000,8192,1,1500,,LS,Running,0,100,0", "gpu_milli"),
        ("p1,4000,8192,2,500,,LS,Running,0,100,0", "gpu_milli"),
        ("p1,lots,8192,1,500,,LS,Running,0,100,0", "cpu_milli"),
        ("p1,4000,-5,1,500,,LS,Running,0,100,0", "memory_mib"),
        ("p1,4000,8192,,500,,LS,Running,0,100,0", "num_gpu"),
        ("p1,4000,8192,1,500,,LS,Running,50,10,0", "deletion_time"),
        ("p1,4000,8192,1,500,,LS,Running,soon,100,0", "creation_time"),
        ("p1,4000,8192,1,500,,LS,Running,inf,,0", "creation_time"),
        ("p0,4000,8192,1,500,,LS,Running,0,100,0", "name"),
        # One row without a time among timed ones: not replayed in file order silently.
        ("p1,4000,8192,1,500,,LS,Running,,,0", "creation_time"),
    ],
)
def test_a_bad_task_row_is_refused_naming_file_line_and_field(
    tmp_path: Path, row: str, column: str
) -> None:
    path = write(tmp_path, "tasks.csv", TASKS_HEADER + GOOD_TASK + row + "\n")
    with pytest.raises(TraceError) as caught:
        load_tasks(path)
    assert caught.value.path == str(path)
    assert caught.value.line == 3
    assert caught.value.column == column
    assert f"{path}:3: column '{column}'" in str(caught.value)


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ("n2,8000,1024,x,T4", "gpu"),
        ("n2,8000,1024,2,", "model"),
        ("n0,8000,1024,1,T4", "sn"),
        ("n2,8000,1024,99999999999999999999999,T4", "gpu"),
    ],
)
def test_a_bad_node_row_is_refused_naming_file_line_and_field(
    tmp_path: Path, row: str, column: str
) -> None:
    path = write(tmp_path, "nodes.csv", NODES_CSV + row + "\n")
    with pytest.raises(TraceError) as caught:
        load_nodes(path)
    assert (caught.value.line, caught.value.column) == (4, column)


def test_a_node_list_without_a_gpu_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,0,\n")
    with pytest.raises(TraceError, match="no node of the node list has a GPU"):
        load_nodes(path)


def test_a_missing_column_and_an_unknown_gpu_type_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="missing column"):
        load_tasks(write(tmp_path, "t.csv", "name,cpu_milli\np,1\n"))
    nodes = load_nodes(write(tmp_path, "n.csv", NODES_CSV))
    tasks_path = write(
        tmp_path, "t2.csv", TASKS_HEADER + GOOD_TASK + "p1,1,1,1,1000,A100,LS,Running,0,1,0\n"
    )
    with pytest.raises(TraceError) as caught:
        check_types(nodes, load_tasks(tasks_path), str(tasks_path))
    assert (caught.value.line, caught.value.column) == (3, "gpu_spec")


def test_replay_frees_what_leaves(tmp_path: Path) -> None:
    nodes = load_nodes(write(tmp_path, "n.csv", NODES_CSV))
    rows = [
        "w0,1000,1024,2,1000,T4,LS,Running,0,10,0",
        "w1,1000,1024,1,1000,,LS,Running,1,20,1",
        "w2,1000,1024,2,1000,T4,LS,Running,5,30,5",  # T4s busy: refused
        "w3,1000,1024,2,1000,T4,LS,Running,10,30,10",  # w0 left at 10: fits
    ]
    tasks = load_tasks(write(tmp_path, "t.csv", TASKS_HEADER + "\n".join(rows) + "\n"))
    result = replay(nodes, tasks, SHARING_PLUGINS["best-fit"](TaskMix(()), 0))
    assert (result.placed, result.unschedulable) == (3, 1)
    assert result.failed_by_kind == {"whole": 1}
    assert result.unallocated_at_first_failure == 0.0


def test_a_task_list_without_times_arrives_in_file_order(tmp_path: Path) -> None:
    tasks = load_tasks(
        write(tmp_path, "t.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,300\n")
    )
    assert tasks[0].created_s is None and tasks[0].task.gpu_milli == 300


def test_inflation_stops_at_capacity_and_reads_each_checkpoint() -> None:
    nodes = [node("a", 2), node("b", 2)]
    shapes = [task("half", milli=500), task("whole"), task("cpu", 0)]
    arrivals = draw(shapes, SharedCluster(nodes).gpu_capacity_milli, seed=1)
    asked = sum(t.shape.gpu_milli_total for t in arrivals)
    assert asked >= 4_000 > asked - arrivals[-1].shape.gpu_milli_total
    result = inflate(nodes, arrivals, Fgd(TaskMix.of(shapes)), checkpoints=(0.5, 1.0))
    assert [p.arrived for p in result.points] == [0.5, 1.0]
    assert all(0.0 <= p.unallocated <= 1.0 for p in result.points)


@pytest.mark.parametrize(
    ("shares", "gpus", "every_share_placed", "any_placement"),
    [
        # Two 0.8 shares strand 0.2 each with nothing to fill them: leaving one out
        # costs 0.8, more than the 0.2 it spares.
        ((800, 800), 2, 400, 400),
        # On three GPUs, whatever the placement, the 1.4 GPUs nobody asked for.
        ((800, 800), 3, 1400, 1400),
        # Two 0.2 shares fill both holes.
        ((800, 800, 200, 200), 2, 0, 0),
        # A 0.3 share fits no 0.2 hole (the best placement leaves 0.3: the bound with
        # shares left out, relaxed to fractions, is lower).
        ((800, 800, 300, 100), 2, 300, 267),
        # No share over half a GPU: two 0.47 shares fill a GPU to 0.94 at most, so
        # beside the whole GPU the best placement leaves 0.06 (which a bound on the
        # sum of sizes alone, 2.88 asked of 2, does not see).
        ((470, 470, 470, 470, 1000), 2, 60, 60),
        # On one GPU with more asked than it has, a 0.6 share strands 0.4 placed, or is
        # left out: at best 0.4 either way, which the fractional bound halves.
        ((600, 500), 1, 400, 200),
    ],
)
def test_the_floor_bounds_what_shapes_strand(
    shares: tuple[int, ...], gpus: int, every_share_placed: int, any_placement: int
) -> None:
    arrivals = [task(f"t{i}", milli=m) for i, m in enumerate(shares)]
    floor = unallocated_floor(arrivals, gpus * GPU_MILLI)
    assert (floor.every_share_placed, floor.any_placement) == (every_share_placed, any_placement)


def _least_unallocated(arrivals: list[SharedTask], gpus: int) -> tuple[int, int | None]:
    """By brute force over every placement (each task on a GPU, or left out): the least
    unallocated capacity, and the least with every share over half a GPU placed."""
    best, best_placed = gpus * GPU_MILLI, None
    for choice in itertools.product(range(gpus + 1), repeat=len(arrivals)):
        used = [0] * gpus
        fits = True
        for where, t in zip(choice, arrivals, strict=True):
            if where < gpus:
                used[where] += t.gpu_milli
                fits = fits and used[where] <= GPU_MILLI
        if not fits:
            continue
        unallocated = gpus * GPU_MILLI - sum(used)
        best = min(best, unallocated)
        big_placed = all(
            where < gpus
            for where, t in zip(choice, arrivals, strict=True)
            if GPU_MILLI > t.gpu_milli > GPU_MILLI // 2
        )
        if big_placed:
            best_placed = unallocated if best_placed is None else min(best_placed, unallocated)
    return best, best_placed


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [100, 160, 200, 230, 300, 320, 400, 470, 500, 550, 600, 650, 700, 810, 900, 1000]
        ),
        max_size=5,
    ),
    st.integers(1, 3),
)
def test_no_placement_leaves_less_than_the_floor(shares: list[int], gpus: int) -> None:
    arrivals = [task(f"t{i}", milli=m) for i, m in enumerate(shares)]
    floor = unallocated_floor(arrivals, gpus * GPU_MILLI)
    least, least_placed = _least_unallocated(arrivals, gpus)
    assert floor.any_placement <= least
    if least_placed is not None:
        assert floor.every_share_placed <= least_placed


def test_alnair_sim_replays_a_node_and_task_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    nodes = write(tmp_path, "n.csv", NODES_CSV)
    tasks = write(tmp_path, "t.csv", TASKS_HEADER + GOOD_TASK)
    args = ["--nodes", str(nodes), "--tasks", str(tasks), "--json"]
    assert cli.run(parser.parse_args([*args, "--share-placement", "best-fit"])) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["placed"], report["unschedulable"]) == (1, 0)
    bad = write(tmp_path, "bad.csv", TASKS_HEADER + "p,1,1,1,2000,,LS,Running,0,1,0\n")
    assert cli.run(parser.parse_args(["--nodes", str(nodes), "--tasks", str(bad)])) == 2
    assert f"{bad}:2: column 'gpu_milli'" in capsys.readouterr().err
    assert cli.run(parser.parse_args(["--nodes", str(nodes)])) == 2
