"""Elastic jobs in the simulator: Pollux workloads, measured scaling, resizes in sim time."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from brain.core import ClusterSnapshot, Decisions, Grant, Policy, Resize, Retreated, decide
from brain.sim import SimConfig, SimulationError, TraceJob, cli, parse_cluster, simulate, summarize
from brain.sim.engine import SpeedCurve
from brain.sim.pollux import (
    ADAPTIVE_GRID,
    BATCH_SCALINGS,
    ElasticRange,
    PolluxScaling,
    load_apps,
    load_pollux_workload,
    normalize_placement,
    packed,
)
from brain.sim.trace import TraceError

POLLUX = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "pollux"
APPS = POLLUX / "apps"
needs_data = pytest.mark.skipif(not APPS.is_dir(), reason="shared Pollux data not present")

HEADER = "name,time,application,num_replicas,batch_size\n"
TINY = (
    "cifar10-0,0,cifar10,4,2048\n"
    "ncf-1,10,ncf,1,32768\n"
    "bert-2,20,bert,6,384\n"
    "yolov3-3,30,yolov3,4,64\n"
    "cifar10-4,40,cifar10,8,4096\n"
    "deepspeech2-5,60,deepspeech2,6,320\n"
)
STATIC = Policy(order="las")
ELASTIC = Policy(order="las", elasticity="marginal-gain", elastic_may_spread=True)


def workload(tmp_path: Path, rows: str = TINY) -> Path:
    path = tmp_path / "workloads" / "tiny.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + rows)
    return path


def test_placements_are_named_as_the_artifact_names_them() -> None:
    assert normalize_placement((2, 1)) == "12"
    assert normalize_placement((4, 0, 2, 4)) == "244"
    assert packed(10, 4) == (4, 4, 2)


@needs_data
def test_a_pollux_workload_loads_as_elastic_trace_jobs(tmp_path: Path) -> None:
    apps = load_apps(APPS)
    jobs = load_pollux_workload(workload(tmp_path), apps, gpus_per_node=4)
    by_id = {j.job_id: j for j in jobs}
    assert [j.job_id for j in jobs] == sorted(by_id, key=lambda i: by_id[i].submit_time)
    assert all(j.duration_s > 0 and j.elastic for j in jobs)
    # ncf never scales past one GPU (as in the artifact); others may double.
    assert (by_id["ncf-1"].min_gpus, by_id["ncf-1"].max_gpus) == (1, 1)
    assert (by_id["cifar10-0"].min_gpus, by_id["cifar10-0"].max_gpus) == (1, 8)
    rigid = load_pollux_workload(workload(tmp_path), apps, gpus_per_node=4, elastic=None)
    assert not any(j.elastic for j in rigid)
    narrow = load_pollux_workload(
        workload(tmp_path), apps, gpus_per_node=4, elastic=ElasticRange(min_gpus=2)
    )
    assert {j.job_id: j.min_gpus for j in narrow}["bert-2"] == 2


@needs_data
def test_measured_speed_depends_on_size_and_nodes() -> None:
    apps = load_apps(APPS)
    scaling = PolluxScaling(apps, 4)
    job = TraceJob("x", 4, 0.0, 100.0, model_name="yolov3", batch_size=64)
    assert scaling.speed(job, (4,)) == 1.0
    # Fewer GPUs are slower; the same four split over two nodes are much slower.
    assert scaling.speed(job, (2,)) < 1.0
    assert scaling.speed(job, (2, 2)) < 0.7
    assert scaling.throughput(job, (4,)) == pytest.approx(64 / scaling.iteration_time(job, (4,)))
    # Keeping each worker's batch, a smaller world trains with a smaller, more
    # sample-efficient batch: per GPU it does more than with the global batch kept.
    local = PolluxScaling(apps, 4, batch="local")
    assert local.batch_at(job, 2) == 32
    assert local.speed(job, (2,)) > scaling.speed(job, (2,))
    assert local.speed(job, (4,)) == 1.0


@needs_data
@pytest.mark.parametrize("batch", BATCH_SCALINGS)
def test_elastic_replay_finishes_every_job_and_resizes(tmp_path: Path, batch: str) -> None:
    apps = load_apps(APPS)
    jobs = load_pollux_workload(workload(tmp_path), apps, gpus_per_node=4)
    scaling = PolluxScaling(apps, 4, batch=batch)  # type: ignore[arg-type]
    results = {}
    for label, policy in (("static", STATIC), ("elastic", ELASTIC)):
        config = SimConfig(
            policy,
            parse_cluster("2x4"),
            scaling=scaling,
            preemption_cost_s=30.0,
            resize_cost_s=30.0,
            start_cost_s=30.0,
        )
        result = simulate(jobs, config)
        assert result.unfinished == ()
        results[label] = summarize(result)
    assert results["static"].resizes == 0
    assert results["elastic"].resizes > 0
    # Every elastic job ran within its range (the engine raises otherwise), and resizes
    # cost a small share of the GPU-time held. (Whether it beats static on JCT is the
    # Pollux bench's question, on the real workloads; a GPU that does not earn its keep
    # stays idle rather than flapping between jobs, so the cluster need not be busier.)
    assert 0 < results["elastic"].resize_gpu_share < 0.2


def test_a_resize_interval_defers_growth_to_the_next_round() -> None:
    # Linear scaling; measured at 2 GPUs 30 s after it starts (t=30), so it could grow
    # at once; with 60 s rounds it waits for the round at t=60.
    job = TraceJob("1", 2, 0.0, 1000.0, min_gpus=1, max_gpus=4)
    policy = Policy(order="fifo", elasticity="linear", elastic_may_spread=True)
    cluster = parse_cluster("1x4")
    every = simulate((job,), SimConfig(policy, cluster))
    rounds = replace(policy, elastic_resize_interval_s=60.0)
    deferred = simulate((job,), SimConfig(rounds, cluster))
    ((now,), (later,)) = every.outcomes, deferred.outcomes
    assert now.resizes == later.resizes == 1
    assert now.jct is not None and later.jct is not None
    # 30 s longer on 2 GPUs instead of 4: 15 s of work (linear scaling) left over.
    assert later.jct == pytest.approx(now.jct + 15.0)


def test_resizes_cost_time_and_are_checked() -> None:
    # No scaling data: an elastic job runs proportionally to its size (linear).
    job = TraceJob("1", 2, 0.0, 1000.0, min_gpus=1, max_gpus=4)
    policy = Policy(order="fifo", elasticity="linear", elastic_may_spread=True)
    free = simulate((job,), SimConfig(policy, parse_cluster("1x4")))
    costly = simulate((job,), SimConfig(policy, parse_cluster("1x4"), resize_cost_s=50.0))
    (fast,), (slow,) = free.outcomes, costly.outcomes
    # Linear scaling: it starts on 2 (what it asked for), is measured, then grows to 4.
    assert fast.resizes == slow.resizes == 1
    assert fast.jct is not None and slow.jct is not None
    assert slow.jct == pytest.approx(fast.jct + 50.0)
    assert fast.jct < 1000.0


def test_a_shrink_may_cost_less_than_a_grow() -> None:
    # Job 1 runs on all 4 GPUs; rigid job 2 arrives, 1 shrinks for it, then grows back.
    elastic = TraceJob("1", 4, 0.0, 2000.0, min_gpus=1, max_gpus=4)
    rigid = TraceJob("2", 2, 100.0, 300.0)
    policy = Policy(order="fifo", elasticity="linear", elastic_may_spread=True)

    def jct(**costs: float | None) -> float:
        config = SimConfig(policy, parse_cluster("1x4"), **costs)  # type: ignore[arg-type]
        outcome = {o.job_id: o for o in simulate((elastic, rigid), config).outcomes}["1"]
        assert outcome.resizes == 2 and outcome.jct is not None
        return outcome.jct

    same = jct(resize_cost_s=50.0)
    assert jct(resize_cost_s=50.0, shrink_cost_s=50.0) == pytest.approx(same)
    # The shrink's 45 s saved were spent on 2 GPUs: 22.5 s of 4-GPU work.
    assert jct(resize_cost_s=50.0, shrink_cost_s=5.0) == pytest.approx(same - 22.5)
    # A grow alone never pays the shrink's cost.
    alone = (replace(elastic, gpus=2),)
    grow_only = SimConfig(policy, parse_cluster("1x4"), resize_cost_s=50.0)
    (plain,) = simulate(alone, grow_only).outcomes
    (cheap,) = simulate(alone, replace(grow_only, shrink_cost_s=0.0)).outcomes
    assert plain.resizes == 1 and cheap.jct == pytest.approx(plain.jct)


def test_a_resize_outside_the_range_is_a_simulation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    job = TraceJob("1", 2, 0.0, 100.0, min_gpus=2, max_gpus=3)

    def broken(
        snapshot: ClusterSnapshot, now: float, policy: Policy, *, waits: bool = True
    ) -> Decisions:
        if not snapshot.running:
            return decide(snapshot, now, policy, waits=waits)
        (running,) = snapshot.running
        shrunk = (Grant(running.grants[0].node, running.grants[0].gpus[:1]),)
        return Decisions((Resize("1", shrunk, Retreated(2, 1, 2.0, 1.0, 0.5)),))

    monkeypatch.setattr("brain.sim.engine.decide", broken)
    policy = Policy(order="fifo", elasticity="marginal-gain")
    with pytest.raises(SimulationError, match=r"elastic job of 2\.\.3"):
        simulate((job,), SimConfig(policy, parse_cluster("1x4"), throughput_report_after_s=1.0))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@needs_data
def test_cli_detects_a_pollux_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = workload(tmp_path)
    common = ("--trace", str(path), "--cluster", "2x4", "--apps", str(APPS), "--json")
    assert cli.run(parse(*common, "--policy", "las")) == 0
    static = json.loads(capsys.readouterr().out)
    argv = (*common, "--policy", "las+marginal-gain", "--resize-cost", "30", "--batch", "local")
    assert cli.run(parse(*argv)) == 0
    elastic = json.loads(capsys.readouterr().out)
    assert static["resizes"] == 0 and elastic["resizes"] > 0
    assert static["jobs"] == elastic["jobs"] == 6


@needs_data
def test_cli_rejects_an_unknown_elasticity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = workload(tmp_path)
    argv = ("--trace", str(path), "--cluster", "2x4", "--apps", str(APPS))
    assert cli.run(parse(*argv, "--policy", "las+greedy")) == 2
    assert "unknown elasticity policy 'greedy'" in capsys.readouterr().err
    assert cli.run(parse(*argv, "--shrink-cost", "-3")) == 2
    assert "--shrink-cost must be a number of seconds >= 0, not -3" in capsys.readouterr().err
    assert cli.run(parse("--trace", str(path), "--cluster", "2x4", "--apps", str(tmp_path))) == 2
    assert "no application directories" in capsys.readouterr().err


# (application, requested GPUs, batch) of jobs like the workloads' own.
ADAPTIVE_JOBS = (
    ("cifar10", 4, 4096),
    ("cifar10", 6, 2048),
    ("bert", 6, 384),
    ("deepspeech2", 6, 320),
    ("imagenet", 16, 6400),
    ("yolov3", 4, 64),
    ("ncf", 1, 32768),
)
PLACEMENTS = ((1,), (2,), (4,), (2, 2), (4, 4), (4, 2), (4, 4, 4, 4))


@needs_data
def test_adaptive_batch_is_never_slower_than_a_kept_batch() -> None:
    apps = load_apps(APPS)
    modes = {mode: PolluxScaling(apps, 4, batch=mode) for mode in BATCH_SCALINGS}
    for app, gpus, batch in ADAPTIVE_JOBS:
        job = TraceJob("x", gpus, 0.0, 1.0, model_name=app, batch_size=batch)
        for per_node in PLACEMENTS:
            speed = {mode: scaling.speed(job, per_node) for mode, scaling in modes.items()}
            kept = max(speed["global"], speed["local"])
            assert speed["adaptive"] >= kept * (1 - 1e-12), (app, per_node, speed)
            # Re-choosing per epoch too can only do better again.
            assert speed["adaptive-epoch"] >= speed["adaptive"] * (1 - 1e-12), (app, per_node)
        # At the size it asked for it runs its own batch or a better one.
        requested = packed(gpus, 4)
        assert modes["adaptive"].speed(job, requested) >= 1.0
        chosen = modes["adaptive"].batch_on(job, requested)
        spec = apps[app]
        assert spec.init_batch_size <= chosen <= spec.max_batch_size
        own = spec.iterations(batch) * spec.iteration_time(requested, batch)
        best = spec.iterations(chosen) * spec.iteration_time(requested, chosen)
        assert best <= own
        assert chosen == batch or best < own


@needs_data
def test_adaptive_batch_picks_from_a_geometric_grid_and_its_own_batch() -> None:
    app = load_apps(APPS)["cifar10"]
    grid = app.batch_candidates(4, 4096, 1000)
    assert list(grid) == sorted(set(grid))
    assert {4096, 1000, app.init_batch_size, app.max_batch_size} <= set(grid)
    assert len(grid) <= ADAPTIVE_GRID + 2
    assert all(app.init_batch_size <= b <= app.max_batch_size for b in grid)
    # Roughly geometric: consecutive steps grow by a bounded ratio.
    assert max(b / a for a, b in itertools.pairwise(grid)) < 1.2
    # The best batch: the smallest time to train among the candidates.
    batch, seconds = app.best_batch((4,), grid)
    assert seconds == min(app.iterations(b) * app.iteration_time((4,), b) for b in grid)
    assert seconds == app.iterations(batch) * app.iteration_time((4,), batch)


@needs_data
def test_adaptive_throughput_is_goodput_consistent_with_speed() -> None:
    apps = load_apps(APPS)
    job = TraceJob("x", 4, 0.0, 1.0, model_name="cifar10", batch_size=4096)
    for mode in ("adaptive", "adaptive-epoch"):
        scaling = PolluxScaling(apps, 4, batch=mode)
        # The stage ranks by ratios between sizes: those must be the speed's ratios.
        for small, large in (((2,), (4,)), ((4,), (4, 4)), ((1,), (4, 2))):
            assert scaling.throughput(job, large) / scaling.throughput(job, small) == (
                pytest.approx(scaling.speed(job, large) / scaling.speed(job, small))
            )
    # Keeping the batch, the reports stay samples/s (what the other rows measured).
    samples = PolluxScaling(apps, 4, batch="local")
    assert samples.throughput(job, (2,)) == pytest.approx(2048 / samples.iteration_time(job, (2,)))


@needs_data
def test_adaptive_modes_are_deterministic(tmp_path: Path) -> None:
    apps = load_apps(APPS)
    job = TraceJob("x", 6, 0.0, 1.0, model_name="deepspeech2", batch_size=320)
    for mode in ("adaptive", "adaptive-epoch"):
        one = PolluxScaling(apps, 4, batch=mode)
        two = PolluxScaling(load_apps(APPS), 4, batch=mode)
        for per_node in PLACEMENTS:
            assert one.epoch_batches(job, per_node) == two.epoch_batches(job, per_node)
            assert one.speed(job, per_node) == two.speed(job, per_node)
    # Per epoch, the batch grows as the gradient noise does (small early, larger late).
    batches = PolluxScaling(apps, 4, batch="adaptive-epoch").epoch_batches(job, (4, 2))
    assert batches[0] < batches[-1]
    jobs = load_pollux_workload(workload(tmp_path), apps, gpus_per_node=4)
    config = SimConfig(
        ELASTIC,
        parse_cluster("2x4"),
        scaling=PolluxScaling(apps, 4, batch="adaptive-epoch"),
        resize_cost_s=30.0,
        start_cost_s=30.0,
        preemption_cost_s=30.0,
    )
    assert simulate(jobs, config) == simulate(jobs, config)


def test_a_speed_curve_is_integrated_exactly() -> None:
    # 60 s of work: 10 at speed 1, 20 at speed 2, 30 at speed 3 (a zero phase dropped).
    curve = SpeedCurve.of([(10.0, 1.0), (0.0, 5.0), (20.0, 2.0), (30.0, 3.0)])
    assert curve.floors == (50.0, 30.0, 0.0)
    assert curve.seconds_to_finish(60.0) == pytest.approx(30.0)
    assert curve.run(60.0, 15.0) == pytest.approx(40.0)
    assert curve.run(60.0, 30.0) == pytest.approx(0.0)
    # Work redone after a preemption runs at the first phase's speed.
    assert curve.seconds_to_finish(70.0) == pytest.approx(40.0)
    with pytest.raises(ValueError, match="positive speeds"):
        SpeedCurve.of([(10.0, 0.0)])

    class Phased:
        def speed(self, job: TraceJob, per_node: Sequence[int]) -> float:
            return 60.0 / 30.0

        def throughput(self, job: TraceJob, per_node: Sequence[int]) -> float:
            return 1.0

        def speed_curve(self, job: TraceJob, per_node: Sequence[int]) -> SpeedCurve:
            return curve

    job = TraceJob("1", 1, 0.0, 60.0)
    config = SimConfig(STATIC, parse_cluster("1x1"), scaling=Phased(), start_cost_s=5.0)
    (outcome,) = simulate((job,), config).outcomes
    assert outcome.jct == pytest.approx(35.0)


@needs_data
def test_cli_runs_the_adaptive_modes_and_rejects_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = workload(tmp_path)
    common = ("--trace", str(path), "--cluster", "2x4", "--apps", str(APPS), "--json")
    elastic = ("--policy", "las+marginal-gain", "--resize-cost", "30")
    for mode in ("adaptive", "adaptive-epoch"):
        assert cli.run(parse(*common, *elastic, "--batch", mode)) == 0
        assert json.loads(capsys.readouterr().out)["jobs"] == 6
    with pytest.raises(SystemExit) as exited:
        parse(*common, "--batch", "goodput")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--batch: invalid choice: 'goodput'" in err and "adaptive" in err
    with pytest.raises(ValueError, match="batch must be one of"):
        PolluxScaling({}, 4, batch="goodput")  # type: ignore[arg-type]


@needs_data
@pytest.mark.parametrize(
    ("row", "says"),
    [
        ("a,inf,cifar10,4,2048\n", "tiny.csv:2: column 'time': 'inf' is not a finite number"),
        ("a,-5,cifar10,4,2048\n", "tiny.csv:2: column 'time': '-5' must be >= 0"),
        ("a,0,cifar10,4,nan\n", "column 'batch_size': 'nan' is not a finite number"),
        ("a,0,cifar10,4,512.7\n", "column 'batch_size': '512.7' is not a whole number >= 1"),
        ("a,0,cifar10,0,2048\n", "column 'num_replicas': '0' is not a whole number >= 1"),
    ],
)
def test_a_bad_pollux_row_is_refused_naming_its_column(tmp_path: Path, row: str, says: str) -> None:
    with pytest.raises(TraceError, match=re.escape(says)):
        load_pollux_workload(workload(tmp_path, row), load_apps(APPS), gpus_per_node=4)
