"""Shared GPUs on a node: CUDA MPS for real GPUs, accounting alone for simulated ones.

A job given a share of a GPU (`Launch.gpu_milli`) runs beside the GPU's other shares.
On NVML GPUs the agent runs one MPS control daemon per shared GPU
(`nvidia-cuda-mps-control -d` with that GPU's own `CUDA_MPS_PIPE_DIRECTORY` and
`CUDA_MPS_LOG_DIRECTORY`, and `CUDA_VISIBLE_DEVICES` set to the GPU's UUID), checks it
answers on its pipe at every watch, starts it again when it does not, and asks it to
quit once no share runs on the GPU. Each job gets its share as
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and its GPU memory as
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, and sees its GPU by UUID (MPS numbers a client's
devices among the server's).

An MPS control daemon serves one Unix user at a time: a client of another user waits
until the first user's MPS server exits. Under confinement each tenant's jobs run as
the tenant's own user (agents/confine.py), so a shared GPU serves one user: the brain
places only one tenant's shares on a GPU (brain/core/sharing.py), and here a share of
another user is refused while the GPU's shares run (`MpsError`, naming both), instead
of hanging; once none runs, the daemon is restarted for the new user. The GPU's pipe
and log directories (the MPS server, which runs as the client's user, writes there
too) belong to that user alone (owned by it, 0700, in a root-owned directory it can
only pass through), and are emptied when the user changes; unconfined, they are the
agent's alone (0700). Before a share starts, the agent checks that its user can reach both,
every directory on the way included, and refuses it naming the directory that stops
it (`out_of_reach`). A daemon that answers on a GPU's pipe before this agent started
one there was left by an earlier agent (killed before it could quit it): whose shares it
serves is not known, so it is quit and started again for the share at hand.

Simulated GPUs get the same environment and the same accounting (shares, memory
limits, per-process memory, a job over its limit stopped, one user per GPU), but no
daemon: nothing limits a process there, and the agent says so
(`ALNAIR_GPU_SHARE_ENFORCED=0` in the job's environment, `enforcement: accounted` in
the heartbeat, and its log).

This module owns the MPS daemons and the share environment; it does not decide who
shares what (the brain does) and does not start or stop jobs (the launcher does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, Protocol

log = logging.getLogger(__name__)

MPS_CONTROL: Final = "nvidia-cuda-mps-control"
# How long one exchange with the control daemon (start, probe, quit) may take.
MPS_COMMAND_S: Final = 10.0
SHARE_ENFORCED_ENV: Final = "ALNAIR_GPU_SHARE_ENFORCED"
GPU_SHARE_ENV: Final = "ALNAIR_GPU_SHARE"
NOT_ENFORCED: Final = (
    "simulated GPU: shares and GPU memory limits are accounted, not enforced "
    "(no MPS daemon; nothing limits a process's threads or memory)"
)


@dataclass(frozen=True, slots=True)
class ShareUser:
    """The Unix user (and the one group: confined jobs drop every other) a share runs
    as. None in its place: unconfined, the agent's own user."""

    name: str
    uid: int
    gid: int


def _who(user: ShareUser | None) -> str:
    return "the agent's own user" if user is None else f"user {user.name}"


def out_of_reach(path: Path, user: ShareUser) -> Path | None:
    """The first directory on the way to `path` that this user (with its one group)
    cannot pass through, or `path` itself if it cannot read, write and enter it; None
    when it can. From the permission bits (access control lists are not read)."""
    if user.uid == 0:
        return None
    for directory in (*reversed(path.parents), path):
        need = 0o7 if directory == path else 0o1
        try:
            info = directory.stat()
        except OSError:
            return directory
        if info.st_uid == user.uid:
            bits = info.st_mode >> 6
        elif info.st_gid == user.gid:
            bits = info.st_mode >> 3
        else:
            bits = info.st_mode
        if bits & need != need:
            return directory
    return None


def share_env(gpu_milli: int, gpu_memory_mib: int | None) -> dict[str, str]:
    """The MPS client limits of a job with this share of its one GPU: its share of the
    GPU's threads (percent, rounded up: MPS takes whole percents), and its memory on
    device 0 (the only device it sees)."""
    env = {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, math.ceil(gpu_milli / 10))),
        GPU_SHARE_ENV: f"{gpu_milli / 1000:g}",
    }
    if gpu_memory_mib is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={gpu_memory_mib}M"
    return env


class ShareEnforcer(Protocol):
    """What runs a GPU's shares: MPS daemons, or nothing (accounting alone)."""

    @property
    def enforcement(self) -> Literal["mps", "accounted"]: ...

    async def prepare(
        self, index: int, uuid: str, user: ShareUser | None = None, *, alone: bool = True
    ) -> dict[str, str]:
        """Ready GPU `index` for a share run as `user`; the environment a job on it
        needs (beyond `share_env`). `alone`: no other share runs on the GPU now. Raises
        `MpsError` when it cannot: the GPU serves another user's shares, its daemon
        cannot run, or `user` cannot reach its pipe."""
        ...

    async def release(self, index: int) -> None:
        """No share runs on the GPU any more."""
        ...

    async def check(self) -> None:
        """Restart what died (called at every watch)."""
        ...

    def problem(self, index: int) -> str | None:
        """Why the GPU's shares are not enforced right now, if something is wrong."""
        ...

    async def close(self) -> None: ...


class MpsError(Exception):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"GPU {index}: MPS: {reason}")
        self.index = index
        self.reason = reason


def one_user_only(serving: ShareUser | None, asking: ShareUser | None) -> str:
    return (
        f"serves {_who(serving)}'s shares; an MPS daemon serves one Unix user at a time, "
        f"so a share of {_who(asking)} would wait until they end"
    )


class Accounted:
    """Simulated GPUs: no daemon; says, once per GPU, that nothing is enforced."""

    enforcement: Literal["accounted"] = "accounted"

    def __init__(self, node: str) -> None:
        self._node = node
        self._said: set[int] = set()
        # The user each shared GPU serves, as MPS would.
        self._users: dict[int, ShareUser | None] = {}

    async def prepare(
        self, index: int, uuid: str, user: ShareUser | None = None, *, alone: bool = True
    ) -> dict[str, str]:
        if index in self._users and self._users[index] != user and not alone:
            raise MpsError(index, one_user_only(self._users[index], user))
        self._users[index] = user
        if index not in self._said:
            self._said.add(index)
            log.warning("%s: GPU %d is shared: %s", self._node, index, NOT_ENFORCED)
        return {SHARE_ENFORCED_ENV: "0"}

    async def release(self, index: int) -> None:
        self._said.discard(index)
        self._users.pop(index, None)

    async def check(self) -> None:
        return None

    def problem(self, index: int) -> str | None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class _Daemon:
    index: int
    uuid: str
    pipe_dir: Path
    log_dir: Path
    # Whose shares it serves (None: the agent's own user's).
    user: ShareUser | None = None
    restarts: int = 0
    problem: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def env(self) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }


class MpsDaemons:
    """One MPS control daemon per shared GPU, under `root/gpu<index>/{pipe,log}`."""

    enforcement: Literal["mps"] = "mps"

    def __init__(
        self, root: Path, *, binary: str = MPS_CONTROL, base_env: Mapping[str, str] | None = None
    ) -> None:
        self._root = root
        self._binary = binary
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._daemons: dict[int, _Daemon] = {}

    async def _control(
        self, daemon: _Daemon, *args: str, stdin: bytes | None = None, output: Path | None = None
    ) -> tuple[int, str]:
        """Run the control binary for this GPU's daemon: (exit status, output). A start
        (`-d`) writes to `output`, a file: the daemon it leaves behind may keep what it
        inherited open, and a pipe would then never end."""
        env = {**self._base_env, **daemon.env(), "CUDA_VISIBLE_DEVICES": daemon.uuid}
        sink = output.open("ab") if output is not None else None
        try:
            process = await asyncio.create_subprocess_exec(
                self._binary,
                *args,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=sink if sink is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
            )
        except OSError as error:
            raise MpsError(daemon.index, f"cannot run {self._binary}: {error}") from None
        finally:
            if sink is not None:
                sink.close()
        try:
            out, _ = await asyncio.wait_for(process.communicate(stdin), MPS_COMMAND_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise MpsError(daemon.index, f"{self._binary} did not answer") from None
        if output is not None:
            out = output.read_bytes()[-2000:]  # noqa: ASYNC240 - a small log file
        return process.returncode or 0, (out or b"").decode(errors="replace").strip()

    async def _alive(self, daemon: _Daemon) -> bool:
        """The daemon answers on its pipe (`get_server_list` succeeds)."""
        if not (daemon.pipe_dir / "control").exists():
            return False
        try:
            status, _ = await self._control(daemon, stdin=b"get_server_list\n")
        except MpsError:
            return False
        return status == 0

    def _lay_out(self, daemon: _Daemon) -> None:
        """The GPU's directories, for its user alone: `pipe` and `log` are that user's
        own (mode 0700), inside a root-owned `gpu<i>` that others may only pass through
        (the agent is root when it confines); unconfined, all three are the agent's
        user's alone. What another user's server left there is removed first.

        Ownership, not a group: the control daemon starts each MPS server as the
        client's uid but not with its group (seen on an H200 with driver 580: servers
        for a uid whose pipe and log directories were root-owned, group rwx for the
        user's group, exited at once without a line of log, and every client failed
        with CUDA error 805)."""
        gpu_dir = daemon.pipe_dir.parent
        self._root.mkdir(parents=True, exist_ok=True)
        user = daemon.user
        uid, gid = (os.geteuid(), os.getegid()) if user is None else (user.uid, user.gid)
        with contextlib.suppress(FileNotFoundError):
            if daemon.pipe_dir.stat().st_uid != uid:
                shutil.rmtree(gpu_dir)
        if user is not None:
            self._root.chmod(0o711)  # every GPU's users pass through to their own
        gpu_dir.mkdir(exist_ok=True)
        gpu_dir.chmod(0o700 if user is None else 0o711)
        for directory in (daemon.pipe_dir, daemon.log_dir):
            directory.mkdir(exist_ok=True)
            if user is not None:
                os.chown(directory, uid, gid)
            directory.chmod(0o700)

    def _check_reach(self, daemon: _Daemon) -> None:
        """Refuse, naming the directory, when the daemon's user could not reach its pipe
        or log directory (its clients could never reach the server)."""
        user = daemon.user
        if user is None:
            return
        for directory in (daemon.pipe_dir, daemon.log_dir):
            blocked = out_of_reach(directory, user)
            if blocked is not None:
                raise MpsError(
                    daemon.index,
                    f"{directory} is out of reach of user {user.name} "
                    f"(uid {user.uid}, gid {user.gid}): it cannot "
                    f"{'use' if blocked == directory else 'pass through'} {blocked}",
                )

    async def _start(self, daemon: _Daemon) -> None:
        try:
            self._lay_out(daemon)
        except OSError as error:
            raise MpsError(
                daemon.index, f"cannot lay out {daemon.pipe_dir.parent}: {error}"
            ) from None
        self._check_reach(daemon)  # before a daemon its user's clients could not reach
        # Not in `log`, where the share's user may write: the agent appends to this.
        start_log = daemon.pipe_dir.parent / "start.log"
        status, out = await self._control(daemon, "-d", output=start_log)
        if status != 0 or not await self._alive(daemon):
            tail = out.splitlines()[-1] if out else f"exit status {status}"
            raise MpsError(daemon.index, f"control daemon did not start: {tail}")
        log.info("GPU %d: MPS control daemon started (pipe %s)", daemon.index, daemon.pipe_dir)

    async def prepare(
        self, index: int, uuid: str, user: ShareUser | None = None, *, alone: bool = True
    ) -> dict[str, str]:
        if shutil.which(self._binary) is None:
            raise MpsError(index, f"{self._binary} is not installed")
        daemon = self._daemons.get(index)
        if daemon is not None and daemon.user != user:
            if not alone:
                raise MpsError(index, one_user_only(daemon.user, user))
            # Its last share has ended: the daemon starts again for the new user.
            await self.release(index)
            daemon = None
        created = daemon is None
        if daemon is None:
            gpu_dir = self._root / f"gpu{index}"
            daemon = _Daemon(index, uuid, gpu_dir / "pipe", gpu_dir / "log", user)
            self._daemons[index] = daemon
        async with daemon.lock:
            try:
                if created and await self._alive(daemon):
                    # Left by an earlier agent (killed before it could quit it): whose
                    # shares it serves, and who owns its directories, is not known.
                    log.warning("GPU %d: an earlier agent's MPS daemon: restarting it", index)
                    await self._control(daemon, stdin=b"quit\n")
                if not await self._alive(daemon):
                    await self._start(daemon)
                    daemon.problem = None
                self._check_reach(daemon)
            except MpsError:
                if created:  # no share runs there: nothing for `check` to restart
                    self._daemons.pop(index, None)
                raise
        return {**daemon.env(), "CUDA_VISIBLE_DEVICES": uuid, SHARE_ENFORCED_ENV: "1"}

    async def release(self, index: int) -> None:
        daemon = self._daemons.pop(index, None)
        if daemon is None:
            return
        async with daemon.lock:
            try:
                await self._control(daemon, stdin=b"quit\n")
            except MpsError as error:
                log.warning("%s", error)

    async def check(self) -> None:
        for daemon in list(self._daemons.values()):
            async with daemon.lock:
                if await self._alive(daemon):
                    continue
                daemon.restarts += 1
                log.warning("GPU %d: MPS control daemon is gone; starting it again", daemon.index)
                try:
                    await self._start(daemon)
                    daemon.problem = None
                except MpsError as error:
                    daemon.problem = f"{error.reason} (restart {daemon.restarts})"

    def problem(self, index: int) -> str | None:
        daemon = self._daemons.get(index)
        return None if daemon is None else daemon.problem

    async def close(self) -> None:
        """Every daemon asked to quit, and the directories removed: a confined agent's
        runtime root, which holds them, is removed after (agents/confine.py). The
        removal follows no link a tenant may have left in its pipe or log directory
        (`shutil.rmtree` works through file descriptors on Linux)."""
        for index in list(self._daemons):
            await self.release(index)
        shutil.rmtree(self._root, ignore_errors=True)


def enforcer_for(kind: Literal["nvml", "sim"], node: str, root: Path) -> ShareEnforcer:
    """MPS daemons for real GPUs; accounting alone for simulated ones."""
    if kind == "nvml":
        return MpsDaemons(root)
    return Accounted(node)
