"""The `alnair` command as a person uses it: real processes, a real cluster."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from bus.server import EmbeddedNats
from cli import up, why
from cli.arguments import ArraySpec, array_spec
from cli.client import call
from cli.client import submit as client_submit
from cli.config import ClusterInfo, resolve_nkey
from cli.format import gpus_text, grants_text, queues_table, record_line
from cli.main import Since, UsageError, _job_ids, _spec_from_yaml, build_parser, load_spec, main
from schemas import subjects
from schemas.api import (
    JOB_RESULT,
    JOBS_RESULT,
    STATUS_RESULT,
    CancelRequest,
    ErrorReply,
    JobReply,
    ListJobsRequest,
    QueueStatus,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    WhyReply,
)
from schemas.base import encode
from schemas.errors import ApiError, BrainUnavailable, InvalidMessage
from schemas.events import JobExited, JobStarted, ResizeCompleted
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGpus, NodeGrant
from schemas.state import NodeEventRecorded
from tests.conftest import REPO, eventually, pids_running
from tests.statelog import live_job_record

CLI = [sys.executable, "-m", "cli"]


async def alnair(*args: str, env: dict[str, str], timeout_s: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_up(
    env: dict[str, str], *args: str
) -> tuple[asyncio.subprocess.Process, list[str], asyncio.Future[None]]:
    """`alnair up ARGS`, its output lines as they come, and the task collecting them."""
    up = await asyncio.create_subprocess_exec(
        *CLI,
        "up",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
    )
    output: list[str] = []

    async def read_up() -> None:
        assert up.stdout is not None
        while line := await up.stdout.readline():
            output.append(line.decode())

    return up, output, asyncio.ensure_future(read_up())


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALNAIR_")}
    env["ALNAIR_HOME"] = str(tmp_path / "home")
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def test_errors_name_what_is_wrong(cli_env, nats_server) -> None:
    code, _, err = await alnair("jobs", env=cli_env)
    assert code == 1 and "no cluster found" in err
    code, _, err = await alnair("jobs", "--nats", nats_server.url, env=cli_env)
    assert code == 1 and "no brain is answering" in err
    # While it asks again, it says so, once: ten silent seconds look like a hang.
    assert err.count("asking again for up to 10 s") == 1, err
    code, _, err = await alnair("events", "--nats", nats_server.url, env=cli_env)
    assert code == 1 and "there is no STATE log on this NATS" in err, err
    code, _, err = await alnair("submit", "--nats", nats_server.url, "--", "true", env=cli_env)
    assert code == 1 and "--gpus N is required" in err
    code, _, err = await alnair(
        "submit",
        "--nats",
        nats_server.url,
        "--gpus",
        "1",
        "--env",
        "CUDA_VISIBLE_DEVICES=3",
        "--",
        "true",
        env=cli_env,
    )
    assert code == 1 and "set by Alnair itself" in err


async def test_a_cluster_goes_with_its_alnair_up(cli_env) -> None:
    """`alnair up` killed outright (SIGKILL, an OOM kill) takes its NATS server, brain
    and agents with it: they stop as on Ctrl-C, rather than run on unsupervised beside
    the next `alnair up` of the same home."""
    from agents.processes import all_pids, ended, proc_stat

    up, output, reader = await start_up(cli_env, "--nodes", "1", "--gpus", "sim:2xA100")
    children: set[int] = set()
    try:
        await eventually(lambda: any("ready" in line for line in output), timeout_s=60)
        # proc_stat's fields start at the state; the parent's pid is the next.
        children = {p for p in all_pids() if (f := proc_stat(p)) and f[1] == str(up.pid)}
        assert len(children) == 3, output  # nats-server, the brain, the agent
        up.kill()
        await up.wait()
        await eventually(lambda: all(ended(p) for p in children), timeout_s=60)
    finally:
        if up.returncode is None:
            up.kill()
            await up.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reader.cancel()


async def test_up_submit_watch_and_stop(cli_env, tmp_path) -> None:
    """The README's promise: `alnair up`, submit, see RUNNING then SUCCEEDED, log holds 42."""
    up, output, reader = await start_up(cli_env, "--nodes", "2", "--gpus", "sim:4xA100")
    follower = None
    try:
        await eventually(lambda: any("ready" in line for line in output), timeout_s=60)
        follower = await asyncio.create_subprocess_exec(
            *CLI,
            "events",
            "--follow",
            "--json",
            env=cli_env,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )
        code, out, err = await alnair(
            "submit",
            "--gpus",
            "2",
            "--name",
            "answer",
            "--",
            sys.executable,
            "-c",
            "print(42)",
            env=cli_env,
        )
        assert code == 0, err
        job_id = out.split()[2]

        async def succeeded() -> dict | None:
            code, out, err = await alnair("jobs", "--json", env=cli_env)
            if code != 0 and "no brain is answering" in err:
                # The brain has not subscribed again yet after the NATS server's restart
                # below (seen in CI): asked again.
                return None
            assert code == 0, err
            jobs = {j["job_id"]: j for j in json.loads(out)}
            job = jobs.get(job_id)
            return job if job and job["state"] == "SUCCEEDED" else None

        job = await eventually(succeeded, timeout_s=60, interval_s=0.3)
        assert job["attempts"] == 1 and job["exit_code"] == 0
        assert sum(len(n["gpus"]) for n in job["nodes"]) == 2
        _, out, _ = await alnair("logs", job_id, env=cli_env)
        assert out.strip() == "42"

        states: list[str] = []
        assert follower.stdout is not None
        while "SUCCEEDED" not in states:
            line = await asyncio.wait_for(follower.stdout.readline(), timeout=30)
            assert line, f"`alnair events --follow` ended ({await follower.wait()})"
            record = json.loads(line)
            if record["kind"] == "job" and record["job"]["job_id"] == job_id:
                states.append(record["job"]["state"])
        assert states.index("RUNNING") < states.index("SUCCEEDED")

        code, out, _ = await alnair("events", "--job", job_id, env=cli_env)
        assert "placed" in out and "SUCCEEDED" in out
        code, out, _ = await alnair("nodes", env=cli_env)
        assert out.count("READY") == 2
        code, out, _ = await alnair("cancel", "999", env=cli_env)
        assert code == 1
        # Several at once, like scancel: one unknown id does not stop the others.
        sleepers = [
            (await alnair("submit", "--gpus", "1", "--", "sleep", "600", env=cli_env))[1].split()[2]
            for _ in range(2)
        ]
        code, out, err = await alnair("cancel", sleepers[0], "999", sleepers[1], env=cli_env)
        assert code == 1 and "999" in err
        assert out.splitlines() == [f"job {job} CANCELLED" for job in sleepers]
        code, _, err = await alnair("submit", "--gpus", "9", "--", "true", env=cli_env)
        assert code == 1 and "cluster has 8" in err
        # One key, one job: a resubmission is answered with the job the first created.
        keyed = ("submit", "--gpus", "1", "--idempotency-key", "nightly-7", "--", "true")
        (_, first, _), (_, again, _) = [await alnair(*keyed, env=cli_env) for _ in range(2)]
        assert first.split()[2] == again.split()[2], (first, again)
        empty_key = ("submit", "--gpus", "1", "--idempotency-key", "", "--", "true")
        code, _, err = await alnair(*empty_key, env=cli_env)
        assert code == 1 and "--idempotency-key must be 1 to 128" in err
        code, out, _ = await alnair("status", env=cli_env)
        assert "epoch 1" in out
        gpus = next(line for line in out.splitlines() if line.startswith("gpus:"))
        assert "drained 0, on lost nodes 0" in gpus, out
        assert any(line.startswith("util:") for line in out.splitlines()), out

        # The NATS server, killed, is started again on its port and store, as a brain or
        # an agent would be; the cluster goes on with what it had stored.
        store = Path(cli_env["ALNAIR_HOME"]) / "nats"
        (server,) = pids_running(f"-sd {store}")
        os.kill(int(server), signal.SIGKILL)
        await eventually(
            lambda: any("nats-server is back" in line for line in output), timeout_s=60
        )
        assert any("nats-server exited with -9" in line for line in output)
        # What it had stored is read back (the job above), and a new job runs.
        await eventually(succeeded, timeout_s=60, interval_s=0.5)
        code, out, err = await alnair("submit", "--gpus", "1", "--", "true", env=cli_env)
        assert code == 0, err
        job_id = out.split()[2]
        await eventually(succeeded, timeout_s=60, interval_s=0.5)
    finally:
        if follower is not None and follower.returncode is None:
            follower.kill()
            await follower.wait()
        with contextlib.suppress(ProcessLookupError):
            up.send_signal(signal.SIGINT)
        await asyncio.wait_for(up.wait(), timeout=60)
        await reader
    assert up.returncode == 0, "".join(output[-30:])
    assert not (Path(cli_env["ALNAIR_HOME"]) / "cluster.json").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--elastic-resize-interval", "-1"],
            "the elastic resize interval must be a number >= 0, not -1",
        ),
        (["--elasticity", "bogus"], "unknown elasticity policy 'bogus'; known: linear"),
    ],
)
async def test_brain_refuses_a_bad_elasticity_setting_by_name(
    flags: list[str], words: str, tmp_path: Path
) -> None:
    env = {**os.environ, "ALNAIR_HOME": str(tmp_path)}
    # Checked before it connects anywhere: the address is never dialled.
    code, _, err = await alnair("brain", "--nats", "nats://127.0.0.1:1", *flags, env=env)
    assert code == 1
    assert words in err


@pytest.mark.parametrize(
    ("state", "gpus", "shown"),
    [
        ("PENDING", (), "2[1..4]"),
        ("RUNNING", (0, 1, 2, 3), "4[1..4]"),
        # Ended: the size it held last, not the size it asked to start at.
        ("SUCCEEDED", (0, 1, 2), "3[1..4]"),
    ],
)
def test_an_elastic_jobs_gpus_are_the_size_it_holds_or_held(
    state: str, gpus: tuple[int, ...], shown: str
) -> None:
    spec = JobSpec(command=["true"], gpus=2, elastic=True, min_gpus=1, max_gpus=4)
    grants = (NodeGrant(node="n1", gpus=gpus),) if gpus else ()
    job = JobRecord(
        job_id="1",
        tenant="default",
        spec=spec,
        state=JobState(state),
        submitted_at=0.0,
        grants=grants,
    )
    assert gpus_text(job) == shown


def test_a_node_an_elastic_job_shrank_off_shows_its_idle_worker_host() -> None:
    spec = JobSpec(command=["true"], gpus=2, elastic=True, min_gpus=1, max_gpus=4)
    grants = (NodeGrant(node="n1", gpus=(0, 1)), NodeGrant(node="n2", gpus=()))
    job = JobRecord(
        job_id="1",
        tenant="default",
        spec=spec,
        state=JobState.RUNNING,
        submitted_at=0.0,
        grants=grants,
    )
    assert grants_text(job) == "n1[0,1],n2[idle]"
    assert gpus_text(job) == "2[1..4]"


@pytest.mark.parametrize(
    ("event", "says"),
    [
        (
            ResizeCompleted(
                event_id="e1",
                node="node-1",
                ts=0.0,
                job_id="2",
                command_id="resize-2-1",
                from_size=4,
                to_size=3,
                ok=True,
                duration_s=2.8216699679906014,
                released_gpus=1,
                placement=(NodeGpus(node="node-1", gpus=(0, 1, 2)), NodeGpus(node="n2", gpus=(5,))),
            ),
            "resize_completed: job_id=2 command_id=resize-2-1 from_size=4 to_size=3 ok=True "
            "duration_s=2.82 released_gpus=1 placement=node-1[0,1,2],n2[5]",
        ),
        (
            JobStarted(
                event_id="e2",
                node="node-1",
                ts=0.0,
                job_id="7",
                attempt=1,
                pid=31711,
                gpus=(0, 1),
                log_path="/logs/7-1.log",
            ),
            "job_started: job_id=7 attempt=1 pid=31711 gpus=0,1 log_path=/logs/7-1.log "
            "limits_enforced=True",
        ),
        (
            JobExited(
                event_id="e3", node="n2", ts=0.0, job_id="7", attempt=1, exit_code=0, runtime_s=20.0
            ),
            "job_exited: job_id=7 attempt=1 exit_code=0 stopped=False runtime_s=20",
        ),
    ],
)
def test_events_print_a_node_events_fields_as_an_operator_reads_them(
    event: ResizeCompleted | JobStarted | JobExited, says: str
) -> None:
    # Seen: `duration_s=2.8216699679906014 placement=({'node': 'node-1', 'gpus': (0, 1, 2)},)`.
    record = NodeEventRecorded(record_id="r", ts=0.0, epoch=1, event=event)
    assert record_line(record, 18).endswith(f" event                {says}")


def test_queues_without_a_queues_file_borrow_nothing() -> None:
    # Seen: with no --queues, `alnair queues` showed "default (not listed) ... BORROWED 4":
    # no queue is owed a guarantee there, so nothing held is borrowed or reclaimed.
    def queue(name: str, listed: bool, guaranteed: int = 0) -> QueueStatus:
        return QueueStatus(
            name=name,
            listed=listed,
            job_class="train",
            guaranteed_gpus=guaranteed,
            running_jobs=1,
            running_gpus=4,
            pending_jobs=0,
            pending_gpus=0,
        )

    alone = queues_table([queue("default", listed=False)]).splitlines()[1].split()
    assert alone[-2] == "-"
    beside = queues_table([queue("a", True, 2), queue("default", False)]).splitlines()
    assert [row.split()[-2] for row in beside[1:]] == ["2", "4"]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"gpus": 1, "gpu_milli": 500, "gpu_memory_mib": 10240}, "0.5 GPU (10240 MiB): RUNNING"),
        ({"gpus": 1}, "1 GPU: RUNNING"),
        ({"gpus": 2, "gpu_types": ["A100"]}, "2 GPUs of type A100: RUNNING"),
    ],
)
def test_why_says_what_the_job_asked_for(fields: dict[str, object], says: str) -> None:
    job = JobRecord(
        job_id="2",
        tenant="default",
        spec=JobSpec.model_validate({"command": ["sleep", "30"], **fields}),
        state=JobState.RUNNING,
        submitted_at=0.0,
    )
    header = why.render(WhyReply(job=job, decisions=())).splitlines()[0]
    assert header == f"job 2 (job), queue default, {says}, attempt 0"


def test_why_says_which_jobs_a_job_runs_after_and_how() -> None:
    job = JobRecord(
        job_id="9",
        tenant="default",
        spec=JobSpec(command=("true",), gpus=1, after=("5", "7"), after_any=("8",)),
        state=JobState.PENDING,
        submitted_at=0.0,
    )
    said = why.render(WhyReply(job=job, decisions=()))
    assert "runs once jobs 5, 7 have SUCCEEDED" in said
    assert "runs once job 8 has ended" in said


def test_why_names_a_jobs_array_and_its_limit() -> None:
    spec = JobSpec(command=("true",), gpus=1, array="3f2a", array_index=7, array_limit=4)
    job = JobRecord(
        job_id="9", tenant="default", spec=spec, state=JobState.PENDING, submitted_at=0.0
    )
    said = why.render(WhyReply(job=job, decisions=()))
    assert "index 7 of array 3f2a, at most 4 at once" in said


@pytest.mark.parametrize(
    ("state", "grants", "says"),
    [
        (JobState.PENDING, (), "elastic 1..4 GPUs, sized by the policy"),
        (JobState.RUNNING, ((0, 1, 2), (0,)), "elastic 1..4 GPUs, on 4 now, sized by the policy"),
        (JobState.SUCCEEDED, ((0, 1, 2),), "elastic 1..4 GPUs, on 3 at the end, sized by"),
    ],
)
def test_why_says_how_many_gpus_an_elastic_job_holds_beside_what_it_asked(
    state: JobState, grants: tuple[tuple[int, ...], ...], says: str
) -> None:
    job = JobRecord(
        job_id="4",
        tenant="default",
        spec=JobSpec(command=("sleep", "30"), gpus=2, elastic=True, min_gpus=1, max_gpus=4),
        state=state,
        submitted_at=0.0,
        grants=tuple(NodeGrant(node=f"n{i}", gpus=gpus) for i, gpus in enumerate(grants)),
    )
    lines = why.render(WhyReply(job=job, decisions=())).splitlines()
    assert lines[0].startswith("job 4 (job), queue default, 2 GPUs: ")
    (hints,) = (line for line in lines if "hints:" in line)
    assert says in hints


@pytest.mark.parametrize(
    ("order", "says"),
    [
        ("las", "; LAS band 1"),
        ("gittins", "; LAS band 1"),
        ("fifo", "; queue order fifo (no bands)"),
        ("priority", "; queue order priority (no bands)"),
        ("srtf", "; queue order srtf (no bands)"),
        (None, "; LAS band 1"),  # a brain that does not say its order
        ("an-order-from-a-newer-brain", "; LAS band 1"),
    ],
)
def test_why_speaks_of_a_las_band_only_under_an_order_that_has_bands(
    order: str | None, says: str
) -> None:
    job = JobRecord(
        job_id="3",
        tenant="default",
        spec=JobSpec(command=("sleep", "30"), gpus=1),
        state=JobState.RUNNING,
        submitted_at=0.0,
        service_level=1,
    )
    (service,) = (
        line
        for line in why.render(WhyReply(job=job, decisions=(), order=order)).splitlines()
        if "service:" in line
    )
    assert service.endswith(says)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cancel", ""], "alnair cancel: invalid job_id: String should have at least 1"),
        (["blacklist", "add", ""], "alnair blacklist: invalid uri: "),
        (["jobs", "--limit", "0"], "alnair jobs: invalid limit: "),
        (["inject", "n1", "--gpu", "-1", "--ecc"], "alnair inject: invalid gpu: "),
    ],
)
def test_arguments_a_request_refuses_are_named_not_a_traceback(
    nats_server: EmbeddedNats, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert main([*argv, "--nats", nats_server.url]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_jobs_takes_a_state_as_its_table_prints_it() -> None:
    args = build_parser().parse_args(["jobs", "--state", "PENDING", "--state", "running"])
    assert args.state == ["pending", "running"]


def test_an_event_kind_that_does_not_exist_is_refused_with_the_kinds_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["events", "--kind", "node_dained"])
    err = capsys.readouterr().err
    assert "no kind 'node_dained'; the kinds are " in err and "node_drained" in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--policy", "bogus"], "unknown order policy 'bogus'"),
        (["--elasticity", "wild"], "unknown elasticity policy 'wild'"),
        (["--elastic-payback", "-1"], "elastic payback factor must be a number >= 0, not -1"),
        (["--gpus", "sim:0xH100"], "simulated GPU count must be 1..64, not 0"),
    ],
)
def test_up_refuses_what_its_brain_or_agents_would_before_starting_anything(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    says: str,
) -> None:
    """Not a brain or agents restarting in a loop, and 'only 0 of 4 nodes joined'."""
    home = tmp_path / "home"
    monkeypatch.setenv("ALNAIR_HOME", str(home))
    assert main(["up", *flags]) == 1
    assert says in capsys.readouterr().err
    assert not home.exists()


def test_up_refuses_gpus_nvml_where_nvml_is_not_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: its agent exited at once, and restarted for ever, while `alnair up` said
    "ready ... 4 GPUs (nvml)" from a node an earlier cluster's log remembered."""
    home = tmp_path / "home"
    monkeypatch.setenv("ALNAIR_HOME", str(home))
    monkeypatch.setattr(up, "probe_nvml", lambda: (0, "NVML Shared Library Not Found"))
    assert main(["up", "--gpus", "nvml"]) == 1
    err = capsys.readouterr().err
    assert "--gpus nvml: NVML Shared Library Not Found; simulate GPUs with --gpus sim:" in err
    assert not home.exists()


@pytest.mark.parametrize("flag", ["--nodes", "--brains"])
def test_up_takes_one_node_or_brain_or_more(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", flag, "0"])
    assert "'0' is not a whole number of 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["brain", "up"])
def test_strict_queues_without_queues_is_refused_before_anything_starts(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("ALNAIR_HOME", str(tmp_path))
    elsewhere = ["--nats", "nats://127.0.0.1:1"] if command == "brain" else []
    assert main([command, "--strict-queues", *elsewhere]) == 1
    assert "--strict-queues needs --queues" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    # `alnair events | head` printed a BrokenPipeError traceback once head had its lines.
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,num_gpu,submit_time,duration\n1,1,0,10\n")
    read, write = os.pipe()
    os.close(read)  # nobody will read what it prints
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cli", "sim", "--trace", str(trace), "--cluster", "1x1"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (128 + signal.SIGPIPE, "")


@pytest.mark.parametrize(
    ("tenant", "seed"),
    [
        ("operator", "operator-operator.nk"),
        ("alice", "tenant-alice.nk"),
        ("bob", "tenant-default.nk"),  # no seed of its own here: the client's
        (None, "tenant-default.nk"),
    ],
)
def test_a_local_secure_cluster_lends_each_tenant_its_own_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tenant: str | None, seed: str
) -> None:
    # `alnair events` and `--tenant operator` on `alnair up --secure` were refused with
    # the default tenant's seed until given --nkey keys/operator-operator.nk.
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("operator-operator.nk", "tenant-default.nk", "tenant-alice.nk"):
        (keys / name).write_text("seed")
    client = str(keys / "tenant-default.nk")
    ClusterInfo(("nats://x",), os.getpid(), 0.0, str(tmp_path), client).write(tmp_path)
    monkeypatch.setenv("ALNAIR_HOME", str(tmp_path))
    for variable in ("ALNAIR_NKEY", "ALNAIR_NATS"):
        monkeypatch.delenv(variable, raising=False)
    assert resolve_nkey(None, tenant=tenant) == str(keys / seed)
    assert resolve_nkey("mine.nk", tenant=tenant) == "mine.nk"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["submit", "--gpus", "1", "--gpu-type", ",,", "--", "true"], "--gpu-type names no type"),
        (["events", "--since", "-5"], "'-5' is not a log sequence (1 or more)"),
    ],
)
def test_arguments_that_would_be_dropped_or_misread_are_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code != 0
    assert says in capsys.readouterr().err


def test_up_refuses_a_port_that_is_none(capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--port", "99999"])
    assert "'99999' is not a port (0..65535; 0: a free one)" in capsys.readouterr().err


class _DeadServer:
    """A NATS server of `alnair up` that has exited; `stuck` ones hang in restart."""

    def __init__(self, name: str, *, stuck: bool) -> None:
        self.name, self.port, self.url = name, 0, f"nats://{name}"
        self.stuck, self.up, self.unstick = stuck, False, asyncio.Event()

    def exited(self) -> int | None:
        return None if self.up else -9

    async def restart(self) -> None:
        if self.stuck:
            await self.unstick.wait()
        self.up = True


async def test_up_starts_each_dead_nats_server_again_on_its_own(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two servers of a local cluster exit: one that hangs as it starts holds up no
    other's start."""
    monkeypatch.setattr(up, "NATS_CHECK_S", 0.01)
    stuck, other = _DeadServer("n1", stuck=True), _DeadServer("n2", stuck=False)
    stopping = asyncio.Event()
    supervisor = asyncio.ensure_future(up._supervise_nats((stuck, other), stopping))  # type: ignore[arg-type]
    await eventually(lambda: other.up, timeout_s=30)
    assert not stuck.up  # still starting
    stuck.unstick.set()
    await eventually(lambda: stuck.up, timeout_s=30)
    stopping.set()
    await asyncio.wait_for(supervisor, timeout=30)
    out = capsys.readouterr().out
    assert "n1 exited with -9; restarting in 2s" in out and "n2 is back on nats://n2" in out


def _status() -> StatusReply:
    return StatusReply(
        epoch=1,
        brain_host="h",
        brain_pid=1,
        started_at=0.0,
        policy="fifo",
        jobs_by_state={},
        nodes=0,
        gpus=0,
    )


async def test_a_reply_from_a_newer_brain_names_the_field_and_the_upgrade(connect) -> None:
    """A brain newer than the CLI answers with a field the CLI's schema does not know:
    the CLI names that field (not every field of the error reply it is not) and says
    to upgrade, rather than a validation dump; to a write, that the brain did it."""
    brain, client = await connect("newer-brain"), await connect("older-cli")
    status = _status()
    submitted = JobReply(job=live_job_record(1, gpus=1).job)
    for verb, reply in (("status", status), ("submit", submitted)):
        answer = reply.model_dump(mode="json") | {"added_later": 1}

        async def respond(msg: Msg, answer: dict = answer) -> None:
            await msg.respond(json.dumps(answer).encode())

        await brain.nc.subscribe(subjects.api("team", verb), cb=respond)
    await brain.nc.flush()

    with pytest.raises(InvalidMessage) as refused:
        await call(client, "team", "status", StatusRequest(), STATUS_RESULT)
    said = str(refused.value)
    assert "StatusReply.added_later: Extra inputs are not permitted" in said
    assert "upgrade alnair" in said and "ErrorReply" not in said
    assert "done" not in said  # a read

    spec = JobSpec(command=("true",), gpus=1)
    with pytest.raises(InvalidMessage) as refused:
        await call(client, "team", "submit", SubmitRequest(spec=spec), JOB_RESULT)
    said = str(refused.value)
    assert "JobReply.added_later" in said and "the brain says it was done" in said


async def test_a_command_asks_again_through_a_failover_and_a_write_is_not_repeated(
    connect,
) -> None:
    """No brain subscribed yet (a failover, a NATS restart under the brain): the request
    reached nobody, so any verb asks again until one answers. A brain answering
    `unavailable` (stepping down) is asked again by a read; a write so answered may
    have been stored, and its caller is told."""
    brain, client = await connect("brain"), await connect("cli")
    status = _status()
    asked: list[str] = []

    async def stepping_down_once(msg: Msg) -> None:
        verb = msg.subject.rsplit(".", 1)[1]
        asked.append(verb)
        if asked.count(verb) == 1:
            refused = ErrorReply(code="unavailable", error="brain stepped down")
            await msg.respond(encode(refused))
        else:
            await msg.respond(encode(status if verb == "status" else submitted))

    submitted = JobReply(job=live_job_record(1, gpus=1).job)

    async def subscribe_later() -> None:
        await asyncio.sleep(0.5)
        await brain.nc.subscribe(f"{subjects.PREFIX}.api.team.*", cb=stepping_down_once)
        await brain.nc.flush()

    later = asyncio.ensure_future(subscribe_later())
    reply = await call(client, "team", "status", StatusRequest(), STATUS_RESULT)
    await later
    assert reply == status and asked == ["status", "status"]

    spec = JobSpec(command=("true",), gpus=1)
    with pytest.raises(ApiError) as refused:
        await call(client, "team", "cancel", CancelRequest(job_id="1"), JOB_RESULT)
    assert refused.value.code == "unavailable" and asked.count("cancel") == 1
    # `submit` asks again itself, with its idempotency key.
    assert (await client_submit(client, "team", spec)).job_id == "1"

    with pytest.raises(BrainUnavailable) as nobody:
        await call(client, "other", "jobs", ListJobsRequest(), JOBS_RESULT, failover_s=0.3)
    assert "(asked for 0.3 s)" in str(nobody.value)


def test_events_since_takes_a_sequence_a_time_ago_or_a_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()

    def since(text: str) -> object:
        return parser.parse_args(["events", "--since", text]).since

    assert since("120") == 120
    before = time.time()
    ago = since("10m")
    assert isinstance(ago, Since) and before - 600 <= ago.ts <= time.time() - 600
    before = time.time()
    ago = since("1.5h")
    assert isinstance(ago, Since) and before - 5400 <= ago.ts <= time.time() - 5400
    zoned = since("2026-12-04T13:00:00+00:00")
    assert zoned == Since(1_796_389_200.0)
    with pytest.raises(SystemExit):
        since("yesterday")
    assert "'yesterday' is not a log sequence (1 or more), a time ago such as 10m" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        since("0")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("45s", 45.0),
        ("90m", 5400.0),
        ("2h", 7200.0),
        ("1.5d", 129_600.0),
        ("1:30:00", 5400.0),
        ("30:00", 1800.0),
        ("2-00:00:00", 172_800.0),
    ],
)
def test_submit_time_takes_a_duration_with_a_unit_or_a_clock(text: str, seconds: float) -> None:
    args = build_parser().parse_args(["submit", "--gpus", "1", "--time", text, "--", "true"])
    assert args.time == seconds


@pytest.mark.parametrize("text", ["3600", "0s", "2 hours", "1:2:3:4"])
def test_submit_time_refuses_what_is_not_a_duration(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "--gpus", "1", "--time", text, "--", "true"])
    assert "argument --time: " in capsys.readouterr().err


def test_jobs_to_run_after_come_from_flags_or_a_job_file(tmp_path: Path) -> None:
    argv = ["submit", "--gpus", "1", "--after", "5,7", "--after", "9", "--after-any", "3"]
    spec = load_spec(build_parser().parse_args([*argv, "--", "train.py"]))
    assert (spec.after, spec.after_any) == (("5", "7", "9"), ("3",))
    job = tmp_path / "job.yaml"
    job.write_text("command: train.py\ngpus: 1\nafter: [5, 7]\nafter_any: [3]\n")
    spec = _spec_from_yaml(job, build_parser().parse_args(["submit", str(job)]))
    assert (spec.after, spec.after_any) == (("5", "7"), ("3",))
    with pytest.raises(UsageError, match="after_any: job 3 is in after too"):
        load_spec(build_parser().parse_args([*argv, "--after", "3", "--", "train.py"]))


def test_a_job_file_gives_its_time_limit_as_the_flag_does(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("command: train.py\ngpus: 1\ntime_limit: 90m\n")
    args = build_parser().parse_args(["submit", str(job)])
    assert _spec_from_yaml(job, args).time_limit_s == 5400.0
    job.write_text("command: train.py\ngpus: 1\ntime_limit: soon\n")
    with pytest.raises(UsageError, match="time_limit: 'soon' is not a duration"):
        _spec_from_yaml(job, args)


def test_a_job_file_names_its_array_and_limit(tmp_path: Path) -> None:
    """Jobs submitted one by one (a sweep driver's) share a limit by naming one array."""
    job = tmp_path / "job.yaml"
    job.write_text("command: train.py\ngpus: 1\narray: lr-sweep\narray_limit: 4\n")
    args = build_parser().parse_args(["submit", str(job)])
    spec = _spec_from_yaml(job, args)
    assert (spec.array, spec.array_limit) == ("lr-sweep", 4)
    job.write_text("command: train.py\ngpus: 1\narray_limit: 4\n")
    with pytest.raises(UsageError, match="array_limit: a limit is of an array: give array too"):
        _spec_from_yaml(job, args)


@pytest.mark.parametrize(
    ("code", "exits", "says"),
    [
        ("pass", 0, "SUCCEEDED: exited 0"),
        ("import sys; sys.exit(3)", 3, "FAILED: user error, not retried: exit code 3"),
    ],
)
async def test_submit_wait_returns_when_the_job_ends_with_its_exit_code(
    brain_factory, agent_factory, nats_server, tmp_path: Path, code: str, exits: int, says: str
) -> None:
    brain = await brain_factory()
    await agent_factory("n1", gpus=1)
    await eventually(lambda: len(brain.state.nodes) == 1)
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "ALNAIR_HOME": str(tmp_path)}
    argv = ["submit", "--wait", "--nats", nats_server.url, "--gpus", "1"]
    returned, out, err = await alnair(*argv, "--", sys.executable, "-c", code, env=env)
    assert returned == exits, (out, err)
    first, last = out.splitlines()
    assert first.startswith("submitted job 1 ") and last.startswith(f"job 1 {says}"), out


@pytest.mark.parametrize(
    ("text", "indices", "at_once"),
    [
        ("0-3", (0, 1, 2, 3), None),
        ("0-9:3", (0, 3, 6, 9), None),
        ("1,3,5%2", (1, 3, 5), 2),
        ("7", (7,), None),
        ("0-2,10-11%1", (0, 1, 2, 10, 11), 1),
    ],
)
def test_array_takes_indices_as_sbatch_does(
    text: str, indices: tuple[int, ...], at_once: int | None
) -> None:
    assert array_spec(text) == ArraySpec(indices, at_once)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("3-1", "empty range"),
        ("0-2000000", "at most 1,000,000"),
        ("0-20000", "is at most 10,000 jobs"),
        ("a-b", "indices such as 0-9"),
        ("0-5%0", "N 1 or more"),
        ("1,1", "names an index twice"),
    ],
)
def test_array_refuses_what_is_not_one_and_says_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        array_spec(text)


async def test_an_array_runs_a_job_per_index_at_most_n_at_once(
    brain_factory, agent_factory, nats_server, tmp_path: Path
) -> None:
    """`submit --array 0-3%2 --wait`: four jobs of one array, each seeing its index,
    named NAME[i]; never more than two hold GPUs at once, though the node has four;
    the command exits once all have ended, with the highest exit code."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=4)
    await eventually(lambda: len(brain.state.nodes) == 1)
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "ALNAIR_HOME": str(tmp_path)}
    code = "import os, sys; sys.exit(int(os.environ['ALNAIR_ARRAY_INDEX']) == 3)"
    argv = ["submit", "--array", "0-3%2", "--wait", "--nats", nats_server.url, "--gpus", "1"]
    argv += ["--name", "sweep", "--idempotency-key", "sweep-7", "--", sys.executable, "-c", code]
    returned, out, err = await alnair(*argv, env=env)
    assert returned == 1, (out, err)  # index 3 exited 1
    lines = out.splitlines()
    assert lines[0] == (
        "submitted jobs 1-4 (array sweep-7 of 4, at most 2 at once; 1 GPU each, queue default; "
        "alnair jobs --array sweep-7)"
    )
    jobs = [brain.state.jobs[str(n)] for n in range(1, 5)]
    assert [j.spec.name for j in jobs] == ["sweep[0]", "sweep[1]", "sweep[2]", "sweep[3]"]
    assert [j.spec.array_index for j in jobs] == [0, 1, 2, 3]
    assert {j.spec.array for j in jobs} == {"sweep-7"}
    assert [j.spec.array_limit for j in jobs] == [2] * 4
    assert [j.state for j in jobs] == [JobState.SUCCEEDED] * 3 + [JobState.FAILED]
    runs = [(j.started_at, j.finished_at) for j in jobs]
    for started, _ in runs:
        assert started is not None
        at_once = sum(1 for s, f in runs if s is not None and f is not None and s <= started < f)
        assert at_once <= 2
    # Listed by the name it printed, and only its own jobs.
    argv = ["submit", "--nats", nats_server.url, "--gpus", "1", "--", sys.executable, "-V"]
    returned, out, err = await alnair(*argv, env=env)
    assert returned == 0, (out, err)
    for array, ids in (("sweep-7", ["1", "2", "3", "4"]), ("sweep-8", [])):
        argv = ["jobs", "--array", array, "--json", "--nats", nats_server.url]
        returned, out, err = await alnair(*argv, env=env)
        assert returned == 0, (out, err)
        assert [j["job_id"] for j in json.loads(out)] == ids


async def test_an_array_is_cancelled_by_its_name(
    brain_factory, agent_factory, nats_server, tmp_path: Path
) -> None:
    """`cancel --array NAME`: every job of the array not yet ended, running or waiting
    its turn (`%1`), and no other job, not even another tenant's array of that name (the
    operator, who sees both, is refused); asked again, there is none left, which is no
    error. With neither ids nor an array, it says what to name."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=2)
    await eventually(lambda: len(brain.state.nodes) == 1)
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "ALNAIR_HOME": str(tmp_path)}
    nats = ("--nats", nats_server.url)
    sleeper = ("--gpus", "1", "--", "sleep", "600")
    argv = ["submit", "--array", "0-2%1", "--idempotency-key", "sweep-9", *nats]
    returned, out, err = await alnair(*argv, *sleeper, env=env)
    assert returned == 0, (out, err)
    returned, out, err = await alnair("submit", *nats, *sleeper, env=env)  # job 4
    assert returned == 0, (out, err)
    returned, out, err = await alnair(*argv, "--tenant", "bob", *sleeper, env=env)  # jobs 5-7
    assert returned == 0, (out, err)
    await eventually(lambda: brain.state.jobs["1"].state is JobState.RUNNING)
    returned, out, err = await alnair(
        "cancel", "--array", "sweep-9", "--tenant", "operator", *nats, env=env
    )
    assert returned == 1 and "names jobs of tenants bob, default" in err, (out, err)
    returned, out, err = await alnair("cancel", "--array", "sweep-9", *nats, env=env)
    assert returned == 0, (out, err)
    assert out.splitlines() == [f"job {n} CANCELLED" for n in (1, 2, 3)]
    for job_id in ("4", "5", "6", "7"):
        assert brain.state.jobs[job_id].state is not JobState.CANCELLED
    returned, out, err = await alnair("cancel", "--array", "sweep-9", *nats, env=env)
    assert returned == 0 and out == "", (out, err)
    assert "no job of array sweep-9 is left to cancel" in err
    returned, out, err = await alnair("cancel", *nats, env=env)
    assert returned == 1 and "name the jobs to cancel" in err, (out, err)


async def test_an_arrays_limit_is_changed_while_it_runs(
    brain_factory, agent_factory, nats_server, tmp_path: Path
) -> None:
    """`throttle ARRAY N`: an array of four submitted `%1` on a 4-GPU node runs one at a
    time until its limit is raised to 3, then three; `none` lifts it (all four); lowered
    to 2, the four run on (the limit preempts no one); the journal says each job's
    change, once. An array the tenant does not have is refused, naming it."""
    brain = await brain_factory()
    await agent_factory("n1", gpus=4)
    await eventually(lambda: len(brain.state.nodes) == 1)
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"], "ALNAIR_HOME": str(tmp_path)}
    nats = ("--nats", nats_server.url)
    argv = ["submit", "--array", "0-3%1", "--idempotency-key", "grid", *nats]
    returned, out, err = await alnair(*argv, "--gpus", "1", "--", "sleep", "600", env=env)
    assert returned == 0, (out, err)

    def running() -> int:
        return sum(1 for j in brain.state.jobs.values() if j.state is JobState.RUNNING)

    await eventually(lambda: running() == 1)
    returned, out, err = await alnair("throttle", "grid", "3", *nats, env=env)
    assert returned == 0, (out, err)
    assert out.strip() == "array grid: at most 3 at once (4 jobs not ended: 1-4)"
    await eventually(lambda: running() == 3)
    assert {j.spec.array_limit for j in brain.state.jobs.values()} == {3}
    returned, out, err = await alnair("throttle", "grid", "none", *nats, env=env)
    assert returned == 0 and out.strip().startswith("array grid: no limit"), (out, err)
    await eventually(lambda: running() == 4)
    for _ in range(2):  # the second changes nothing, and journals nothing
        returned, out, err = await alnair("throttle", "grid", "2", *nats, env=env)
        assert returned == 0, (out, err)
    await asyncio.sleep(0.5)
    assert running() == 4
    returned, out, err = await alnair("events", "--job", "2", "--json", *nats, env=env)
    assert returned == 0, (out, err)
    records = [json.loads(line) for line in out.splitlines()]
    said = [r["cause"]["message"] for r in records if r["kind"] == "job"]
    assert [m for m in said if "throttled" in m] == [
        "array grid throttled by tenant default: at most 3 at once (was at most 1 at once)",
        "array grid throttled by tenant default: no limit (was at most 3 at once)",
        "array grid throttled by tenant default: at most 2 at once (was no limit)",
    ]
    returned, out, err = await alnair("throttle", "nope", "2", *nats, env=env)
    assert returned == 1 and "tenant default has no job of array nope left to run" in err
    returned, out, err = await alnair("throttle", "grid", "0", *nats, env=env)
    assert returned == 2 and "'0' is neither a number of jobs" in err, (out, err)


def test_cancel_takes_runs_of_job_ids_as_an_array_is_named() -> None:
    assert _job_ids(["3", "12-15", "14", "7-7"]) == ["3", "12", "13", "14", "15", "7"]
    with pytest.raises(UsageError, match="9-2: a run of job ids is FIRST-LAST"):
        _job_ids(["9-2"])
