"""What the live brain feeds the policies, without a bus: the queues file, the job
spec's policy hints, and the learned service distribution folded from the log."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from brain.core import DEFAULT_SERVICE_PRIOR, QueueQuota
from brain.queues import QueueConfigError, load_queues, parse_quota, queue_status
from brain.service import BrainConfig, InvalidBrainConfig
from brain.sim import TraceError, cli, load_trace
from brain.state import SERVICE_SAMPLES, BrainState, job_view
from cli.format import queues_table
from cli.main import UsageError, build_parser, load_spec, main
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.state import Cause, CauseKind, JobChanged

# -- the queues file ------------------------------------------------------------------

GOOD = """\
queues:
  - name: interactive
    guaranteed_gpus: 4
    class: build
  - name: research
    guaranteed_gpus: 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "queues.yaml"
    path.write_text(text)
    return path


def test_a_queues_file_gives_the_quotas_in_order(tmp_path: Path) -> None:
    assert load_queues(write(tmp_path, GOOD)) == (
        QueueQuota("interactive", 4, "build"),
        QueueQuota("research", 8, "train"),
    )
    assert load_queues(write(tmp_path, "queues: []\n")) == ()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "found an empty file"),
        ("queues: [\n", "not valid YAML"),
        ("- name: a\n", "expected a mapping with one key, `queues`"),
        ("queue: []\n", "found keys queue"),
        ("queues: {a: 1}\n", "`queues` must be a list of queues, not dict"),
        ("queues: [research]\n", "queues[0]: expected a mapping"),
        ("queues:\n  - guaranteed_gpus: 1\n", "queues[0]: `name` is required"),
        ("queues:\n  - name: a\n", "queues[0] (a): `guaranteed_gpus` is required"),
        (
            "queues:\n  - name: a\n    guaranteed_gpus: 1\n    gpus: 2\n",
            "queues[0]: unknown key(s) gpus; known: name, guaranteed_gpus, class",
        ),
        (
            "queues:\n  - name: a\n    guaranteed_gpus: -1\n",
            "queues[0] (a): guaranteed_gpus must be a whole number >= 0, not -1",
        ),
        (
            "queues:\n  - name: a\n    guaranteed_gpus: 1.5\n",
            "guaranteed_gpus must be a whole number >= 0, not 1.5",
        ),
        ("queues:\n  - name: a\n    guaranteed_gpus: yes\n", "not True"),
        (
            "queues:\n  - name: a\n    guaranteed_gpus: 1\n    class: batch\n",
            "queues[0] (a): class must be build or train, not 'batch'",
        ),
        ("queues:\n  - name: a b\n    guaranteed_gpus: 1\n", "invalid queue name 'a b'"),
        (
            "queues:\n  - {name: a, guaranteed_gpus: 1}\n  - {name: a, guaranteed_gpus: 2}\n",
            "queue 'a' is configured twice",
        ),
        # A key given twice: PyYAML would keep the last, and the first list would be lost.
        ("queues:\n  - {name: a, guaranteed_gpus: 1}\nqueues: []\n", "key 'queues' is given twice"),
        (
            "queues:\n  - name: a\n    guaranteed_gpus: 4\n    guaranteed_gpus: 8\n",
            "key 'guaranteed_gpus' is given twice (first on line 3)",
        ),
        ("queues: [{name: a, guaranteed_gpus: 8, guaranteed_gpus: 0}]\n", "given twice"),
    ],
)
def test_a_bad_queues_file_says_what_is_wrong(tmp_path: Path, text: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(QueueConfigError) as raised:
        load_queues(path)
    assert says in str(raised.value)
    assert str(raised.value).startswith(str(path))


def test_a_missing_queues_file(tmp_path: Path) -> None:
    with pytest.raises(QueueConfigError, match="cannot read"):
        load_queues(tmp_path / "nope.yaml")


def test_quota_flags() -> None:
    assert parse_quota("research=8") == QueueQuota("research", 8, "train")
    assert parse_quota("interactive=2:build") == QueueQuota("interactive", 2, "build")
    for bad, says in [
        ("research", "expected NAME=GPUS"),
        ("research=-1", "expected NAME=GPUS"),
        ("research=two", "expected NAME=GPUS"),
        ("research=2:batch", "class must be build or train"),
        ("=2", "invalid queue name ''"),
    ]:
        with pytest.raises(QueueConfigError, match=says):
            parse_quota(bad)


def test_the_brain_and_up_refuse_a_bad_queues_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALNAIR_HOME", str(tmp_path / "home"))
    path = write(tmp_path, "queues:\n  - name: a\n    guaranteed_gpus: -2\n")
    # Refused before connecting anywhere: nothing listens on this port.
    assert main(["brain", "--nats", "nats://127.0.0.1:9", "--queues", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"alnair brain: {path}: queues[0] (a): guaranteed_gpus must be" in err
    # `alnair up` checks it before starting anything.
    assert main(["up", "--gpus", "sim:2xA100", "--nodes", "1", "--queues", str(path)]) == 1
    assert "alnair up: " in capsys.readouterr().err
    assert not (tmp_path / "home" / "nats").exists()


# -- the simulator's quotas -----------------------------------------------------------


def _job(number: int, queue: str, gpus: int, *, on: tuple[int, ...] = ()) -> JobRecord:
    spec = JobSpec(command=("x",), gpus=gpus, queue=queue)
    state = JobState.RUNNING if on else JobState.PENDING
    grants = (NodeGrant(node="n1", gpus=on),) if on else ()
    return JobRecord(
        job_id=str(number), tenant="t", spec=spec, state=state, submitted_at=0.0, grants=grants
    )


def test_queue_status_sets_each_guarantee_beside_what_its_jobs_hold_and_ask() -> None:
    quotas = (QueueQuota("prod", 2), QueueQuota("interactive", 1, "build"))
    running = [
        _job(1, "prod", 2, on=(0, 1)),
        _job(2, "prod", 1, on=(2,)),  # one beyond the guarantee: borrowed
        _job(3, "scratch", 1, on=(3,)),  # not listed: all of it borrowed
    ]
    pending = [_job(4, "interactive", 1), _job(5, "scratch", 4), _job(6, "scratch", 2)]
    shown = [
        (
            *(q.name, q.listed, q.job_class, q.guaranteed_gpus),
            *(q.running_jobs, q.running_gpus, q.borrowed_gpus, q.pending_jobs, q.pending_gpus),
        )
        for q in queue_status(quotas, running, pending)
    ]
    assert shown == [
        ("interactive", True, "build", 1, 0, 0, 0, 1, 1),
        ("prod", True, "train", 2, 2, 3, 1, 0, 0),
        ("scratch", False, "train", 0, 1, 1, 1, 2, 6),
    ]


def test_queue_status_counts_a_share_as_its_share() -> None:
    """As the policy charges it: three 0.3 shares and a 0.5 share hold 1.4 of a queue's
    1-GPU guarantee, 0.4 borrowed, with no binary-fraction tail."""
    quarters = [
        JobRecord(
            job_id=str(n),
            tenant="t",
            spec=JobSpec(command=("x",), gpus=1, gpu_milli=milli, queue="team"),
            state=JobState.RUNNING if n < 4 else JobState.PENDING,
            submitted_at=0.0,
            grants=(NodeGrant(node="n1", gpus=(0,)),) if n < 4 else (),
        )
        for n, milli in enumerate((300, 300, 300, 500, 250))
    ]
    (team,) = queue_status((QueueQuota("team", 1),), quarters[:4], quarters[4:])
    assert (team.running_gpus, team.borrowed_gpus, team.pending_gpus) == (1.4, 0.4, 0.25)
    assert queues_table([team]).splitlines()[1].split()[3:] == ["4/1.4", "0.4", "1/0.25"]


def test_traces_carry_a_queue(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("job_id,num_gpu,submit_time,duration,queue\na,1,0,10,prod\nb,1,0,10,\n")
    assert [j.queue for j in load_trace(path)] == ["prod", "default"]
    path.write_text("job_id,num_gpu,submit_time,duration,queue\na,1,0,10,a b\n")
    with pytest.raises(TraceError, match="column 'queue'"):
        load_trace(path)


def test_traces_may_name_tenants(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("job_id,num_gpu,submit_time,duration,tenant\na,1,0,10,ml\nb,1,0,10,\n")
    assert [j.tenant for j in load_trace(path)] == ["ml", None]
    path.write_text("job_id,num_gpu,submit_time,duration\na,1,0,10\n")
    assert [j.tenant for j in load_trace(path)] == [None]  # no users: one tenant
    path.write_text("job_id,num_gpu,submit_time,duration,tenant\na,1,0,10,a b\n")
    with pytest.raises(TraceError, match="column 'tenant'"):
        load_trace(path)


def sim_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_sim_quota_flags_reclaim_for_an_owner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "job_id,num_gpu,submit_time,duration,queue\n"
        "borrower,4,0,1000,research\nowner,2,10,100,prod\n"
    )
    base = ("--trace", str(trace), "--cluster", "1x4", "--policy", "fifo", "--no-progress")
    # FIFO alone never preempts; prod's guarantee does.
    assert cli.run(sim_args(*base)) == 0
    assert "QuotaReclaim" not in capsys.readouterr().out
    queues = write(tmp_path, "queues:\n  - {name: prod, guaranteed_gpus: 2}\n")
    assert cli.run(sim_args(*base, "--queues", str(queues), "--quota", "research=0")) == 0
    out = capsys.readouterr().out
    assert "queues: prod=2:train research=0:train" in out
    assert "preemptions, QuotaReclaim: 1" in out
    assert cli.run(sim_args(*base, "--queues", str(queues), "--quota", "prod=1")) == 2
    assert "queue 'prod' is configured twice" in capsys.readouterr().err


# -- job specs and the state fold -----------------------------------------------------


def test_policy_hints_in_the_spec_reach_the_job_view() -> None:
    spec = JobSpec(command=("true",), gpus=2, declared_duration_s=90, network_sensitive=True)
    view = job_view(
        JobRecord(job_id="1", tenant="t", spec=spec, state=JobState.PENDING, submitted_at=0)
    )
    assert view.declared_duration_s == 90.0 and view.network_sensitive
    assert view.tenant == "t"  # a shared GPU serves one tenant (brain/core/sharing.py)
    plain = job_view(
        JobRecord(
            job_id="2",
            tenant="t",
            spec=JobSpec(command=("true",), gpus=1),
            state=JobState.PENDING,
            submitted_at=0,
        )
    )
    assert plain.declared_duration_s is None and not plain.network_sensitive
    for bad in (0, -5, float("inf")):
        with pytest.raises(ValidationError, match="declared_duration_s"):
            JobSpec(command=("true",), gpus=1, declared_duration_s=bad)


def _finished(job_id: str, service: float, *, at: float) -> list[JobChanged]:
    spec = JobSpec(command=("true",), gpus=1)
    running = JobRecord(
        job_id=job_id, tenant="t", spec=spec, state=JobState.RUNNING, submitted_at=0
    )
    done = running.model_copy(
        update={"state": JobState.SUCCEEDED, "attained_gpu_seconds": service, "finished_at": at}
    )
    cause = Cause(kind=CauseKind.EXITED, message="exited 0")
    return [
        JobChanged(record_id=f"{job_id}-{i}", ts=at, epoch=1, job=job, previous=None, cause=cause)
        for i, job in enumerate((running, done))
    ]


def test_the_fold_learns_each_finished_jobs_service_once() -> None:
    state = BrainState()
    records = [*_finished("1", 30.0, at=2), *_finished("2", 10.0, at=1)]
    for seq, record in enumerate(records, 1):
        state.apply(record, seq)
    # Replayed again (a follower reading from an older sequence): nothing new.
    for seq, record in enumerate(records, 1):
        state.apply(record, seq)
    assert list(state.service_samples) == [30.0, 10.0]
    assert state.service_samples.maxlen == SERVICE_SAMPLES
    learned = state.snapshot().service_distribution
    assert learned is not None and learned.observed == 2
    assert set(learned.values) >= {10.0, 30.0} and len(learned.values) == 26
    # Built once, until another job finishes.
    assert state.snapshot().service_distribution is learned
    # A brain starting from a snapshot has the same samples, in the same order.
    snapshot = state.to_snapshot(taken_at=3, epoch=1)
    restored = BrainState.from_snapshot(snapshot)
    assert list(restored.service_samples) == [30.0, 10.0]
    assert restored.service_distribution().values == learned.values
    # One from a snapshot that predates them learns them from its jobs, as they finished.
    older = BrainState.from_snapshot(snapshot.model_copy(update={"service_samples": None}))
    assert list(older.service_samples) == [10.0, 30.0]
    # A configured prior is used in place of the default one.
    prior = DEFAULT_SERVICE_PRIOR.with_samples([5.0])
    assert state.service_distribution(prior).observed == 3


def test_submit_takes_a_duration_and_network_sensitivity(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["submit", "--gpus", "2", "--duration", "90", "--network-sensitive", "--", "true"]
    )
    spec = load_spec(args)
    assert (spec.declared_duration_s, spec.network_sensitive) == (90.0, True)
    plain = load_spec(parser.parse_args(["submit", "--gpus", "1", "--", "true"]))
    assert (plain.declared_duration_s, plain.network_sensitive) == (None, False)
    job = tmp_path / "job.yaml"
    job.write_text("command: echo\ngpus: 1\ndeclared_duration_s: 30\nnetwork_sensitive: true\n")
    from_yaml = load_spec(parser.parse_args(["submit", str(job)]))
    assert (from_yaml.declared_duration_s, from_yaml.network_sensitive) == (30.0, True)
    overridden = load_spec(parser.parse_args(["submit", "--duration", "5", str(job)]))
    assert overridden.declared_duration_s == 5.0
    with pytest.raises(UsageError, match="declared_duration_s: Input should be greater than 0"):
        load_spec(parser.parse_args(["submit", "--gpus", "1", "--duration", "0", "--", "true"]))


def test_a_job_file_that_is_not_there_is_named_and_a_command_after_dashes_is_not_one(
    tmp_path: Path,
) -> None:
    parser = build_parser()
    missing = str(tmp_path / "job.yaml")
    with pytest.raises(UsageError, match=f"{missing}: no such job file"):
        load_spec(parser.parse_args(["submit", missing]))
    command = load_spec(parser.parse_args(["submit", "--gpus", "1", "--", missing]))
    assert command.command == (missing,)


def test_options_after_a_job_file_are_refused_saying_where_they_go(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("command: echo\ngpus: 1\n")
    parser = build_parser()
    with pytest.raises(UsageError) as refused:
        load_spec(parser.parse_args(["submit", str(job), "--gpus", "2"]))
    assert str(refused.value) == (
        f"{job}: nothing may follow a job file; put options before it "
        f"(alnair submit --gpus 2 {job})"
    )
    # A command that happens to start with a .yaml word, after `--`, is a command.
    command = load_spec(parser.parse_args(["submit", "--gpus", "1", "--", str(job), "x"]))
    assert command.command == (str(job), "x")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prioirty: 5", "prioirty is not a job field (did you mean priority?); the fields are "),
        ("gpu_memory: 12GiB\ngpu_memory_mib: 5", "gpu_memory and gpu_memory_mib: give one"),
        ("memory: lots", "memory takes a size such as 20GiB or 512MiB, not 'lots'"),
        ("env: {LR: 0.10}", 'env.LR: YAML read 0.1, not text: quote it (LR: "0.1")'),
        ("env: {DEBUG: yes}", "env.DEBUG: YAML read True, not text: quote it"),
    ],
)
def test_a_job_file_is_refused_saying_what_to_write(tmp_path: Path, text: str, says: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"command: [sleep, '1']\ngpus: 1\n{text}\n")
    with pytest.raises(UsageError) as refused:
        load_spec(build_parser().parse_args(["submit", str(job)]))
    assert says in str(refused.value)


def test_a_job_file_takes_sizes_as_the_flags_do(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("command: [sleep, '1']\ngpus: 0.5\ngpu_memory: 12GiB\nmemory: 2G\n")
    spec = load_spec(build_parser().parse_args(["submit", str(job)]))
    assert (spec.gpu_milli, spec.gpu_memory_mib, spec.memory_mib) == (500, 12288, 2048)


def test_a_refused_job_is_said_in_the_validators_words_without_pydantics() -> None:
    parser = build_parser()
    args = ["submit", "--gpus", "2", "--elastic", "--min-gpus", "3", "--max-gpus", "2", "--"]
    with pytest.raises(UsageError) as refused:
        load_spec(parser.parse_args([*args, "true"]))
    said = "invalid job in the command line: job: min_gpus 3 is above max_gpus 2"
    assert str(refused.value) == said


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("node_timeout_s", math.nan, "node_timeout_s (--node-timeout) must be a number"),
        ("lease_ttl_s", -1.0, "lease_ttl_s (--lease-ttl) must be a number of seconds more than 0"),
        ("fence_margin_s", math.inf, "fence_margin_s (--fence-margin)"),
        ("job_credential_ttl_s", 0.0, "job_credential_ttl_s (--job-credential-ttl)"),
        ("snapshot_every", 0, "snapshot_every must be at least 1"),
    ],
)
def test_brain_settings_that_make_no_sense_are_refused_naming_the_flag(
    setting: str, value: float, says: str
) -> None:
    with pytest.raises(InvalidBrainConfig) as refused:
        BrainConfig(**{setting: value})
    assert says in str(refused.value)
    BrainConfig(fence_margin_s=0.0, job_credential_ttl_s=None)  # 0 and "never": fine


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("agent", "--node", "n1", "--gpus", "sim:1xH100", "--cpus", "nan"), "above 0"),
        (("agent", "--node", "n1", "--gpus", "sim:1xH100", "--cpus", "inf"), "above 0"),
    ],
)
def test_cli_numbers_that_make_no_sense_are_refused(
    args: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(list(args))
    assert says in capsys.readouterr().err


def test_a_size_past_what_a_float_counts_is_refused() -> None:
    from cli.main import UsageError, parse_mib

    with pytest.raises(UsageError, match="more memory than any machine has"):
        parse_mib("9" * 400 + "TiB", "--gpu-memory")


def test_a_queues_file_may_share_settings_through_yaml_merge_keys(tmp_path: Path) -> None:
    text = (
        "queues:\n"
        "  - &train {name: research, class: train, guaranteed_gpus: 8}\n"
        "  - <<: *train\n"
        "    name: prod\n"
    )
    assert [(q.name, q.guaranteed_gpus) for q in load_queues(write(tmp_path, text))] == [
        ("research", 8),
        ("prod", 8),
    ]
