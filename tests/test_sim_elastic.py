"""Elastic jobs in the simulator: Pollux workloads, measured scaling, resizes in sim time."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from brain.core import ClusterSnapshot, Decisions, Grant, Policy, Resize, decide
from brain.sim import SimConfig, SimulationError, TraceJob, cli, parse_cluster, simulate, summarize
from brain.sim.pollux import (
    ElasticRange,
    PolluxScaling,
    load_apps,
    load_pollux_workload,
    normalize_placement,
    packed,
)

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
@pytest.mark.parametrize("batch", ["global", "local"])
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
    # Every elastic job ran within its range (the engine raises otherwise) and the
    # cluster was busier: idle GPUs went to elastic jobs.
    assert results["elastic"].utilization > results["static"].utilization


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


def test_a_resize_outside_the_range_is_a_simulation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    job = TraceJob("1", 2, 0.0, 100.0, min_gpus=2, max_gpus=3)

    def broken(snapshot: ClusterSnapshot, now: float, policy: Policy) -> Decisions:
        if not snapshot.running:
            return decide(snapshot, now, policy)
        (running,) = snapshot.running
        shrunk = (Grant(running.grants[0].node, running.grants[0].gpus[:1]),)
        return Decisions((Resize("1", shrunk, "below its minimum"),))

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
    assert cli.run(parse("--trace", str(path), "--cluster", "2x4", "--apps", str(tmp_path))) == 2
    assert "no application directories" in capsys.readouterr().err
