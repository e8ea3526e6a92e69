"""An attempt's Launch commands without a server (brain/launches.py): one per node not
yet started, each with what its agent needs to run its part alone."""

from __future__ import annotations

from dataclasses import dataclass

from brain import secrets
from brain.attempts import launch_id
from brain.launches import Launches
from schemas.commands import Launch
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.state import BlacklistEntry, Cause, CauseKind
from schemas.workers import EXEC_SECRET_ENV
from tests.parts import Clock, Shell
from tests.statelog import START_TS

KEY = b"k" * 32


@dataclass(frozen=True)
class Settings:
    launch_ttl_s: float = 60.0
    keep_disconnected_s: float = 300.0


@dataclass(frozen=True)
class Tokens:
    renew_s: float | None = 900.0


async def cluster_key() -> bytes:
    return KEY


def launches(shell: Shell, *, tokens: Tokens | None = None) -> Launches:
    return Launches(
        lambda: shell.state,
        shell,
        Settings(),
        clock=shell.clock,
        cluster_key=cluster_key,
        tokens=tokens,
    )


def running(spec: JobSpec, *grants: NodeGrant, attempt: int = 2) -> JobRecord:
    return JobRecord(
        job_id="7",
        tenant="team",
        spec=spec,
        state=JobState.RUNNING,
        submitted_at=START_TS,
        attempt=attempt,
        grants=grants,
    )


def sent(shell: Shell) -> dict[str, Launch]:
    out = {node: command for node, command in shell.commands if isinstance(command, Launch)}
    assert len(out) == len(shell.commands)
    return out


async def test_each_node_not_yet_started_gets_its_launch() -> None:
    shell = Shell(clock=Clock(START_TS + 5), epoch=3)
    await shell.blacklist_changed(
        {
            uri: BlacklistEntry(uri=uri, reason="r", added_at=START_TS, added_by="op")
            for uri in ("s3://b", "s3://a")
        },
        Cause(kind=CauseKind.BLACKLISTED, message="test"),
    )
    spec = JobSpec(command=("train",), gpus=4, memory_mb_per_gpu=1024, cpus_per_gpu=2)
    job = running(
        spec,
        NodeGrant(node="n1", gpus=(0, 1), pid=100),  # started already
        NodeGrant(node="n2", gpus=(2, 3)),
        NodeGrant(node="n3", gpus=(0,), exited=True),  # its part ended
    )
    await launches(shell).send(job)
    (only,) = sent(shell).items()
    node, launch = only
    assert node == "n2"
    assert launch.command_id == launch_id("7", 2, "n2")
    assert (launch.epoch, launch.attempt, launch.gpus) == (3, 2, (2, 3))
    assert (launch.node_rank, launch.nodes) == (1, ("n1", "n2", "n3"))
    assert launch.expires_at == START_TS + 5 + 60.0
    assert launch.blacklist == ("s3://a", "s3://b")
    assert (launch.memory_mb, launch.cpus) == (2048, 4)  # sized for its 2 GPUs here
    assert launch.tenant == "team" and launch.fence_after_s is None
    assert secrets.JOB_TOKEN_ENV not in launch.env and EXEC_SECRET_ENV not in launch.env


async def test_a_launch_sent_again_has_the_same_command_id() -> None:
    """JetStream drops a re-send that was stored; the agent ignores one it has run."""
    shell = Shell()
    job = running(JobSpec(command=("train",), gpus=1), NodeGrant(node="n1", gpus=(0,)))
    part = launches(shell)
    await part.send(job)
    await part.send(job)
    (first, _), (second, _) = shell.commands
    ids = {command.command_id for _, command in shell.commands}
    assert first == second == "n1" and ids == {launch_id("7", 2, "n1")}


async def test_an_elastic_job_is_told_its_workers_and_the_secret_that_signs_them() -> None:
    shell = Shell()
    spec = JobSpec(command=("train",), gpus=3, elastic=True, min_gpus=1, max_gpus=4)
    job = running(spec, NodeGrant(node="n1", gpus=(0, 1)), NodeGrant(node="n2", gpus=(0,)))
    await launches(shell, tokens=Tokens()).send(job)
    by_node = sent(shell)
    secret = secrets.exec_secret(KEY, "7", 2)
    assert all(launch.env[EXEC_SECRET_ENV] == secret for launch in by_node.values())
    assert all(
        launch.env[secrets.JOB_TOKEN_ENV] == secrets.job_token(KEY, "7", 2)
        and launch.env[secrets.JOB_RENEW_ENV] == "900"
        for launch in by_node.values()
    )
    # The supervisor (rank 0) is told where the other workers run; the others are not.
    assert by_node["n1"].command != by_node["n2"].command
    assert "n2" in " ".join(by_node["n1"].command)
    assert "n2" not in " ".join(by_node["n2"].command)


async def test_a_job_kept_through_a_disconnect_is_fenced_after_the_setting() -> None:
    shell = Shell()
    spec = JobSpec(command=("train",), gpus=1, on_disconnect="keep")
    await launches(shell).send(running(spec, NodeGrant(node="n1", gpus=(0,))))
    assert sent(shell)["n1"].fence_after_s == 300.0
