"""Which GPU each worker of an elastic job uses: one GPU per worker, claimed by a lock.

The agent starts an elastic job's supervisor with `CUDA_VISIBLE_DEVICES` set to the
GPUs of its launch. A grow adds GPUs later, and a new worker started by horovodrun
inherits the launch's list, so it would land on a GPU another worker already uses
(and never on the added one); a shrink retires whichever workers Horovod picks, not
those on the GPUs the brain meant to release.

So the supervisor keeps a directory (`ALNAIR_GPU_DIR` in the workers' environment)
holding the job's current GPUs (`devices`, one physical index per line, rewritten
atomically on each resize) and a lock file per GPU. A worker calls `claim_gpu()` before
it touches CUDA: it takes an exclusive `flock` on the first free GPU's lock file, keeps
it for its whole life, and sets `CUDA_VISIBLE_DEVICES` to that GPU alone. The kernel
drops the lock when the process exits, however it exits (SIGKILL included), so the
supervisor learns which GPUs are still in use by probing the locks, and reports, after
a shrink, the GPUs its workers really hold.

Pure standard library; imports neither torch nor horovod.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final, TextIO

log = logging.getLogger(__name__)

GPU_DIR_ENV: Final = "ALNAIR_GPU_DIR"
DEVICES_FILE: Final = "devices"
CLAIM_TIMEOUT_S: Final = 60.0

# The lock this process holds: kept open for the life of the process.
_held: tuple[int, TextIO] | None = None


def _lock_path(directory: Path, gpu: int) -> Path:
    return directory / f"gpu-{gpu}.lock"


def parse_devices(text: str, *, where: str) -> tuple[int, ...]:
    """GPU indices from a `CUDA_VISIBLE_DEVICES`-like list (commas or lines)."""
    out: list[int] = []
    for word in text.replace(",", "\n").split():
        if not word.isdigit():
            raise ValueError(f"{where}: {word!r} is not a GPU index")
        out.append(int(word))
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: a GPU is listed twice in {out}")
    return tuple(out)


def launch_gpus() -> tuple[int, ...]:
    """The GPUs the agent launched this process with (`CUDA_VISIBLE_DEVICES`): what a
    supervisor or worker host offers its workers to claim. () when unset, or when they
    are not indices (UUIDs, say): then workers see the list as it is."""
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return parse_devices(visible, where="CUDA_VISIBLE_DEVICES")
    except ValueError as error:
        log.warning("no per-worker GPUs: %s", error)
        return ()


def read_devices(directory: Path) -> tuple[int, ...]:
    path = directory / DEVICES_FILE
    return parse_devices(path.read_text(), where=str(path))


def write_devices(directory: Path, gpus: Iterable[int]) -> None:
    """Replace the job's GPU list atomically: a starting worker never reads half."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f"{DEVICES_FILE}.tmp"
    temporary.write_text("".join(f"{gpu}\n" for gpu in gpus))
    os.replace(temporary, directory / DEVICES_FILE)


def _try_lock(directory: Path, gpu: int) -> TextIO | None:
    handle = open(_lock_path(directory, gpu), "a")  # noqa: SIM115 - held while we run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def claimed(directory: Path, gpus: Iterable[int]) -> tuple[int, ...]:
    """Those of `gpus` a live process holds (the supervisor's probe). Probing takes
    each free lock for an instant; a worker claiming at that instant retries."""
    held = []
    for gpu in gpus:
        handle = _try_lock(directory, gpu)
        if handle is None:
            held.append(gpu)
        else:
            handle.close()  # closing drops the lock
    return tuple(held)


def held_gpu() -> int | None:
    """The GPU this process claimed, if it did."""
    return None if _held is None else _held[0]


def claim_gpu(*, timeout_s: float = CLAIM_TIMEOUT_S) -> int | None:
    """Take one of the job's GPUs for this process and make it the only one CUDA sees.

    Call it before anything initialises CUDA. Returns the physical GPU index, or None
    outside an Alnair elastic job (no `ALNAIR_GPU_DIR`), where nothing changes. Raises
    RuntimeError when no GPU of the job is free within `timeout_s` (more workers than
    GPUs: the supervisor's slots and the brain's grant disagree).
    """
    global _held
    if _held is not None:
        return _held[0]
    where = os.environ.get(GPU_DIR_ENV)
    if not where:
        return None
    directory = Path(where)
    deadline = time.monotonic() + timeout_s
    gpus: tuple[int, ...] = ()
    while True:
        with contextlib.suppress(FileNotFoundError):
            gpus = read_devices(directory)
        for gpu in gpus:
            handle = _try_lock(directory, gpu)
            if handle is not None:
                _held = (gpu, handle)
                os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
                return gpu
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"no free GPU among the job's {list(gpus)} after {timeout_s:g}s "
                f"(every one is held by another worker; see {directory})"
            )
        time.sleep(0.05)
