"""GPU backends: the agent's only view of its GPUs.

`GpuBackend` is a Protocol with two implementations: NVML (real GPUs, through the
`pynvml` module that NVIDIA's nvidia-ml-py provides) and a simulated one. The
simulated backend is only ever chosen explicitly (`--gpus sim:8xH100`), never as a
fallback when NVML fails.
"""

from __future__ import annotations

import logging
import math
import random
import re
import shutil
import tempfile
import uuid
import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from schemas.errors import AlnairError
from schemas.telemetry import GpuHealth, GpuInfo, GpuSample

log = logging.getLogger(__name__)


class GpuBackendError(AlnairError):
    pass


class GpuBackend(Protocol):
    @property
    def kind(self) -> Literal["nvml", "sim"]: ...

    def inventory(self) -> tuple[GpuInfo, ...]: ...

    def sample(self) -> tuple[GpuSample, ...]: ...

    def set_busy(self, gpus: Iterable[int]) -> None:
        """Which GPUs run jobs; only the simulated backend uses it, to look busy."""

    def process_memory(self, index: int) -> dict[int, float]:
        """GPU memory (MiB) each process uses on GPU `index`, by pid; a process whose
        use is not known is left out."""
        ...

    def job_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """What a job on these GPUs needs in its environment from the backend (the
        simulated one: where the job says what GPU memory it uses)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SimModel:
    name: str
    memory_mib: int
    max_power_w: float
    sm_clock_mhz: float
    mem_clock_mhz: float


SIM_MODELS: Final[dict[str, SimModel]] = {
    m.name: m
    for m in (
        SimModel("H200", 143_771, 700.0, 1980.0, 3201.0),
        SimModel("H100", 81_559, 700.0, 1980.0, 2619.0),
        SimModel("A100", 81_920, 400.0, 1410.0, 1593.0),
        SimModel("A10", 23_028, 150.0, 1695.0, 6251.0),
        SimModel("L4", 23_034, 72.0, 2040.0, 6251.0),
        SimModel("V100", 32_768, 300.0, 1530.0, 877.0),
        SimModel("T4", 15_360, 70.0, 1590.0, 5001.0),
    )
}

# A job on a simulated GPU writes the GPU memory it "uses" (MiB) to a file named by its
# pid in this directory (agents/mps.py: the accounting of shares on simulated GPUs).
SIM_GPU_MEMORY_ENV: Final = "ALNAIR_SIM_GPU_MEMORY_DIR"
_SIM_SPEC: Final = re.compile(r"^sim:(?P<count>\d+)x(?P<model>[A-Za-z0-9]+)$")


class SimulatedGpus:
    """N GPUs of a named model whose telemetry follows what the agent runs on them."""

    kind: Literal["sim"] = "sim"

    def __init__(
        self,
        node: str,
        count: int,
        model: str,
        *,
        seed: int | None = None,
        memory_dir: Path | None = None,
    ) -> None:
        if model not in SIM_MODELS:
            raise GpuBackendError(
                f"unknown simulated GPU model {model!r}; known: {', '.join(SIM_MODELS)}"
            )
        if not 1 <= count <= 64:
            raise GpuBackendError(f"simulated GPU count must be 1..64, not {count}")
        self.model = SIM_MODELS[model]
        self._gpus = tuple(
            GpuInfo(
                index=i,
                uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{i}.alnair.sim')}",
                model=f"NVIDIA {model} (simulated)",
                memory_mib=self.model.memory_mib,
            )
            for i in range(count)
        )
        self._busy: frozenset[int] = frozenset()
        # Injected faults (`alnair inject`): double-bit ECC counts, and lost GPUs.
        self._ecc_dbe: dict[int, int] = {}
        self._rng = random.Random(seed if seed is not None else zlib.crc32(node.encode()))
        self._ticks = 0
        # Where simulated jobs write the GPU memory they use (a file per pid, in MiB):
        # a process on a simulated GPU allocates nothing there, so it says. Made when a
        # job first needs it: `memory_dir` (the agent's own: what a killed agent left
        # there is cleared now), else a temporary directory. Removed by `close`, and a
        # temporary one also when the backend is collected or the process exits, so a
        # backend nobody closed leaves nothing behind. Jobs confined to their tenant's
        # user write there too: each GPU's directory takes files from anyone but lists
        # to no one and lets no one remove another's (mode 1733, as /tmp), and a file
        # counts only for a process of its own owner (`declared`).
        self._memory_dir = memory_dir
        self._remove_memory: weakref.finalize[[str, bool], SimulatedGpus] | None = None
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)

    def inventory(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def set_busy(self, gpus: Iterable[int]) -> None:
        self._busy = frozenset(gpus)

    def job_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        if not gpus:
            return {}
        if self._memory_dir is None:
            made = tempfile.mkdtemp(prefix="alnair-sim-gpu-memory-")
            self._memory_dir = Path(made)
            self._remove_memory = weakref.finalize(self, shutil.rmtree, made, True)
        else:
            self._memory_dir.mkdir(parents=True, exist_ok=True)
        self._memory_dir.chmod(0o711)  # passed through, never listed
        where = self._memory_dir / f"gpu{gpus[0]}"
        where.mkdir(exist_ok=True)
        where.chmod(0o1733)  # mkdir's mode is cut by the umask
        return {SIM_GPU_MEMORY_ENV: str(where)}

    def declared(self, index: int) -> dict[int, tuple[float, float | None]]:
        """What processes wrote to `$ALNAIR_SIM_GPU_MEMORY_DIR/<pid>`: the GPU memory
        they use (MiB) and, optionally after it, their utilisation (percent). A file
        counts only if its owner runs the process it names (or is root): a job may
        speak for its own processes, not make another tenant's look over its limit."""
        if self._memory_dir is None:
            return {}
        said: dict[int, tuple[float, float | None]] = {}
        try:
            entries = list((self._memory_dir / f"gpu{index}").iterdir())
        except OSError:
            return {}
        for entry in entries:
            try:
                owner = entry.stat().st_uid
                runs_as = Path(f"/proc/{entry.name}").stat().st_uid
            except OSError:
                runs_as = None
            if not entry.name.isdigit() or runs_as is None:
                entry.unlink(missing_ok=True)  # its process has gone: so has its memory
                continue
            if owner not in (0, runs_as):
                log.warning(
                    "simulated GPU %d: user %d wrote the memory of process %s, which "
                    "runs as user %d: not counted",
                    index,
                    owner,
                    entry.name,
                    runs_as,
                )
                entry.unlink(missing_ok=True)
                continue
            try:
                words = entry.read_text().split()
                util = min(100.0, max(0.0, float(words[1]))) if len(words) > 1 else None
                said[int(entry.name)] = (max(0.0, float(words[0])), util)
            except (OSError, ValueError, IndexError):
                continue
        return said

    def process_memory(self, index: int) -> dict[int, float]:
        return {pid: memory for pid, (memory, _) in self.declared(index).items()}

    def suffer(self, gpu: int, fault: str) -> None:
        """Make GPU `gpu` show an injected fault where NVML would show it."""
        if fault == "ecc_dbe":
            self._ecc_dbe[gpu] = self._ecc_dbe.get(gpu, 0) + 1
        elif fault == "lost":
            self._gpus = tuple(
                g.model_copy(update={"health": GpuHealth.LOST, "health_reason": "injected: lost"})
                if g.index == gpu
                else g
                for g in self._gpus
            )

    def sample(self) -> tuple[GpuSample, ...]:
        self._ticks += 1
        return tuple(self._sample_one(gpu.index) for gpu in self._gpus)

    def _sample_one(self, index: int) -> GpuSample:
        m = self.model
        said = self.declared(index) if index in self._busy else {}
        if said:
            # What its jobs declared (a simulated share, or a job playing a profile).
            util = min(100.0, sum(u for _, u in said.values() if u is not None))
            mem_frac = min(1.0, sum(mem for mem, _ in said.values()) / m.memory_mib)
        elif index in self._busy:
            # A training job: high utilisation with a periodic dip (data loading,
            # checkpoints), as real jobs show.
            wave = 0.5 + 0.5 * math.sin(self._ticks / 5.0 + index)
            util = min(100.0, 70.0 + 28.0 * wave + self._rng.uniform(-2, 2))
            mem_frac = 0.7 + 0.05 * wave
        else:
            util = 0.0
            mem_frac = 0.005
        used = m.memory_mib * mem_frac
        return GpuSample(
            index=index,
            util_gpu_pct=round(max(0.0, util), 1),
            util_mem_pct=round(max(0.0, util * 0.6), 1),
            mem_used_mib=round(used, 1),
            mem_total_mib=float(m.memory_mib),
            power_w=round(m.max_power_w * (0.12 + 0.8 * util / 100.0), 1),
            temp_c=round(32.0 + 0.4 * util + self._rng.uniform(-0.5, 0.5), 1),
            sm_clock_mhz=m.sm_clock_mhz if util > 0 else 210.0,
            mem_clock_mhz=m.mem_clock_mhz,
            ecc_dbe_total=self._ecc_dbe.get(index, 0),
        )

    def close(self) -> None:
        if self._remove_memory is not None:
            self._remove_memory.detach()
            self._remove_memory = None
        if self._memory_dir is not None:
            shutil.rmtree(self._memory_dir, ignore_errors=True)
            self._memory_dir = None


class NvmlGpus:
    """Real GPUs through NVML. Raises GpuBackendError when there is no usable driver."""

    kind: Literal["nvml"] = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        """`nvml`: the `pynvml` module (by default), or what stands in for it."""
        if nvml is None:
            try:
                import pynvml
            except ImportError as error:  # pragma: no cover - it is a dependency
                raise GpuBackendError(
                    "the pynvml module (package nvidia-ml-py) is missing"
                ) from error
            nvml = pynvml
        self._nvml: Any = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            raise GpuBackendError(f"NVML is not usable here: {error}") from error
        # The version of the memory query that reports the driver's reserve apart.
        self._memory_v2: Any = getattr(nvml, "nvmlMemory_v2", None)
        count = nvml.nvmlDeviceGetCount()
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._gpus = tuple(self._info(i, h) for i, h in enumerate(self._handles))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; a query the GPU does not support reads as None."""
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _info(self, index: int, handle: Any) -> GpuInfo:
        nvml = self._nvml
        name = self._call(nvml.nvmlDeviceGetName, handle) or "unknown"
        uuid_ = self._call(nvml.nvmlDeviceGetUUID, handle) or f"GPU-index-{index}"
        memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
        return GpuInfo(
            index=index,
            uuid=_text(uuid_),
            model=_text(name),
            memory_mib=int(memory.total // (1024 * 1024)) if memory is not None else 0,
        )

    def inventory(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def set_busy(self, gpus: Iterable[int]) -> None:
        pass

    def job_env(self, gpus: tuple[int, ...]) -> dict[str, str]:
        return {}

    def process_memory(self, index: int) -> dict[int, float]:
        """NVML's compute processes on the GPU, and its MPS clients, with the memory
        each uses; NVML says None where it cannot tell.

        Drivers list an MPS client in both queries (nvidia-smi's type "M+C"), with the
        same figure: a process's use is the larger of the two, never their sum (summed,
        each share of an H200 read twice its use, and would be stopped at half its
        limit)."""
        nvml = self._nvml
        handle = self._handles[index]
        used: dict[int, float] = {}
        for query in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetMPSComputeRunningProcesses",
        ):
            fn = getattr(nvml, query, None)
            processes = self._call(fn, handle) if fn is not None else None
            for process in processes or ():
                memory = getattr(process, "usedGpuMemory", None)
                if isinstance(memory, int) and memory >= 0:
                    pid = int(process.pid)
                    used[pid] = max(used.get(pid, 0.0), memory / (1024 * 1024))
        return used

    def sample(self) -> tuple[GpuSample, ...]:
        return tuple(self._sample_one(i, h) for i, h in enumerate(self._handles))

    def _memory(self, handle: Any) -> Any:
        """Memory in use as nvidia-smi shows it. The first version of the query counts
        what the driver reserves for itself as used (615 MiB of an idle H200 that
        nvidia-smi shows at 0); the second reports that apart. A driver (or bindings)
        without the second gets the first, and is not asked the second again."""
        nvml = self._nvml
        if self._memory_v2 is not None:
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle, self._memory_v2)
            if memory is not None:
                return memory
            self._memory_v2 = None
        return self._call(nvml.nvmlDeviceGetMemoryInfo, handle)

    def _sample_one(self, index: int, handle: Any) -> GpuSample:
        nvml = self._nvml
        util = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._memory(handle)
        power_mw = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
        temp = self._call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        sm = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
        mem_clock = self._call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM)
        dbe = self._call(
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        mib = 1024 * 1024
        return GpuSample(
            index=index,
            util_gpu_pct=float(util.gpu) if util is not None else 0.0,
            util_mem_pct=float(util.memory) if util is not None else 0.0,
            mem_used_mib=memory.used / mib if memory is not None else 0.0,
            mem_total_mib=memory.total / mib if memory is not None else 0.0,
            power_w=power_mw / 1000.0 if power_mw is not None else 0.0,
            temp_c=float(temp) if temp is not None else 0.0,
            sm_clock_mhz=float(sm or 0),
            mem_clock_mhz=float(mem_clock or 0),
            ecc_dbe_total=int(dbe) if dbe is not None else None,
        )

    def close(self) -> None:
        self._call(self._nvml.nvmlShutdown)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_backend(spec: str, *, node: str, data_dir: Path | None = None) -> GpuBackend:
    """`nvml` or `sim:<count>x<model>`; errors say what was wrong with the spec.
    Simulated GPUs keep what their jobs say they use under `data_dir` (the agent's)."""
    if spec == "nvml":
        return NvmlGpus()
    match = _SIM_SPEC.match(spec)
    if match is None:
        raise GpuBackendError(
            f"--gpus must be 'nvml' or 'sim:<count>x<model>' (e.g. sim:8xH100), not {spec!r}"
        )
    memory_dir = data_dir / "sim-gpu-memory" if data_dir is not None else None
    return SimulatedGpus(node, int(match["count"]), match["model"], memory_dir=memory_dir)


def probe_nvml() -> tuple[int, str]:
    """How many NVIDIA GPUs this machine has, and why none if none."""
    try:
        backend = NvmlGpus()
    except GpuBackendError as error:
        return 0, str(error)
    try:
        count = len(backend.inventory())
    finally:
        backend.close()
    return count, "" if count else "NVML found no GPU"
