"""The trace simulator: loading traces, replaying them through `decide`, reporting."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from brain.core import Policy, QueueQuota, ServiceDistribution
from brain.sim import (
    ClusterSpec,
    SimConfig,
    TraceError,
    TraceJob,
    cli,
    load_trace,
    parse_cluster,
    simulate,
    summarize,
)
from brain.sim.report import format_table, percentile

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
SIXTY_JOBS = SHARED / "tiresias" / "60_job.csv"

HEADER = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"


def write_trace(tmp_path: Path, rows: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(header + rows)
    return path


def jobs(*specs: tuple[str, int, float, float]) -> tuple[TraceJob, ...]:
    return tuple(TraceJob(job_id, gpus, at, duration) for job_id, gpus, at, duration in specs)


def run(
    trace: tuple[TraceJob, ...], policy: Policy, shape: str = "1x4", **config: object
) -> dict[str, tuple[float | None, int]]:
    result = simulate(trace, SimConfig(policy, parse_cluster(shape), **config))  # type: ignore[arg-type]
    return {o.job_id: (o.jct, o.preemptions) for o in result.outcomes}


# -- traces ---------------------------------------------------------------------------


def test_load_trace_reads_tiresias_format(tmp_path: Path) -> None:
    path = write_trace(tmp_path, "1,2,30,100,vgg19,50,0\n0,1,0,606,vgg19,164,30\n")
    assert load_trace(path) == (
        TraceJob("0", 1, 0.0, 164.0, 606, "vgg19"),
        TraceJob("1", 2, 30.0, 50.0, 100, "vgg19"),
    )


@pytest.mark.parametrize(
    ("header", "rows", "message"),
    [
        ("job_id,num_gpu,submit_time\n", "0,1,0\n", "missing column(s) duration"),
        (HEADER, "0,x,0,1,m,5,0\n", "trace.csv:2: column 'num_gpu': 'x' is not a number"),
        (HEADER, "0,1,0,1,m,5,0\n1,1.5,0,1,m,5,0\n", "trace.csv:3: column 'num_gpu'"),
        (HEADER, "0,1,0,1,m,-5,0\n", "column 'duration': '-5' must be >= 0"),
        (HEADER, "0,1,,1,m,5,0\n", "column 'submit_time': missing value"),
        (HEADER, "0,1,0,1,m,5,0\n0,1,0,1,m,5,0\n", "duplicate job id '0'"),
        (HEADER, "", "the trace has no jobs"),
        # What would never finish replaying: a clock in seconds that stops moving.
        (HEADER, "0,1,0,1,m,inf,0\n", "column 'duration': 'inf' is past 1e"),
        (HEADER, "0,1,1e16,1,m,5,0\n", "column 'submit_time': '1e16' is past 1e"),
        (HEADER, "0,1,0,1e400,m,5,0\n", "column 'iterations': '1e400' is past"),
        (HEADER, "0,1,nan,1,m,5,0\n", "column 'submit_time': 'nan' must be >= 0"),
    ],
)
def test_bad_traces_name_the_row_and_column(
    tmp_path: Path, header: str, rows: str, message: str
) -> None:
    path = write_trace(tmp_path, rows, header)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_trace(path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"job_id,num_gpu\n\xff\xfe,1\n", "trace.csv: not UTF-8 text", id="binary"),
        pytest.param(
            "job_id,num_gpu,submit_time,duration\n".encode("utf-16"),
            "trace.csv: not UTF-8 text",
            id="utf-16",
        ),
    ],
)
def test_a_trace_that_is_not_utf8_is_named(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(raw)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_a_spreadsheet_s_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("\ufeffjob_id,num_gpu,submit_time,duration\n0,1,0,5\n", encoding="utf-8")
    (job,) = load_trace(path)
    assert job.job_id == "0"


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize("text", ["12", "0x4", "12x", "axb", "3x0", "99999999999x8", "2x9999"])
def test_bad_cluster_shapes(text: str) -> None:
    with pytest.raises(TraceError, match="cluster"):
        parse_cluster(text)


def test_cluster_shape() -> None:
    assert parse_cluster("12x4") == ClusterSpec(12, 4)
    assert parse_cluster(" 2X8 ", nodes_per_switch=1).total_gpus == 16


# -- replay ---------------------------------------------------------------------------


def test_fifo_runs_jobs_in_submission_order() -> None:
    trace = jobs(("a", 4, 0, 100), ("b", 4, 10, 50), ("c", 1, 20, 10))
    outcome = run(trace, Policy(order="fifo"))
    # b waits for a (until 100), c waits behind b (head of line) until 150.
    assert outcome == {"a": (100.0, 0), "b": (140.0, 0), "c": (140.0, 0)}


def test_las_preempts_and_resumes_keeping_attained_service() -> None:
    # One 4-GPU node; a long job passes the first threshold (3250 GPU-s at 4 GPUs =
    # 812.5 s), then a short job arrives and takes the GPUs; the long one resumes.
    trace = jobs(("long", 4, 0, 2000), ("short", 4, 1000, 100))
    outcome = run(trace, Policy(order="las"))
    assert outcome["short"] == (100.0, 0)
    assert outcome["long"] == (2100.0, 1)


def test_preemption_cost_is_paid_on_resume() -> None:
    trace = jobs(("long", 4, 0, 2000), ("short", 4, 1000, 100))
    outcome = run(trace, Policy(order="las"), preemption_cost_s=30.0)
    assert outcome["long"] == (2130.0, 1)


def test_srtf_gets_declared_durations_and_las_does_not() -> None:
    trace = jobs(("long", 1, 0, 1000), ("short", 1, 10, 10))
    srtf = run(trace, Policy(order="srtf"), "1x1")
    assert srtf["short"] == (10.0, 0)
    # LAS only sees attained service: the newcomer (0 GPU-s) outranks the long job
    # only once it has left band 0... which it never did: FIFO within band 0.
    las = run(trace, Policy(order="las"), "1x1")
    assert las["short"] == (1000.0, 0)


def test_progress_policy_learns_remaining_time_from_reports() -> None:
    # After its 60 s probe the long job reports 6% done: ~940 s left; the newcomer
    # is probed, reports 60/70 done, and is finished first.
    trace = jobs(("long", 1, 0, 1000), ("short", 1, 100, 70))
    outcome = run(trace, Policy(order="progress"), "1x1")
    assert outcome["short"] == (70.0, 0)
    assert outcome["long"] == (1070.0, 1)


def test_quota_reclaim_in_simulation() -> None:
    trace = tuple(
        TraceJob(job_id, gpus, at, duration)
        for job_id, gpus, at, duration in [("borrower", 4, 0, 1000), ("owner", 4, 10, 100)]
    )
    queues = (QueueQuota("default", 0),)
    result = simulate(trace, SimConfig(Policy(order="fifo"), parse_cluster("1x4"), queues=queues))
    # Without a guarantee nobody is reclaimed; FIFO never preempts.
    assert not result.preemptions
    owner_trace = (TraceJob("borrower", 4, 0, 1000), TraceJob("owner", 4, 10, 100))
    guaranteed = (QueueQuota("default", 4),)
    again = simulate(
        owner_trace, SimConfig(Policy(order="fifo"), parse_cluster("1x4"), queues=guaranteed)
    )
    assert not again.preemptions  # both in one queue: the borrower is within quota


def test_a_job_too_big_for_the_cluster_is_reported_unfinished() -> None:
    result = simulate(
        jobs(("big", 8, 0, 10), ("ok", 1, 0, 10)),
        SimConfig(Policy(order="las"), parse_cluster("1x4")),
    )
    assert result.unfinished == ("big",)
    assert summarize(result).unfinished == 1


def test_metrics_and_table() -> None:
    trace = jobs(("a", 4, 0, 100), ("b", 4, 0, 100))
    metrics = summarize(simulate(trace, SimConfig(Policy(order="fifo"), parse_cluster("1x4"))))
    assert (metrics.avg_jct, metrics.median_jct, metrics.makespan) == (150.0, 150.0, 200.0)
    assert metrics.avg_queue == 50.0
    assert metrics.utilization == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert "fifo" in format_table([("fifo", metrics)])


@pytest.mark.skipif(not SIXTY_JOBS.exists(), reason="shared trace data not present")
@pytest.mark.parametrize(
    ("order", "shape", "tiresias"),
    [
        ("fifo", "2x4", 1556.5),
        ("las", "2x4", 715.3),
        ("srtf", "2x4", 563.4),
        ("fifo", "4x4", 200.8),
        ("las", "4x4", 190.7),
    ],
)
def test_sixty_job_trace_matches_tiresias(order: str, shape: str, tiresias: float) -> None:
    result = simulate(load_trace(SIXTY_JOBS), SimConfig(Policy(order=order), parse_cluster(shape)))
    assert summarize(result).avg_jct == pytest.approx(tiresias, abs=0.05)


PHILLY = SHARED / "philly"
# Tiresias' own simulator on the shared Philly clusters (../shared/data/README.md).
PHILLY_FIFO_AND_SHORTEST_GPU = [
    pytest.param("vc_0e4a51", "12x4", "fifo", 1_407_738),
    pytest.param("vc_0e4a51", "12x4", "srtf", 195_115),
    pytest.param("vc_2869ce", "12x4", "fifo", 841_485),
    pytest.param("vc_2869ce", "12x4", "srtf", 260_758),
    # Ten-thousand-job replays: seconds each, so kept out of the quick run.
    pytest.param("vc_6c71a0", "12x4", "fifo", 818_597, marks=pytest.mark.slow),
    pytest.param("vc_6c71a0", "12x4", "srtf", 26_122, marks=pytest.mark.slow),
    pytest.param("vc_b436b2", "18x4", "fifo", 1_326_675, marks=pytest.mark.slow),
    pytest.param("vc_b436b2", "18x4", "srtf", 20_822, marks=pytest.mark.slow),
]


@pytest.mark.skipif(not PHILLY.exists(), reason="shared trace data not present")
@pytest.mark.parametrize(("trace", "shape", "order", "tiresias"), PHILLY_FIFO_AND_SHORTEST_GPU)
def test_philly_fifo_and_srtf_equal_tiresias(
    trace: str, shape: str, order: str, tiresias: float
) -> None:
    """fifo and srtf are Tiresias' fifo and shortest-gpu exactly (its numbers are
    rounded to the second)."""
    config = SimConfig(Policy(order=order), parse_cluster(shape))
    result = simulate(load_trace(PHILLY / f"{trace}.csv"), config)
    assert summarize(result).avg_jct == pytest.approx(tiresias, abs=0.5)


def test_priority_on_a_trace_without_priorities_is_refused() -> None:
    trace = jobs(("1", 1, 0, 10), ("2", 1, 1, 10))
    with pytest.raises(TraceError, match="no `priority` column"):
        simulate(trace, SimConfig(Policy(order="priority"), parse_cluster("1x4")))


def test_priority_column_orders_the_jobs(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path,
        "1,4,0,100\n2,4,1,100,\n3,4,2,100,5\n",
        header="job_id,num_gpu,submit_time,duration,priority\n",
    )
    trace = load_trace(path)
    assert [j.priority for j in trace] == [None, None, 5]
    result = simulate(trace, SimConfig(Policy(order="priority"), parse_cluster("1x4")))
    finished = {o.job_id: o.finished_at for o in result.outcomes}
    # Job 3 (priority 5) preempts job 1 on arrival and finishes before job 2.
    assert finished["3"] == 102
    assert finished["3"] < finished["2"]


def test_progress_error_is_fixed_per_job_and_bounded() -> None:
    from brain.sim.engine import _misestimate

    factors = [_misestimate(str(i), 1.0) for i in range(2000)]
    assert factors == [_misestimate(str(i), 1.0) for i in range(2000)]
    assert all(0.5 <= f <= 2.0 for f in factors)
    assert min(factors) < 0.55 and max(factors) > 1.9
    assert _misestimate("7", 0.0) == 1.0


# -- the CLI glue ---------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path, "0,1,0,1,m,100,0\n1,1,0,1,m,50,0\n")
    assert (
        cli.run(parse("--trace", str(path), "--cluster", "1x1", "--policy", "fifo", "--json")) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {
        "avg_jct",
        "median_jct",
        "p95_jct",
        "p99_jct",
        "avg_queue",
        "makespan",
        "utilization",
        "preemptions",
    }
    assert report["avg_jct"] == 125.0


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path, "0,4,0,1,m,2000,0\n1,4,1000,1,m,100,0\n")
    assert (
        cli.run(
            parse(
                "--trace",
                str(path),
                "--cluster",
                "1x4",
                "--policy",
                "las",
                "--preemption-cost",
                "5",
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "avg JCT" in out
    assert "preemptions, Outranked: 1" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--policy", "priority"), "no `priority` column"),
        (("--progress-error", "-1"), "--progress-error must be a number >= 0, not -1"),
        # NaN passes every "< 0" test: each is refused by what it must be.
        (("--progress-error", "nan"), "--progress-error must be a number >= 0, not nan"),
        (("--preemption-cost", "inf"), "--preemption-cost must be a number of seconds >= 0"),
        (("--gittins-quantum", "nan"), "the Gittins quantum must be positive, not nan"),
        (("--starvation-guard", "nan"), "the starvation guard must be positive, not nan"),
        (("--relax-locality-after", "nan"), "the locality relaxation cannot be negative"),
        (("--policy", "gittins", "--fixed-distribution"), "--fixed-distribution needs"),
    ],
)
def test_cli_refuses_what_the_policy_cannot_run_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    path = write_trace(tmp_path, "0,1,0,1,m,10,0\n")
    assert cli.run(parse("--trace", str(path), "--cluster", "1x1", *flags)) == 2
    assert message in capsys.readouterr().err


def test_cli_names_the_jobs_that_never_finished_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path, "0,1,0,1,m,10,0\n1,4,0,1,m,10,0\n")
    assert cli.run(parse("--trace", str(path), "--cluster", "1x2", "--json")) == 1
    captured = capsys.readouterr()
    assert '"unfinished": 1' in captured.out
    assert "1 job never finished: 1 (asks 4 GPUs; the cluster has 2)" in captured.err


def test_cli_progress_error_and_fixed_distribution(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path, "0,1,0,1,m,100,0\n1,1,5,1,m,10,0\n")
    prior = tmp_path / "prior.csv"
    prior.write_text("duration\n50\n5000\n")
    for flags in (
        ("--policy", "progress", "--progress-error", "1"),
        ("--policy", "gittins-tiresias", "--service-prior", str(prior), "--fixed-distribution"),
    ):
        assert cli.run(parse("--trace", str(path), "--cluster", "1x1", "--json", *flags)) == 0
        assert '"unfinished": 0' in capsys.readouterr().out


def test_cli_reports_bad_input_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_trace(tmp_path, "0,1,0,1,m,oops,0\n")
    assert cli.run(parse("--trace", str(path), "--cluster", "1x1")) == 2
    assert "column 'duration'" in capsys.readouterr().err
    assert cli.run(parse("--trace", str(path), "--cluster", "nope")) == 2


def test_cli_plot_without_matplotlib_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # matplotlib is in the dev extra; hide it (a None entry makes its import fail).
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = write_trace(tmp_path, "0,1,0,1,m,100,0\n")
    assert (
        cli.run(
            parse(
                "--trace",
                str(path),
                "--cluster",
                "1x1",
                "--json",
                "--plot",
                str(tmp_path / "plots"),
            )
        )
        == 2
    )
    assert "needs matplotlib" in capsys.readouterr().err


def test_gittins_learns_from_unfinished_jobs_too() -> None:
    # A long job runs beside five short ones. Finished jobs alone say every job is
    # short; the long job's service so far (a censored sample: it will use more)
    # says some are long, so a new job's index is lower with it.
    trace = jobs(("long", 1, 0, 5000), *((f"s{i}", 1, 100.0 * i, 50) for i in range(5)))
    probes = (0.0,)
    config = {"index_probes_gpu_s": probes, "service_prior": ServiceDistribution.from_samples([])}
    policy = Policy(order="gittins", gittins_quantum_gpu_s=100.0)
    finished_only = simulate(
        trace, SimConfig(policy, parse_cluster("1x2"), learn_censored=False, **config)
    )
    censored = simulate(trace, SimConfig(policy, parse_cluster("1x2"), **config))
    assert [n for n, _ in finished_only.learned_index] == [1, 2, 3, 4, 5, 6]
    # Every short job used 50 GPU-s: alone, they say a new job finishes within 100.
    assert finished_only.learned_index[4][1] == (pytest.approx(1 / 50),)
    by_finished = dict(censored.learned_index)
    assert by_finished[5][0] < 1 / 50
    # Once the long job has finished, both know the same.
    assert by_finished[6] == finished_only.learned_index[-1][1]
    # Nothing is recorded unless asked for, and nothing for an order that does not read it.
    assert simulate(trace, SimConfig(policy, parse_cluster("1x2"))).learned_index == ()
    las = SimConfig(Policy(order="las"), parse_cluster("1x2"), index_probes_gpu_s=probes)
    assert simulate(trace, las).learned_index == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("duration\n50\nnan\n", "prior.csv:3: column 'duration': 'nan' must be >= 0"),
        ("duration\n50\ninf\n", "prior.csv:3: column 'duration': 'inf' is past"),
        ("duration\n", "no durations"),
        ("seconds\n50\n", "missing column"),
    ],
)
def test_a_service_prior_that_says_nothing_sound_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "prior.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        cli.load_prior(path)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("0,1,0,1.5,m,5,0\n", "column 'iterations': '1.5' is not a whole number"),
        ("0,1,0,1,m,5,0,extra\n", "trace.csv:2: 8 fields, and the header names 7"),
    ],
)
def test_what_a_trace_row_would_lose_is_refused(tmp_path: Path, rows: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write_trace(tmp_path, rows))
