"""GPU health on the node: NVML's event stream and health queries, and simulated faults.

The agent reports faults; it never decides what they mean. Each fault becomes a
`GpuFault` event, and the brain's XID catalogue (brain/core/failures.py) decides whether
it drains the GPU, the node, or nothing.

- With NVML, `NvmlHealthWatcher` runs one thread that blocks in `nvmlEventSetWait` on an
  event set every GPU registered for critical XIDs, double-bit ECC errors and DRAM
  retirement events, and between waits polls what NVML only answers to queries:
  retired pages pending, row-remap failures, and a GPU that no longer answers (lost).
- With simulated GPUs, `alnair inject` asks the agent (request/reply on
  `alnair.node.<node>.inject`) to make a GPU suffer one of these faults; an agent with
  real GPUs refuses.

This module must not touch job processes or the bus; the agent does both.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from schemas.commands import InjectFault

log = logging.getLogger(__name__)

FaultKind = Literal["xid", "ecc_dbe", "retired_pages", "row_remap_failure", "lost"]

# nvmlEventSetWait blocks at most this long, so the thread notices a stop request.
WAIT_MS: Final = 1000
# Retired pages, row remapping and lost GPUs are queried, not evented: this often.
POLL_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class FaultReport:
    """One fault on one GPU, as the node saw it."""

    gpu: int
    fault: FaultKind
    xid: int | None = None
    detail: str = ""


FaultSink = Callable[[FaultReport], None]


class NvmlHealthWatcher:
    """Watches real GPUs through NVML in a daemon thread; reports through `sink`.

    `sink` is called from the watcher thread: the agent passes one that hops onto its
    event loop (`loop.call_soon_threadsafe`).
    """

    def __init__(
        self,
        nvml: Any,
        handles: Sequence[Any],
        sink: FaultSink,
        *,
        poll_s: float = POLL_S,
        wait_ms: int = WAIT_MS,
    ) -> None:
        self._nvml = nvml
        self._handles = list(handles)
        self._sink = sink
        self._poll_s = poll_s
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        # What was already reported, so a fault that persists is reported once.
        self._reported: set[tuple[int, str]] = set()

    def start(self) -> str | None:
        """Start watching. Returns None when watching, else why it cannot (no driver,
        no event support): health then rests on telemetry alone, which is no error."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()  # reference-counted by NVML: safe beside the backend's own
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as error:
            return f"NVML events unavailable: {error}"
        wanted = (
            nvml.nvmlEventTypeXidCriticalError
            | nvml.nvmlEventTypeDoubleBitEccError
            | getattr(nvml, "nvmlEventTypeDramRetirementFailure", 0)
        )
        registered = 0
        for index, handle in enumerate(self._handles):
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, self._event_set)
                registered += 1
            except nvml.NVMLError as error:
                # Some GPUs (and vGPUs) support no events; queries still cover them.
                log.warning("GPU %d: cannot register NVML events: %s", index, error)
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()
        return None if registered else "no GPU supports NVML events; polling only"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._wait_ms / 1000 + 2)
            self._thread = None
        if self._event_set is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            self._wait_once()
            if time.monotonic() >= next_poll:
                for index, handle in enumerate(self._handles):
                    self.poll(index, handle)
                next_poll = time.monotonic() + self._poll_s

    def _wait_once(self) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait(self._event_set, self._wait_ms)
        except nvml.NVMLError as error:
            if getattr(error, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                log.warning("nvmlEventSetWait failed: %s", error)
                self._stop.wait(self._wait_ms / 1000)
            return
        report = self.translate(data)
        if report is not None:
            self._sink(report)

    def _index_of(self, device: Any) -> int | None:
        nvml = self._nvml
        try:
            uuid = nvml.nvmlDeviceGetUUID(device)
            for index, handle in enumerate(self._handles):
                if nvml.nvmlDeviceGetUUID(handle) == uuid:
                    return index
        except nvml.NVMLError:
            return None
        return None

    def translate(self, data: Any) -> FaultReport | None:
        """An `nvmlEventData_t` (device, eventType, eventData) as a fault report."""
        nvml = self._nvml
        index = self._index_of(data.device)
        if index is None:
            return None
        if data.eventType == nvml.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
            return FaultReport(index, "xid", xid, f"NVML XID {xid}")
        if data.eventType == nvml.nvmlEventTypeDoubleBitEccError:
            return FaultReport(index, "ecc_dbe", None, "NVML double-bit ECC error event")
        if data.eventType == getattr(nvml, "nvmlEventTypeDramRetirementFailure", -1):
            return FaultReport(index, "row_remap_failure", None, "NVML DRAM retirement failure")
        return None

    def poll(self, index: int, handle: Any) -> None:
        """Query what NVML does not send events for; report each fault once."""
        for fault, detail in self._polled_faults(handle):
            if (index, fault) not in self._reported:
                self._reported.add((index, fault))
                self._sink(FaultReport(index, fault, None, detail))

    def _polled_faults(self, handle: Any) -> list[tuple[FaultKind, str]]:
        nvml = self._nvml
        found: list[tuple[FaultKind, str]] = []
        try:
            nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError as error:
            if getattr(error, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST:
                return [("lost", "NVML: GPU is lost")]
        try:
            if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                found.append(("retired_pages", "NVML: retired pages pending (reset needed)"))
        except nvml.NVMLError:
            pass  # not supported (Ampere and later remap rows instead)
        try:
            _corr, _unc, _pending, failure = nvml.nvmlDeviceGetRemappedRows(handle)
            if failure:
                found.append(("row_remap_failure", "NVML: row remapping failed"))
        except nvml.NVMLError:
            pass
        return found


def watch_nvml(backend: Any, sink: FaultSink) -> tuple[NvmlHealthWatcher | None, str | None]:
    """A started watcher for an NVML backend, or None and why not."""
    nvml = getattr(backend, "_nvml", None)
    handles = getattr(backend, "_handles", None)
    if nvml is None or handles is None:
        return None, "not an NVML backend"
    watcher = NvmlHealthWatcher(nvml, handles, sink)
    reason = watcher.start()
    if watcher._thread is None:
        return None, reason
    return watcher, reason


def simulated_fault(request: InjectFault) -> FaultReport:
    """What an injected fault reports, as NVML would have for a real GPU."""
    if request.fault == "xid":
        detail = request.detail or f"injected XID {request.xid}"
        return FaultReport(request.gpu, "xid", request.xid, detail)
    return FaultReport(
        request.gpu, request.fault, None, request.detail or f"injected {request.fault}"
    )


def check_injection(request: InjectFault, backend_kind: str, gpu_count: int) -> str | None:
    """Why an injection must be refused, or None to go ahead."""
    if backend_kind != "sim":
        return "fault injection is refused on real GPUs (this node's backend is nvml)"
    if request.gpu >= gpu_count:
        return f"this node has GPUs 0..{gpu_count - 1}, not {request.gpu}"
    if request.fault == "xid" and request.xid is None:
        return "an injected XID needs its number (--xid N)"
    return None
