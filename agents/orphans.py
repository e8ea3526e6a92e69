"""Job processes an agent leaves behind when it dies, and the next agent that stops them.

An agent killed outright (SIGKILL, an OOM kill, a crash) leaves its jobs' processes
running: they hold GPUs the next agent of the node knows nothing about, for attempts the
brain will fail and run again elsewhere. So every launch is written down in the agent's
data directory (one small file per attempt: its first process, with that process's start
time so that a recycled pid is never mistaken for it, and its launch token) and struck
out once the attempt's exit has been stored in JetStream. A new agent stops whatever is
still written down: the first process's group while that process lives, every process
started with the launch's token (agents/processes.py), also those that left the group
and those whose first process has already ended, and, for a confined attempt, whatever
is in its cgroup, whose directories go too. They cannot be followed (they are
not its children, their exit status is lost), and the brain has already been told, by
the new agent instance in the heartbeat, that they are gone (brain/liveness.py
`agent_restarted`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from agents import processes
from agents.cgroups import Cgroups, JobCgroup
from agents.processes import ended, proc_stat, process_start

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Leftover:
    job_id: str
    attempt: int
    pid: int
    # The process's start time in clock ticks since boot (/proc/PID/stat), None where
    # there is no /proc: then the pid alone identifies it.
    started: int | None
    path: Path
    # Its launch token (`ALNAIR_LAUNCH_ID`); None in an entry written before there was one.
    launch_id: str | None = None


def _alive(leftover: Leftover) -> bool:
    try:
        os.kill(leftover.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: the pid was recycled
    if leftover.started is None:
        return True
    fields = proc_stat(leftover.pid)
    if fields is None or fields[0] == "Z":
        return False  # gone, or a zombie waiting to be reaped
    return len(fields) > 19 and int(fields[19]) == leftover.started


class ProcessLedger:
    """The attempts whose processes this node's agents started and has not yet seen
    reported ended."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, job_id: str, attempt: int) -> Path:
        return self.directory / f"{job_id}-{attempt}.json"

    def record(self, job_id: str, attempt: int, pid: int, launch_id: str | None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(job_id, attempt)
        tmp = path.with_suffix(".tmp")
        entry = {
            "job_id": job_id,
            "attempt": attempt,
            "pid": pid,
            "started": process_start(pid),
            "launch_id": launch_id,
        }
        tmp.write_text(json.dumps(entry))
        tmp.replace(path)

    def forget(self, job_id: str, attempt: int) -> None:
        self._path(job_id, attempt).unlink(missing_ok=True)

    def leftovers(self) -> list[Leftover]:
        found: list[Leftover] = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                found.append(
                    Leftover(
                        job_id=str(data["job_id"]),
                        attempt=int(data["attempt"]),
                        pid=int(data["pid"]),
                        started=None if data.get("started") is None else int(data["started"]),
                        path=path,
                        launch_id=None if data.get("launch_id") is None else str(data["launch_id"]),
                    )
                )
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("unreadable process ledger entry %s (%r); dropping it", path, error)
                path.unlink(missing_ok=True)
        return found


async def stop_leftovers(
    leftovers: list[Leftover], *, grace_s: float, node: str, cgroups: Cgroups | None = None
) -> list[Leftover]:
    """Stop what an earlier agent's attempts left running (SIGTERM, then SIGKILL after
    `grace_s`), remove the cgroups of those that were confined (`cgroups`: where this
    node's agent makes them), and strike them from the ledger. Take `leftovers` from the
    ledger before launching anything. Returns those that still had processes running."""
    launches = {x.launch_id for x in leftovers if x.launch_id is not None}
    # An attempt's cgroup is named for it alone: a retry is another attempt.
    confined: dict[Leftover, JobCgroup] = {}
    for x in leftovers:
        cgroup = cgroups.leftover(f"{x.job_id}-{x.attempt}") if cgroups is not None else None
        if cgroup is not None:
            confined[x] = cgroup

    def find(among: Collection[int] | None) -> dict[Leftover, set[int]]:
        pids = [pid for pid in (processes.all_pids() if among is None else among) if not ended(pid)]
        tokens = processes.of_launches(launches, pids)
        found: dict[Leftover, set[int]] = {}
        for leftover in leftovers:
            mine = set(tokens.get(leftover.launch_id or "", ()))
            if _alive(leftover):
                # Its group only while its first process lives: a pid, and so a group id,
                # of a process that is gone may be another's by now.
                mine |= processes.in_group(leftover.pid, pids)
            cgroup = confined.get(leftover)
            if cgroup is not None:
                # Its user cannot leave it, whatever it does to its group or environment.
                mine |= cgroup.pids() & set(pids)
            if mine:
                found[leftover] = mine
        return found

    running = await asyncio.to_thread(find, None)
    for leftover, pids in running.items():
        log.warning(
            "%s: job %s attempt %d outlived the agent that started it (%d %s; its first "
            "was pid %d); stopping it",
            node,
            leftover.job_id,
            leftover.attempt,
            len(pids),
            "process" if len(pids) == 1 else "processes",
            leftover.pid,
        )

    def still(among: Collection[int] | None) -> set[int]:
        return set().union(*find(among).values())

    left = await processes.end(still, set().union(*running.values()), grace_s=grace_s)
    if left:
        log.error("%s: %d processes of a crashed agent's jobs outlived SIGKILL", node, len(left))
    for cgroup in confined.values():
        await cgroup.remove(wait_s=processes.KILL_WAIT_S)
    for leftover in leftovers:
        leftover.path.unlink(missing_ok=True)
    return list(running)
