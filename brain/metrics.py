"""The brain's Prometheus metrics: every GPU under dcgm-exporter's names, and the scheduler's own.

GPU series use dcgm-exporter's metric names, units and labels (`gpu`, `UUID`, `device`,
`modelName`, `Hostname`), so dashboards and alerts written for it work unchanged; Alnair
adds `node` (its node name: simulated nodes share a host) and `alnair_job` (the job
holding the GPU, like dcgm-exporter's `pod`; not `job`, which Prometheus reserves for
the scrape job). They are read from the brain's latest telemetry at scrape time.

Scheduler series are named `alnair_*`. Counters follow the brain's journal, its
decisions and the cluster's dead-letter subjects; gauges are read at scrape time.

This module only reads brain state and observes; it never changes either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from brain.core.model import (
    Decisions,
    MemoryPressure,
    Preempt,
    QueueQuota,
    QuotaReclaim,
    Resize,
)
from brain.queues import queue_status
from brain.telemetry import GpuReading, LatestTelemetry
from schemas import subjects
from schemas.api import GpuCensus, QueueStatus, utilisation_bucket
from schemas.events import GpuFault
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeRecord, NodeState
from schemas.state import JobChanged, NodeEventRecorded, StateRecord

if TYPE_CHECKING:
    from brain.service import Brain
    from brain.state import BrainState

log = logging.getLogger(__name__)

# The GPU series' labels (`_gpu_chunks` writes them sorted, as prometheus_client does).
GPU_LABELS: Final = ("gpu", "UUID", "device", "modelName", "Hostname", "node", "alnair_job")
PROFILE_LABELS: Final = ("alnair_job", "tenant", "queue")
# Pending time spans seconds (an idle cluster) to days (a starved queue).
PENDING_BUCKETS: Final = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


# How hard /metrics is compressed: the fastest, which already takes the text to about a
# tenth (repeated label sets).
GZIP_LEVEL: Final = 1


def _go_float(value: float) -> str:
    """A value as prometheus_client writes it (Go's formatting of a float), the common
    case first: a finite value under a million is Python's repr (a third of a
    scrape's time went to the general function)."""
    number = float(value)
    if -math.inf < number < 1e6:
        return repr(number)
    return _go_float_slowly(number)


_go_float_slowly: Final[Callable[[float], str]] = floatToGoString

# dcgm-exporter's fields, with its help texts and units, and what of a GPU each shows
# (None: no line, as dcgm-exporter leaves out a field a GPU does not have).
_GPU_SERIES: Final[tuple[tuple[str, str, Callable[[GpuReading, int], float | None]], ...]] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda r, xid: r.util_gpu_pct),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", lambda r, xid: r.util_mem_pct),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda r, xid: r.mem_used_mib),
    (
        "DCGM_FI_DEV_FB_FREE",
        "Framebuffer memory free (in MiB).",
        lambda r, xid: max(0.0, r.mem_total_mib - r.mem_used_mib),
    ),
    ("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", lambda r, xid: r.mem_total_mib),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda r, xid: r.power_w),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda r, xid: r.temp_c),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda r, xid: r.sm_clock_mhz),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", lambda r, xid: r.mem_clock_mhz),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", lambda r, xid: xid),
    # dcgm-exporter declares this one a counter but keeps its name without `_total`; as
    # a gauge the exposed name stays exactly dcgm-exporter's.
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        lambda r, xid: r.ecc_dbe_total,
    ),
)


# What a node's GPU series say of it: its hostname and each GPU's UUID and model.
_NodeLabels = tuple[str, dict[int, tuple[str, str]]]


def _node_labels(node: NodeRecord) -> _NodeLabels | None:
    """None for a LOST node: its last batch is stale, not a measurement."""
    if node.state is NodeState.LOST:
        return None
    return node.hostname, {gpu.index: (gpu.uuid, gpu.model) for gpu in node.gpus}


@dataclass(frozen=True)
class _GpuView:
    """What the GPU series are made of, copied in the event loop so that they can be
    rendered elsewhere while the loop goes on changing state; plain data, cheap to
    send to the rendering process (`_Renderer`)."""

    telemetry: LatestTelemetry
    # The nodes whose GPUs are shown (not LOST).
    nodes: dict[str, _NodeLabels]
    holders: dict[tuple[str, int], str]
    last_xid: dict[tuple[str, int], int]

    @classmethod
    def take(cls, metrics: BrainMetrics) -> _GpuView:
        brain = metrics.brain
        return cls(
            telemetry=brain.telemetry.copy(),
            nodes=metrics.node_labels(),
            holders=_gpu_holders(brain.state.jobs_in(JobState.RUNNING)),
            last_xid=dict(metrics.last_xid),
        )


class _Renderer:
    """Renders the exposition in a process of its own, started at the first scrape.

    Rendering every GPU's series is seconds of CPU at thousands of nodes (about 2.3 s
    at 20,000 8-GPU nodes, 1.76 million lines). In a thread of the brain's process it
    held the interpreter's lock half the time the loop wanted it, and a brain already
    busy with a node flood fell behind for the length of every scrape. A process has
    its own; the view it is sent is plain data (packed telemetry, label strings).
    Should the process die, that scrape is rendered in a thread, and the next starts
    another process."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def render(self, scheduler: bytes, view: _GpuView, gzip: bool) -> bytes:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _exposition, scheduler, view, gzip)
        except (BrokenProcessPool, OSError) as error:
            # This scrape is rendered here, in a thread; the next starts a process again.
            log.warning("the /metrics rendering process failed (%r): rendering in a thread", error)
            self.close()
            return await asyncio.to_thread(_exposition, scheduler, view, gzip)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class _ClusterCollector(Collector):
    """Gauges read from the brain's state at scrape time."""

    def __init__(self, metrics: BrainMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        brain = self.metrics.brain
        state = brain.state
        queues = brain.config.queues
        statuses = queue_status(
            queues, state.jobs_in(JobState.RUNNING), state.jobs_in(JobState.PENDING)
        )
        yield from self._queues(statuses)
        yield from self._quotas(queues, statuses)
        jobs = GaugeMetricFamily("alnair_jobs", "Jobs the brain knows, by state.", labels=["state"])
        for job_state in JobState:
            jobs.add_metric([job_state.value], len(state.jobs_in(job_state)))
        yield jobs
        yield _waiting(state)
        nodes = GaugeMetricFamily("alnair_nodes", "Nodes by state.", labels=["state"])
        for node_state in NodeState:
            count = sum(1 for n in state.nodes.values() if n.state is node_state)
            nodes.add_metric([node_state.value], count)
        yield nodes
        held = sum(len(g) for g in state.allocated().values())
        yield GaugeMetricFamily(
            "alnair_gpus_schedulable",
            "GPUs the scheduler may use (healthy, on READY nodes).",
            value=state.capacity(),
        )
        yield GaugeMetricFamily("alnair_gpus_allocated", "GPUs held by running jobs.", value=held)
        yield GaugeMetricFamily(
            "alnair_brain_leader", "1 while this brain leads.", value=int(brain.leading.is_set())
        )
        yield GaugeMetricFamily(
            "alnair_brain_state_seq", "Last STATE log sequence applied.", value=state.last_seq
        )
        yield from self._census()
        yield from self._ingest()
        yield from self._profiles()
        yield from self._shares()

    def _census(self) -> Iterator[Metric]:
        """Every GPU counted by what it is doing, and READY nodes' GPUs by utilisation:
        the cluster in a few series, where the per-GPU ones are millions of lines."""
        census = self.metrics.census
        if census is None:
            return
        by_state = GaugeMetricFamily(
            "alnair_gpus_by_state",
            "GPUs by what they are doing: each in exactly one state "
            "(unavailable: on nodes not heard from).",
            labels=["state"],
        )
        for name in ("busy", "shared", "free", "drained", "unavailable"):
            by_state.add_metric([name], getattr(census, name))
        yield by_state
        by_util = GaugeMetricFamily(
            "alnair_gpus_by_utilisation",
            "READY nodes' GPUs by their latest utilisation (percent range).",
            labels=["percent"],
        )
        for index, count in enumerate(census.utilisation):
            by_util.add_metric([utilisation_bucket(index)], count)
        yield by_util
        yield GaugeMetricFamily(
            "alnair_gpus_unreported",
            "READY nodes' GPUs with no telemetry sample yet.",
            value=census.unreported,
        )

    def _shares(self) -> Iterator[Metric]:
        """Each shared GPU's jobs: their share, GPU memory limit and use (from the
        agents' heartbeats)."""
        brain = self.metrics.brain
        labels = ["node", "gpu", "job", "enforcement"]
        share = GaugeMetricFamily(
            "alnair_gpu_share", "A job's share of a shared GPU (0..1).", labels=labels
        )
        limit = GaugeMetricFamily(
            "alnair_gpu_share_memory_limit_mib",
            "A shared GPU job's GPU memory limit (MiB; MPS pinned memory).",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "alnair_gpu_share_memory_used_mib",
            "GPU memory a shared GPU job's processes use (MiB).",
            labels=labels,
        )
        for node in sorted(brain.state.nodes):
            for gpu in brain.shares(node):
                for use in gpu.jobs:
                    names = [node, str(gpu.index), use.job_id, gpu.enforcement]
                    share.add_metric(names, use.gpu_milli / 1000)
                    if use.memory_limit_mib is not None:
                        limit.add_metric(names, use.memory_limit_mib)
                    if use.memory_used_mib is not None:
                        used.add_metric(names, use.memory_used_mib)
        yield from (share, limit, used)

    def _ingest(self) -> Iterator[Metric]:
        """Heartbeats and telemetry (brain/ingest.py): what arrived, what was news, and
        what was shed because the brain fell behind."""
        brain = self.metrics.brain
        counts = brain.ingest.counts
        dropped = brain.ingest_bus.dropped
        yield CounterMetricFamily(
            "alnair_ingest_heartbeats",
            "Heartbeats received while leading.",
            value=counts.heartbeats,
        )
        yield CounterMetricFamily(
            "alnair_ingest_heartbeats_forwarded",
            "Heartbeats with news (a node new, back, or changed) handed to the decision loop.",
            value=counts.heartbeats_forwarded,
        )
        yield CounterMetricFamily(
            "alnair_ingest_telemetry", "Telemetry batches received.", value=counts.telemetry
        )
        yield CounterMetricFamily(
            "alnair_telemetry_shed",
            "Telemetry batches dropped unread because the brain fell behind.",
            value=dropped[subjects.ALL_TELEMETRY],
        )
        journal = brain.journal
        yield CounterMetricFamily(
            "alnair_journal_groups",
            "Groups of state records committed to the log (one fenced, pipelined append each).",
            value=journal.groups,
        )
        yield CounterMetricFamily(
            "alnair_journal_records", "State records committed to the log.", value=journal.records
        )
        yield CounterMetricFamily(
            "alnair_journal_commands_sent",
            "Commands published after their records were stored.",
            value=journal.commands_sent,
        )
        yield GaugeMetricFamily(
            "alnair_journal_commands_queued",
            "Commands whose records are stored, not yet taken by the command stream.",
            value=journal.queued,
        )
        yield CounterMetricFamily(
            "alnair_journal_commands_unsent",
            "Commands that did not go out after their records were stored (sent again or "
            "undone where they are watched).",
            value=journal.commands_unsent,
        )
        yield CounterMetricFamily(
            "alnair_heartbeats_dropped",
            "Heartbeats dropped unread because the brain fell far behind (should stay 0).",
            value=dropped[subjects.ALL_HEARTBEATS],
        )

    @staticmethod
    def _queues(statuses: list[QueueStatus]) -> Iterator[Metric]:
        length = GaugeMetricFamily(
            "alnair_queue_pending_jobs", "Pending jobs, by queue.", labels=["queue"]
        )
        gpus = GaugeMetricFamily(
            "alnair_queue_pending_gpus",
            "GPUs asked for by pending jobs, by queue.",
            labels=["queue"],
        )
        for status in statuses:
            if status.pending_jobs:
                length.add_metric([status.name], status.pending_jobs)
                gpus.add_metric([status.name], status.pending_gpus)
        yield length
        yield gpus

    @staticmethod
    def _quotas(queues: tuple[QueueQuota, ...], statuses: list[QueueStatus]) -> Iterator[Metric]:
        """What each queue holds beside what it is guaranteed: a queue over its
        guarantee borrows (and its jobs past it may be preempted), one under it is owed
        GPUs that other queues' jobs give back when it asks (docs/policies.md)."""
        guaranteed = GaugeMetricFamily(
            "alnair_queue_guaranteed_gpus",
            "GPUs each configured queue is guaranteed (alnair brain --queues), and its class.",
            labels=["queue", "class"],
        )
        for quota in queues:
            guaranteed.add_metric([quota.name, quota.job_class], quota.guaranteed_gpus)
        held = GaugeMetricFamily(
            "alnair_queue_running_gpus",
            "GPUs held by running jobs, by queue (a share of a GPU counts as its share).",
            labels=["queue"],
        )
        jobs = GaugeMetricFamily(
            "alnair_queue_running_jobs", "Running jobs, by queue.", labels=["queue"]
        )
        for status in statuses:
            # Every configured queue (0 when it holds none), and any other that holds some.
            if status.listed or status.running_jobs:
                held.add_metric([status.name], status.running_gpus)
                jobs.add_metric([status.name], status.running_jobs)
        yield guaranteed
        yield held
        yield jobs

    def _profiles(self) -> Iterator[Metric]:
        brain = self.metrics.brain

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=PROFILE_LABELS)

        mean = family("alnair_job_gpu_util_mean_percent", "A running job's mean GPU utilisation.")
        p95 = family("alnair_job_gpu_util_p95_percent", "A running job's p95 GPU utilisation.")
        peak = family("alnair_job_gpu_mem_peak_mib", "A running job's peak GPU memory (MiB).")
        period = family("alnair_job_period_seconds", "A running job's detected cycle.")
        next_util = family(
            "alnair_job_gpu_util_forecast_percent", "Forecast GPU utilisation, next window."
        )
        next_mem = family("alnair_job_gpu_mem_forecast_mib", "Forecast peak GPU memory (MiB).")
        underused = family(
            "alnair_job_underused", "1 when a running job holds GPUs it barely uses."
        )
        idle = family("alnair_job_idle_gpus", "Held GPUs below the barely-used line.")
        for profile in brain.profiles.running_profiles():
            job = brain.state.jobs.get(profile.job_id)
            if job is None or job.state is not JobState.RUNNING:
                continue
            labels = [job.job_id, job.tenant, job.spec.queue]
            mean.add_metric(labels, profile.mean_util_pct)
            p95.add_metric(labels, profile.p95_util_pct)
            peak.add_metric(labels, profile.mem_peak_mib)
            if profile.period_s is not None:
                period.add_metric(labels, profile.period_s)
            next_util.add_metric(labels, profile.forecast_util_pct)
            next_mem.add_metric(labels, profile.forecast_mem_mib)
            underused.add_metric(labels, int(profile.underused))
            idle.add_metric(labels, profile.idle_gpus)
        yield from (mean, p95, peak, period, next_util, next_mem, underused, idle)


class BrainMetrics:
    """One brain's registry. Create it before the brain starts; `start()` once it has."""

    def __init__(self, brain: Brain) -> None:
        self.brain = brain
        self.registry = CollectorRegistry(auto_describe=False)
        # (node, GPU index) -> the last XID it reported, as dcgm-exporter shows it.
        self.last_xid: dict[tuple[str, int], int] = {}
        # job id -> when it last became pending, to time its wait.
        self._pending_since: dict[str, float] = {}
        self._dlq_sub: Subscription | None = None
        self._renderer = _Renderer()
        # The GPU census as of the scrape being rendered (`_ClusterCollector._census`).
        self.census: GpuCensus | None = None
        # node -> (the record its labels were read from, its labels): read again only
        # when the node's record changes.
        self._labels: dict[str, tuple[NodeRecord, _NodeLabels | None]] = {}
        registry = self.registry
        self.pending_seconds = Histogram(
            "alnair_job_pending_seconds",
            "Time from becoming pending (submission or requeue) to being placed.",
            ["queue"],
            buckets=PENDING_BUCKETS,
            registry=registry,
        )
        self.decisions = Counter(
            "alnair_scheduler_decisions",
            "Actions the policy core decided, by action.",
            ["action"],
            registry=registry,
        )
        self.cycles = Counter(
            "alnair_scheduler_cycles", "Scheduling cycles (calls to decide).", registry=registry
        )
        self.preemptions = Counter(
            "alnair_scheduler_preemptions",
            "Preemptions the policy core decided, by cause.",
            ["cause"],
            registry=registry,
        )
        self.resizes = Counter(
            "alnair_scheduler_resizes",
            "Resizes of elastic jobs the policy core decided, by cause.",
            ["cause"],
            registry=registry,
        )
        self.transitions = Counter(
            "alnair_job_transitions",
            "Job state changes journaled, by new state and cause.",
            ["state", "cause"],
            registry=registry,
        )
        self.outcomes = Counter(
            "alnair_job_outcomes",
            "Jobs that ended, by final state and failure class.",
            ["state", "failure_class"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "alnair_dead_letters",
            "Messages any component refused and dead-lettered, by origin.",
            ["origin"],
            registry=registry,
        )
        registry.register(_ClusterCollector(self))
        brain.record_observers.append(self.on_record)
        brain.decision_observers.append(self.on_decisions)

    async def start(self) -> None:
        """Count dead letters cluster-wide: every component publishes them on the bus."""
        self._dlq_sub = await self.brain.bus.nc.subscribe(subjects.ALL_DLQ, cb=self._on_dead_letter)

    async def stop(self) -> None:
        self._renderer.close()
        if self._dlq_sub is not None:
            try:
                await self._dlq_sub.unsubscribe()
            except Exception as error:  # the connection may already be closed
                log.debug("dead-letter subscription: %r", error)
            self._dlq_sub = None

    async def render(self, *, gzip: bool = False) -> bytes:
        """The exposition: the scheduler's series rendered in the loop (cheap), every
        GPU's from a copy taken in the loop and rendered in a process of its own
        (`_Renderer`: seconds at thousands of nodes). `gzip`: all of it compressed
        there too, as it is rendered (Prometheus asks for it; at 20,000 8-GPU nodes the
        text is about 270 MB, and gzip takes it to about a thirtieth)."""
        self.census = await self.brain.api.census()
        scheduler = generate_latest(self.registry)
        return await self._renderer.render(scheduler, _GpuView.take(self), gzip)

    def node_labels(self) -> dict[str, _NodeLabels]:
        """Every shown node's labels, kept from one scrape to the next by record."""
        nodes = self.brain.state.nodes
        kept = self._labels
        if len(kept) > len(nodes):
            self._labels = kept = {name: kept[name] for name in nodes if name in kept}
        shown: dict[str, _NodeLabels] = {}
        for name, record in nodes.items():
            entry = kept.get(name)
            if entry is None or entry[0] is not record:
                entry = kept[name] = (record, _node_labels(record))
            if entry[1] is not None:
                shown[name] = entry[1]
        return shown

    async def _on_dead_letter(self, msg: Msg) -> None:
        origin = msg.subject.removeprefix(f"{subjects.PREFIX}.dlq.") or "unknown"
        self.dead_letters.labels(origin=origin[:64]).inc()

    def on_decisions(self, decisions: Decisions) -> None:
        self.cycles.inc()
        for action in decisions.actions:
            self.decisions.labels(action=_action_name(action)).inc()
            if isinstance(action, Preempt):
                cause = (
                    "quota_reclaim"
                    if isinstance(action.cause, QuotaReclaim)
                    else "memory_pressure"
                    if isinstance(action.cause, MemoryPressure)
                    else "outranked"
                )
                self.preemptions.labels(cause=cause).inc()
            elif isinstance(action, Resize):
                self.resizes.labels(cause=action.cause.kind).inc()

    def on_record(self, record: StateRecord, seq: int) -> None:
        if isinstance(record, NodeEventRecorded):
            event = record.event
            if isinstance(event, GpuFault) and event.xid is not None:
                self.last_xid[(event.node, event.gpu)] = event.xid
            return
        if not isinstance(record, JobChanged):
            return
        job = record.job
        self.transitions.labels(state=job.state.value, cause=record.cause.kind.value).inc()
        if job.state is JobState.PENDING and record.previous is not JobState.PENDING:
            self._pending_since[job.job_id] = record.ts
        elif job.state is JobState.RUNNING and record.previous is JobState.PENDING:
            since = self._pending_since.pop(job.job_id, job.submitted_at)
            self.pending_seconds.labels(queue=job.spec.queue).observe(max(0.0, record.ts - since))
        if job.state.terminal and (record.previous is None or not record.previous.terminal):
            self._pending_since.pop(job.job_id, None)
            self.outcomes.labels(state=job.state.value, failure_class=_failure_class(job)).inc()


def _exposition(scheduler: bytes, view: _GpuView, gzip: bool) -> bytes:
    """The scheduler's series, then every GPU's; gzip-compressed a family at a time if
    asked, so that the whole text is never held at once."""
    if not gzip:
        return b"".join((scheduler, *_gpu_chunks(view)))
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [compressor.compress(scheduler)]
    parts += [compressor.compress(chunk) for chunk in _gpu_chunks(view)]
    parts.append(compressor.flush())
    return b"".join(parts)


def _gpu_chunks(view: _GpuView) -> Iterator[bytes]:
    """Every GPU's series in the text exposition format, a family at a time, written
    here rather than by prometheus_client: its `generate_latest` makes a sample object
    per line and escapes and sorts the line's labels anew, about 27 µs a line, which at
    20,000 8-GPU nodes (1.76 million lines) is 48 CPU-seconds a scrape. Here a GPU's
    labels are written once for its eleven lines. The bytes are prometheus_client's,
    labels in its order (tests/test_metrics_render.py renders the same view both
    ways)."""
    gpus: list[tuple[str, GpuReading, int]] = []
    telemetry, holders, last_xid = view.telemetry, view.holders, view.last_xid
    for name in sorted(telemetry):
        node = view.nodes.get(name)
        if node is None:
            continue  # unknown, or LOST: its last batch is not a measurement
        hostname, infos = node
        host, node_label = _label_value(hostname), _label_value(name)
        for reading in telemetry.readings(name) or ():
            index = reading.gpu
            uuid, model = infos.get(index, ("", ""))
            labels = (
                f'Hostname="{host}",'
                f'UUID="{_label_value(uuid)}",'
                f'alnair_job="{_label_value(holders.get((name, index), ""))}",'
                f'device="nvidia{index}",gpu="{index}",'
                f'modelName="{_label_value(model)}",'
                f'node="{node_label}"'
            )
            gpus.append((labels, reading, last_xid.get((name, index), 0)))
    for metric, doc, value_of in _GPU_SERIES:
        lines = [f"# HELP {metric} {doc}\n# TYPE {metric} gauge\n"]
        for labels, reading, xid in gpus:
            value = value_of(reading, xid)
            if value is not None:
                lines.append(f"{metric}{{{labels}}} {_go_float(value)}\n")
        yield "".join(lines).encode()


def _label_value(value: str) -> str:
    """A label's value as the text format escapes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _action_name(action: object) -> str:
    """`Place` -> `place`, `SetServiceLevel` -> `set_service_level`."""
    name = type(action).__name__
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _failure_class(job: JobRecord) -> str:
    """User, infrastructure or input (Philly): the class of the attempt that ended it."""
    if job.state not in (JobState.FAILED, JobState.UNSUCCESSFUL):
        return "none"
    return job.failures[-1].failure_class.value if job.failures else "unclassified"


def _waiting(state: BrainState) -> GaugeMetricFamily:
    """Pending jobs by the kind of their wait (`BrainState.waits_by_kind`): what an
    operator asks first of a long queue."""
    family = GaugeMetricFamily(
        "alnair_jobs_waiting", "Pending jobs by why they wait.", labels=["kind"]
    )
    for kind, count in sorted(state.waits_by_kind().items()):
        family.add_metric([kind], count)
    return family


def _gpu_holders(running: list[JobRecord]) -> dict[tuple[str, int], str]:
    return {
        (grant.node, gpu): job.job_id
        for job in running
        for grant in job.grants
        for gpu in grant.gpus
    }
