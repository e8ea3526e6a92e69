"""Jobs: what a user submits (JobSpec) and what the brain keeps (JobRecord)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.base import NodeName, QueueName, TenantName

MAX_GPUS_PER_JOB: Final = 4096
# A declared run time beyond this (about ten years) is a mistake, not a plan.
MAX_DECLARED_DURATION_S: Final = 3.2e8
# The largest index of a job array (`JobSpec.array_index`), and where a job reads its
# own (the brain puts it in the launch's environment).
MAX_ARRAY_INDEX: Final = 1_000_000
ARRAY_INDEX_ENV: Final = "ALNAIR_ARRAY_INDEX"
# A job array's name (`JobSpec.array`), within its tenant.
ArrayName = Annotated[str, Field(min_length=1, max_length=128)]
# Jobs one job may wait for (`JobSpec.after`).
MAX_AFTER: Final = 64
_ENV_NAME_CHARS: Final = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
)
# Set by the agent for every job; a spec may not override them.
RESERVED_ENV_PREFIXES: Final = ("ALNAIR_", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_")
# How a job that cannot use the in-job SDK over NATS says it failed on an input: it
# prints `ALNAIR_BAD_INPUT <uri> [reason]` as one of its last log lines and exits with
# this code (sysexits' EX_NOINPUT). `workloads.sdk.fail_on_bad_input` does both.
BAD_INPUT_EXIT_CODE: Final = 66
BAD_INPUT_MARKER: Final = "ALNAIR_BAD_INPUT"
# Names the file (one URI per line) holding the cluster's input blacklist for a job.
BLACKLIST_FILE_ENV: Final = "ALNAIR_BLACKLIST_FILE"
# A random token per launch, which the launch's processes inherit: how its agent knows
# them, also those that left its process group (agents/processes.py).
LAUNCH_ID_ENV: Final = "ALNAIR_LAUNCH_ID"
# A confined job's limits (agents/cgroups.py) when its spec names none: per GPU it
# holds on a node, and a flat cap on its processes and threads.
DEFAULT_MEMORY_MB_PER_GPU: Final = 16 * 1024
DEFAULT_CPUS_PER_GPU: Final = 4.0
JOB_PIDS_MAX: Final = 4096
MAX_MEMORY_MB_PER_GPU: Final = 16 * 1024 * 1024
# A share of one GPU is asked in thousandths of it (`--gpus 0.25` is 250).
GPU_MILLI: Final = 1000
MAX_GPU_MEMORY_MIB: Final = 16 * 1024 * 1024
MAX_GPU_TYPES: Final = 16
# The most a job's spec may take, encoded: its record is one STATE entry and its
# command and environment go with every launch, both within one NATS message (1 MiB)
# beside the input blacklist (brain/blacklist.py). Large data belongs in files.
MAX_SPEC_BYTES: Final = 256 * 1024

OnDisconnect = Literal["stop", "keep"]


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    # Failed for reasons not its own (infrastructure, bad input) more often than the
    # retry limit allows: Philly's "unsuccessful", told apart from a user's FAILED.
    UNSUCCESSFUL = "UNSUCCESSFUL"

    @property
    def terminal(self) -> bool:
        return self in (
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.UNSUCCESSFUL,
        )


class FailureClass(StrEnum):
    """Why an attempt failed, which decides whether running it again can help (Philly)."""

    USER = "user"  # its own code or configuration: it would fail the same way again
    INFRASTRUCTURE = "infrastructure"  # node lost, GPU fault, NCCL/Gloo timeout, OOM kill
    INPUT = "input"  # it reported the input it failed on


class AttemptFailure(BaseModel):
    """One failed attempt of a job: what the brain classified it as, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempt: int = Field(ge=1)
    failure_class: FailureClass
    reason: str
    nodes: tuple[NodeName, ...] = ()
    # The nodes an infrastructure failure is blamed on, which its retries avoid: the
    # node where it happened, or all of `nodes` for a failure between them (a
    # collective's timeout). None: all of `nodes` (records from before this field).
    at_fault: tuple[NodeName, ...] | None = None
    at: float
    exit_code: int | None = None
    signal: int | None = None
    input_uri: str | None = None
    # The last lines of the attempt's log, for user errors (what the user must fix).
    log_tail: tuple[str, ...] = ()


def clock_text(seconds: float) -> str:
    """A length of time as `squeue` writes one: `1:30` (m:ss), `2:00:00`, `1-02:00:00`
    (days-h:mm:ss): `alnair jobs`' TIME, and time limits in reasons."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


class JobSpec(BaseModel):
    """What a user asks for. Validated at the API edge; field errors name the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="job", min_length=1, max_length=128)
    command: tuple[str, ...] = Field(min_length=1, max_length=4096)
    gpus: int = Field(ge=1, le=MAX_GPUS_PER_JOB)
    queue: QueueName = "default"
    priority: int = Field(default=0, ge=-1000, le=1000)
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    cwd: str | None = Field(default=None, max_length=4096)
    # Elastic (Horovod) jobs run between min_gpus and max_gpus under the supervisor;
    # `gpus` is then the size the job would like to start at. See docs/elastic.md.
    elastic: bool = False
    min_gpus: int | None = Field(default=None, ge=1, le=MAX_GPUS_PER_JOB)
    max_gpus: int | None = Field(default=None, ge=1, le=MAX_GPUS_PER_JOB)
    # How long the job runs on its GPUs, if its submitter knows: the `srtf` order ranks
    # by what is left of it. Other orders ignore it.
    declared_duration_s: float | None = Field(
        default=None, gt=0, le=MAX_DECLARED_DURATION_S, allow_inf_nan=False
    )
    # The most it may run, in seconds, over all its attempts (its run time, as `alnair
    # why` counts it): past it the brain stops it, FAILED, "time limit 2:00:00 reached"
    # (Slurm's --time). None: no limit.
    time_limit_s: float | None = Field(
        default=None, gt=0, le=MAX_DECLARED_DURATION_S, allow_inf_nan=False
    )
    # Network-bound (e.g. all-reduce heavy): never spread over switches to start sooner.
    network_sensitive: bool = False
    # Limits of a confined job's cgroup on each node, per GPU it may hold there
    # (defaults DEFAULT_MEMORY_MB_PER_GPU, DEFAULT_CPUS_PER_GPU). Exceeding the memory
    # limit kills the job: a user failure, "out of memory (limit ...)".
    memory_mb_per_gpu: int | None = Field(default=None, ge=16, le=MAX_MEMORY_MB_PER_GPU)
    cpus_per_gpu: float | None = Field(default=None, gt=0, le=1024, allow_inf_nan=False)
    # What its node does when it loses NATS (docs/operations.md, "Partitions"): "stop"
    # (fence: the agent stops it, and the brain runs it elsewhere once that is sure to
    # be done) or "keep" (it runs on through the partition; the brain runs it elsewhere
    # only when its node returns without it or a much longer timeout passes).
    on_disconnect: OnDisconnect = "stop"
    # A share of one GPU, in thousandths (`gpus` is then 1): `alnair submit --gpus 0.25`
    # asks 250 (`share_request`). Jobs sharing a GPU run under CUDA MPS (docs/sharing.md).
    gpu_milli: int | None = Field(default=None, ge=1, lt=GPU_MILLI)
    # GPU memory the job needs on each of its GPUs (MiB): a share's limit under MPS;
    # for whole GPUs, only GPUs with at least this much.
    gpu_memory_mib: int | None = Field(default=None, ge=1, le=MAX_GPU_MEMORY_MIB)
    # GPU models the job may run on (`H100` matches `NVIDIA H100 80GB HBM3`); empty: any.
    gpu_types: tuple[str, ...] = Field(default=(), max_length=MAX_GPU_TYPES)
    # CPUs and memory (MiB) the job needs on its node: placement reserves them, and
    # they are its cgroup's limits (instead of the per-GPU ones).
    cpus: float | None = Field(default=None, gt=0, le=1024, allow_inf_nan=False)
    memory_mib: int | None = Field(default=None, ge=16, le=MAX_MEMORY_MB_PER_GPU)
    # A whole-GPU job that lets shares run beside it on its GPUs while its utilisation
    # profile shows it leaves room (low utilisation, memory headroom); they are moved
    # off again before its GPU runs out of memory (docs/sharing.md, "Co-location").
    shareable: bool = False
    # Jobs that must have SUCCEEDED before this one may start (Slurm's
    # --dependency=afterok): it waits for them, and is cancelled if one ends otherwise.
    after: tuple[str, ...] = Field(default=(), max_length=MAX_AFTER)
    # Jobs that must have ended, however, before this one may start (Slurm's
    # --dependency=afterany): a clean-up, a report, the next step of a sweep.
    after_any: tuple[str, ...] = Field(default=(), max_length=MAX_AFTER)
    # Its index in a job array (`alnair submit --array 0-9`): the job sees it as
    # $ALNAIR_ARRAY_INDEX (Slurm's $SLURM_ARRAY_TASK_ID).
    array_index: int | None = Field(default=None, ge=0, le=MAX_ARRAY_INDEX)
    # The array it belongs to: one name for all its jobs, the submitter's own (`alnair
    # submit --array` gives the array's idempotency key), within its tenant.
    array: ArrayName | None = None
    # At most this many of the array's jobs run at once (sbatch's `--array 0-99%10`):
    # the others wait, "array_limit", while this many of its jobs hold GPUs, whatever
    # ranks ahead of them. A job's own limit counts for it.
    array_limit: int | None = Field(default=None, ge=1, le=MAX_ARRAY_INDEX)

    @field_validator("after", "after_any")
    @classmethod
    def _job_ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for job_id in value:
            if not 1 <= len(job_id) <= 64:
                raise ValueError(f"invalid job id {job_id!r}: 1 to 64 characters")
        return tuple(dict.fromkeys(value))

    @field_validator("gpu_types")
    @classmethod
    def _gpu_type_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = []
        for name in value:
            name = name.strip()
            if not name or len(name) > 128 or any(c in name for c in ",|"):
                raise ValueError(f"invalid GPU type {name!r}")
            names.append(name)
        return tuple(sorted(set(names)))

    @model_validator(mode="after")
    def _one_kind_of_wait(self) -> JobSpec:
        both = sorted(set(self.after) & set(self.after_any))
        if both:
            raise ValueError(
                f"after_any: job {both[0]} is in after too: it runs after a job that "
                "SUCCEEDED (after) or one that ended however (after_any), not both"
            )
        if self.array_limit is not None and self.array is None:
            raise ValueError("array_limit: a limit is of an array: give array too")
        return self

    @model_validator(mode="after")
    def _share_rules(self) -> JobSpec:
        if self.gpu_milli is not None and self.gpus != 1:
            raise ValueError(f"gpu_milli: a share is of one GPU, and gpus is {self.gpus}")
        if self.cpus is not None and self.cpus_per_gpu is not None:
            raise ValueError("cpus: give cpus (per job) or cpus_per_gpu, not both")
        if self.memory_mib is not None and self.memory_mb_per_gpu is not None:
            raise ValueError("memory_mib: give memory_mib (per job) or memory_mb_per_gpu, not both")
        if self.shareable and self.gpu_milli is not None:
            raise ValueError(
                "shareable: a share already shares its GPU; shareable is for whole GPUs"
            )
        if self.elastic:
            if self.shareable:
                raise ValueError("shareable: not for elastic jobs")
            for name in ("gpu_milli", "gpu_memory_mib", "cpus", "memory_mib"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: not for elastic jobs")
            if self.gpu_types:
                raise ValueError("gpu_types: not for elastic jobs")
        return self

    @property
    def shared(self) -> bool:
        """Asks a share of one GPU (runs beside other jobs on it)."""
        return self.gpu_milli is not None

    @property
    def constrained(self) -> bool:
        """Asks something beyond whole GPUs: a share, a GPU type or memory, CPUs or
        memory on the node. Such a job is placed through the sharing ledger, on one
        node unless it asks whole GPUs and no CPUs or memory (docs/sharing.md)."""
        return (
            self.gpu_milli is not None
            or self.gpu_memory_mib is not None
            or bool(self.gpu_types)
            or self.cpus is not None
            or self.memory_mib is not None
        )

    @property
    def gpu_request(self) -> str:
        """What it asks, as an operator reads it: `0.25 GPU (20480 MiB)`, `2 GPUs`."""
        text = (
            f"{self.gpu_milli / GPU_MILLI:g} GPU"
            if self.gpu_milli is not None
            else f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
        )
        if self.gpu_memory_mib is not None:
            text += f" ({self.gpu_memory_mib} MiB)"
        if self.gpu_types:
            text += f" of type {'|'.join(self.gpu_types)}"
        return text

    @model_validator(mode="after")
    def _elastic_bounds(self) -> JobSpec:
        if not self.elastic:
            if self.min_gpus is not None or self.max_gpus is not None:
                raise ValueError("min_gpus and max_gpus are only for elastic jobs")
            return self
        low = self.min_gpus if self.min_gpus is not None else 1
        high = self.max_gpus if self.max_gpus is not None else self.gpus
        if low > high:
            raise ValueError(f"min_gpus {low} is above max_gpus {high}")
        if not low <= self.gpus <= high:
            raise ValueError(f"gpus {self.gpus} is outside min_gpus..max_gpus ({low}..{high})")
        return self

    @property
    def gpu_range(self) -> tuple[int, int]:
        """(least, most) GPUs the job can run on; (gpus, gpus) for a rigid job."""
        if not self.elastic:
            return (self.gpus, self.gpus)
        low = self.min_gpus if self.min_gpus is not None else 1
        return (low, self.max_gpus if self.max_gpus is not None else self.gpus)

    @field_validator("gpus", mode="before")
    @classmethod
    def _whole_gpus(cls, value: Any) -> Any:
        # The spec keeps a share as `gpus: 1` and `gpu_milli` (the CLI and job.yaml take
        # `gpus: 0.25` and convert it: `share_request`); say so rather than "a valid integer".
        if isinstance(value, float) and not value.is_integer() and 0 < value < 1:
            raise ValueError(
                f"{value:g} is a share of a GPU: ask gpus 1 and gpu_milli "
                f"{round(value * GPU_MILLI)} (thousandths of the GPU)"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value[0].strip():
            raise ValueError("the program to run (first word of the command) is empty")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not name or name[0].isdigit() or not set(name) <= _ENV_NAME_CHARS:
                raise ValueError(f"invalid environment variable name {name!r}")
            if name.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"environment variable {name} is set by Alnair itself")
        return value


def unlaunchable(spec: JobSpec) -> str | None:
    """Why no process could be started as `spec` asks, naming the field; None if one
    could. The kernel takes C strings, so a NUL byte in the command, the environment or
    the directory can never be launched; a relative directory would be of the agent's.
    Checked when a job is submitted (`SubmitRequest`), not on the records already
    stored (which were accepted before and must still load)."""
    for i, word in enumerate(spec.command):
        if "\0" in word:
            return f"command: word {i} contains a NUL character"
    for name, value in spec.env.items():
        if "\0" in value:
            return f"env: {name}'s value contains a NUL character"
    if spec.cwd is not None:
        if "\0" in spec.cwd:
            return "cwd: the working directory contains a NUL character"
        if not spec.cwd.startswith("/"):
            return f"cwd: the working directory must be an absolute path, not {spec.cwd!r}"
    return None


class NodeGrant(BaseModel):
    """The GPUs of one node given to one attempt of a job, and what became of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: NodeName
    gpus: tuple[int, ...]
    pid: int | None = None
    log_path: str | None = None
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None


class NodeGpus(BaseModel):
    """Some GPUs of one node (physical indices): a part of an elastic job's placement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: NodeName
    gpus: tuple[int, ...] = Field(min_length=1, max_length=MAX_GPUS_PER_JOB)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, gpus: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
            raise ValueError(f"GPUs {list(gpus)}: each a distinct index >= 0")
        return gpus


def share_request(fields: dict[str, Any]) -> dict[str, Any]:
    """Job fields as a person writes them (`gpus: 0.25`, a share of one GPU) as the
    spec keeps them (`gpus: 1, gpu_milli: 250`). Whole numbers are left alone; a
    fraction that is not a share is refused naming `gpus`."""
    gpus = fields.get("gpus")
    if isinstance(gpus, str):
        try:
            gpus = float(gpus)
        except ValueError:
            return fields  # the field's own validation names it
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)):
        return fields
    if gpus <= 0:
        raise ValueError(
            f"gpus {gpus:g}: asks for no GPU; ask for whole GPUs (1 or more) "
            "or a share of one (0.001..0.999)"
        )
    if isinstance(gpus, int) or gpus.is_integer():
        return fields
    if not 0 < gpus < 1:
        raise ValueError(
            f"gpus {gpus:g}: a share of a GPU is between 0 and 1; "
            "more than one GPU is a whole number"
        )
    milli = round(gpus * GPU_MILLI)
    if not 1 <= milli < GPU_MILLI or abs(milli - gpus * GPU_MILLI) > 1e-6:
        raise ValueError(f"gpus {gpus:g}: a share is in thousandths of a GPU (0.001..0.999)")
    if fields.get("gpu_milli") not in (None, milli):
        raise ValueError(f"gpus {gpus:g} and gpu_milli {fields['gpu_milli']} disagree")
    return {**fields, "gpus": 1, "gpu_milli": milli}


def job_limits(spec: JobSpec, gpus_here: int) -> tuple[int, float]:
    """(memory MiB, CPUs) of a job's cgroup on a node where it holds `gpus_here` GPUs.
    An elastic job is sized for the most it may grow to, since its supervisor's workers
    share the one cgroup of its launch."""
    sized_for = max(gpus_here, spec.gpu_range[1]) if spec.elastic else gpus_here
    sized_for = max(1, sized_for)
    memory = spec.memory_mb_per_gpu or DEFAULT_MEMORY_MB_PER_GPU
    cpus = spec.cpus_per_gpu or DEFAULT_CPUS_PER_GPU
    return (
        spec.memory_mib if spec.memory_mib is not None else memory * sized_for,
        spec.cpus if spec.cpus is not None else cpus * sized_for,
    )


def placement_size(placement: tuple[NodeGpus, ...]) -> int:
    return sum(len(part.gpus) for part in placement)


def describe_placement(placement: tuple[NodeGpus, ...]) -> str:
    return ", ".join(f"{part.node}:{','.join(map(str, part.gpus))}" for part in placement)


class StagedResize(BaseModel):
    """An elastic job's resize that the brain commanded and its supervisor has not
    acknowledged yet (a statement: committed on the supervisor's `ResizeCompleted`,
    rolled back on a refusal or a timeout).

    While it is staged the job's grants hold every GPU of both sizes: a grow's added
    GPUs from the start (so nobody else takes them, and a node the job did not run on
    gets its worker host), a shrink's released ones until the workers on them have
    exited. The supervisor's node (`node`, the job's first) is in both placements.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    command_id: str = Field(min_length=1, max_length=128)
    # The node of the job's supervisor.
    node: NodeName
    # The job's GPUs per node before, and once committed (the supervisor's node first).
    before: tuple[NodeGpus, ...] = Field(min_length=1)
    after: tuple[NodeGpus, ...] = Field(min_length=1)
    staged_at: float
    # Why: the policy's cause, or the operator who asked.
    cause: str = Field(max_length=1000)
    # A grow rolled back after its supervisor may have begun it (a timeout, or a
    # refusal after trying): the job holds the grow's GPUs until the supervisor says it
    # is back at the size before. Timing out in turn, it ends holding them all.
    reverting: bool = False
    # A shrink off nodes that were lost (`Resize.lost`): the job's parts there are
    # already dropped from its grants; refused or unanswered, it fails the attempt
    # rather than rolling back onto them.
    lost: tuple[NodeName, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _one_node_form(cls, data: object) -> object:
        """Journals written when elastic jobs resized on one node only said that node's
        GPUs (`from_gpus`, `to_gpus`)."""
        if isinstance(data, dict) and "from_gpus" in data and "before" not in data:
            data = dict(data)
            node = data.get("node")
            data["before"] = ({"node": node, "gpus": data.pop("from_gpus")},)
            data["after"] = ({"node": node, "gpus": data.pop("to_gpus", ())},)
        return data

    @property
    def from_size(self) -> int:
        return placement_size(self.before)

    @property
    def to_size(self) -> int:
        return placement_size(self.after)

    @property
    def grow(self) -> bool:
        return self.to_size > self.from_size


class JobRecord(BaseModel):
    """The brain's whole view of one job; every STATE entry for a job carries it entire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    tenant: TenantName
    spec: JobSpec
    state: JobState
    attempt: int = Field(default=0, ge=0)
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    grants: tuple[NodeGrant, ...] = ()
    exit_code: int | None = None
    signal: int | None = None
    # Why the job is in its state: the last cause's message, or why it waits.
    reason: str | None = None
    # When `reason` is why the job waits, the kind of that wait (brain/core/model.py's
    # wait causes: "ranked_out", "fixed_quota", ...): a wait of another kind is
    # journaled, one of the same kind with other figures is shown, not journaled. Any
    # change that gives another reason clears it (`brain.state.accounted`).
    wait_kind: str | None = None
    idempotency_key: str | None = None
    # Service accounting for the queue orders (Tiresias): GPUs x seconds and seconds
    # run over all finished runs (the current run is added when it ends), when the
    # job last became pending, and the LAS band the policy last put it in.
    attained_gpu_seconds: float = Field(default=0.0, ge=0)
    executed_seconds: float = Field(default=0.0, ge=0)
    pending_since: float | None = None
    service_level: int = Field(default=0, ge=0)
    service_level_since: float | None = None
    # Every failed attempt, oldest first; the retry policy counts them by class.
    failures: tuple[AttemptFailure, ...] = ()
    # A job retried after a failure waits until `not_before` (back-off, brain clock)
    # and is never placed on `avoid_nodes` (the nodes its failed attempts ran on).
    not_before: float | None = None
    avoid_nodes: tuple[NodeName, ...] = ()
    # Pre-run (Philly): "pending" before its one-GPU trial, "running" during it,
    # "passed" once it survived; None when its queue has no pre-run.
    prerun: Literal["pending", "running", "passed"] | None = None
    # Elastic jobs: the resize in flight, if any, and when the job's current size took
    # effect in this run (GPU-seconds are counted per size).
    resize: StagedResize | None = None
    resized_at: float | None = None
    # Nodes where a grow could not start an elastic job's worker host in this attempt
    # (`barred_nodes`). A node its resizes merely left keeps its grant, with no GPU.
    failed_nodes: tuple[NodeName, ...] = ()
    # When the last resize of this run committed and how long it took from command to
    # commit: the policy lets the job run a multiple of that before moving it again.
    last_resize_at: float | None = None
    last_resize_s: float | None = Field(default=None, ge=0)
    # An operator's `alnair resize JOB N` pins the job at N GPUs, across attempts,
    # until `alnair resize JOB auto`: the policy does not resize it by itself.
    pinned_gpus: int | None = Field(default=None, ge=1)
    # The policy shrank the job from this size because the GPUs above did not earn
    # their keep, at `gain_ceiling_at`: it is not grown back there on the same evidence.
    gain_ceiling: int | None = Field(default=None, ge=1)
    gain_ceiling_at: float | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(grant.node for grant in self.grants)

    @property
    def gpu_count(self) -> int:
        return sum(len(grant.gpus) for grant in self.grants)

    @property
    def gpu_size(self) -> float:
        """GPUs its service is reckoned in while it runs: a share of one GPU its share,
        any other job the GPUs it holds (`brain.core.model.JobView.gpu_size`)."""
        milli = self.spec.gpu_milli
        return self.gpu_count if milli is None or not self.grants else milli / GPU_MILLI

    @property
    def barred_nodes(self) -> frozenset[str]:
        """Nodes an elastic job does not grow onto again in this attempt: its worker host
        could not start there, or has ended (a launch there is named by the attempt, so
        a second one would be dropped as a duplicate). None once it no longer runs."""
        if self.state is not JobState.RUNNING:
            return frozenset()
        return frozenset((*self.failed_nodes, *(g.node for g in self.grants if g.exited)))

    @property
    def placement(self) -> tuple[NodeGpus, ...]:
        """Its grants' GPUs per node (those that hold any)."""
        return tuple(NodeGpus(node=g.node, gpus=g.gpus) for g in self.grants if g.gpus)
