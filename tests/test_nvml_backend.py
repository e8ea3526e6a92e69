"""The NVML backend against a scripted driver that answers as the H200 lent to this
project did (bench/results/gpu_check-*-h200*.md): what nvidia-smi shows is what the
agent reports. Constants and errors are pynvml's own; a GPU machine runs the same code
against the driver itself (bench/gpu_check.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agents.gpu import NvmlGpus

MIB = 1024 * 1024
TOTAL = 143_771 * MIB
RESERVED = 615 * MIB  # the driver's own: NVML's first memory query counts it as used


class ScriptedNvml:
    """One GPU. `compute` and `mps`: (pid, MiB) as each process query lists them.
    `has_v2`: the bindings know the second memory query; `driver_v2`: the driver has it.
    `memory_queries` counts the memory queries by version."""

    def __init__(
        self, pynvml: Any, *, has_v2: bool = True, driver_v2: bool = True, used_mib: int = 0
    ) -> None:
        self._real = pynvml
        self.NVMLError = pynvml.NVMLError
        self.has_v2 = has_v2
        self.driver_v2 = driver_v2
        self.memory_queries: list[int | None] = []
        self.used = used_mib * MIB
        self.compute: list[tuple[int, int]] = []
        self.mps: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:  # constants: NVML_*, nvmlMemory_v2
        if name == "nvmlMemory_v2" and not self.has_v2:
            raise AttributeError(name)
        return getattr(self._real, name)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "gpu0"

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return "GPU-95e9199b-38ed-97e1-f007-7ef92408a079"

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> Any:
        self.memory_queries.append(version)
        if version is not None and not self.driver_v2:
            raise self._real.NVMLError(self._real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if version is None:  # the first version: reserved memory reads as used
            return SimpleNamespace(
                total=TOTAL, used=self.used + RESERVED, free=TOTAL - self.used - RESERVED
            )
        return SimpleNamespace(
            total=TOTAL, reserved=RESERVED, used=self.used, free=TOTAL - self.used - RESERVED
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m * MIB) for p, m in self.compute]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: str) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m * MIB) for p, m in self.mps]

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        return SimpleNamespace(gpu=100, memory=40)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 645_548

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 59

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return 1725 if clock == self._real.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        return 0


@pytest.fixture
def pynvml() -> Any:
    return pytest.importorskip("pynvml")


@pytest.mark.parametrize(
    ("has_v2", "driver_v2", "used_mib", "reported_mib", "v2_asked"),
    [
        pytest.param(True, True, 0, 0, 2, id="idle: nvidia-smi's 0, not the driver's reserve"),
        pytest.param(True, True, 9165, 9165, 2, id="a job's 9,165 MiB, as nvidia-smi shows"),
        pytest.param(False, True, 0, 615, 0, id="bindings without the second query: the first"),
        # Asked once: a query the driver refused is not asked again at every sample.
        pytest.param(True, False, 0, 615, 1, id="a driver without the second query: the first"),
    ],
)
def test_memory_in_use_is_what_nvidia_smi_shows(
    pynvml: Any, has_v2: bool, driver_v2: bool, used_mib: int, reported_mib: int, v2_asked: int
) -> None:
    driver = ScriptedNvml(pynvml, has_v2=has_v2, driver_v2=driver_v2, used_mib=used_mib)
    backend = NvmlGpus(driver)

    (sample,) = backend.sample()
    backend.sample()

    assert sample.mem_used_mib == reported_mib
    assert sample.mem_total_mib == 143_771
    assert (sample.util_gpu_pct, sample.power_w, sample.sm_clock_mhz) == (100.0, 645.548, 1725)
    assert sum(version is not None for version in driver.memory_queries) == v2_asked


def test_an_mps_client_listed_by_both_queries_is_counted_once(pynvml: Any) -> None:
    driver = ScriptedNvml(pynvml)
    # As the H200 listed two 0.5 shares and their MPS server (nvidia-smi: M+C, M+C, C).
    driver.compute = [(608, 66), (563, 6820), (584, 6820)]
    driver.mps = [(563, 6820), (584, 6820)]
    backend = NvmlGpus(driver)

    assert backend.process_memory(0) == {608: 66.0, 563: 6820.0, 584: 6820.0}
