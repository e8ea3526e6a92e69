"""`alnair`: the one command for operators, users and the components themselves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import difflib
import json
import logging
import math
import os
import re
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import ValidationError

from agents.joblogs import DEFAULT_KEEP_DAYS, DEFAULT_MAX_TOTAL_SHARE
from bus.auth import inbox_prefix_for_seed
from cli import confine, failures, why
from cli import format as fmt
from cli.arguments import (
    MAX_ARRAY_JOBS,
    ArraySpec,
    array_argument,
    duration,
    duration_seconds,
    number_or_zero,
    positive_number,
    unit_seconds,
    whole_number,
)
from cli.client import call, open_bus, submit
from cli.config import alnair_home, resolve_nats, resolve_nkey, resolve_tls
from schemas import subjects
from schemas.api import (
    HISTORY_RESULT,
    JOB_RESULT,
    JOBS_RESULT,
    NODES_RESULT,
    OPERATOR_TENANT,
    QUEUES_RESULT,
    STATUS_RESULT,
    THROTTLE_RESULT,
    CancelRequest,
    GetJobRequest,
    HistoryRequest,
    ListJobsRequest,
    ListNodesRequest,
    ListQueuesRequest,
    ResizeRequest,
    StatusRequest,
    ThrottleRequest,
)
from schemas.base import check_name, describe_invalid
from schemas.errors import AlnairError, ApiError, BrainUnavailable, BusTimeout
from schemas.jobs import (
    MAX_ARRAY_INDEX,
    MAX_GPUS_PER_JOB,
    JobRecord,
    JobSpec,
    JobState,
    share_request,
)
from schemas.nodes import NodeStatus
from schemas.state import (
    STATE_RECORD,
    StateRecord,
    record_job_id,
    record_kind,
    record_kinds,
    record_node,
)
from schemas.yamlfile import load_yaml, read_text

log = logging.getLogger("alnair")


class UsageError(AlnairError):
    pass


COMPONENTS = frozenset({"up", "brain", "agent"})


def _setup_logging(verbose: bool, command: str) -> None:
    quiet = logging.INFO if command in COMPONENTS else logging.WARNING
    logging.basicConfig(
        level=logging.DEBUG if verbose else quiet,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        help="NATS URL(s), comma-separated (default: $ALNAIR_NATS, else the local cluster)",
    )
    parser.add_argument(
        "--creds", default=os.environ.get("ALNAIR_CREDS"), help="NATS credentials file"
    )
    parser.add_argument(
        "--nkey",
        help="this identity's nkey seed file, from `alnair keys` (default: $ALNAIR_NKEY, "
        "else the local secure cluster's)",
    )
    parser.add_argument(
        "--tls-ca",
        help="connect over TLS, trusting this CA (default: $ALNAIR_TLS_CA, else the local "
        "cluster's, from `alnair up --tls`)",
    )
    parser.add_argument(
        "--tls-cert", help="client certificate, for servers that verify clients ($ALNAIR_TLS_CERT)"
    )
    parser.add_argument("--tls-key", help="the client certificate's key ($ALNAIR_TLS_KEY)")


def _absolute(path: str | None) -> str | None:
    """A file named relative to here, as a process started elsewhere must name it."""
    return os.path.abspath(path) if path else None


def _with_tls(options: Any, args: argparse.Namespace) -> Any:
    """`options` (a ConnectOptions) with the TLS files from --tls-*, the environment or
    the local cluster."""
    tls = resolve_tls(args.tls_ca, args.tls_cert, args.tls_key)
    if tls is None:
        return options
    return dataclasses.replace(options, tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)


def _client_args(parser: argparse.ArgumentParser) -> None:
    _connection_args(parser)
    parser.add_argument(
        "--tenant",
        default=os.environ.get("ALNAIR_TENANT", "default"),
        help="tenant to act as (default: $ALNAIR_TENANT or 'default')",
    )


async def _with_bus(
    args: argparse.Namespace, fn: Callable[[Any], Awaitable[int]], *, as_tenant: str | None = None
) -> int:
    """Run `fn` on a bus connected as the command's tenant (`as_tenant`: another one, the
    operator for reading the log): on a local secure cluster, with that tenant's seed."""
    bus = await open_bus(
        resolve_nats(args.nats),
        name="alnair-cli",
        credentials=args.creds,
        nkey=resolve_nkey(args.nkey, tenant=as_tenant or args.tenant),
        tls=resolve_tls(args.tls_ca, args.tls_cert, args.tls_key),
    )
    try:
        return await fn(bus)
    finally:
        await bus.close()


# -- submit ---------------------------------------------------------------------------


def load_spec(args: argparse.Namespace) -> JobSpec:
    words: list[str] = list(args.command)
    dashed = bool(words) and words[0] == "--"
    if dashed:
        words = words[1:]
    if not dashed and len(words) > 1 and words[0].endswith((".yaml", ".yml")):
        # `submit job.yaml --gpus 2`: argparse stops reading options at the file.
        rest = " ".join(shlex.quote(w) for w in words[1:])
        raise UsageError(
            f"{words[0]}: nothing may follow a job file; put options before it "
            f"(alnair submit {rest} {shlex.quote(words[0])})"
        )
    if len(words) == 1 and words[0].endswith((".yaml", ".yml")):
        if Path(words[0]).is_file():
            return _spec_from_yaml(Path(words[0]), args)
        if not dashed:
            raise UsageError(f"{words[0]}: no such job file (a command goes after `--`)")
    if not words:
        raise UsageError("nothing to run: give a command after `--`, or a job.yaml")
    if args.gpus is None:
        raise UsageError("--gpus N is required")
    fields: dict[str, Any] = {
        "command": words,
        "gpus": args.gpus,
        "name": args.name or Path(words[0]).name,
        "queue": args.queue,
        "priority": args.priority,
        "env": _env_pairs(args.env),
        # A relative --cwd is of the directory the command runs in (as sbatch's).
        "cwd": os.path.abspath(args.cwd) if args.cwd else os.getcwd(),
        **_policy_hints(args),
        **_elastic_fields(args),
        **_share_fields(args),
    }
    return _validated(fields, "the command line")


_SIZE: Final = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?\s*$", re.I)
_MIB_PER: Final = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_mib(text: str, option: str) -> int:
    """`20GiB`, `512M`, `80g`, `2048` (MiB) as MiB; binary units whatever the spelling."""
    match = _SIZE.match(text)
    if match is None or (match["unit"] and match["unit"].upper() == "B"):
        raise UsageError(f"{option} takes a size such as 20GiB or 512MiB, not {text!r}")
    unit = (match["unit"] or "M")[0].upper()
    mib = float(match["n"]) * _MIB_PER[unit]
    if not mib < 2**53:  # past what a float counts exactly (inf, for 400 digits)
        raise UsageError(f"{option} {text!r} is more memory than any machine has")
    if mib < 1 or (not mib.is_integer() and mib < 1024):
        raise UsageError(f"{option} {text!r} is less than a MiB or not a whole number of MiB")
    return round(mib)


def _logs_total(text: str) -> tuple[int | None, float | None]:
    """`agent --job-logs-max-total`: a size (`50GiB`), a share of the logs' filesystem
    (`10%`), or 0 (no bound), as AgentConfig's (MiB, share)."""
    text = text.strip()
    if text == "0":
        return None, None
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = math.nan
        if not 0 < percent <= 100:
            raise UsageError(
                f"--job-logs-max-total takes a share of the disk from 0 to 100% (such as "
                f"10%), a size (such as 50GiB) or 0, not {text!r}"
            )
        return None, percent / 100
    return parse_mib(text, "--job-logs-max-total"), None


# A log sequence: the log's first entry is 1.
_sequence = whole_number(1, None, "a log sequence (1 or more)")


@dataclasses.dataclass(frozen=True)
class Since:
    """`events --since` as a time (seconds since the epoch), not a log sequence."""

    ts: float


def _since(text: str) -> int | Since:
    """`--since 120` (a log sequence), `--since 10m` (that long ago: s, m, h or d) or
    `--since 2026-12-04T13:00` (a time: local unless it says its zone)."""
    text = text.strip()
    if text.isascii() and text.isdigit():
        return _sequence(text)
    if (ago := unit_seconds(text)) is not None:
        return Since(time.time() - ago)
    try:
        return Since(datetime.datetime.fromisoformat(text).timestamp())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log sequence (1 or more), a time ago such as 10m or 2h, "
            "or a time such as 2026-12-04T13:00"
        ) from None


def gpus_arg(text: str) -> int | float:
    """`--gpus 2` (whole GPUs) or `--gpus 0.25` (a share of one GPU)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GPUs: {text!r}") from None
    return int(value) if value.is_integer() else value


def _share_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`--gpu-memory 20GiB --gpu-type H100,A100 --cpus 4 --memory 32GiB`."""
    fields: dict[str, Any] = {}
    if args.gpu_memory is not None:
        fields["gpu_memory_mib"] = parse_mib(args.gpu_memory, "--gpu-memory")
    if args.gpu_type:
        types = [t.strip() for value in args.gpu_type for t in value.split(",") if t.strip()]
        if not types:
            # Not "any type": that is what leaving the option out says.
            raise UsageError(f"--gpu-type names no type: {','.join(args.gpu_type)!r}")
        fields["gpu_types"] = types
    if args.cpus is not None:
        fields["cpus"] = args.cpus
    if args.memory is not None:
        fields["memory_mib"] = parse_mib(args.memory, "--memory")
    if args.shareable:
        fields["shareable"] = True
    return fields


def _policy_hints(args: argparse.Namespace) -> dict[str, Any]:
    """What the command line tells the queue order and placement about the job."""
    hints: dict[str, Any] = {}
    if args.duration is not None:
        hints["declared_duration_s"] = args.duration
    if args.time is not None:
        hints["time_limit_s"] = args.time
    # `--after 5,7 --after 9`: the jobs it runs after, once each has SUCCEEDED;
    # `--after-any`: once each has ended, however.
    for option, field in (("after", "after"), ("after_any", "after_any")):
        values = getattr(args, option)
        if values:
            hints[field] = [j.strip() for value in values for j in value.split(",") if j.strip()]
    if args.network_sensitive:
        hints["network_sensitive"] = True
    if args.on_disconnect is not None:
        hints["on_disconnect"] = args.on_disconnect
    return hints


def _elastic_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`--elastic --min-gpus A --max-gpus B`: the job runs on A..B GPUs under the
    elastic supervisor, starting on `--gpus`. The spec's own check refuses a range
    without `--elastic`, or a start outside it."""
    fields: dict[str, Any] = {}
    if args.elastic:
        fields["elastic"] = True
    if args.min_gpus is not None:
        fields["min_gpus"] = args.min_gpus
    if args.max_gpus is not None:
        fields["max_gpus"] = args.max_gpus
    return fields


def _spec_from_yaml(path: Path, args: argparse.Namespace) -> JobSpec:
    try:
        data = load_yaml(read_text(path))
    except OSError as error:
        raise UsageError(f"{path}: cannot read: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of job fields (name, command, gpus, ...)")
    if isinstance(data.get("command"), str):
        data["command"] = shlex.split(data["command"])
    data = _yaml_fields(data, path)
    data.setdefault("cwd", str(path.resolve().parent))
    if isinstance(data["cwd"], str) and data["cwd"] and not os.path.isabs(data["cwd"]):
        data["cwd"] = str(path.resolve().parent / data["cwd"])  # of the job file's directory
    if args.gpus is not None:
        data["gpus"] = args.gpus
    if args.name:
        data["name"] = args.name
    data.update(_policy_hints(args))
    data.update(_elastic_fields(args))
    data.update(_share_fields(args))
    return _validated(data, str(path))


# A job file may give sizes and times as the flags take them (`gpu_memory: 20GiB`,
# `time_limit: 2h`).
_YAML_SIZES: Final = {"gpu_memory": "gpu_memory_mib", "memory": "memory_mib"}
_YAML_TIMES: Final = {"time_limit": "time_limit_s"}


def _yaml_fields(data: dict[Any, Any], path: Path) -> dict[str, Any]:
    """A job file's fields as the spec takes them, or a refusal that says what to write:
    sizes and times with units converted (`_with_units`); a field that is not one named,
    with the nearest that is; job ids YAML read as numbers as text; an environment value
    that YAML read as a number or a boolean told to be quoted (its text as written is
    gone by then: `0.10` reads 0.1)."""
    fields = _with_units(dict(data), path)
    known = set(JobSpec.model_fields) | set(_YAML_SIZES) | set(_YAML_TIMES)
    for name in fields:
        if name not in known:
            near = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise UsageError(
                f"invalid job in {path}: {name} is not a job field{hint}; the fields are "
                f"{', '.join(sorted(known))}"
            )
    for field in ("after", "after_any"):
        after = fields.get(field)
        if isinstance(after, list | tuple):
            # `after: [5, 7]`: job ids, which YAML reads as numbers.
            fields[field] = [str(job_id) if isinstance(job_id, int) else job_id for job_id in after]
    env = fields.get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(value, bool | int | float):
                raise UsageError(
                    f"invalid job in {path}: env.{key}: YAML read {value!r}, not text: quote "
                    f'it ({key}: "{value}"); environment values are strings'
                )
    return fields


def _with_units(fields: dict[str, Any], path: Path) -> dict[str, Any]:
    """`gpu_memory: 20GiB` as `gpu_memory_mib`, `time_limit: 2h` as `time_limit_s`."""
    for name, spec_name in (*_YAML_SIZES.items(), *_YAML_TIMES.items()):
        if name not in fields:
            continue
        if spec_name in fields:
            raise UsageError(f"invalid job in {path}: {name} and {spec_name}: give one")
        text = str(fields.pop(name))
        if name in _YAML_SIZES:
            fields[spec_name] = parse_mib(text, name)
            continue
        try:
            fields[spec_name] = duration_seconds(text)
        except ValueError as error:
            raise UsageError(f"invalid job in {path}: {name}: {error}") from None
    return fields


def _validated(fields: dict[str, Any], where: str) -> JobSpec:
    try:
        fields = share_request(fields)
    except ValueError as error:
        raise UsageError(f"invalid job in {where}: {error}") from None
    try:
        return JobSpec.model_validate(fields)
    except ValidationError as error:
        raise UsageError(f"invalid job in {where}: {describe_invalid(error, 'job')}") from None


def _env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--env takes NAME=VALUE, not {pair!r}")
        env[name] = value
    return env


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args)
    key = args.idempotency_key
    if key is not None and not 1 <= len(key) <= 128:
        raise UsageError(f"--idempotency-key must be 1 to 128 characters, not {len(key)}")
    if args.array is not None:
        return await _submit_array(args, spec, args.array)

    async def run(bus: Any) -> int:
        job = await submit(
            bus, args.tenant, spec, idempotency_key=args.idempotency_key, retry_for_s=args.retry_for
        )
        if args.json:
            print(job.model_dump_json())
        else:
            size = spec.gpu_request
            if spec.elastic:
                low, high = spec.gpu_range
                size += f", elastic {low}..{high}"
            print(f"submitted job {job.job_id} ({size}, queue {spec.queue})", flush=True)
        return 0 if not args.wait else await _wait_for_end(bus, args.tenant, job.job_id)

    return await _with_bus(args, run)


async def _submit_array(args: argparse.Namespace, spec: JobSpec, array: ArraySpec) -> int:
    """`submit --array`: one job per index, in order, each with the array's key and its
    index as its idempotency key, so the same command again (with `--idempotency-key`)
    makes no job twice. The array is named by that key; with `%N`, at most N of its
    jobs hold GPUs at once (`JobSpec.array_limit`: the brain starts the next as one
    ends)."""
    base = args.idempotency_key or uuid.uuid4().hex
    if len(base) > 120:
        raise UsageError("--idempotency-key of an array must be at most 120 characters")
    specs = []
    for index in array.indices:
        fields = spec.model_dump() | {
            "name": f"{spec.name[:110]}[{index}]",
            "array_index": index,
            "array": base,
            "array_limit": array.at_once,
        }
        specs.append(_validated(fields, "--array"))

    async def run(bus: Any) -> int:
        ids: list[str] = []
        for index, element in zip(array.indices, specs, strict=True):
            try:
                job = await submit(
                    bus,
                    args.tenant,
                    element,
                    idempotency_key=f"{base}-{index}",
                    retry_for_s=args.retry_for,
                )
            except AlnairError as error:
                done = f"jobs {_id_ranges(ids)} were submitted; " if ids else ""
                raise AlnairError(
                    f"index {index} of the array was not submitted ({error}); {done}the same "
                    f"command with --idempotency-key {base} submits the rest, none twice"
                ) from None
            ids.append(job.job_id)
            if args.json:
                print(job.model_dump_json(), flush=True)
        if not args.json:
            at_once = f", at most {array.at_once} at once" if array.at_once else ""
            print(
                f"submitted jobs {_id_ranges(ids)} (array {base} of {len(ids)}{at_once}; "
                f"{spec.gpu_request} each, queue {spec.queue}; alnair jobs --array {base})",
                flush=True,
            )
        if not args.wait:
            return 0
        codes = [await _wait_for_end(bus, args.tenant, job_id) for job_id in ids]
        return max(codes)

    return await _with_bus(args, run)


def _id_ranges(ids: list[str]) -> str:
    """Job ids as runs: `12-21,25` (ids that are not numbers as they are)."""
    runs: list[list[int]] = []
    words: list[str] = []
    for job_id in ids:
        if not job_id.isdigit():
            words.append(job_id)
        elif runs and int(job_id) == runs[-1][1] + 1:
            runs[-1][1] += 1
        else:
            runs.append([int(job_id), int(job_id)])
    said = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    return ",".join(said + words)


async def _wait_for_end(bus: Any, tenant: str, job_id: str) -> int:
    """`submit --wait` (as `sbatch --wait`): until the job ends; the exit status is the
    job's own exit code when it ran to one, 0 for SUCCEEDED, else 1. A brain that does
    not answer for a while (a failover) is asked again."""
    ask = GetJobRequest(job_id=job_id)
    while True:
        try:
            job = (await call(bus, tenant, "job", ask, JOB_RESULT)).job
        except (BrainUnavailable, BusTimeout):
            job = None
        if job is not None and job.state.terminal:
            break
        await asyncio.sleep(1.0)
    print(f"job {job.job_id} {job.state.value}: {job.reason or job.state.value}")
    if job.state is JobState.SUCCEEDED:
        return 0
    return job.exit_code if job.exit_code else 1


# -- queries --------------------------------------------------------------------------


def job_json(job: JobRecord) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "tenant": job.tenant,
        "queue": job.spec.queue,
        "state": job.state.value,
        "gpus": job.spec.gpus,
        "gpu_request": job.spec.gpu_request,
        "gpu_share": None if job.spec.gpu_milli is None else job.spec.gpu_milli / 1000,
        "gpu_memory_mib": job.spec.gpu_memory_mib,
        "gpu_types": list(job.spec.gpu_types),
        "cpus": job.spec.cpus,
        "memory_mib": job.spec.memory_mib,
        "shareable": job.spec.shareable,
        "nodes": [{"node": g.node, "gpus": list(g.gpus)} for g in job.grants],
        "attempts": job.attempt,
        "exit_code": job.exit_code,
        "signal": job.signal,
        "reason": job.reason,
        "submitted_at": job.submitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "logs": [g.log_path for g in job.grants if g.log_path],
        **({"elastic": elastic_json(job)} if job.spec.elastic else {}),
    }


def elastic_json(job: JobRecord) -> dict[str, Any]:
    """An elastic job's size now, the range it may run in, and any resize in flight."""
    low, high = job.spec.gpu_range
    staged = job.resize
    size = staged.from_size if staged is not None else job.gpu_count
    return {
        "size": size if job.state is JobState.RUNNING else None,
        "min_gpus": low,
        "max_gpus": high,
        "start_gpus": job.spec.gpus,
        # Set while an operator holds it at that size (`alnair resize JOB N`).
        "pinned_gpus": job.pinned_gpus,
        "resize": None
        if staged is None
        else {
            "from_gpus": staged.from_size,
            "to_gpus": staged.to_size,
            "node": staged.node,
            "placement": {part.node: list(part.gpus) for part in staged.after},
            "command_id": staged.command_id,
            "staged_at": staged.staged_at,
            "cause": staged.cause,
        },
    }


async def cmd_jobs(args: argparse.Namespace) -> int:
    states = tuple(JobState(s.upper()) for s in args.state) if args.state else None
    queues = tuple(args.queue) if args.queue else None
    arrays = tuple(args.array) if args.array else None

    async def run(bus: Any) -> int:
        request = ListJobsRequest(states=states, queues=queues, arrays=arrays, limit=args.limit)
        jobs = await _listed(bus, args.tenant, request)
        if args.json:
            print(json.dumps([job_json(j) for j in jobs], indent=2))
        else:
            print(fmt.jobs_table(jobs))
        return 0

    return await _with_bus(args, run)


async def _listed(bus: Any, tenant: str, request: ListJobsRequest) -> list[JobRecord]:
    """The newest `request.limit` jobs it matches, oldest first: page by page, newest
    first, as one answer holds what one NATS message can (jobs with a large environment
    fill it sooner)."""
    jobs: list[JobRecord] = []
    limit = request.limit
    while True:
        reply = await call(bus, tenant, "jobs", request, JOBS_RESULT)
        jobs[:0] = reply.jobs
        if reply.next_before is None or not reply.jobs or len(jobs) >= limit:
            return jobs
        update = {"limit": limit - len(jobs), "before": reply.next_before}
        request = request.model_copy(update=update)


async def cmd_job(args: argparse.Namespace) -> int:
    async def run(bus: Any) -> int:
        reply = await call(bus, args.tenant, "job", GetJobRequest(job_id=args.job), JOB_RESULT)
        if args.json:
            print(reply.job.model_dump_json(indent=2))
        else:
            shown = job_json(reply.job)
            # Its GPU utilisation profile (mean, p95, memory peak, period, forecast).
            shown["profile"] = reply.profile.model_dump(mode="json") if reply.profile else None
            if reply.job.spec.shared:
                # What MPS holds a share to (a share that asked none: its part of the GPU).
                shown["gpu_memory_limit_mib"] = reply.gpu_memory_limit_mib
            print(json.dumps(shown, indent=2))
        return 0

    return await _with_bus(args, run)


_ID_RANGE: Final = re.compile(r"([0-9]+)-([0-9]+)")


def _job_ids(words: Sequence[str]) -> list[str]:
    """Job ids as `alnair cancel` takes them: ids, and runs of them (`12-21`, an array
    as `submit --array` names it)."""
    ids: list[str] = []
    for word in words:
        run = _ID_RANGE.fullmatch(word)
        if run is None:
            ids.append(word)
            continue
        first, last = int(run[1]), int(run[2])
        if last < first or last - first >= MAX_ARRAY_JOBS:
            raise UsageError(f"{word}: a run of job ids is FIRST-LAST, at most {MAX_ARRAY_JOBS:,}")
        ids.extend(str(n) for n in range(first, last + 1))
    return list(dict.fromkeys(ids))


async def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel jobs by id, and (`--array`) every job of an array that has not ended (as
    `scancel` an array's id): those are listed first, so a job of it that ends meanwhile
    is not a refusal."""
    if not args.job and not args.array:
        raise UsageError("name the jobs to cancel: ids, runs of them (12-21), or --array")
    # Every id is checked before any job is cancelled.
    requests = [CancelRequest(job_id=job_id) for job_id in _job_ids(args.job)]

    async def run(bus: Any) -> int:
        of_arrays: list[str] = []  # the ids of the named arrays' jobs not ended
        if args.array:
            live = tuple(state for state in JobState if not state.terminal)
            listing = ListJobsRequest(states=live, arrays=tuple(args.array), limit=100_000)
            listed = await _listed(bus, args.tenant, listing)
            tenants = sorted({job.tenant for job in listed})
            if len(tenants) > 1:
                # An array is named within its tenant; the operator sees every tenant's.
                raise UsageError(
                    f"--array {', '.join(args.array)} names jobs of tenants "
                    f"{', '.join(tenants)}: cancel as the tenant, or by job id"
                )
            of_arrays = [job.job_id for job in listed]
            if not of_arrays:
                names = ", ".join(args.array)
                print(f"alnair cancel: no job of array {names} is left to cancel", file=sys.stderr)
        named = {request.job_id for request in requests}
        requests.extend(CancelRequest(job_id=job_id) for job_id in of_arrays if job_id not in named)
        listed_ids = set(of_arrays)
        refused = 0
        for request in requests:
            try:
                reply = await call(bus, args.tenant, "cancel", request, JOB_RESULT)
            except ApiError as error:
                if error.code == "conflict" and request.job_id in listed_ids:
                    continue  # it ended after the listing: nothing to cancel
                # The others are still cancelled (like scancel): say which was not.
                print(f"alnair cancel: {error}", file=sys.stderr)
                refused += 1
                continue
            print(f"job {reply.job.job_id} {reply.job.state.value}")
        return 1 if refused else 0

    return await _with_bus(args, run)


def _count_or(text: str, word: str, of: str, most: int) -> int | None:
    """A count from 1 to `most` of `of`, or None for `word` (an argument's type)."""
    if text == word:
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= most:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number of {of} (1 to {most:,}) nor {word!r}"
        )
    return count


def _throttle_limit(text: str) -> int | None:
    return _count_or(text, "none", "jobs", MAX_ARRAY_INDEX)


async def cmd_throttle(args: argparse.Namespace) -> int:
    """How many of an array's jobs hold GPUs at once, changed while it runs."""
    request = ThrottleRequest(array=args.array, limit=args.limit)

    async def run(bus: Any) -> int:
        reply = await call(bus, args.tenant, "throttle", request, THROTTLE_RESULT)
        said = "no limit" if reply.limit is None else f"at most {reply.limit} at once"
        jobs = len(reply.jobs)
        print(
            f"array {reply.array}: {said} ({jobs} job{'' if jobs == 1 else 's'} not ended: "
            f"{_id_ranges(list(reply.jobs))})"
        )
        return 0

    return await _with_bus(args, run)


def _resize_size(text: str) -> int | Literal["auto"]:
    size = _count_or(text, "auto", "GPUs", MAX_GPUS_PER_JOB)
    return "auto" if size is None else size


async def cmd_resize(args: argparse.Namespace) -> int:
    """Pin a job at a size and stage the resize (or lift the pin: `auto`); with
    --wait, follow the resize until it is committed (exit 0) or rolled back (exit 1,
    with the reason)."""

    async def run(bus: Any) -> int:
        request = ResizeRequest(job_id=args.job, gpus=args.gpus)
        job = (await call(bus, args.tenant, "resize", request, JOB_RESULT)).job
        if args.gpus == "auto":
            print(f"job {job.job_id}: not pinned; the policy sizes it")
            return 0
        staged = job.resize
        if staged is None:
            print(f"job {job.job_id} runs on {job.gpu_count} GPUs, pinned there")
            return 0
        print(
            f"job {job.job_id}: resize {staged.from_size} -> {staged.to_size} GPUs "
            f"staged (command {staged.command_id}); pinned at {staged.to_size}"
        )
        if not args.wait:
            return 0
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            ask = GetJobRequest(job_id=args.job)
            job = (await call(bus, args.tenant, "job", ask, JOB_RESULT)).job
            if job.resize is None or job.resize.command_id != staged.command_id:
                committed = job.state is JobState.RUNNING and job.gpu_count == staged.to_size
                print(f"job {job.job_id}: {job.reason or job.state.value}")
                return 0 if committed else 1
        raise UsageError(f"job {args.job}: resize still staged after {args.timeout:g}s")

    return await _with_bus(args, run)


async def cmd_nodes(args: argparse.Namespace) -> int:
    async def run(bus: Any) -> int:
        # Page by page: one answer holds what one NATS message can (a few hundred
        # 8-GPU nodes with their latest telemetry).
        nodes: list[NodeStatus] = []
        after: str | None = None
        while True:
            request = ListNodesRequest(after=after, name=args.name)
            reply = await call(bus, args.tenant, "nodes", request, NODES_RESULT)
            nodes += reply.nodes
            if reply.next_after is None or not reply.nodes:
                break
            after = reply.next_after
        if args.json:
            print(json.dumps([n.model_dump(mode="json") for n in nodes], indent=2))
        else:
            print(fmt.nodes_table(nodes))
        return 0

    return await _with_bus(args, run)


async def cmd_queues(args: argparse.Namespace) -> int:
    async def run(bus: Any) -> int:
        reply = await call(bus, args.tenant, "queues", ListQueuesRequest(), QUEUES_RESULT)
        if args.json:
            print(json.dumps(reply.model_dump(mode="json")["queues"], indent=2))
            return 0
        if not reply.queues:
            print("no queues configured and no jobs (alnair brain --queues FILE)")
            return 0
        print(fmt.queues_table(reply.queues))
        if not any(q.listed for q in reply.queues):
            print("no queues configured (alnair brain --queues FILE): no guarantees, no reclaims")
        if reply.strict:
            print("queues not listed are refused (--strict-queues)")
        return 0

    return await _with_bus(args, run)


async def cmd_status(args: argparse.Namespace) -> int:
    servers = resolve_nats(args.nats)

    async def run(bus: Any) -> int:
        from cli.nats_status import nats_report

        reply = await call(bus, args.tenant, "status", StatusRequest(), STATUS_RESULT)
        nats = await nats_report(bus, servers)
        if args.json:
            shown = {**reply.model_dump(mode="json"), "nats": list(servers), **nats.as_json()}
            print(json.dumps(shown, indent=2))
            return 0
        print(
            f"leader:  {reply.brain_host} pid {reply.brain_pid}, epoch {reply.epoch}, "
            f"up {fmt.duration(time.time() - reply.started_at)}"
        )
        for brain in reply.brains:
            role = "leader " if brain.leader else "standby"
            http = f", http {brain.http}" if brain.http else ""
            print(f"brain:   {role} {brain.brain_id} on {brain.host} pid {brain.pid}{http}")
        print(f"policy:  {reply.policy}")
        print(f"nodes:   {reply.nodes} ({reply.gpus} schedulable GPUs)")
        if reply.census is not None:
            print("\n".join(fmt.census_lines(reply.census)))
        print("jobs:    " + ", ".join(f"{k.lower()} {v}" for k, v in reply.jobs_by_state.items()))
        if reply.waiting:
            print("waiting: " + ", ".join(f"{kind} {n}" for kind, n in reply.waiting.items()))
        if reply.commands_queued:
            print(f"commands: {reply.commands_queued} stored, not yet taken by the command stream")
        print("\n".join(nats.lines()))
        return 0

    return await _with_bus(args, run)


async def cmd_logs(args: argparse.Namespace) -> int:
    """The log of a job's attempt, from the node that ran it, over NATS: works from any
    host. A node that does not answer (down, cut off, an older agent) is read from this
    machine's disk if the log is here."""
    from bus.logs import LogUnavailable, attempt_nodes, copy_log

    async def run(bus: Any) -> int:
        history = await call(
            bus, args.tenant, "history", HistoryRequest(job_id=args.job), HISTORY_RESULT
        )
        job = history.job
        rows = [(a.attempt, a.nodes) for a in history.attempts]
        try:
            attempt, nodes = attempt_nodes(rows, (job.attempt, job.nodes), args.attempt)
        except LogUnavailable as error:
            raise UsageError(f"job {args.job}: {error.reason} (state {job.state.value})") from None
        if args.node:
            if args.node not in nodes:
                raise UsageError(f"job {args.job} attempt {attempt} did not run on {args.node}")
            nodes = (args.node,)
        for node in nodes if not args.follow else nodes[:1]:
            if len(nodes) > 1 and not args.follow:
                print(f"==> {node} <==", flush=True)
            try:
                await copy_log(bus, node, args.job, attempt, _write_out, follow=args.follow)
            except LogUnavailable as error:
                if not _local_log(job, node, attempt):
                    raise UsageError(error.reason) from None
        return 0

    return await _with_bus(args, run)


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _local_log(job: JobRecord, node: str, attempt: int) -> bool:
    """The log as this machine's disk has it (the node's agent did not answer)."""
    import codecs

    from agents.joblogs import data_start, dropped_note

    for grant in job.grants:
        if grant.node == node and grant.log_path and attempt == job.attempt:
            path = Path(grant.log_path)
            if not path.is_file():
                continue
            with path.open("rb") as log_file:
                kept = data_start(log_file.fileno(), 0)  # past what a cap dropped
                log_file.seek(kept)
                if kept:  # from the first whole line, as the agent serves it
                    kept += len(log_file.readline())
                    sys.stdout.write(dropped_note(kept, node))
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                while chunk := log_file.read(1 << 20):
                    sys.stdout.write(decoder.decode(chunk))
                sys.stdout.write(decoder.decode(b"", final=True))
            return True
    return False


# -- events ---------------------------------------------------------------------------


def _event_kind(text: str) -> str:
    kinds = record_kinds()
    if text not in kinds:
        raise argparse.ArgumentTypeError(f"no kind {text!r}; the kinds are {', '.join(kinds)}")
    return text


def _matches(record: StateRecord, args: argparse.Namespace) -> bool:
    if args.job and record_job_id(record) != args.job:
        return False
    if args.node and record_node(record) != args.node:
        return False
    return not (args.kind and record_kind(record) not in args.kind)


async def cmd_events(args: argparse.Namespace) -> int:
    import nats.js.errors

    async def run(bus: Any) -> int:
        info = await bus.js.stream_info(subjects.STREAM_STATE)
        first = int(info.state.first_seq)
        if isinstance(args.since, Since):
            since = await bus.first_seq_since(subjects.STREAM_STATE, args.since.ts)
            if since == first and info.state.messages and first > 1:
                print(
                    f"the log begins at seq {first}, after that time: the entries before "
                    "were compacted behind the brain's snapshots",
                    file=sys.stderr,
                )
        else:
            since = args.since
            if info.state.messages and first > since:
                print(
                    f"the log begins at seq {first}: the entries before were compacted "
                    "behind the brain's snapshots",
                    file=sys.stderr,
                )
        async for item, seq, subject in bus.read(
            subjects.STREAM_STATE, STATE_RECORD, start_seq=since, follow=args.follow
        ):
            if isinstance(item, AlnairError):
                print(f"{seq:>6} unreadable entry on {subject}: {item}", file=sys.stderr)
                continue
            if not _matches(item, args):
                continue
            if args.json:
                print(json.dumps({"seq": seq, "subject": subject, **item.model_dump(mode="json")}))
            else:
                print(fmt.record_line(item, seq))
            sys.stdout.flush()
        return 0

    try:
        # The log is the operator's to read (docs/security.md).
        return await _with_bus(args, run, as_tenant=OPERATOR_TENANT)
    except TimeoutError:  # nats.errors.TimeoutError is one too
        raise UsageError(
            "JetStream did not answer reading the STATE log. If the cluster runs with "
            "--secure, only the operator identity may read it: "
            "--nkey $ALNAIR_HOME/keys/operator-operator.nk"
        ) from None
    except nats.js.errors.NotFoundError:
        raise UsageError(
            "there is no STATE log on this NATS: no brain has led this cluster yet "
            "(`make up` / `alnair up`, or `alnair brain`), or --nats names another one"
        ) from None


# -- components -----------------------------------------------------------------------


async def _serve_until_signalled(
    start: Callable[[], Awaitable[Any]], stop: Callable[[], Awaitable[None]]
) -> int:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await start()
    await done.wait()
    await stop()
    return 0


def _strict_queues(args: argparse.Namespace) -> bool:
    if args.strict_queues and not args.queues:
        raise UsageError("--strict-queues needs --queues: the queues jobs may use")
    return bool(args.strict_queues)


async def cmd_brain(args: argparse.Namespace) -> int:
    from brain.core.collector import tune_for_a_service
    from brain.credentials import DEFAULT_TTL_S as DEFAULT_JOB_CREDENTIAL_TTL_S
    from brain.queues import load_queues
    from brain.service import Brain, BrainConfig
    from brain.tenants import load_tenant_map
    from bus.client import Bus, ConnectOptions
    from cli.up import policy_of

    config = BrainConfig(
        policy=policy_of(args),
        node_timeout_s=args.node_timeout,
        fence_margin_s=args.fence_margin,
        keep_disconnected_s=args.keep_disconnected,
        lease_ttl_s=args.lease_ttl,
        launch_ttl_s=args.launch_ttl,
        queues=load_queues(args.queues) if args.queues else (),
        strict_queues=_strict_queues(args),
        history_path=Path(args.history) if args.history else alnair_home() / "brain" / "history.db",
        failures=failures.policy_of(args),
        tenants=load_tenant_map(args.tenant_users).tenants if args.tenant_users else None,
        callout_seed=Path(args.callout_seed) if args.callout_seed else None,
        job_credential_ttl_s=(
            DEFAULT_JOB_CREDENTIAL_TTL_S
            if args.job_credential_ttl is None
            else args.job_credential_ttl or None  # 0: never expires
        ),
        **({} if args.log_keep_entries is None else {"log_keep_entries": args.log_keep_entries}),
        history_keep_days=args.history_keep_days,
    )
    bus = await Bus.connect(
        _with_tls(
            ConnectOptions(
                servers=resolve_nats(args.nats),
                name="brain",
                credentials=args.creds,
                nkey_seed=resolve_nkey(args.nkey),
            ),
            args,
        ),
        replicas=args.replicas,
    )
    brain = Brain(bus, config)
    tune_for_a_service()
    http = _http_server(brain, args)
    http_stopping = asyncio.Event()
    follower: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal follower
        if http is not None and args.http_leader_only:
            follower = asyncio.ensure_future(http.follow_leadership(http_stopping))
        elif http is not None:
            await http.start()
            # Announced with the brain, so `alnair status` and standbys can point to it.
            brain.config = dataclasses.replace(brain.config, http_address=http.public_url)
        await brain.start()

    async def stop() -> None:
        http_stopping.set()
        if follower is not None:
            await asyncio.wait({follower}, timeout=5.0)
        elif http is not None:
            await http.stop()
        await brain.stop()
        await bus.close()

    return await _serve_until_signalled(start, stop)


def _http_server(brain: Any, args: argparse.Namespace) -> Any:
    """The brain's HTTP API, metrics and dashboard, if `--http` asks for them."""
    if not args.http:
        return None
    from brain.http import HttpServer, ensure_tokens_file, parse_address

    host, port = parse_address(args.http)
    tokens_path = Path(args.http_tokens) if args.http_tokens else alnair_home() / "http-tokens.json"
    tokens = ensure_tokens_file(tokens_path)
    log.info("HTTP API tokens in %s", tokens_path)
    return HttpServer(brain, tokens=tokens, host=host, port=port)


async def cmd_agent(args: argparse.Namespace) -> int:
    from agents.agent import Agent, AgentConfig
    from agents.gpu import open_backend
    from bus.client import Bus, ConnectOptions

    check_name("node", args.node)
    logs_total = _logs_total(args.job_logs_max_total)
    data_dir = Path(args.data_dir) if args.data_dir else alnair_home() / "agents" / args.node
    backend = open_backend(args.gpus, node=args.node, data_dir=data_dir)
    servers = resolve_nats(args.nats)
    config = AgentConfig(
        node=args.node,
        data_dir=data_dir,
        heartbeat_s=args.heartbeat,
        telemetry_s=args.heartbeat,
        # Every URL, so a job's supervisor survives a server's death too.
        nats_url=",".join(servers),
        nkey_seed=_absolute(resolve_nkey(args.nkey)),
        job_nkey_seed=_absolute(args.job_nkey),
        confinement=confine.agent_confinement(args, args.node, data_dir),
        fence_after_s=args.fence_after or None,
        fence_grace_s=args.fence_grace,
        cpu_milli=round(args.cpus * 1000) if args.cpus is not None else None,
        memory_mib=parse_mib(args.memory, "--memory") if args.memory is not None else None,
        job_log_max_mib=(
            None
            if args.job_log_max.strip() == "0"
            else parse_mib(args.job_log_max, "--job-log-max")
        ),
        job_log_keep_days=args.job_log_keep_days or None,
        job_logs_max_total_mib=logs_total[0],
        job_logs_max_total_share=logs_total[1],
    )
    bus = await Bus.connect(
        _with_tls(
            ConnectOptions(
                servers=servers,
                name=f"agent:{args.node}",
                credentials=args.creds,
                nkey_seed=resolve_nkey(args.nkey),
                inbox_prefix=inbox_prefix_for_seed(args.nkey) if args.nkey else None,
            ),
            args,
        )
    )
    agent = Agent(bus, config, backend)

    async def stop() -> None:
        await agent.stop(stop_jobs=True)
        await bus.close()
        backend.close()

    return await _serve_until_signalled(agent.start, stop)


def cmd_keys(args: argparse.Namespace) -> int:
    from bus.auth import CALLOUT_SEED_FILE, unlisted_seeds, write_cluster_keys
    from bus.server import route_url, write_route_authorization

    names = [n for n in args.nodes.split(",") if n]
    tenants = [t for t in args.tenants.split(",") if t]
    hosts = tuple(h.strip() for h in args.tls_hosts.split(",") if h.strip())
    if args.tls:
        from bus.tls import check_hosts, openssl_binary

        check_hosts(hosts)  # before anything is written
        openssl_binary()
    keep = not args.rotate
    identities, config = write_cluster_keys(
        Path(args.dir), nodes=names, tenants=tenants, brains=args.brains, keep=keep
    )
    for identity in identities:
        made = "kept" if identity.kept else "new "
        print(
            f"{identity.role:<8} {identity.name:<16} {made} {identity.public_key}  "
            f"{identity.seed_path}"
        )
    print(f"callout  (brains' --callout-seed)  {Path(args.dir) / CALLOUT_SEED_FILE}")
    print(f"server config: {config}  (include it from nats-server.conf)")
    for seed in unlisted_seeds(Path(args.dir), identities):
        print(f"not admitted any more: {seed} (not listed this time; delete it, or list it)")
    routes, secret = write_route_authorization(Path(args.dir))
    print(f"route password: {routes}  (include it in cluster {{}}; routes as")
    print(f"               {route_url('HOST', 6222, secret)})")
    if args.tls:
        from bus.tls import JobIssuer, write_tls_config, write_tls_files

        files = write_tls_files(Path(args.dir).resolve() / "tls", hosts=hosts, keep=keep)
        tls_config = write_tls_config(files, Path(args.dir) / "nats-tls.conf")
        print(f"TLS CA:        {files.ca}")
        print(f"server cert:   {files.server_cert} (key {files.server_key})")
        print(f"client cert:   {files.client_cert} (key {files.client_key})")
        issuer = JobIssuer.in_dir(files.ca.parent)
        print(f"job issuer:    {issuer.cert} (key {issuer.key}; agents' --job-tls-issuer)")
        print(f"server config: {tls_config}  (include it at the top level and in cluster {{}})")
    return 0


# -- parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alnair", description="Alnair: a control plane for shared GPU clusters."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    from cli.up import add_policy_args, add_up_parser

    add_up_parser(sub)

    p = sub.add_parser("submit", help="submit a job: --gpus N -- CMD..., or a job.yaml")
    _client_args(p)
    p.add_argument(
        "--gpus",
        type=gpus_arg,
        help="whole GPUs to allocate (a gang: all or none), or a share of one GPU (0.25)",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="GPU memory per GPU (20GiB): a share's limit under MPS; whole GPUs: at least this",
    )
    p.add_argument(
        "--gpu-type",
        action="append",
        default=[],
        metavar="TYPES",
        help="GPU models it may run on, comma-separated (H100,A100)",
    )
    p.add_argument("--cpus", type=float, help="CPUs the job needs on its node")
    p.add_argument("--memory", metavar="SIZE", help="memory the job needs on its node (32GiB)")
    p.add_argument(
        "--shareable",
        action="store_true",
        help="whole GPUs: let shares run beside it while its profile shows low utilisation "
        "and memory headroom (moved off before its GPU runs out of memory)",
    )
    p.add_argument("--name", help="job name (default: the program's name)")
    p.add_argument("--queue", default="default", help="queue (default: default)")
    p.add_argument("--priority", type=int, default=0, help="priority, -1000..1000")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the job's processes (repeat for more)",
    )
    p.add_argument("--cwd", help="working directory on the node (default: the current one)")
    p.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="how long the job runs on its GPUs, if known (the srtf order ranks by it)",
    )
    p.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="JOB[,JOB]",
        help="start only once these jobs have SUCCEEDED (repeat, or comma-separate); if "
        "one ends otherwise, this job is cancelled (Slurm's --dependency=afterok)",
    )
    p.add_argument(
        "--after-any",
        action="append",
        default=[],
        metavar="JOB[,JOB]",
        help="start only once these jobs have ended, however they ended (repeat, or "
        "comma-separate; Slurm's --dependency=afterany)",
    )
    p.add_argument(
        "--time",
        type=duration,
        metavar="LIMIT",
        help="the most the job may run, over all its attempts (90m, 2h, 1:30:00, "
        "2-00:00:00): past it, it is stopped and FAILED, not retried",
    )
    p.add_argument(
        "--network-sensitive",
        action="store_true",
        help="never spread the job over switches to start it sooner",
    )
    p.add_argument(
        "--on-disconnect",
        choices=("stop", "keep"),
        help="when its node loses NATS: stop it (default; it runs again elsewhere) or keep "
        "it running, not run elsewhere until the node returns or the brain's "
        "--keep-disconnected passes (docs/operations.md, Partitions)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="an elastic Horovod job: runs under the supervisor on --min-gpus..--max-gpus "
        "GPUs, starting on --gpus, resizable (`alnair resize`); on one node while it fits "
        "one, across nodes once it fills one",
    )
    p.add_argument("--min-gpus", type=int, help="elastic: the fewest GPUs it runs on (default 1)")
    p.add_argument(
        "--max-gpus", type=int, help="elastic: the most GPUs it runs on (default: --gpus)"
    )
    p.add_argument("--json", action="store_true", help="print the job record as JSON")
    p.add_argument(
        "--retry-for",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="keep retrying while no brain answers (a failover), this long (default 120)",
    )
    p.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="submissions with the same key (and tenant) create one job: a retry is "
        "answered with it (default: a fresh key per command, reused by its own retries)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="then wait until the job ends, and exit with its exit code (0 when it "
        "SUCCEEDED, 1 when it ended without one), as `sbatch --wait`",
    )
    p.add_argument(
        "--array",
        type=array_argument,
        metavar="INDICES[%N]",
        help="a job array, as sbatch's: one job per index (0-9, 0-99:10, 1,3,5), named "
        "NAME[i], each seeing its index as $ALNAIR_ARRAY_INDEX; %%N runs at most N at once "
        "(the next starts as one ends)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS..., or job.yaml")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("jobs", help="list jobs (like squeue)")
    _client_args(p)
    p.add_argument(
        "--state",
        action="append",
        # As `alnair jobs` prints it (PENDING) or in lower case.
        type=str.lower,
        choices=[s.value.lower() for s in JobState],
        help="only jobs in this state (repeatable)",
    )
    p.add_argument(
        "--queue", action="append", metavar="QUEUE", help="only jobs of this queue (repeatable)"
    )
    p.add_argument(
        "--array",
        action="append",
        metavar="ARRAY",
        help="only jobs of this array, as `submit --array` names it (repeatable)",
    )
    p.add_argument("--limit", type=int, default=200, help="at most this many, newest")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_jobs)

    p = sub.add_parser("job", help="show one job")
    _client_args(p)
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="the full record")
    p.set_defaults(fn=cmd_job)

    p = sub.add_parser("cancel", help="cancel jobs")
    _client_args(p)
    p.add_argument("job", nargs="*", help="job ids, or runs of them (12-21)")
    p.add_argument(
        "--array",
        action="append",
        metavar="ARRAY",
        help="every job of this array that has not ended, as `submit --array` names it "
        "(repeatable)",
    )
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser(
        "throttle",
        help="change how many of an array's jobs run at once (none: no limit), as "
        "scontrol's ArrayTaskThrottle",
    )
    _client_args(p)
    p.add_argument("array", help="the array, as `submit --array` names it")
    p.add_argument("limit", type=_throttle_limit, help="at most this many at once, or none")
    p.set_defaults(fn=cmd_throttle)

    p = sub.add_parser(
        "resize", help="pin a running elastic job at N GPUs (auto: let the policy size it)"
    )
    _client_args(p)
    p.add_argument("job")
    p.add_argument(
        "gpus",
        type=_resize_size,
        metavar="N|auto",
        help="GPUs to run on, within its min..max: the policy leaves it there until "
        "'auto' hands its size back",
    )
    p.add_argument("--wait", action="store_true", help="wait until it is committed or rolled back")
    p.add_argument(
        "--timeout", type=float, default=180.0, metavar="SECONDS", help="how long --wait waits"
    )
    p.set_defaults(fn=cmd_resize)

    p = sub.add_parser("logs", help="print a job's log, from the node that ran it")
    _client_args(p)
    p.add_argument("job")
    p.add_argument("--attempt", type=int, help="this attempt (default: the latest)")
    p.add_argument("--node", help="of a job on several nodes, this node's part only")
    p.add_argument(
        "--follow", "-f", action="store_true", help="keep printing while the attempt runs"
    )
    p.set_defaults(fn=cmd_logs)

    p = sub.add_parser("nodes", help="list nodes (like sinfo)")
    _client_args(p)
    p.add_argument("name", nargs="?", help="only this node")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_nodes)

    p = sub.add_parser(
        "queues", help="queues: each one's guaranteed GPUs beside what its jobs hold and ask"
    )
    _client_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_queues)

    failures.add_commands(sub, _client_args, _with_bus)
    why.add_command(sub, _client_args, _with_bus)

    p = sub.add_parser("status", help="the brain leader, its epoch, and the NATS servers")
    _client_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("events", help="state changes and node events, from the STATE log")
    _client_args(p)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--job", help="only this job")
    p.add_argument("--node", help="only this node")
    p.add_argument(
        "--kind",
        action="append",
        type=_event_kind,
        help="only this kind (cause or event kind; repeat for several)",
    )
    p.add_argument(
        "--since",
        type=_since,
        default=1,
        metavar="SEQ|AGO|TIME",
        help="start at this log sequence (120), this long ago (10m, 2h, 1d: s, m, h or d) "
        "or at this time (2026-12-04T13:00, local unless a zone is given)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(fn=cmd_events)

    p = sub.add_parser("brain", help="run a brain (for multi-machine clusters)")
    _connection_args(p)
    add_policy_args(p)
    p.add_argument(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds without heartbeat before a node is LOST",
    )
    p.add_argument(
        "--fence-margin",
        type=float,
        default=5.0,
        help="seconds after a node is LOST before its jobs run elsewhere: at least the "
        "agents' --fence-after plus --fence-grace minus --node-timeout, plus slack",
    )
    p.add_argument(
        "--keep-disconnected",
        type=float,
        default=300.0,
        help="seconds an --on-disconnect keep job's node may be unheard before the job "
        "is stopped there and (after --fence-margin more) run elsewhere",
    )
    p.add_argument("--history", help="sqlite history file (default: $ALNAIR_HOME/brain/history.db)")
    p.add_argument(
        "--replicas",
        type=int,
        default=int(os.environ.get("ALNAIR_REPLICAS") or 1),
        help="copies of each stream and bucket: 1 on one NATS server, 3 in a cluster "
        "(default: $ALNAIR_REPLICAS, else 1)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        help="leader lease TTL, seconds: how soon a standby takes over",
    )
    p.add_argument(
        "--launch-ttl",
        type=float,
        default=60.0,
        help="seconds a node has to confirm a launch before it is requeued",
    )
    p.add_argument(
        "--history-keep-days",
        type=float,
        metavar="DAYS",
        help="forget, from this brain's sqlite history, the jobs that ended and the log "
        "entries older than DAYS (checked hourly; default: keep everything)",
    )
    p.add_argument(
        "--log-keep-entries",
        type=int,
        metavar="N",
        help="compact the STATE log behind snapshots, keeping at least the latest N "
        "entries (default a million: about 1.2 KB each, 6 a job); 0: keep every entry",
    )
    p.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve the HTTP API, /metrics and the dashboard here (e.g. 127.0.0.1:8470)",
    )
    p.add_argument(
        "--http-tokens",
        metavar="FILE",
        help="bearer tokens of tenants and operators (default: $ALNAIR_HOME/http-tokens.json, "
        "written with new tokens if missing)",
    )
    failures.add_policy_args(p)
    confine.add_brain_args(p)
    p.add_argument(
        "--http-leader-only",
        action="store_true",
        help="listen on --http only while this brain leads, so brains sharing one address "
        "hand it over on failover (without it, a standby answers 503 naming the leader)",
    )
    p.set_defaults(fn=cmd_brain)

    p = sub.add_parser("agent", help="run a node agent")
    _connection_args(p)
    p.add_argument("--node", required=True, help="this node's name")
    p.add_argument("--gpus", required=True, help="'nvml', or simulated: sim:<count>x<model>")
    p.add_argument("--data-dir", help="job logs and state (default: $ALNAIR_HOME/agents/NODE)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval, seconds")
    p.add_argument(
        "--cpus",
        type=positive_number,
        help="CPUs jobs may reserve here (default: those this machine has)",
    )
    p.add_argument(
        "--memory", metavar="SIZE", help="memory jobs may reserve here (default: all of it)"
    )
    confine.add_agent_args(p)
    p.add_argument(
        "--fence-after",
        type=float,
        default=5.0,
        help="stop this node's jobs after this many seconds without NATS (0: never)",
    )
    p.add_argument(
        "--fence-grace",
        type=float,
        default=3.0,
        help="seconds between SIGTERM and SIGKILL when fencing",
    )
    p.add_argument(
        "--job-log-max",
        metavar="SIZE",
        default="1GiB",
        help="what one attempt's log may hold on this node's disk: past it, its oldest "
        "part is dropped and the newest half kept (0: unbounded; default: 1GiB)",
    )
    p.add_argument(
        "--job-log-keep-days",
        metavar="DAYS",
        type=number_or_zero,
        default=DEFAULT_KEEP_DAYS,
        help="remove a job's log this many days after it was last written, once its "
        f"attempt has ended (0: keep logs for good; default: {DEFAULT_KEEP_DAYS:g})",
    )
    p.add_argument(
        "--job-logs-max-total",
        metavar="SIZE|N%",
        default=f"{DEFAULT_MAX_TOTAL_SHARE * 100:g}%",
        help="what all job logs on this node may hold together, as a size or a share of "
        "their filesystem: past it, ended attempts' logs are removed, least recently "
        f"written first (0: no bound; default: {DEFAULT_MAX_TOTAL_SHARE * 100:g}%%)",
    )
    p.set_defaults(fn=cmd_agent)

    p = sub.add_parser("keys", help="create NATS identities (nkeys) and the server config")
    p.add_argument("--dir", required=True, help="where to write the seeds and nats-auth.conf")
    p.add_argument("--nodes", default="", help="node names, comma-separated")
    p.add_argument("--tenants", default="default", help="tenant names, comma-separated")
    p.add_argument("--brains", type=int, default=1, help="brain identities to create")
    p.add_argument(
        "--tls",
        action="store_true",
        help="also write a CA, a server and a client certificate (in DIR/tls) and the "
        "server's tls {} block (DIR/nats-tls.conf)",
    )
    p.add_argument(
        "--tls-hosts",
        default="",
        help="names and addresses of the NATS servers, comma-separated, for the server "
        "certificate (localhost and the loopback addresses are always in it)",
    )
    p.add_argument(
        "--rotate",
        action="store_true",
        help="make every identity, the callout key and (with --tls) the CA and "
        "certificates anew; without it, those already in DIR are kept and only what is "
        "missing is made (the server certificate is always made again)",
    )
    p.set_defaults(fn=cmd_keys, sync=True)

    with contextlib.suppress(ImportError):
        from brain.sim import cli as sim_cli

        p = sub.add_parser("sim", help="replay a job trace through the scheduler's policies")
        sim_cli.add_arguments(p)
        p.set_defaults(fn=sim_cli.run, sync=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.cmd)
    try:
        if getattr(args, "sync", False):
            return int(args.fn(args))
        return int(asyncio.run(args.fn(args)))
    except AlnairError as error:
        print(f"alnair {args.cmd}: {error}", file=sys.stderr)
        return 1
    except ValidationError as error:
        # A request built from the arguments that its schema refuses (an empty job id,
        # a size out of range): the fields, not a traceback.
        print(f"alnair {args.cmd}: invalid {describe_invalid(error, 'request')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`alnair events | head`): stop quietly, as a tool killed
        # by SIGPIPE would, and keep Python's exit-time flush from raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
