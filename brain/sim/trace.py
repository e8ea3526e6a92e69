"""Loading Tiresias-format job traces and cluster shapes.

A trace is a CSV with at least `job_id,num_gpu,submit_time,duration` (Tiresias'
`60_job.csv` and the Philly virtual-cluster files also carry `iterations`,
`model_name` and `interval`, which are read when present). An optional `queue` column
puts each job in a queue, for quotas (`alnair sim --queues`); without it, or where it
is empty, a job is in queue `default`. An optional `priority` column (an integer,
higher first) is what `--policy priority` orders by; a trace without one cannot be
run under it (`TraceJob.priority` is None). An optional `tenant` column names each
job's tenant (None where absent or empty). `duration` is the run time
on the requested GPUs. A bad row is reported with its line and column.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from schemas.base import check_name
from schemas.errors import AlnairError, InvalidName

REQUIRED_COLUMNS: Final = ("job_id", "num_gpu", "submit_time", "duration")


class TraceError(AlnairError, ValueError):
    """A trace or cluster argument that cannot be read; says where and why."""

    def __init__(
        self,
        reason: str,
        *,
        path: str | None = None,
        line: int | None = None,
        column: str | None = None,
    ) -> None:
        where = ":".join(p for p in (path, None if line is None else str(line)) if p)
        prefix = f"{where}: " if where else ""
        col = f"column {column!r}: " if column else ""
        super().__init__(f"{prefix}{col}{reason}")
        self.path = path
        self.line = line
        self.column = column
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceJob:
    job_id: str
    gpus: int
    submit_time: float
    # Run time on the requested GPUs, in seconds.
    duration_s: float
    iterations: int | None = None
    model_name: str = ""
    # Global batch size, for traces whose speed comes from a scaling model (Pollux).
    batch_size: int | None = None
    # An elastic job runs anywhere between these; None for a rigid job.
    min_gpus: int | None = None
    max_gpus: int | None = None
    # The queue whose quota the job counts against (`alnair sim --queues`).
    queue: str = "default"
    # The submitter's priority (higher first), from an optional `priority` column;
    # None when the trace has none.
    priority: int | None = None
    # The submitting tenant, from an optional `tenant` column; None where the trace
    # has no users (all such jobs are one tenant).
    tenant: str | None = None

    @property
    def elastic(self) -> bool:
        return self.min_gpus is not None


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    # Nodes under one switch; None: all under one.
    nodes_per_switch: int | None = None

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


_CLUSTER_PATTERN: Final = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


# The most nodes `--cluster` may ask (the brain is measured at 20,000).
MAX_CLUSTER_NODES: Final = 1_000_000


def parse_cluster(text: str, *, nodes_per_switch: int | None = None) -> ClusterSpec:
    match = _CLUSTER_PATTERN.match(text)
    if match is None:
        raise TraceError(f"cluster {text!r} is not NODESxGPUS, e.g. 12x4")
    nodes, gpus = int(match.group(1)), int(match.group(2))
    if nodes <= 0 or gpus <= 0:
        raise TraceError(f"cluster {text!r} needs at least one node and one GPU per node")
    if nodes > MAX_CLUSTER_NODES or gpus > 256:
        raise TraceError(
            f"cluster {text!r} is larger than a simulation takes "
            f"(at most {MAX_CLUSTER_NODES:,} nodes of at most 256 GPUs)"
        )
    if nodes_per_switch is not None and nodes_per_switch <= 0:
        raise TraceError(f"nodes per switch must be positive, not {nodes_per_switch}")
    return ClusterSpec(nodes, gpus, nodes_per_switch)


def _number(row: dict[str, str | None], column: str, path: str, line: int) -> float:
    raw = row.get(column)
    if raw is None or raw.strip() == "":
        raise TraceError("missing value", path=path, line=line, column=column)
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{raw!r} is not a number", path=path, line=line, column=column) from None
    return trace_number(value, raw, path=path, line=line, column=column)


# The largest number a trace may give (times in seconds, durations, counts): beyond it a
# clock in seconds no longer moves by a second (a time in nanoseconds, say, or `inf`),
# and a replay would never end.
MAX_TRACE_NUMBER: Final = 1e12


def trace_number(value: float, raw: str, *, path: str, line: int, column: str) -> float:
    """`value` (read from `raw`) if it is a finite number from 0 to `MAX_TRACE_NUMBER`;
    else a TraceError naming the file, line and column."""
    if not value >= 0:  # also NaN
        raise TraceError(f"{raw!r} must be >= 0", path=path, line=line, column=column)
    if not math.isfinite(value) or value > MAX_TRACE_NUMBER:
        raise TraceError(
            f"{raw!r} is past {MAX_TRACE_NUMBER:g} (times are in seconds)",
            path=path,
            line=line,
            column=column,
        )
    return value


def _parse_row(row: dict[str, str | None], path: str, line: int) -> TraceJob:
    job_id = (row.get("job_id") or "").strip()
    if not job_id:
        raise TraceError("missing value", path=path, line=line, column="job_id")
    gpus = _number(row, "num_gpu", path, line)
    if gpus < 1 or gpus != int(gpus):
        raise TraceError(
            f"{gpus:g} is not a whole number >= 1", path=path, line=line, column="num_gpu"
        )
    queue = (row.get("queue") or "").strip() or "default"
    try:
        check_name("queue", queue)
    except InvalidName as error:
        raise TraceError(str(error), path=path, line=line, column="queue") from None
    tenant = (row.get("tenant") or "").strip() or None
    if tenant is not None:
        try:
            check_name("tenant", tenant)
        except InvalidName as error:
            raise TraceError(str(error), path=path, line=line, column="tenant") from None
    priority_raw = (row.get("priority") or "").strip()
    priority: int | None = None
    if priority_raw:
        try:
            priority = int(priority_raw)
        except ValueError:
            raise TraceError(
                f"{priority_raw!r} is not a whole number", path=path, line=line, column="priority"
            ) from None
    iterations_raw = (row.get("iterations") or "").strip()
    iterations = None
    if iterations_raw:
        counted = _number(row, "iterations", path, line)
        if counted != int(counted):
            raise TraceError(
                f"{iterations_raw!r} is not a whole number",
                path=path,
                line=line,
                column="iterations",
            )
        iterations = int(counted)
    return TraceJob(
        job_id=job_id,
        gpus=int(gpus),
        submit_time=_number(row, "submit_time", path, line),
        duration_s=_number(row, "duration", path, line),
        iterations=iterations,
        model_name=(row.get("model_name") or "").strip(),
        queue=queue,
        priority=priority,
        tenant=tenant,
    )


def csv_rows(path: str | Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """A CSV trace's rows as (line, {column: stripped value}), after checking that its
    header has every `required` column; TraceError names the file (and line) otherwise."""
    name = str(path)
    try:
        # utf-8-sig: a spreadsheet's export starts with a byte-order mark.
        handle = open(path, newline="", encoding="utf-8-sig")  # noqa: SIM115 - closed below
    except OSError as err:
        raise TraceError(f"cannot open: {err.strerror}", path=name) from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            columns = reader.fieldnames or []
            missing = [c for c in required if c not in columns]
            if missing:
                raise TraceError(
                    f"missing column(s) {', '.join(missing)}; found {', '.join(columns) or 'none'}",
                    path=name,
                    line=1,
                )
            for row in reader:
                if None in row:  # the fields past the header's are kept under None
                    raise TraceError(
                        f"{len(columns) + len(row[None])} fields, and the header names "
                        f"{len(columns)}",
                        path=name,
                        line=reader.line_num,
                    )
                yield reader.line_num, {k: (v or "").strip() for k, v in row.items() if k}
        except UnicodeDecodeError:
            # (Decoded a chunk at a time: where in the file is not known.)
            raise TraceError("not UTF-8 text; save it as UTF-8 CSV", path=name) from None
        except csv.Error as err:
            raise TraceError(f"not a CSV file: {err}", path=name, line=reader.line_num) from None


def load_trace(path: str | Path) -> tuple[TraceJob, ...]:
    """Every job of the trace, by submission time (file order among equals)."""
    name = str(path)
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for line, row in csv_rows(path, REQUIRED_COLUMNS):
        job = _parse_row(dict(row), name, line)
        if job.job_id in seen:
            raise TraceError(
                f"duplicate job id {job.job_id!r}", path=name, line=line, column="job_id"
            )
        seen.add(job.job_id)
        jobs.append(job)
    if not jobs:
        raise TraceError("the trace has no jobs", path=name)
    return tuple(sorted(jobs, key=lambda j: j.submit_time))
