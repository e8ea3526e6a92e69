"""Which processes on this node are a launch's, and ending them.

Every launch gets a random token in its environment (`ALNAIR_LAUNCH_ID`, set by the
launcher last, so a job's own settings cannot override it). What the launch's
processes exec keeps it, also a process that left the job's process group (`setsid`, a
daemonising child), and no other launch has it: not an earlier attempt, not the same
attempt's part on another node (`workloads/hvdrun.py` keeps Horovod from passing it to
remote workers, whose worker host has its own), not another cluster's job of the same
number whose agent shares the machine. A confined job's environment is readable only
by its own user (and root), so another tenant cannot learn the token to have its
processes charged to, or ended with, someone else's job. A process that both leaves
the group and execs with a scrubbed environment is not found: only a cgroup holds it.

Ending processes that are not the caller's children is polling: SIGTERM, wait for them
to go, SIGKILL to what is left, wait for the kernel to tear those down (`end`). Each poll
looks again at the processes it is waiting for, not at every process on the node, and
asks again whose they are: a pid freed and taken by another process is not the
launch's. The launcher does it for what an attempt left running when its first process
ended; the process ledger (agents/orphans.py) for what a crashed agent's attempts left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Final, TypeAlias

from schemas.jobs import LAUNCH_ID_ENV

# A killed process still runs until the kernel has torn it down (a large CUDA context
# takes a while): how long `end` waits for that before calling it outlived.
KILL_WAIT_S: Final = 5.0
POLL_S: Final = 0.1

_LAUNCH_ID_PREFIX: Final = LAUNCH_ID_ENV.encode() + b"="

# Which of these processes (or, given None, of all) are still running and still those
# being ended.
Find: TypeAlias = Callable[[Collection[int] | None], set[int]]


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


def ended(pid: int) -> bool:
    """Gone, or a zombie: that holds nothing, and its reaper may never come (in a
    container, pid 1 may not reap)."""
    fields = proc_stat(pid)
    return fields is None or fields[0] == "Z"


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def launched_as(pid: int) -> str | None:
    """The launch a process belongs to (`ALNAIR_LAUNCH_ID` in its environment as
    exec'd), if any and if it is ours to read."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_LAUNCH_ID_PREFIX):
            return entry[len(_LAUNCH_ID_PREFIX) :].decode(errors="replace")
    return None


def of_launches(
    launch_ids: Collection[str], pids: Iterable[int] | None = None
) -> dict[str, set[int]]:
    """The processes (of `pids`, or of all) of each of these launches that has any."""
    found: dict[str, set[int]] = {}
    if not launch_ids:
        return found
    for pid in all_pids() if pids is None else pids:
        launch = launched_as(pid)
        if launch is not None and launch in launch_ids:
            found.setdefault(launch, set()).add(pid)
    return found


def in_group(leader: int, pids: Iterable[int] | None = None) -> set[int]:
    """Which processes (of `pids`, or of all) are in process group `leader`."""
    found: set[int] = set()
    for pid in all_pids() if pids is None else pids:
        try:
            if os.getpgid(pid) == leader:
                found.add(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def signal_each(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def until_gone(find: Find, left: set[int], timeout_s: float) -> set[int]:
    """What `find` still finds of `left` once that is nothing, or `timeout_s` has
    passed."""
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        left = await asyncio.to_thread(find, left)
    return left


async def end(
    find: Find, left: set[int], *, grace_s: float, kill_wait_s: float = KILL_WAIT_S
) -> set[int]:
    """End the processes `find` finds (`left`, found already): SIGTERM, then, after up
    to `grace_s`, SIGKILL to what `find` finds then among all processes (what the first
    ones started meanwhile too), then wait up to `kill_wait_s` for those to go. `find`
    runs in a thread (it reads /proc) and must skip what has `ended`. Returns what
    outlived SIGKILL."""
    if not left:
        return left
    signal_each(left, signal.SIGTERM)
    await until_gone(find, left, grace_s)
    left = await asyncio.to_thread(find, None)
    signal_each(left, signal.SIGKILL)
    return await until_gone(find, left, kill_wait_s)
