"""Which processes are a job attempt's (`JobProcess.owns`): what a share's memory is
summed over, and what is ended with it, also after its agent crashed (agents/orphans.py).
Real processes; a confined job's cgroup is stood in for by its pid list, but for the
crash case, which makes a real one (as root)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agents import cgroups, processes
from agents import launcher as launcher_module
from agents.confine import Confined, Confinement
from agents.launcher import ExitStatus, JobProcess, Launcher, LaunchRequest
from agents.orphans import ProcessLedger, stop_leftovers
from agents.processes import ended, launched_as
from cli.confine import agent_confinement
from schemas.jobs import LAUNCH_ID_ENV
from tests.conftest import eventually

SLEEP = (sys.executable, "-c", "import time; time.sleep(30)")


async def spawn(**env: str) -> asyncio.subprocess.Process:
    # Not the token of a launch these tests may themselves run in.
    inherited = {k: v for k, v in os.environ.items() if k != LAUNCH_ID_ENV}
    return await asyncio.create_subprocess_exec(
        *SLEEP, env={**inherited, **env}, start_new_session=True
    )


def attempt(process: asyncio.subprocess.Process, cgroup_pids: set[int] | None) -> JobProcess:
    confined = None
    if cgroup_pids is not None:
        confined = cast(Confined, SimpleNamespace(cgroup=SimpleNamespace(pids=lambda: cgroup_pids)))
    return JobProcess(
        job_id="7",
        attempt=2,
        gpus=(0,),
        process=process,
        log_path=Path("/dev/null"),
        started_at=time.time(),
        started_monotonic=time.monotonic(),
        confined=confined,
        launch_id="L7",
    )


async def test_a_job_owns_its_group_its_cgroup_and_what_it_started_nothing_else() -> None:
    procs: list[Any] = []
    try:
        lead = await spawn()
        # Left the group (a session of its own), still started with the launch's token.
        escaped = await spawn(**{LAUNCH_ID_ENV: "L7"})
        # Another launch: an earlier attempt, another job, the same attempt's part on
        # another node (agents of two nodes on one machine), or another cluster's job 7
        # attempt 2 on a node of the same name; named as this one in all but the token.
        other = await spawn(
            ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="2", ALNAIR_NODE="n1", **{LAUNCH_ID_ENV: "L8"}
        )
        in_cgroup = await spawn()  # its environment scrubbed, its cgroup still the job's
        stranger = await spawn()
        procs = [lead, escaped, other, in_cgroup, stranger]
        gone = 2**22 + 1  # no such process
        pids = [p.pid for p in procs] + [gone]
        assert launched_as(escaped.pid) == "L7"
        assert launched_as(stranger.pid) is None
        assert attempt(lead, None).owns(pids) == {lead.pid, escaped.pid}
        confined = attempt(lead, {lead.pid, in_cgroup.pid})
        assert confined.owns(pids) == {lead.pid, escaped.pid, in_cgroup.pid}
    finally:
        for p in procs:
            p.kill()
            await p.wait()


# Starts a child in its group that ignores SIGTERM, and one in a session of its own, writes
# their pids, and exits at once: an unconfined job that leaves processes behind.
LEAVES_TWO = """
import os, signal, subprocess, sys, time
stay = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
group = subprocess.Popen([sys.executable, "-c", stay])
session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                           start_new_session=True)
time.sleep(0.3)  # the first has set its handler
open(sys.argv[1], "w").write(f"{group.pid} {session.pid}")
"""


async def launched(
    tmp_path: Path, program: str, out: Path, monkeypatch: Any, leftover_grace_s: float
) -> tuple[Launcher, list[JobProcess]]:
    """An unconfined launcher, its leftovers given `leftover_grace_s`, that has started
    `program OUT` as job 7's first attempt on n1; and the attempts it has seen exit."""
    monkeypatch.setattr(launcher_module, "LEFTOVER_GRACE_S", leftover_grace_s)
    exits: list[JobProcess] = []

    async def on_exit(job: JobProcess, status: ExitStatus) -> None:
        exits.append(job)

    launcher = Launcher(tmp_path / "logs", on_exit)
    request = LaunchRequest(
        job_id="7",
        attempt=1,
        gpus=(0,),
        command=(sys.executable, "-c", program, str(out)),
        env={"ALNAIR_JOB_ID": "7", "ALNAIR_ATTEMPT": "1", "ALNAIR_NODE": "n1"},
        cwd=None,
    )
    await launcher.launch(request)
    return launcher, exits


async def test_what_an_unconfined_job_leaves_running_ends_before_its_exit_is_reported(
    tmp_path: Path, monkeypatch: Any
) -> None:
    pids = tmp_path / "pids"
    launcher, exits = await launched(tmp_path, LEAVES_TWO, pids, monkeypatch, 0.5)
    await launcher.wait_idle()
    assert len(exits) == 1
    for pid in map(int, pids.read_text().split()):
        # Gone, or a zombie until init reaps it: nothing holds its GPU any more.
        assert ended(pid)


# Starts a child in a session of its own that ignores SIGTERM (the stop's SIGKILL to the
# job's group does not reach it), says so, and waits to be stopped.
STUBBORN_CHILD = """
import subprocess, sys, time
stay = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
child = subprocess.Popen([sys.executable, "-c", stay], start_new_session=True)
time.sleep(0.3)  # it has set its handler
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


async def test_a_stop_s_grace_bounds_what_the_job_left_running(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # A fenced node's jobs must be gone within the fence's grace, leftovers too: they
    # are waited for no longer than what is left of the stop's 0.3 s, not the 600 s
    # leftovers are given otherwise.
    waits: list[float] = []
    until_gone = processes.until_gone

    async def recorded(find: Any, left: set[int], timeout_s: float) -> set[int]:
        waits.append(timeout_s)
        return await until_gone(find, left, timeout_s)

    monkeypatch.setattr(processes, "until_gone", recorded)
    pid_file = tmp_path / "pid"
    launcher, _ = await launched(tmp_path, STUBBORN_CHILD, pid_file, monkeypatch, 600.0)
    await eventually(pid_file.exists)
    await launcher.stop("7", 1, reason="fenced", grace_s=0.3)
    assert waits and waits[0] <= 0.3
    assert ended(int(pid_file.read_text()))


async def test_a_crashed_agent_s_leftovers_are_found_by_their_launch_token(
    tmp_path: Path,
) -> None:
    """A restarted agent ends what its predecessor's attempts left running: a process
    that left the group of an attempt whose first process has ended (found by the
    launch's token alone), and a live first process (its group); nothing of a launch
    it did not write down, and nothing by a recycled pid."""
    procs: list[Any] = []
    try:
        ended_first = await asyncio.create_subprocess_exec("true")
        await ended_first.wait()
        escaped = await spawn(**{LAUNCH_ID_ENV: "L1"})
        lead = await spawn()  # its token scrubbed: found as its group's leader
        stranger = await spawn(**{LAUNCH_ID_ENV: "L9"})
        recycled = await spawn()  # the pid of an entry whose process started earlier
        procs = [escaped, lead, stranger, recycled]
        ledger = ProcessLedger(tmp_path / "processes")
        ledger.record("1", 1, ended_first.pid, "L1")
        ledger.record("2", 1, lead.pid, "L2")
        ledger.record("3", 1, recycled.pid, None)  # an entry from before launch tokens
        entry = ledger.directory / "3-1.json"
        written = json.loads(entry.read_text())
        entry.write_text(json.dumps({**written, "started": written["started"] - 1}))

        running = await stop_leftovers(ledger.leftovers(), grace_s=0.5, node="n1")

        assert sorted(x.job_id for x in running) == ["1", "2"]
        assert ended(escaped.pid) and ended(lead.pid)
        assert not ended(stranger.pid) and not ended(recycled.pid)
        assert ledger.leftovers() == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
            await p.wait()


async def test_each_launch_has_a_token_of_its_own_that_the_job_cannot_set(
    tmp_path: Path,
) -> None:
    async def on_exit(job: JobProcess, status: ExitStatus) -> None:
        pass

    launcher = Launcher(tmp_path / "logs", on_exit)
    seen: list[tuple[str | None, str]] = []
    for number in (1, 2):
        out = tmp_path / f"token-{number}"
        show = f"import os; open({str(out)!r}, 'w').write(os.environ[{LAUNCH_ID_ENV!r}])"
        job = await launcher.launch(
            LaunchRequest(
                job_id="7",
                attempt=number,
                gpus=(0,),
                command=(sys.executable, "-c", show),
                env={LAUNCH_ID_ENV: "chosen by the job"},
                cwd=None,
            )
        )
        await launcher.wait_idle()
        seen.append((job.launch_id, out.read_text()))
    assert all(token == launch_id for launch_id, token in seen)
    tokens = {token for _, token in seen}
    assert len(tokens) == 2 and all(len(t) == 32 for t in tokens)


async def test_a_crashed_agent_s_confined_leftovers_go_with_their_cgroup(tmp_path: Path) -> None:
    """A confined attempt's process that left its group and scrubbed its environment
    carries no token, but cannot leave its cgroup: a restarted agent ends it there and
    removes the cgroup. Real cgroups: needs root."""
    version = cgroups.detect()
    if os.geteuid() != 0 or version is None:
        pytest.skip("needs root and a cgroup hierarchy")
    tree = cgroups.Cgroups(version, parent=f"alnair-test-{os.getpid()}", node="n1")
    group = tree.create("7-1", cgroups.Limits(256 << 20, 1.0, 100, devices=None))
    escaped = await asyncio.create_subprocess_exec(*SLEEP, env={}, start_new_session=True)
    try:
        for procs in group.procs_files:
            procs.write_text(str(escaped.pid))
        ended_first = await asyncio.create_subprocess_exec("true")
        await ended_first.wait()
        ledger = ProcessLedger(tmp_path / "processes")
        ledger.record("7", 1, ended_first.pid, "L7")

        running = await stop_leftovers(ledger.leftovers(), grace_s=0.5, node="n1", cgroups=tree)

        assert [x.job_id for x in running] == ["7"]
        assert ended(escaped.pid)
        assert tree.leftover("7-1") is None and ledger.leftovers() == []
    finally:
        if escaped.returncode is None:
            escaped.kill()
        await escaped.wait()
        await group.remove()
        tree.remove_empty()


def _confinement_of(tmp_path: Path, home: str, parent: str) -> Confinement:
    """What `alnair agent --tenant-users ... --node node-1` of the cluster at `home`
    confines with (its data directory is the default, under that home)."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  a: {user: nobody}\n")
    args = argparse.Namespace(
        tenant_users=str(tenants),
        job_tls_issuer=None,
        gpu_device_dir=None,
        gpus="sim:1xA100",
        job_runtime_dir=None,
        cgroup_parent=parent,
        job_nkey=None,
    )
    confinement = agent_confinement(args, "node-1", tmp_path / home / "agents" / "node-1")
    assert confinement is not None
    return confinement


def test_two_clusters_agents_named_alike_keep_their_jobs_apart(tmp_path: Path) -> None:
    """Node names are unique within a cluster only: two clusters' node-1 agents on one
    machine keep their jobs' private directories and cgroups apart; an agent restarted
    on the same data directory finds its predecessor's."""
    a = _confinement_of(tmp_path, "a", "alnair")
    b = _confinement_of(tmp_path, "b", "alnair")
    restarted = _confinement_of(tmp_path, "a", "alnair")
    assert a.runtime_root != b.runtime_root
    assert a.runtime_root == restarted.runtime_root
    assert a.runtime_root.parent == Path(tempfile.gettempdir()) / "alnair"
    assert a.runtime_root.name.startswith("node-1.")
    if a.cgroups is not None and b.cgroups is not None and restarted.cgroups is not None:
        assert a.cgroups.node == a.runtime_root.name == restarted.cgroups.node
        assert b.cgroups.node == b.runtime_root.name


async def test_one_clusters_attempt_ending_leaves_anothers_of_the_same_name(
    tmp_path: Path,
) -> None:
    """Job 1 attempt 1 on node-1 of two clusters at once: the second's cgroup is not the
    first's, so its end (which kills what is left in its cgroup) leaves the first's
    process running. Real cgroups: needs root."""
    if os.geteuid() != 0 or cgroups.detect() is None:
        pytest.skip("needs root and a cgroup hierarchy")
    parent = f"alnair-test-{os.getpid()}"
    trees = [_confinement_of(tmp_path, home, parent).cgroups for home in ("a", "b")]
    assert trees[0] is not None and trees[1] is not None
    limits = cgroups.Limits(256 << 20, 1.0, 100, devices=None)
    first = trees[0].create("1-1", limits)
    job = await asyncio.create_subprocess_exec(*SLEEP, start_new_session=True)
    try:
        for procs in first.procs_files:
            procs.write_text(str(job.pid))
        second = trees[1].create("1-1", limits)
        await second.remove()
        assert not ended(job.pid)
        assert job.pid in first.pids()
        assert trees[1].leftover("1-1") is None and trees[0].leftover("1-1") is not None
    finally:
        if job.returncode is None:
            job.kill()
        await job.wait()
        await first.remove()
        for tree in trees:
            tree.remove_empty()


async def test_a_share_whose_memory_limit_does_not_fit_beside_the_others_waits(
    tmp_path: Path,
) -> None:
    """Shares run together on a GPU while their shares and their memory limits fit it;
    one whose limit would promise more memory than the GPU has beside the others is
    refused (retryably) rather than started: the brain placed it for after a share
    that is still there."""

    async def on_exit(job: JobProcess, status: ExitStatus) -> None:
        pass

    launcher = Launcher(tmp_path / "logs", on_exit, gpu_memory_mib={0: 16_384}.get)

    def share(job_id: str, milli: int, memory_mib: int) -> LaunchRequest:
        return LaunchRequest(
            job_id=job_id,
            attempt=1,
            gpus=(0,),
            command=SLEEP,
            env={"ALNAIR_JOB_ID": job_id, "ALNAIR_ATTEMPT": "1", "ALNAIR_NODE": "n1"},
            cwd=None,
            gpu_milli=milli,
            gpu_memory_mib=memory_mib,
        )

    try:
        await launcher.launch(share("1", 500, 10_000))
        with pytest.raises(launcher_module.LaunchError) as refused:
            await launcher.launch(share("2", 400, 8_000), gpu_wait_s=0.1)
        assert refused.value.retryable and "held by job 1 attempt 1" in str(refused.value)
        await launcher.launch(share("3", 400, 6_000))
        assert sorted(p.job_id for p in launcher.running()) == ["1", "3"]
    finally:
        await launcher.stop_all(reason="test over", grace_s=5.0)
        await launcher.wait_idle()


@pytest.mark.parametrize(
    ("command", "env"),
    [
        pytest.param(("true", "a\0b"), {}, id="argument"),
        pytest.param(("true",), {"A": "x\0y"}, id="environment"),
    ],
)
async def test_what_the_kernel_cannot_start_fails_the_launch_for_good(
    tmp_path: Path, command: tuple[str, ...], env: dict[str, str]
) -> None:
    """A NUL byte no process can be started with (a record from before the API
    refused it): the launch fails, not retryable, rather than the agent's handler."""

    async def on_exit(job: JobProcess, status: ExitStatus) -> None:
        raise AssertionError("nothing ran")

    launcher = Launcher(tmp_path / "logs", on_exit)
    request = LaunchRequest(job_id="7", attempt=1, gpus=(0,), command=command, env=env, cwd=None)
    with pytest.raises(launcher_module.LaunchError) as refused:
        await launcher.launch(request)
    assert not refused.value.retryable
    assert "cannot start 'true': embedded null byte" in refused.value.reason
