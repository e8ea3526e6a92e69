"""Job processes an agent leaves behind when it dies, and the next agent that stops them.

An agent killed outright (SIGKILL, an OOM kill, a crash) leaves its jobs' process groups
running: they hold GPUs the next agent of the node knows nothing about, for attempts the
brain will fail and run again elsewhere. So every launch is written down in the agent's
data directory (one small file per attempt, with the process's start time so that a
recycled pid is never mistaken for it) and struck out once the attempt's exit has been
stored in JetStream. A new agent stops whatever is still written down: its processes
cannot be followed (they are not its children, their exit status is lost), and the
brain has already been told, by the new agent instance in the heartbeat, that they are
gone (brain/liveness.py `agent_restarted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

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


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3), or None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    return stat.rpartition(")")[2].split()


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None if unknown."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


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

    def record(self, job_id: str, attempt: int, pid: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(job_id, attempt)
        tmp = path.with_suffix(".tmp")
        entry = {"job_id": job_id, "attempt": attempt, "pid": pid, "started": process_start(pid)}
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
                    )
                )
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("unreadable process ledger entry %s (%r); dropping it", path, error)
                path.unlink(missing_ok=True)
        return found


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def stop_leftovers(leftovers: list[Leftover], *, grace_s: float, node: str) -> list[Leftover]:
    """Stop the process groups an earlier agent left running (SIGTERM, then SIGKILL
    after `grace_s`) and strike them from the ledger. Take `leftovers` from the ledger
    before launching anything. Returns those that were still running."""
    running: list[Leftover] = []
    for leftover in leftovers:
        if _alive(leftover):
            running.append(leftover)
            log.warning(
                "%s: job %s attempt %d (pid %d) outlived the agent that started it; stopping it",
                node,
                leftover.job_id,
                leftover.attempt,
                leftover.pid,
            )
            _signal_group(leftover.pid, signal.SIGTERM)
        else:
            leftover.path.unlink(missing_ok=True)
    deadline = time.monotonic() + grace_s
    # Not our children: nothing to wait on but their pids, so poll them.
    while time.monotonic() < deadline:
        if not any(_alive(x) for x in running):
            break
        await asyncio.sleep(0.1)
    for leftover in running:
        if _alive(leftover):
            _signal_group(leftover.pid, signal.SIGKILL)
        leftover.path.unlink(missing_ok=True)
    return running
