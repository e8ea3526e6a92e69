"""One cgroup per job attempt: memory, CPU and process limits, and which devices it may open.

Both hierarchies are supported:

- cgroup v1 (one directory tree per controller, `/sys/fs/cgroup/<controller>/`): the
  `memory`, `cpu`, `pids` and `devices` controllers. The devices controller denies
  every device, then allows the harmless ones (null, zero, full, random, urandom, tty,
  ptmx, pts) and the GPU device files the job was granted plus NVIDIA's control devices.
- cgroup v2 (the unified tree, `/sys/fs/cgroup/cgroup.controllers` present): memory,
  cpu and pids controllers; device access, which v2 leaves to eBPF, by a device program
  attached to the job's cgroup (agents/devices_bpf.py) that allows the same rules as v1.

A job's cgroup lives at `<root>/<controller>/<parent>/<node>/<job>-<attempt>` (v1) or
`<root>/<parent>/<node>/<job>-<attempt>` (v2), `node` being the agent's scope (its
node's name and a tag of its data directory: cli.confine.agent_scope). The agent moves
the job's first process in before it runs the job's program (agents/confine_exec.py), so
every process the job ever starts is inside. Nothing here decides limits:
agents/confine.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from agents import devices_bpf
from schemas.errors import AlnairError

log = logging.getLogger(__name__)

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
CFS_PERIOD_US: Final = 100_000
# Devices every process needs (char major:minor), as container runtimes allow them.
BASE_DEVICES: Final = (
    "c 1:3 rwm",  # null
    "c 1:5 rwm",  # zero
    "c 1:7 rwm",  # full
    "c 1:8 rwm",  # random
    "c 1:9 rwm",  # urandom
    "c 5:0 rwm",  # tty
    "c 5:2 rwm",  # ptmx
    "c 136:* rwm",  # pts
)
# Opened by every CUDA process, whichever GPUs it uses.
NVIDIA_CONTROL_DEVICES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

Version = Literal["v1", "v2"]


class CgroupError(AlnairError):
    pass


@dataclass(frozen=True, slots=True)
class Limits:
    memory_bytes: int
    cpus: float
    pids: int
    # Device rules ("c MAJOR:MINOR rwm") allowed on top of BASE_DEVICES; None: device
    # access is left alone (no v1 devices controller, no v2 device program).
    devices: tuple[str, ...] | None


# The limits of a cgroup found left behind (`Cgroups.leftover`): not read back.
UNKNOWN_LIMITS: Final = Limits(memory_bytes=0, cpus=0.0, pids=0, devices=None)


def gpu_device_rules(device_dir: Path, gpus: Sequence[int]) -> tuple[str, ...]:
    """Allow rules for the granted GPUs' device files (`nvidia<N>`) and the control
    devices, from the device numbers of the files in `device_dir` (normally /dev). A
    granted GPU with no device file is refused: the job could not use it anyway."""
    rules: list[str] = []
    names = [f"nvidia{gpu}" for gpu in gpus]
    for name in [*names, *NVIDIA_CONTROL_DEVICES]:
        path = device_dir / name
        try:
            st = path.stat()
        except FileNotFoundError:
            if name in names:
                raise CgroupError(f"GPU device file {path} does not exist") from None
            continue
        if not stat.S_ISCHR(st.st_mode):
            raise CgroupError(f"{path} is not a character device")
        rules.append(f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm")
    return tuple(rules)


def detect(root: Path = CGROUP_ROOT) -> Version | None:
    """Which hierarchy this machine mounts, or None when neither is usable here."""
    if (root / "cgroup.controllers").exists():
        return "v2"
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return "v1"
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as error:
        raise CgroupError(f"cannot write {value!r} to {path}: {error.strerror or error}") from None


def _read_counter(path: Path, key: str) -> int:
    """A `key value` line of a cgroup stats file (memory.oom_control, memory.events)."""
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


@dataclass
class JobCgroup:
    """A job attempt's cgroup: the files its first process joins by, and its fate."""

    version: Version
    # One directory per v1 controller; one directory on v2.
    directories: tuple[Path, ...]
    memory_dir: Path
    limits: Limits

    @property
    def procs_files(self) -> tuple[Path, ...]:
        return tuple(d / "cgroup.procs" for d in self.directories)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this cgroup at its memory limit."""
        if self.version == "v1":
            return _read_counter(self.memory_dir / "memory.oom_control", "oom_kill") > 0
        return _read_counter(self.memory_dir / "memory.events", "oom_kill") > 0

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in procs.read_text().split())
        return found

    async def remove(self, *, wait_s: float = 5.0) -> None:
        """Kill what the job left running, then remove its directories."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            busy = []
            for directory in self.directories:
                try:
                    directory.rmdir()
                except FileNotFoundError:
                    continue
                except OSError:
                    busy.append(directory)
            if not busy:
                return
            if loop.time() >= deadline:
                log.warning("cgroups %s still busy; left in place", ", ".join(map(str, busy)))
                return
            await asyncio.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Cgroups:
    """Where and how this agent makes its jobs' cgroups."""

    version: Version
    parent: str
    node: str
    root: Path = CGROUP_ROOT

    def _v1_dir(self, controller: str) -> Path:
        base = self.root / controller
        if controller == "cpu" and not base.exists():
            base = self.root / "cpu,cpuacct"
        return base / self.parent / self.node

    def remove_empty(self) -> None:
        """Remove this node's (and the parent's) directories if no job's is left in them:
        an agent shutting down leaves nothing behind."""
        if self.version == "v1":
            levels = [self._v1_dir(c) for c in ("memory", "cpu", "pids", "devices")]
        else:
            levels = [self.root / self.parent / self.node]
        for level in levels:
            for directory in (level, level.parent):
                with contextlib.suppress(OSError):
                    directory.rmdir()

    def leftover(self, name: str) -> JobCgroup | None:
        """The cgroup `name` as an earlier agent left it (it died before the attempt
        ended), if any of its directories is still there."""
        if self.version == "v1":
            memory = self._v1_dir("memory") / name
            controllers = ("memory", "cpu", "pids", "devices")
            directories = tuple(
                d for d in (self._v1_dir(c) / name for c in controllers) if d.is_dir()
            )
        else:
            memory = self.root / self.parent / self.node / name
            directories = (memory,) if memory.is_dir() else ()
        if not directories:
            return None
        return JobCgroup(self.version, directories, memory, UNKNOWN_LIMITS)

    def create(self, name: str, limits: Limits) -> JobCgroup:
        """A fresh cgroup with these limits (an old one of the same name is replaced)."""
        if self.version == "v1":
            return self._create_v1(name, limits)
        return self._create_v2(name, limits)

    def _create_v1(self, name: str, limits: Limits) -> JobCgroup:
        controllers = ["memory", "cpu", "pids"]
        if limits.devices is not None:
            controllers.append("devices")
        dirs = {c: self._v1_dir(c) / name for c in controllers}
        for directory in dirs.values():
            _fresh_dir(directory)
        memory = dirs["memory"]
        _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
        swap = memory / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swapping past the limit either
            _write(swap, str(limits.memory_bytes))
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CFS_PERIOD_US))))
        _write(dirs["pids"] / "pids.max", str(limits.pids))
        if limits.devices is not None:
            devices = dirs["devices"]
            _write(devices / "devices.deny", "a")
            for rule in (*BASE_DEVICES, *limits.devices):
                _write(devices / "devices.allow", rule)
        return JobCgroup("v1", tuple(dirs.values()), memory, limits)

    def _create_v2(self, name: str, limits: Limits) -> JobCgroup:
        parent = self.root / self.parent / self.node
        # Each level must hand the controllers down to the next.
        for level in (self.root, self.root / self.parent, parent):
            level.mkdir(exist_ok=True)
            for controller in ("+memory", "+cpu", "+pids"):
                with contextlib.suppress(OSError):
                    (level / "cgroup.subtree_control").write_text(controller)
        directory = parent / name
        _fresh_dir(directory)
        _write(directory / "memory.max", str(limits.memory_bytes))
        swap = directory / "memory.swap.max"
        if swap.exists():
            _write(swap, "0")
        quota = max(1000, int(limits.cpus * CFS_PERIOD_US))
        _write(directory / "cpu.max", f"{quota} {CFS_PERIOD_US}")
        _write(directory / "pids.max", str(limits.pids))
        if limits.devices is not None:
            try:
                devices_bpf.attach(directory, (*BASE_DEVICES, *limits.devices))
            except devices_bpf.DeviceFilterError as error:
                with contextlib.suppress(OSError):
                    directory.rmdir()
                raise CgroupError(f"device access of cgroup {directory}: {error}") from None
        return JobCgroup("v2", (directory,), directory, limits)


def _fresh_dir(directory: Path) -> None:
    if directory.exists():
        # A leftover of an attempt whose agent crashed: its processes were stopped
        # (agents/orphans.py), so the directory is empty or about to be.
        with contextlib.suppress(OSError):
            directory.rmdir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CgroupError(f"cannot create cgroup {directory}: {error.strerror or error}") from None
