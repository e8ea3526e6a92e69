"""Which GPU processes are a job attempt's (`JobProcess.owns`): what a share's memory is
summed over. Real processes; the confined job's cgroup is stood in for by its pid list."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from agents import launcher as launcher_module
from agents.confine import Confined
from agents.launcher import ExitStatus, JobProcess, Launcher, LaunchRequest, started_as
from tests.conftest import eventually

SLEEP = (sys.executable, "-c", "import time; time.sleep(30)")


async def spawn(**env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *SLEEP, env={**os.environ, **env}, start_new_session=True
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
        node="n1",
    )


async def test_a_job_owns_its_group_its_cgroup_and_what_it_started_nothing_else() -> None:
    procs: list[Any] = []
    try:
        lead = await spawn()
        # Left the group (a session of its own), still started as the job's.
        escaped = await spawn(ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="2", ALNAIR_NODE="n1")
        earlier = await spawn(ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="1", ALNAIR_NODE="n1")
        other = await spawn(ALNAIR_JOB_ID="8", ALNAIR_ATTEMPT="2", ALNAIR_NODE="n1")
        # The same attempt's part on another node (agents of two nodes on one machine).
        elsewhere = await spawn(ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="2", ALNAIR_NODE="n2")
        in_cgroup = await spawn()  # its environment scrubbed, its cgroup still the job's
        stranger = await spawn()
        procs = [lead, escaped, earlier, other, elsewhere, in_cgroup, stranger]
        gone = 2**22 + 1  # no such process
        pids = [p.pid for p in procs] + [gone]
        assert started_as(escaped.pid) == ("7", 2, "n1")
        assert started_as(stranger.pid) is None
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
        assert launcher_module._ended(pid)


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
    until_gone = launcher_module._until_gone

    async def recorded(job: JobProcess, left: set[int], timeout_s: float) -> set[int]:
        waits.append(timeout_s)
        return await until_gone(job, left, timeout_s)

    monkeypatch.setattr(launcher_module, "_until_gone", recorded)
    pid_file = tmp_path / "pid"
    launcher, _ = await launched(tmp_path, STUBBORN_CHILD, pid_file, monkeypatch, 600.0)
    await eventually(pid_file.exists)
    await launcher.stop("7", 1, reason="fenced", grace_s=0.3)
    assert waits and waits[0] <= 0.3
    assert launcher_module._ended(int(pid_file.read_text()))
