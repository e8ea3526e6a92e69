"""Shares, GPU types, CPUs and memory in `decide` (brain/core/shares.py), as tables and
as a property: whatever the sequence of placements and exits, no GPU is given more than
the whole of it or more memory than it has, a whole GPU is nobody else's, every job is
on a model it allows, no node's CPUs or memory are over-committed, and no GPU holds
shares (or a shareable host) of two tenants. Also the
request's validation (schemas/jobs.py) and the refusal at submission (`never_fits`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from brain.core.decide import DEFAULT_POLICY, STARVING, Policy, decide
from brain.core.model import (
    Ask,
    ClusterSnapshot,
    Demand,
    GpuMemory,
    Grant,
    JobView,
    MemoryPressure,
    NodeView,
    Outranked,
    Place,
    QueueQuota,
    QuotaReclaim,
    UtilizationProfile,
    Wait,
)
from brain.core.shares import host_room, model_matches, never_fits, spreads
from brain.core.sharing import SHARING_PLUGINS, share_memory_mib
from schemas.jobs import JobSpec, share_request

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def node(
    name: str,
    gpus: int = 2,
    *,
    model: str = H100,
    memory: int = 81_920,
    cpu: int | None = 16_000,
    ram: int | None = 65_536,
    held: frozenset[int] = frozenset(),
) -> NodeView:
    indices = tuple(range(gpus))
    return NodeView(
        name,
        indices,
        frozenset(indices) - held,
        model=model,
        gpu_memory_mib=memory,
        cpu_milli=cpu,
        memory_mib=ram,
    )


def share(job_id: str, milli: int, memory: int = 0, **fields: object) -> JobView:
    return JobView(
        job_id,
        1,
        float(len(job_id)),
        demand=Demand(gpu_milli=milli, gpu_memory_mib=memory),
        **fields,
    )  # type: ignore[arg-type]


def places(
    snapshot: ClusterSnapshot, policy: Policy = DEFAULT_POLICY
) -> dict[str, tuple[Grant, ...]]:
    return {a.job_id: a.grants for a in decide(snapshot, 100.0, policy).placements}


# -- the request ---------------------------------------------------------------------


def spec_of(fields: dict[str, object]) -> JobSpec:
    return JobSpec.model_validate(share_request({"command": ["x"], **fields}))


def test_a_share_is_asked_as_a_fraction_of_one_gpu() -> None:
    spec = spec_of({"gpus": 0.25, "gpu_memory_mib": 20480})
    assert (spec.gpus, spec.gpu_milli, spec.shared) == (1, 250, True)
    assert spec.gpu_request == "0.25 GPU (20480 MiB)"
    assert spec_of({"gpus": "0.5"}).gpu_milli == 500
    assert share_request({"gpus": 2}) == {"gpus": 2}
    # Over the wire (strict, as the API decodes): the stored form.
    assert JobSpec.model_validate_json(spec.model_dump_json(), strict=True) == spec


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"gpus": 1.5}, "gpus 1.5"),
        ({"gpus": 0.0001}, "gpus 0.0001"),
        ({"gpus": 0}, "gpus 0: asks for no GPU"),
        ({"gpus": -0.5}, "gpus -0.5: asks for no GPU"),
        ({"gpus": 2, "gpu_milli": 500}, "gpu_milli"),
        ({"gpus": 0.5, "elastic": True}, "gpu_milli: not for elastic jobs"),
        ({"gpus": 1, "gpu_types": ["H100"], "elastic": True}, "gpu_types"),
        ({"gpus": 1, "cpus": 2, "cpus_per_gpu": 2}, "cpus"),
        ({"gpus": 1, "memory_mib": 1024, "memory_mb_per_gpu": 1024}, "memory_mib"),
        ({"gpus": 1, "gpu_types": ["A|B"]}, "GPU type"),
        ({"gpus": 1, "env": {"CUDA_MPS_PIPE_DIRECTORY": "/x"}}, "set by Alnair"),
    ],
)
def test_bad_requests_name_the_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises((ValidationError, ValueError)) as error:
        spec_of(fields)
    assert named in str(error.value)


def test_gpu_types_match_words_of_the_model() -> None:
    assert model_matches(H100, "H100")
    assert model_matches(A100, "a100")
    assert model_matches("NVIDIA H100 (simulated)", "H100")
    assert not model_matches(H100, "H10")
    assert not model_matches(A100, "H100")


@pytest.mark.parametrize(
    ("demand", "gpus", "named"),
    [
        (Demand(gpu_types=("V100",)), 1, "gpu_types: no node has GPUs of type V100"),
        (Demand(gpu_types=("A100",), cpu_milli=1000), 4, "gpus:"),
        (Demand(gpu_milli=500, gpu_memory_mib=100_000), 1, "gpu_memory_mib:"),
        (
            Demand(cpu_milli=64_500),
            1,
            "cpus: asks 64.5 CPUs; the most a node that fits the rest has is 16 CPUs",
        ),
        (Demand(gpu_types=("A100",), memory_mib=100_000), 1, "memory_mib:"),
        (Demand(gpu_types=("H100",), memory_mib=100_000), 1, None),
        (Demand(gpu_milli=250, gpu_memory_mib=20_480), 1, None),
        # Whole GPUs asking nothing of a node's CPUs or memory go on several nodes:
        # the type's nodes together have enough, or they do not.
        (Demand(gpu_types=("A100", "H100")), 10, None),
        (Demand(gpu_types=("H100",)), 16, "gpus: asks 16 GPUs; the nodes that fit the rest have 8"),
        (Demand(gpu_types=("A100",)), 4, "gpus: asks 4 GPUs; the nodes that fit the rest have 2"),
        (Demand(gpu_memory_mib=100_000), 4, "gpu_memory_mib: asks 100000 MiB per GPU"),
        (Demand(gpu_types=("H100",), cpu_milli=1000), 16, "gpus: asks 16 GPUs (a job that"),
    ],
)
def test_what_no_node_could_ever_run_is_refused(
    demand: Demand, gpus: int, named: str | None
) -> None:
    nodes = (node("a", 2, model=A100), node("h", 8, ram=200_000))
    reason = never_fits(demand, gpus, nodes)
    if named is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(named)


# -- placement tables ----------------------------------------------------------------


def test_two_halves_share_one_gpu() -> None:
    placed = places(ClusterSnapshot((node("n", 2),), (share("j1", 500), share("j2", 500))))
    assert placed == {"j1": (Grant("n", (0,)),), "j2": (Grant("n", (0,)),)}


def test_shares_that_do_not_add_up_take_two_gpus() -> None:
    placed = places(ClusterSnapshot((node("n", 2),), (share("j1", 600), share("j2", 600))))
    assert {g for grants in placed.values() for g in grants} == {
        Grant("n", (0,)),
        Grant("n", (1,)),
    }


def test_memory_limits_keep_shares_apart() -> None:
    jobs = (share("j1", 300, 50_000), share("j2", 300, 50_000))
    placed = places(ClusterSnapshot((node("n", 2),), jobs))
    assert placed["j1"] != placed["j2"]


def test_a_share_joins_a_running_share_and_a_whole_job_does_not() -> None:
    running = share("r", 500, grants=(Grant("n", (0,)),), started_at=0.0)
    snapshot = ClusterSnapshot(
        (node("n", 1, held=frozenset({0})),),
        (share("s", 500), JobView("whole", 1, 50.0)),
        (running,),
    )
    decisions = decide(snapshot, 100.0)
    assert places(snapshot) == {"s": (Grant("n", (0,)),)}
    (place,) = decisions.placements
    assert isinstance(place, Place) and place.takes == ()
    assert "a 0.5 share of its GPU, placed by fgd" in place.reason
    assert any(isinstance(a, Wait) and a.job_id == "whole" for a in decisions.actions)


def test_shares_pack_to_keep_whole_gpus_for_the_whole_gpu_jobs_the_cluster_runs() -> None:
    """fgd weighs fragment against the workload: every job the brain holds, whole-GPU
    jobs included (they are a share of the mix like any other shape). With only the
    shares in the mix, a quarter would take the idle GPU: for a 0.5 and a 0.25, a GPU
    with 0.75 free is no fragment, and the whole GPUs that most jobs need would be
    cut up one share at a time."""
    half = share("half", 500, grants=(Grant("n", (0,)),), started_at=0.0)
    whole = JobView("whole", 1, 0.0, grants=(Grant("m", (0,)),), started_at=0.0)
    nodes = (node("n", 2, held=frozenset({0})), node("m", 1, held=frozenset({0})))
    snapshot = ClusterSnapshot(nodes, (share("quarter", 250),), (half, whole))
    assert places(snapshot) == {"quarter": (Grant("n", (0,)),)}


def test_shares_pack_when_the_jobs_that_finished_lately_took_whole_gpus() -> None:
    """With no whole-GPU job held now, the recent workload still says whole GPUs are
    asked for: the quarter goes beside the half. Without it, each share takes an idle
    GPU."""
    half = share("half", 500, grants=(Grant("n", (0,)),), started_at=0.0)
    nodes = (node("n", 2, held=frozenset({0})),)
    alone = ClusterSnapshot(nodes, (share("quarter", 250),), (half,))
    assert places(alone) == {"quarter": (Grant("n", (1,)),)}
    lately = replace(alone, recent_asks=((Ask(1), 30), (Ask(2), 10)))
    assert places(lately) == {"quarter": (Grant("n", (0,)),)}


def test_a_shared_gpu_serves_one_tenant() -> None:
    jobs = tuple(share(f"{t}{n}", 250, tenant=t) for n, t in ((1, "a"), (1, "b"), (2, "a")))
    placed = places(ClusterSnapshot((node("n", 2),), jobs))
    assert placed["a1"] == placed["a2"] != placed["b1"]


def test_a_share_waits_when_only_other_tenants_gpus_have_room() -> None:
    running = share("r", 500, tenant="a", grants=(Grant("n", (0,)),), started_at=0.0)
    nodes = (node("n", 1, held=frozenset({0})),)
    decisions = decide(ClusterSnapshot(nodes, (share("s", 500, tenant="b"),), (running,)), 100.0)
    (wait,) = decisions.waits
    assert not decisions.placements
    assert "on a GPU open to tenant b: the GPUs with room serve other tenants' shares" in (
        wait.reason
    )
    # The same tenant joins it; with no room anywhere, the reason is the plain one.
    assert places(ClusterSnapshot(nodes, (share("s", 500, tenant="a"),), (running,))) == {
        "s": (Grant("n", (0,)),)
    }
    (full,) = decide(ClusterSnapshot(nodes, (share("s", 600, tenant="b"),), (running,)), 1.0).waits
    assert "other tenants" not in full.reason


def test_a_share_joins_only_its_own_tenants_shareable_job() -> None:
    nodes = (node("n", 1, held=frozenset({0})),)
    host = replace(_host(20.0, 16_000), tenant="a")
    for tenant, joins in (("a", True), ("b", False)):
        guest = share("guest", 500, 20_000, tenant=tenant)
        decisions = decide(ClusterSnapshot(nodes, (guest,), (host,)), 100.0)
        assert bool(decisions.placements) is joins, decisions.actions
    other = share("g", 500, 20_000, tenant="b")
    (wait,) = decide(ClusterSnapshot(nodes, (other,), (host,)), 1.0).waits
    assert "serve other tenants' shares" in wait.reason


def test_types_cpus_and_memory_choose_the_node() -> None:
    nodes = (node("a", 4, model=A100, cpu=4_000), node("h", 4, cpu=32_000))
    typed = JobView("typed", 2, 0.0, demand=Demand(gpu_types=("A100",)))
    cpu_heavy = JobView("cpu", 1, 1.0, demand=Demand(cpu_milli=8_000))
    placed = places(ClusterSnapshot(nodes, (typed, cpu_heavy)))
    assert placed["typed"][0].node == "a"
    assert placed["cpu"][0].node == "h"
    nowhere = JobView("x", 1, 2.0, demand=Demand(gpu_types=("V100",)))
    (wait,) = decide(ClusterSnapshot(nodes, (nowhere,)), 100.0).waits
    assert "no schedulable GPU of type V100" in wait.reason


def test_a_typed_job_larger_than_a_node_goes_on_several_of_its_type() -> None:
    """Whole GPUs of a type, asking no CPUs or memory, are placed as a job without a
    demand where no one node has room: on the fewest nodes of that type."""
    nodes = (
        node("a0", 8, model=A100),
        node("h0", 8),
        node("h1", 8),
        node("h2", 8, held=frozenset(range(6))),
    )
    big = JobView("big", 16, 0.0, demand=Demand(gpu_types=("H100",)))
    (place,) = decide(ClusterSnapshot(nodes, (big,)), 100.0).placements
    assert place.grants == (Grant("h0", tuple(range(8))), Grant("h1", tuple(range(8))))
    assert "16 whole GPUs, type H100, placed by consolidate" in place.reason
    # One node that has room is the sharing placement's, as before.
    small = JobView("small", 2, 0.0, demand=Demand(gpu_types=("H100",)))
    assert places(ClusterSnapshot(nodes, (small,))) == {"small": (Grant("h2", (6, 7)),)}
    # Several in one cycle: each sees what the ones before it took.
    wide = (node("a0", 8, model=A100), *(node(f"h{i}", 8) for i in range(4)))
    bigs = tuple(replace(big, job_id=f"big{i}", submitted_at=float(i)) for i in range(3))
    decisions = decide(ClusterSnapshot(wide, bigs), 100.0)
    assert [[g.node for g in p.grants] for p in decisions.placements] == [
        ["h0", "h1"],
        ["h2", "h3"],
    ]
    assert [w.job_id for w in decisions.waits] == ["big2"]
    # Not enough of the type free: it waits, saying so; the A100s are not for it.
    (wait,) = decide(ClusterSnapshot(nodes, (replace(big, gpus=20),)), 100.0).waits
    assert wait.reason.endswith(
        "needs 20 GPUs; 18 free of 24 schedulable on nodes with GPUs of type H100"
    )


def test_a_share_that_waits_is_told_only_what_it_asked_for() -> None:
    nodes = (node("n", 1, held=frozenset({0})),)
    (wait,) = decide(ClusterSnapshot(nodes, (share("s", 500, 4096),)), 100.0).waits
    assert wait.reason.startswith("no node has 0.5 of a GPU with 4096 MiB of GPU memory free")
    assert "CPU" not in wait.reason
    asks = JobView("c", 1, 0.0, demand=Demand(gpu_milli=500, cpu_milli=2_000, memory_mib=1024))
    (wait,) = decide(ClusterSnapshot(nodes, (asks,)), 100.0).waits
    assert "no node has 2000 CPU milli, 1024 MiB of memory and 0.5 of a GPU free" in wait.reason


def test_a_node_that_does_not_say_its_cpus_takes_no_cpu_request() -> None:
    nodes = (node("quiet", 2, cpu=None, ram=None),)
    asks = JobView("j", 1, 0.0, demand=Demand(cpu_milli=1_000))
    (wait,) = decide(ClusterSnapshot(nodes, (asks,)), 100.0).waits
    assert "1000 CPU milli" in wait.reason
    plain = JobView("p", 1, 0.0, demand=Demand(gpu_milli=500))
    assert places(ClusterSnapshot(nodes, (plain,))) == {"p": (Grant("quiet", (0,)),)}


@pytest.mark.parametrize("plugin", sorted(SHARING_PLUGINS))
def test_a_share_sees_what_the_cycle_placed_before_it(plugin: str) -> None:
    """The sharing ledger is kept across a cycle's jobs and redone only where something
    changed; whatever the plugin, each job sees what the cycle did before it."""
    policy = Policy(order="fifo", share_placement=plugin).validate()
    # A whole GPU that a job without a demand took (the free ledger said so): the 0.7
    # share finds neither the 0.5 share's GPU nor that one.
    first, whole, later = share("s1", 500), JobView("w", 1, 5.0), share("s2longer", 700)
    assert first.submitted_at < whole.submitted_at < later.submitted_at
    two = (node("a", 1), node("b", 1))
    placed = places(ClusterSnapshot(two, (first, whole, later)), policy)
    assert set(placed) == {"s1", "w"} and placed["s1"][0].node != placed["w"][0].node
    # A share placed (the jobs held): a second 0.5 joins it, a third finds no room.
    halves = (first, whole, share("s3longer", 500), share("s4longerstill", 500))
    placed = places(ClusterSnapshot(two, halves), policy)
    assert set(placed) == {"s1", "w", "s3longer"} and placed["s3longer"] == placed["s1"]

    # Whether the job may join a shareable job's GPU: a share, beside the host; not a
    # whole-GPU job with a demand (it takes the A100); a share again, beside the host.
    def h100_share(job_id: str, milli: int, at: float) -> JobView:
        return JobView(job_id, 1, at, demand=Demand(gpu_milli=milli, gpu_types=("H100",)))

    typed = JobView("t", 1, 1.5, demand=Demand(gpu_types=("A100",)))
    beside = ClusterSnapshot(
        (node("n", 1, held=frozenset({0})), node("m", 1, model=A100)),
        (h100_share("s", 500, 1.0), typed, h100_share("s2", 250, 2.0)),
        (_host(20.0, 16_000),),
    )
    on_n = (Grant("n", (0,)),)
    assert places(beside, policy) == {"s": on_n, "t": (Grant("m", (0,)),), "s2": on_n}


@pytest.mark.parametrize(("plugin", "chosen"), [("fgd-paper", "h"), ("fgd", "a")])
def test_live_fgd_leaves_the_gpus_of_a_model_that_jobs_asking_for_it_need(
    plugin: str, chosen: str
) -> None:
    """The workload (jobs that finished lately here) asks H100s by name for a quarter of
    its GPUs, and now and then 4 GPUs of any model. A job that may run anywhere: by the
    paper's measure it takes an H100 to keep the A100 node whole for a 4-GPU job; fgd
    weighs that H100-only jobs need more than half the H100s, and takes an A100."""
    nodes = (node("h", 2), node("a", 4, model=A100))
    anywhere = JobView("anywhere", 1, 0.0, demand=Demand(cpu_milli=1_000))
    h100_only = Ask(1, Demand(gpu_types=("H100",)))
    snapshot = ClusterSnapshot(
        nodes, (anywhere,), recent_asks=((h100_only, 2), (Ask(1), 4), (Ask(4), 1))
    )
    ((grant,),) = places(snapshot, Policy(share_placement=plugin).validate()).values()
    assert grant.node == chosen


@pytest.mark.parametrize("plugin", sorted(SHARING_PLUGINS))
def test_every_sharing_plugin_places_live_jobs(plugin: str) -> None:
    policy = Policy(share_placement=plugin).validate()
    jobs = tuple(share(f"j{i}", 250) for i in range(8))
    placed = places(ClusterSnapshot((node("n", 2),), jobs), policy)
    per_gpu: dict[int, int] = defaultdict(int)
    for grants in placed.values():
        per_gpu[grants[0].gpus[0]] += 250
    assert len(placed) == 8 and all(v <= 1000 for v in per_gpu.values())


# -- the property --------------------------------------------------------------------

NODES = (
    node("h0", 2, cpu=8_000, ram=32_000),
    node("h1", 4, cpu=16_000, ram=64_000),
    node("a0", 2, model=A100, memory=40_960, cpu=8_000, ram=32_000),
)
CAPACITY = {n.name: n for n in NODES}

demands = st.one_of(
    st.none(),
    st.builds(
        Demand,
        gpu_milli=st.sampled_from([100, 250, 300, 500, 700, 1000]),
        gpu_memory_mib=st.sampled_from([0, 10_000, 30_000, 50_000]),
        gpu_types=st.sampled_from([(), ("H100",), ("A100",), ("A100", "H100")]),
        cpu_milli=st.sampled_from([0, 1_000, 4_000]),
        memory_mib=st.sampled_from([0, 8_000, 20_000]),
    ),
)
# A whole-GPU job may be shareable, with the profile it shows once it runs.
profiles = st.one_of(
    st.none(),
    st.builds(
        lambda util, mem: UtilizationProfile(util, util, mem, None, util, mem),
        st.sampled_from([10.0, 30.0, 50.0, 90.0]),
        st.sampled_from([5_000.0, 20_000.0, 40_000.0, 70_000.0]),
    ),
)
# None: a job of no known tenant (all such are one tenant).
tenants = st.sampled_from([None, "a", "b"])
steps = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), demands, st.integers(1, 3), profiles, tenants),
        st.tuples(st.just("exit"), st.integers(0, 50), st.just(0), st.none(), st.none()),
    ),
    min_size=1,
    max_size=25,
)


def _check(running: dict[str, JobView]) -> None:
    shares: dict[tuple[str, int], list[Demand]] = defaultdict(list)
    whole: dict[tuple[str, int], int] = defaultdict(int)
    hosts: dict[tuple[str, int], tuple[int, float]] = {}
    # The tenants of each GPU's shares and of its shareable host, if it has one.
    tenants_on: dict[tuple[str, int], set[str | None]] = defaultdict(set)
    cpu: dict[str, int] = defaultdict(int)
    ram: dict[str, int] = defaultdict(int)
    for job in running.values():
        demand = job.demand
        assert len(job.grants) == 1 or demand is None or spreads(demand, job.gpus)
        for grant in job.grants:
            view = CAPACITY[grant.node]
            if demand is not None:
                cpu[grant.node] += demand.cpu_milli
                ram[grant.node] += demand.memory_mib
                if demand.gpu_types:
                    assert any(model_matches(view.model, t) for t in demand.gpu_types)
                assert demand.gpu_memory_mib <= view.gpu_memory_mib
            room = host_room(job)
            for gpu in grant.gpus:
                if job.shared:
                    shares[(grant.node, gpu)].append(demand or Demand())
                    tenants_on[(grant.node, gpu)].add(job.tenant)
                else:
                    whole[(grant.node, gpu)] += 1
                    if room is not None:
                        hosts[(grant.node, gpu)] = room
                    if job.shareable:
                        tenants_on[(grant.node, gpu)].add(job.tenant)
    for key, count in whole.items():
        assert count == 1, f"GPU {key} given twice"
        assert key not in shares or key in hosts, f"GPU {key} shared beside a job that is no host"
    for key, held in shares.items():
        host_milli, host_mib = hosts.get(key, (0, 0.0))
        assert host_milli + sum(d.gpu_milli for d in held) <= 1000
        # A share without a limit holds its share of the GPU's memory (what MPS is told).
        total = CAPACITY[key[0]].gpu_memory_mib
        limits = sum(share_memory_mib(d.gpu_milli, d.gpu_memory_mib, total) for d in held)
        assert host_mib + limits <= total
        assert len(tenants_on[key]) == 1, f"GPU {key} serves tenants {tenants_on[key]}"
    for name, used in cpu.items():
        assert used <= (CAPACITY[name].cpu_milli or 0)
        assert ram[name] <= (CAPACITY[name].memory_mib or 0)


Step = tuple[str, object, int, UtilizationProfile | None, str | None]
# Shareable jobs that leave room, and shares: co-location is common.
colocating = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.none(),
            st.integers(1, 2),
            st.builds(
                lambda util, mem: UtilizationProfile(util, util, mem, None, util, mem),
                st.sampled_from([10.0, 30.0, 50.0]),
                st.sampled_from([5_000.0, 20_000.0, 40_000.0, 62_000.0]),
            ),
            tenants,
        ),
        st.tuples(
            st.just("submit"),
            st.builds(
                Demand,
                gpu_milli=st.sampled_from([100, 250, 500]),
                gpu_memory_mib=st.sampled_from([5_000, 10_000, 20_000]),
            ),
            st.just(1),
            st.none(),
            tenants,
        ),
        st.tuples(st.just("exit"), st.integers(0, 50), st.just(0), st.none(), st.none()),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_no_gpu_over_committed_whatever_the_sequence(ops: list[Step]) -> None:
    _replay(ops, NODES)


@settings(max_examples=150, deadline=None)
@given(colocating)
def test_no_gpu_over_committed_on_a_full_small_node(ops: list[Step]) -> None:
    """One node of two GPUs: shares land beside shareable jobs far more often."""
    _replay(ops, NODES[:1])


# Shares and whole-GPU jobs crowding two nodes of 2 and 4 GPUs, exits rarer than
# submissions: whole-GPU jobs often wait while shares hold GPUs.
crowding = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.builds(Demand, gpu_milli=st.sampled_from([250, 500, 700])),
            st.just(1),
            st.none(),
            st.none(),
        ),
        st.tuples(st.just("submit"), st.none(), st.integers(1, 3), st.none(), st.none()),
        st.tuples(st.just("exit"), st.integers(0, 50), st.just(0), st.none(), st.none()),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(crowding, st.lists(st.integers(0, 2), min_size=25, max_size=25))
def test_shares_make_room_for_better_ranked_jobs_whatever_the_sequence(
    ops: list[Step], priorities: list[int]
) -> None:
    """Under `priority`, shares are victims too: never over-committed, and only ever
    for a better-ranked whole-GPU job that waits."""
    _replay(ops, NODES[:2], Policy(order="priority").validate(), priorities)


@settings(max_examples=150, deadline=None)
@given(crowding, st.lists(st.integers(0, 2), min_size=25, max_size=25))
def test_shares_make_room_for_starving_jobs_whatever_the_sequence(
    ops: list[Step], priorities: list[int]
) -> None:
    """With a starvation guard (4 steps), a whole-GPU job that waited past it ranks
    ahead of shares whatever their priority, and they make room for it too."""
    policy = Policy(order="priority", starvation_guard_s=4.0).validate()
    _replay(ops, NODES[:2], policy, priorities)


@settings(max_examples=150, deadline=None)
@given(crowding, st.lists(st.sampled_from(["a", "b", "c"]), min_size=25, max_size=25))
def test_shares_give_a_queue_back_its_guarantee_whatever_the_sequence(
    ops: list[Step], queue_of: list[str]
) -> None:
    """Queues a and b are guaranteed 2 GPUs each, c none: shares are charged their
    share, and are taken back, a GPU at a time, only for a whole-GPU job."""
    queues = (QueueQuota("a", 2), QueueQuota("b", 2))
    _replay(ops, NODES[:2], DEFAULT_POLICY, None, queues, queue_of)


def _replay(
    ops: list[Step],
    cluster: tuple[NodeView, ...],
    policy: Policy = DEFAULT_POLICY,
    priorities: list[int] | None = None,
    queues: tuple[QueueQuota, ...] = (),
    queue_of: list[str] | None = None,
) -> None:
    pending: dict[str, JobView] = {}
    running: dict[str, JobView] = {}
    for n, (op, arg, gpus, profile, tenant) in enumerate(ops):
        if op == "submit":
            demand = arg if isinstance(arg, Demand) else None
            size = 1 if demand is not None and demand.fractional else gpus
            host = profile is not None and (demand is None or not demand.fractional)
            pending[f"j{n}"] = JobView(
                f"j{n}",
                size,
                float(n),
                tenant=tenant,
                priority=priorities[n] if priorities else 0,
                queue=queue_of[n] if queue_of else "default",
                demand=demand,
                shareable=host,
                profile=profile,
            )
        elif running:
            assert isinstance(arg, int)
            del running[sorted(running)[arg % len(running)]]
        held: dict[str, set[int]] = defaultdict(set)
        for job in running.values():
            for grant in job.grants:
                held[grant.node].update(grant.gpus)
        nodes = tuple(
            NodeView(
                v.name,
                v.gpus,
                frozenset(v.gpus) - held[v.name],
                model=v.model,
                gpu_memory_mib=v.gpu_memory_mib,
                cpu_milli=v.cpu_milli,
                memory_mib=v.memory_mib,
            )
            for v in cluster
        )
        snapshot = ClusterSnapshot(nodes, tuple(pending.values()), tuple(running.values()), queues)
        decisions = decide(snapshot, float(n + 1), policy)
        for move in decisions.preemptions:
            victim = running[move.job_id]
            if priorities is None and not queues:
                # Only shares move, and only off a host's GPU short of memory.
                assert isinstance(move.cause, MemoryPressure) and victim.shared
            elif isinstance(move.cause, Outranked):
                winner = pending[move.cause.by_job]
                if winner.shared or victim.shared:
                    # A share needs none of the whole-GPU budget, by which whole-GPU
                    # jobs are selected out (as Tiresias' count): it takes GPUs only
                    # from a job ranked behind it (priority, then submission, unless
                    # the winner is ahead by the starvation guard), and loses them only
                    # to a whole-GPU job ranked ahead.
                    if STARVING not in move.cause.winner_rank:
                        assert (-winner.priority, winner.submitted_at) < (
                            -victim.priority,
                            victim.submitted_at,
                        )
                    assert not (victim.shared and winner.demand is not None)
            elif isinstance(move.cause, QuotaReclaim):
                # For a queue owed its guarantee, from a job over its own queue's
                # (the same queue's, when its job is larger than the guarantee); a
                # share only for a whole-GPU job.
                winner = pending[move.cause.for_job]
                assert (winner.queue, victim.queue) == (
                    move.cause.owner_queue,
                    move.cause.victim_queue,
                )
                assert not (victim.shared and winner.demand is not None)
            moved = running.pop(move.job_id)
            pending[moved.job_id] = replace(moved, grants=(), started_at=None)
        for place in decisions.placements:
            job = pending.pop(place.job_id)
            running[job.job_id] = JobView(
                job.job_id,
                job.gpus,
                job.submitted_at,
                tenant=job.tenant,
                priority=job.priority,
                queue=job.queue,
                grants=place.grants,
                started_at=float(n),
                demand=job.demand,
                shareable=job.shareable,
                profile=job.profile,
            )
        _check(running)


# -- co-location of shareable jobs, and moving shares off before memory runs out -------


def _host(profile_util: float, mem: float, *, shareable: bool = True) -> JobView:
    return JobView(
        "host",
        1,
        0.0,
        grants=(Grant("n", (0,)),),
        started_at=0.0,
        shareable=shareable,
        profile=UtilizationProfile(
            mean_util_pct=profile_util,
            p95_util_pct=profile_util,
            mem_peak_mib=mem,
            period_s=None,
            forecast_util_pct=profile_util,
            forecast_mem_mib=mem,
        ),
    )


def test_a_share_is_colocated_with_a_shareable_job_that_leaves_room() -> None:
    nodes = (node("n", 1, held=frozenset({0})),)
    guest = share("guest", 500, 20_000)
    decisions = decide(ClusterSnapshot(nodes, (guest,), (_host(20.0, 16_000),)), 100.0)
    (place,) = decisions.placements
    assert place.grants == (Grant("n", (0,)),) and place.takes == ()
    assert "co-located with job host, whose profile leaves room" in place.reason
    # A share without a limit holds its share of the GPU's memory: 0.5, 40,960 MiB,
    # beside the host's reckoned 20,000.
    unlimited = ClusterSnapshot(nodes, (share("u", 500),), (_host(20.0, 16_000),))
    (place,) = decide(unlimited, 100.0).placements
    assert "co-located with job host" in place.reason
    # Not beside a busy job, one that did not opt in, or where its memory does not fit
    # (0.8 of the GPU's, 65,536 MiB, beside 20,000).
    for running, pending in (
        (_host(80.0, 16_000), guest),
        (_host(20.0, 16_000, shareable=False), guest),
        (_host(20.0, 16_000), share("wide", 800)),
        (_host(20.0, 60_000), share("big", 300, 20_000)),
    ):
        assert not decide(ClusterSnapshot(nodes, (pending,), (running,)), 100.0).placements


def test_a_share_that_waits_is_told_why_it_is_not_beside_a_shareable_job() -> None:
    nodes = (node("n", 1, held=frozenset({0})),)
    # Seen on an H100: the host grew, its guest was moved off, and then waited.
    grown = ClusterSnapshot(nodes, (share("guest", 500, 4096),), (_host(0.0, 81_559),))
    (wait,) = decide(grown, 100.0).waits
    assert wait.reason.endswith(
        "; no room beside shareable job host: a profile's utilisation over 50 % leaves "
        "none, and its memory is reckoned at 1.25 x its peak or forecast"
    )
    # Without a shareable job, nothing is said of one.
    plain = ClusterSnapshot(nodes, (share("p", 500, 4096),), (_host(0.0, 1_000, shareable=False),))
    (wait,) = decide(plain, 100.0).waits
    assert "shareable" not in wait.reason


def test_a_colocated_share_moves_off_before_the_gpu_runs_out_of_memory() -> None:
    nodes = (node("n", 1, held=frozenset({0})), node("m", 1))
    older = share("older", 250, 10_000, grants=(Grant("n", (0,)),), started_at=1.0)
    newer = share("newer", 250, 10_000, grants=(Grant("n", (0,)),), started_at=2.0)
    # The host's own memory (its profile leaves its guests out) beside what its guests'
    # limits hold (20,000 of 81,920 MiB): under 90 % of the 61,920 they leave.
    calm = ClusterSnapshot(nodes, (), (_host(20.0, 50_000), older, newer))
    assert not decide(calm, 100.0).preemptions
    # Over it: the later share moves, and that leaves the host room enough.
    pressed = ClusterSnapshot(nodes, (), (_host(20.0, 60_000), older, newer))
    (move,) = decide(pressed, 100.0).preemptions
    assert move.job_id == "newer"
    assert isinstance(move.cause, MemoryPressure)
    assert move.reason == (
        "memory pressure: GPU 0 of n, shared with job host, is forecast to use 60000 MiB "
        "besides the 20000 its shares may use, of 81920 MiB; moved off before it runs out "
        "of memory"
    )
    # Grown further, both move, the latest first, in one decision.
    grown = ClusterSnapshot(nodes, (), (_host(20.0, 76_000), older, newer))
    moves = decide(grown, 100.0).preemptions
    assert [p.job_id for p in moves] == ["newer", "older"]
    assert [p.cause.guest_memory_mib for p in moves if isinstance(p.cause, MemoryPressure)] == [
        20_000,
        10_000,
    ]
    # Started together: the later job moves, by the job order every order breaks ties by
    # (job 10 after job 9, although "10" < "9" as text).
    nine = share("9", 250, 10_000, grants=(Grant("n", (0,)),), started_at=1.0)
    ten = share("10", 250, 10_000, grants=(Grant("n", (0,)),), started_at=1.0)
    tied = ClusterSnapshot(nodes, (), (_host(20.0, 60_000), ten, nine))
    (move,) = decide(tied, 100.0).preemptions
    assert move.job_id == "10"


def test_a_host_on_several_gpus_is_reckoned_with_per_gpu() -> None:
    """A shareable job on two GPUs uses 70,000 MiB of one and 10,000 of the other: a
    share fits beside it on the second only, and the first growing moves nothing off
    the second."""
    nodes = (node("n", 2, held=frozenset({0, 1})), node("m", 1))
    busy, calm = GpuMemory("n", 0, 70_000, 70_000), GpuMemory("n", 1, 10_000, 10_000)
    host = replace(
        _host(20.0, 70_000),
        gpus=2,
        grants=(Grant("n", (0, 1)),),
        profile=UtilizationProfile(20.0, 20.0, 70_000, None, 20.0, 70_000, gpu_memory=(busy, calm)),
    )
    placed = places(ClusterSnapshot(nodes[:1], (share("guest", 250, 20_000),), (host,)))
    assert placed == {"guest": (Grant("n", (1,)),)}
    guest = share("guest", 250, 20_000, grants=(Grant("n", (1,)),), started_at=1.0)
    assert not decide(ClusterSnapshot(nodes, (), (host, guest)), 100.0).preemptions
    # Its second GPU grows toward what the guest leaves: the guest moves.
    grown = GpuMemory("n", 1, 10_000, 60_000)
    assert host.profile is not None
    pressed = replace(host, profile=replace(host.profile, gpu_memory=(busy, grown)))
    (move,) = decide(ClusterSnapshot(nodes, (), (pressed, guest)), 100.0).preemptions
    assert move.job_id == "guest" and "forecast to use 60000 MiB" in move.reason


def test_a_host_with_shares_beside_it_is_no_victim() -> None:
    nodes = (node("n", 1, held=frozenset({0})),)
    guest = share("guest", 250, 10_000, grants=(Grant("n", (0,)),), started_at=1.0)
    urgent = JobView("urgent", 1, 50.0, priority=10)
    policy = Policy(order="priority").validate()
    alone = decide(ClusterSnapshot(nodes, (urgent,), (_host(20.0, 16_000),)), 100.0, policy)
    assert [p.job_id for p in alone.preemptions] == ["host"]
    hosting = ClusterSnapshot(nodes, (urgent,), (_host(20.0, 16_000), guest))
    decisions = decide(hosting, 100.0, policy)
    assert not decisions.preemptions and not decisions.placements


# -- shares make room for a better-ranked whole-GPU job, a GPU at a time ---------------


def _shares_on(*placed: tuple[str, int, int, int], queue: str = "default") -> tuple[JobView, ...]:
    """Running shares: (id, milli, GPU of node n, priority)."""
    return tuple(
        share(
            job_id,
            milli,
            grants=(Grant("n", (gpu,)),),
            started_at=1.0,
            priority=priority,
            queue=queue,
        )
        for job_id, milli, gpu, priority in placed
    )


def _after(snapshot: ClusterSnapshot, policy: Policy) -> ClusterSnapshot:
    """`snapshot` once its decisions' preemptions are applied: the victims wait again."""
    decisions = decide(snapshot, 100.0, policy)
    gone = {p.job_id for p in decisions.preemptions}
    running = tuple(j for j in snapshot.running if j.job_id not in gone)
    requeued = tuple(
        replace(j, grants=(), started_at=None) for j in snapshot.running if j.job_id in gone
    )
    held = {gpu for j in running for g in j.grants for gpu in g.gpus}
    nodes = tuple(replace(n, free=frozenset(n.gpus) - held) for n in snapshot.nodes)
    return ClusterSnapshot(nodes, (*snapshot.pending, *requeued), running, queues=snapshot.queues)


def test_a_better_ranked_whole_gpu_job_makes_room_among_shares() -> None:
    nodes = (node("n", 2, held=frozenset({0, 1})),)
    shares = _shares_on(("s1", 500, 0, 0), ("s2", 250, 0, 0), ("s3", 500, 1, 0))
    big = JobView("big", 2, 50.0, priority=10)
    snapshot = ClusterSnapshot(nodes, (big,), shares)
    policy = Policy(order="priority").validate()
    decisions = decide(snapshot, 100.0, policy)
    # Every share of both GPUs goes, each told why; the job is placed in the next cycle.
    assert sorted(p.job_id for p in decisions.preemptions) == ["s1", "s2", "s3"]
    assert {p.reason for p in decisions.preemptions} == {
        "outranked by job big under priority: priority 10 ahead of priority 0"
    }
    assert [w.reason for w in decisions.waits] == [
        "shares on 2 GPUs ranked behind it are preempted to make room"
    ]
    following = decide(_after(snapshot, policy), 100.0, policy)
    assert [(p.job_id, p.grants) for p in following.placements] == [("big", (Grant("n", (0, 1)),))]
    assert not following.preemptions


def test_a_queue_reclaims_its_guarantee_from_shares_over_quota() -> None:
    nodes = (node("n", 2, held=frozenset({0, 1})),)
    shares = _shares_on(("s1", 100, 0, 0), ("s2", 100, 1, 0), queue="scratch")
    owner = JobView("owner", 2, 50.0, queue="prod")
    snapshot = ClusterSnapshot(nodes, (owner,), shares, queues=(QueueQuota("prod", 2, "train"),))
    decisions = decide(snapshot, 100.0)
    assert [p.reason for p in decisions.preemptions] == [
        "quota reclaim: queue prod needs its guaranteed GPUs for job owner; "
        "queue scratch was over its quota"
    ] * 2


def test_a_gpu_comes_back_only_with_all_its_shares() -> None:
    nodes = (node("n", 2, held=frozenset({0, 1})),)
    # GPU 0 holds a share ranked ahead of the waiting job: it is kept, and so is the
    # share beside it; GPU 1's share alone ranks behind.
    shares = _shares_on(("low", 250, 0, 0), ("high", 250, 0, 20), ("other", 500, 1, 0))
    policy = Policy(order="priority").validate()
    two = ClusterSnapshot(nodes, (JobView("two", 2, 50.0, priority=10),), shares)
    waits = decide(two, 100.0, policy)
    assert not waits.preemptions  # no room it could make
    assert [w.reason for w in waits.waits] == [
        "needs 2 GPUs; 0 left after higher-ranked jobs (priority 10, priority) "
        "and the 2 GPUs that shares hold"
    ]
    one = ClusterSnapshot(nodes, (JobView("one", 1, 50.0, priority=10),), shares)
    assert [p.job_id for p in decide(one, 100.0, policy).preemptions] == ["other"]


def test_shares_ranked_ahead_keep_their_gpus() -> None:
    nodes = (node("n", 2, held=frozenset({0, 1})),)
    shares = _shares_on(("s1", 500, 0, 10), ("s2", 500, 1, 10))
    snapshot = ClusterSnapshot(nodes, (JobView("big", 2, 50.0, priority=5),), shares)
    assert not decide(snapshot, 100.0, Policy(order="priority")).preemptions
    # Under fifo, shares that came first keep their GPUs too.
    assert not decide(snapshot, 100.0).preemptions


def test_room_is_made_where_the_job_will_go() -> None:
    # A 2-GPU job that must stay on one node: of three GPUs whose shares rank behind
    # it, only the two of node m are taken; node n's share stays.
    nodes = (node("n", 2, held=frozenset({0, 1})), node("m", 2, held=frozenset({0, 1})))
    running = (
        share("keep", 500, grants=(Grant("n", (0,)),), started_at=1.0),
        JobView("whole", 1, 1.0, priority=20, grants=(Grant("n", (1,)),), started_at=1.0),
        share("m0", 500, grants=(Grant("m", (0,)),), started_at=1.0),
        share("m1", 500, grants=(Grant("m", (1,)),), started_at=1.0),
    )
    big = JobView("big", 2, 50.0, priority=10, network_sensitive=True)
    decisions = decide(ClusterSnapshot(nodes, (big,), running), 100.0, Policy(order="priority"))
    assert sorted(p.job_id for p in decisions.preemptions) == ["m0", "m1"]


def test_a_gpu_given_a_share_in_the_cycle_is_not_taken_back() -> None:
    # A better-ranked share is placed beside the old one on GPU 0 in this cycle: GPU 0
    # stays shared, so the 2-GPU job cannot have room, and nothing is preempted.
    nodes = (node("n", 2, held=frozenset({0, 1})),)
    shares = _shares_on(("old0", 500, 0, 0), ("old1", 500, 1, 0))
    newer = share("newer", 250, priority=30)
    big = JobView("big", 2, 50.0, priority=10)
    decisions = decide(
        ClusterSnapshot(nodes, (newer, big), shares), 100.0, Policy(order="priority")
    )
    assert [p.job_id for p in decisions.placements] == ["newer"]
    assert not decisions.preemptions


def test_a_share_takes_no_gpu_a_better_ranked_victim_gave_back() -> None:
    # The 3-GPU job's count makes the 2-GPU job a victim, and its GPUs are given back
    # for it; it still cannot be placed (a share ahead took the last free GPU). The
    # share behind the victim may not have the victim's GPUs: it keeps running.
    nodes = (node("n", 4, held=frozenset({0, 1, 2})),)
    running = (
        share("s0", 700, grants=(Grant("n", (0,)),), started_at=1.0, priority=2),
        JobView("victim", 2, 5.0, priority=1, grants=(Grant("n", (1, 2)),), started_at=5.0),
    )
    pending = (
        share("ahead", 500, priority=2),
        JobView("three", 3, 6.0, priority=2),
        replace(share("behind", 700, priority=1), submitted_at=9.0),
    )
    decisions = decide(ClusterSnapshot(nodes, pending, running), 100.0, Policy(order="priority"))
    assert [p.job_id for p in decisions.placements] == ["ahead"]
    assert not decisions.preemptions
    assert "behind" in {w.job_id for w in decisions.waits}
