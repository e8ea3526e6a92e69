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

from agents.confine import Confined
from agents.launcher import JobProcess, started_as

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
    )


async def test_a_job_owns_its_group_its_cgroup_and_what_it_started_nothing_else() -> None:
    procs: list[Any] = []
    try:
        lead = await spawn()
        # Left the group (a session of its own), still started as the job's.
        escaped = await spawn(ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="2")
        earlier = await spawn(ALNAIR_JOB_ID="7", ALNAIR_ATTEMPT="1")
        other = await spawn(ALNAIR_JOB_ID="8", ALNAIR_ATTEMPT="2")
        in_cgroup = await spawn()  # its environment scrubbed, its cgroup still the job's
        stranger = await spawn()
        procs = [lead, escaped, earlier, other, in_cgroup, stranger]
        gone = 2**22 + 1  # no such process
        pids = [p.pid for p in procs] + [gone]
        assert started_as(escaped.pid) == ("7", 2)
        assert started_as(stranger.pid) is None
        assert attempt(lead, None).owns(pids) == {lead.pid, escaped.pid}
        confined = attempt(lead, {lead.pid, in_cgroup.pid})
        assert confined.owns(pids) == {lead.pid, escaped.pid, in_cgroup.pid}
    finally:
        for p in procs:
            p.kill()
            await p.wait()
