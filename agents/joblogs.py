"""Job logs use bounded disk on their node: an attempt's log keeps its newest part, and
the logs of attempts that ended long ago are removed.

An attempt writes its log (`<data_dir>/logs/<job>/attempt-<n>.log`) through a
descriptor the launcher opened for appending; nothing here touches what it writes. Once
a log holds more than `max_bytes` on disk, its oldest part is given back to the
filesystem by punching a hole in the file (fallocate(2), `FALLOC_FL_PUNCH_HOLE`), so it
keeps at least the newest half of `max_bytes`. The file keeps its length, every offset
keeps its meaning, the job's appends go on at its end, and nothing is copied; readers
find where the kept part begins with `lseek(SEEK_DATA)` (`data_start`), skip the hole
and say what was dropped (agents/logserve.py). A filesystem that cannot punch holes is
said once, and its logs grow as the job writes them.

A log whose attempt no longer runs here, last written more than `keep_s` ago, is
removed, and its job's directory with the last of them; and while all the logs together
hold more than `max_total` on disk, those of ended attempts are removed, the least
recently written first (as journald keeps its files within `SystemMaxUse`). Running
attempts' logs are never removed: each is held to `max_bytes`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# What a log may hold on disk by default, and how long one is kept after its attempt.
DEFAULT_MAX_MIB: Final = 1024
DEFAULT_KEEP_DAYS: Final = 30.0
# What all the logs may hold together by default: this share of their filesystem.
DEFAULT_MAX_TOTAL_SHARE: Final = 0.10
# How often the logs of ended attempts are looked over.
PRUNE_EVERY_S: Final = 300.0


def filesystem_bytes(path: Path) -> int:
    """The size of the filesystem `path` is on (or will be: its nearest existing
    ancestor's)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_blocks * stats.f_frsize


# <linux/falloc.h>
_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's fallocate(2), where there is one (Linux): looked up at first use."""
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def punch_head(fd: int, length: int) -> None:
    """Give the first `length` bytes of the file back to the filesystem; they read as
    zeros and `data_start` skips them. OSError (EOPNOTSUPP: the filesystem cannot)."""
    fallocate = _fallocate()
    if fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "no fallocate(2) on this system")
    if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def data_start(fd: int, offset: int) -> int:
    """The first offset at or after `offset` that holds data: past the hole a capped
    log begins with (the file's size if there is nothing after it). `offset` itself
    where the filesystem does not say (no SEEK_DATA)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as error:
        if error.errno == errno.ENXIO:  # nothing but a hole from there to the end
            return max(offset, os.fstat(fd).st_size)
        return offset


def dropped_note(dropped: int, node: str) -> str:
    """What a reader of a capped log sees where its dropped part was."""
    return (
        f"[alnair: the first {dropped} bytes of this log were dropped on node {node} to "
        "bound its disk use (`alnair agent --job-log-max`); what follows is its newest "
        "part]\n"
    )


@dataclass
class LogKeeper:
    """Keeps one agent's job logs within bounds: `cap` the running attempts' logs (each
    second), `prune` the ended ones (each `PRUNE_EVERY_S`). `max_bytes` None: logs grow
    as they are written; `keep_s` None: kept for good; `max_total` None: no bound on
    all of them together."""

    node: str
    log_dir: Path
    max_bytes: int | None = DEFAULT_MAX_MIB * 1024 * 1024
    keep_s: float | None = DEFAULT_KEEP_DAYS * 86_400
    max_total: int | None = None
    clock: Callable[[], float] = time.time
    _unpunchable: bool = field(default=False, init=False)
    _pruned_at: float | None = field(default=None, init=False)

    def cap(self, paths: Collection[Path]) -> int:
        """Punch out the oldest part of each log over `max_bytes` on disk; the bytes
        given back."""
        if self.max_bytes is None or self._unpunchable:
            return 0
        freed = 0
        for path in paths:
            try:
                freed += self._cap(path, self.max_bytes)
            except FileNotFoundError:
                continue
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("%s: cannot bound the log %s: %s", self.node, path, error)
                    continue
                self._unpunchable = True
                log.warning(
                    "%s: the filesystem of %s cannot punch holes (%s): job logs here grow "
                    "as their jobs write them (--job-log-max is not applied)",
                    self.node,
                    self.log_dir,
                    error.strerror,
                )
                return freed
        return freed

    def _cap(self, path: Path, max_bytes: int) -> int:
        status = path.stat()
        used = status.st_blocks * 512
        if used <= max_bytes:
            return 0
        block = status.st_blksize or 4096
        # Keep the newest half, cut at a block: a hole ends where data begins.
        cut = (status.st_size - max_bytes // 2) // block * block
        if cut <= 0:
            return 0
        with path.open("r+b") as log_file:
            punch_head(log_file.fileno(), cut)
            after = os.fstat(log_file.fileno()).st_blocks * 512
        log.info(
            "%s: %s/%s held %d MiB: dropped its first %d MiB, kept the newest %d MiB",
            self.node,
            path.parent.name,
            path.name,
            used >> 20,
            cut >> 20,
            after >> 20,
        )
        return max(0, used - after)

    def _survey(
        self, running: Collection[Path]
    ) -> tuple[int, list[tuple[float, str, int, str]], dict[str, int]] | None:
        """What the logs hold on disk together; the logs of ended attempts, as (last
        written, path, bytes, job directory); how many files each job directory holds.
        None: the log directory cannot be read."""
        try:
            jobs = [job for job in os.scandir(self.log_dir) if job.is_dir(follow_symlinks=False)]
        except OSError as error:
            if not isinstance(error, FileNotFoundError):
                log.warning("%s: cannot look over the job logs: %s", self.node, error)
            return None
        total = 0
        ended: list[tuple[float, str, int, str]] = []
        left: dict[str, int] = {}
        for job in jobs:
            left[job.path] = 0
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(job.path):
                    try:
                        status = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    left[job.path] += 1
                    used = status.st_blocks * 512
                    total += used
                    if Path(entry.path).resolve() not in running:
                        ended.append((status.st_mtime, entry.path, used, job.path))
        return total, ended, left

    def prune_due(self) -> bool:
        return (self.keep_s is not None or self.max_total is not None) and (
            self._pruned_at is None or self.clock() - self._pruned_at >= PRUNE_EVERY_S
        )

    def prune(self, running: Collection[Path]) -> list[Path]:
        """Remove the logs of ended attempts (never those of `running` ones) last
        written more than `keep_s` ago, then, least recently written first, as many
        more as take every log together within `max_total`; the job directories left
        empty, for `remove_empty`. Walks the whole log directory: run it in a thread."""
        self._pruned_at = now = self.clock()
        if self.keep_s is None and self.max_total is None:
            return []
        before = -math.inf if self.keep_s is None else now - self.keep_s
        survey = self._survey({path.resolve() for path in running})
        if survey is None:
            return []
        total, ended, left = survey
        ended.sort()
        aged = room = 0
        for written, path, used, job_path in ended:
            old = written < before
            if not old and (self.max_total is None or total <= self.max_total):
                break  # the rest were written later
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as error:
                log.warning("%s: cannot remove the log %s: %s", self.node, path, error)
                continue
            total -= used
            left[job_path] -= 1
            if old:
                aged += 1
            else:
                room += 1
        if aged:
            assert self.keep_s is not None
            log.info(
                "%s: removed %d job logs last written over %g days ago",
                self.node,
                aged,
                self.keep_s / 86_400,
            )
        if room:
            log.info(
                "%s: removed the %d least recently written logs of ended attempts: job "
                "logs held over %d MiB (--job-logs-max-total)",
                self.node,
                room,
                (self.max_total or 0) >> 20,
            )
        if self.max_total is not None and total > self.max_total:
            log.warning(
                "%s: job logs still hold %d MiB, over --job-logs-max-total (%d MiB): "
                "what is left is running attempts' (each held to --job-log-max, never "
                "removed while it runs) or could not be removed",
                self.node,
                total >> 20,
                self.max_total >> 20,
            )
        return [Path(path) for path, count in left.items() if count == 0]

    @staticmethod
    def remove_empty(directories: Collection[Path]) -> None:
        """Remove the job directories `prune` left empty. On the event loop's thread: the
        launcher makes a job's directory and opens its log without yielding between, so
        none goes from under a launch; one a launch has used meanwhile is not empty."""
        for directory in directories:
            with contextlib.suppress(OSError):  # not empty, or gone
                directory.rmdir()
