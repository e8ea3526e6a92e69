"""Failure handling policy (Philly, ATC'19): classify a failed attempt, then retry it or end it.

Pure: no I/O, no clock. The shell hands in what it knows about an attempt's end (its
exit, the last lines of its log, the infrastructure events that touched it, the input
it reported) and gets back a class with its reason, then a `Retry` or a `GiveUp`.

- `user`: its own code or configuration (a Python traceback, a usage error, its own
  cgroup's memory limit exceeded, any non-zero exit that no infrastructure event
  explains). Running it again fails the same way, so it is not retried unless its
  queue says so.
- `infrastructure`: the node was lost, a GPU faulted (XID, ECC), a collective timed
  out (NCCL, Gloo), or the kernel's OOM killer killed it. Retried with exponential
  back-off up to a limit, never on a node it failed on; past the limit UNSUCCESSFUL.
- `input`: it reported the input it failed on. Retried only once that input is
  blacklisted (then the job can skip it).

The XID catalogue says which GPU faults take a GPU, or its whole node, out of service.
A node on which job after job fails for reasons not their own, with no fault to show for
it (a bad link, a driver that hangs), is a black hole (`black_hole`): it is drained too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from brain.core.ordering import job_sequence
from schemas.errors import AlnairError
from schemas.jobs import (
    BAD_INPUT_EXIT_CODE,
    BAD_INPUT_MARKER,
    AttemptFailure,
    FailureClass,
    JobState,
)

SIGKILL: Final = 9

DrainScope = Literal["none", "gpu", "node"]


@dataclass(frozen=True, slots=True)
class Xid:
    """One entry of NVIDIA's XID catalogue, and what Alnair does about it."""

    code: int
    meaning: str
    drain: DrainScope


# Critical XIDs take the GPU out of service, or the node for those that leave the whole
# machine suspect (79: fallen off the bus; 95: uncontained ECC error). Application XIDs
# are the job's own doing (a bad kernel, a page fault) and drain nothing.
XID_CATALOGUE: Final[dict[int, Xid]] = {
    x.code: x
    for x in (
        Xid(13, "graphics engine exception (application)", "none"),
        Xid(31, "GPU memory page fault (application)", "none"),
        Xid(43, "GPU stopped processing (application)", "none"),
        Xid(45, "preemptive cleanup after a prior error (application)", "none"),
        Xid(68, "NVDEC0 exception (application)", "none"),
        Xid(48, "double-bit ECC error", "gpu"),
        Xid(61, "internal micro-controller breakpoint", "gpu"),
        Xid(62, "internal micro-controller halt", "gpu"),
        Xid(63, "ECC page retirement or row remapping recorded", "gpu"),
        Xid(64, "ECC page retirement or row remapping failure", "gpu"),
        Xid(74, "NVLink error", "gpu"),
        Xid(79, "GPU has fallen off the bus", "node"),
        Xid(92, "high single-bit ECC error rate", "gpu"),
        Xid(94, "contained ECC error", "gpu"),
        Xid(95, "uncontained ECC error", "node"),
        Xid(119, "GSP RPC timeout", "gpu"),
        Xid(120, "GSP error", "gpu"),
        Xid(140, "unrecovered ECC error", "gpu"),
    )
}

GpuFaultKind = Literal["xid", "ecc_dbe", "retired_pages", "row_remap_failure", "lost"]


@dataclass(frozen=True, slots=True)
class FaultAction:
    drain: DrainScope
    reason: str


def fault_action(fault: GpuFaultKind, xid: int | None, gpu: int) -> FaultAction:
    """What a GPU fault does to scheduling: drain nothing, the GPU, or its node."""
    if fault == "xid":
        entry = XID_CATALOGUE.get(xid or 0)
        if entry is None:
            return FaultAction("none", f"GPU {gpu}: XID {xid} (not in the catalogue; recorded)")
        return FaultAction(entry.drain, f"GPU {gpu}: XID {entry.code} {entry.meaning}")
    what = {
        "ecc_dbe": "double-bit ECC error",
        "retired_pages": "memory pages retired (pending retirement)",
        "row_remap_failure": "row remapping failed",
        "lost": "GPU lost (no longer answers)",
    }[fault]
    return FaultAction("gpu", f"GPU {gpu}: {what}")


# --- classification ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptEnd:
    """How an attempt's process ended; None fields when it never ended on its own
    (its node was lost, its GPU was drained)."""

    exit_code: int | None = None
    signal: int | None = None
    log_tail: tuple[str, ...] = ()
    runtime_s: float = 0.0
    # The job's own cgroup killed it at this memory limit (MiB): it asked for too little,
    # or uses too much; another node would kill it the same way.
    oom_limit_mb: int | None = None
    # Its agent stopped it for using more GPU memory than its share's limit (MiB):
    # (used, limit). Its own doing, like a cgroup's OOM kill.
    gpu_memory_over: tuple[float, int] | None = None


@dataclass(frozen=True, slots=True)
class Classification:
    failure_class: FailureClass
    reason: str
    input_uri: str | None = None
    # An infrastructure failure between the attempt's nodes (a collective that timed
    # out or lost a peer): the node that reported it is not to blame more than the
    # others, so a retry avoids them all. False: the failure is of the node where it
    # happened (lost, its agent restarted, a GPU fault, the kernel's OOM killer there),
    # and a retry avoids that node alone.
    between_nodes: bool = False
    # The nodes it happened on, where more than the one it is reported for (an elastic
    # job that could not go on without its parts on several lost nodes).
    on_nodes: tuple[str, ...] = ()


# (pattern, what it means, whether it is a failure between nodes).
_INFRA_LOG: Final = (
    (
        re.compile(r"NCCL.*(time ?out|timed out|Watchdog)", re.I),
        "NCCL communication timeout",
        True,
    ),
    (
        re.compile(r"nccl(SystemError|RemoteError|InternalError)|NCCL communicator was aborted"),
        "NCCL communication failure",
        True,
    ),
    (
        re.compile(r"gloo.*(timed out|timeout|connection closed by peer|connection reset)", re.I),
        "Gloo communication timeout",
        True,
    ),
    (
        re.compile(r"uncorrectable ECC error|GPU is lost|fallen off the bus", re.I),
        "GPU hardware error",
        False,
    ),
    (
        re.compile(r"Out of memory: Killed process|oom-kill", re.I),
        "killed by the kernel's OOM killer",
        False,
    ),
)
_TRACEBACK: Final = "Traceback (most recent call last)"
_CONFIG_ERROR: Final = re.compile(r"^(usage: |.*: error: |.*[Cc]onfig(uration)? error)")


def _last_line(lines: Sequence[str]) -> str:
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def bad_input_in(log_tail: Sequence[str]) -> tuple[str, str] | None:
    """The (uri, reason) of the last `ALNAIR_BAD_INPUT` line in a log tail, if any."""
    for line in reversed(log_tail):
        text = line.strip()
        if text.startswith(BAD_INPUT_MARKER + " "):
            _, _, rest = text.partition(" ")
            uri, _, reason = rest.strip().partition(" ")
            if uri:
                return uri, reason.strip()
    return None


def _how(end: AttemptEnd) -> str:
    if end.signal is not None:
        return f"signal {end.signal}"
    return f"exit code {end.exit_code}"


def classify(
    end: AttemptEnd,
    infra_events: Sequence[str] = (),
    reported_input: str | None = None,
) -> Classification:
    """Classify a failed attempt. `infra_events` are what the brain saw happen to the
    attempt's nodes and GPUs (node lost, XID, drain); `reported_input` is the URI it
    reported through the SDK, if any."""
    if infra_events:
        return Classification(FailureClass.INFRASTRUCTURE, "; ".join(infra_events))
    if end.oom_limit_mb is not None:
        return Classification(FailureClass.USER, f"out of memory (limit {end.oom_limit_mb} MiB)")
    if end.gpu_memory_over is not None:
        used, limit = end.gpu_memory_over
        return Classification(
            FailureClass.USER,
            f"out of GPU memory: used {used:.0f} MiB, over its limit of {limit} MiB",
        )
    marked = bad_input_in(end.log_tail)
    if reported_input is not None or (marked is not None and end.exit_code == BAD_INPUT_EXIT_CODE):
        uri = reported_input if reported_input is not None else marked[0] if marked else ""
        why = marked[1] if marked is not None and marked[0] == uri and marked[1] else ""
        return Classification(
            FailureClass.INPUT, f"failed on input {uri}" + (f": {why}" if why else ""), uri
        )
    for pattern, what, between in _INFRA_LOG:
        line = next((ln.strip() for ln in reversed(end.log_tail) if pattern.search(ln)), None)
        if line is not None:
            return Classification(
                FailureClass.INFRASTRUCTURE, f"{what} ({_how(end)}): {line}", between_nodes=between
            )
    if end.signal == SIGKILL:
        return Classification(
            FailureClass.INFRASTRUCTURE,
            "killed by SIGKILL that Alnair did not send (the kernel's OOM killer)",
        )
    last = _last_line(end.log_tail)
    if any(_TRACEBACK in line for line in end.log_tail):
        return Classification(FailureClass.USER, f"Python traceback ({_how(end)}): {last}")
    if any(_CONFIG_ERROR.match(line.strip()) for line in end.log_tail):
        return Classification(FailureClass.USER, f"configuration error ({_how(end)}): {last}")
    return Classification(
        FailureClass.USER,
        f"{_how(end)}, no infrastructure event explains it" + (f": {last}" if last else ""),
    )


# --- retry policy ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FailurePolicy:
    """Retry limits and back-off, input blacklisting and pre-run, per cluster with
    per-queue overrides."""

    infrastructure_retries: int = 4
    # Back-off before retry n (1-based): base * 2**(n-1), at most `backoff_max_s`.
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    # User errors are not retried unless a queue says so: (queue, retries) pairs.
    user_retries: int = 0
    queue_user_retries: tuple[tuple[str, int], ...] = ()
    # Input failures are retried (once the input is blacklisted) at most this often.
    input_retries: int = 4
    # An input is blacklisted once this many distinct jobs failed on it.
    blacklist_after_jobs: int = 3
    # Pre-run: jobs of these queues asking for at least `prerun_min_gpus` first run on
    # one GPU for `prerun_s`; dying there fails them before they take the large grant.
    prerun_queues: tuple[str, ...] = ()
    prerun_min_gpus: int = 2
    prerun_s: float = 30.0
    # A node is a black hole (drained) once infrastructure failures blamed on it came in
    # this many separate incidents within the window (0: never); the rule drains at
    # most this share of the cluster's nodes (at least one), so that a cluster-wide
    # outage does not drain every node.
    black_hole_after: int = 3
    black_hole_window_s: float = 3600.0
    black_hole_max_share: float = 0.1

    def validate(self) -> FailurePolicy:
        """Refuse settings that make no sense, naming the setting."""
        counts = {
            "infrastructure_retries": self.infrastructure_retries,
            "user_retries": self.user_retries,
            "input_retries": self.input_retries,
            **{f"user_retries of queue {q}": n for q, n in self.queue_user_retries},
        }
        for name, count in counts.items():
            if count < 0:
                raise InvalidFailurePolicy(f"{name} cannot be negative (got {count})")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise InvalidFailurePolicy(
                f"back-off needs 0 <= base <= max (got base {self.backoff_base_s:g}s, "
                f"max {self.backoff_max_s:g}s)"
            )
        if self.blacklist_after_jobs < 1:
            raise InvalidFailurePolicy(
                f"blacklist_after_jobs must be at least 1 (got {self.blacklist_after_jobs})"
            )
        if self.prerun_min_gpus < 2:
            raise InvalidFailurePolicy(
                f"prerun_min_gpus must be at least 2: a pre-run takes one GPU "
                f"(got {self.prerun_min_gpus})"
            )
        if self.prerun_s <= 0:
            raise InvalidFailurePolicy(f"prerun_s must be positive (got {self.prerun_s:g})")
        if self.black_hole_after < 0:
            raise InvalidFailurePolicy(
                f"black_hole_after cannot be negative (got {self.black_hole_after}; 0: never)"
            )
        if not self.black_hole_window_s > 0:
            raise InvalidFailurePolicy(
                f"black_hole_window_s must be positive (got {self.black_hole_window_s:g})"
            )
        if not 0 < self.black_hole_max_share <= 1:
            raise InvalidFailurePolicy(
                f"black_hole_max_share must be in (0, 1] (got {self.black_hole_max_share:g})"
            )
        return self

    def user_retries_for(self, queue: str) -> int:
        return dict(self.queue_user_retries).get(queue, self.user_retries)

    def wants_prerun(self, queue: str, gpus: int) -> bool:
        return queue in self.prerun_queues and gpus >= self.prerun_min_gpus

    def backoff_s(self, retry: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, retry - 1)))


class InvalidFailurePolicy(AlnairError, ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid failure policy: {reason}")
        self.reason = reason


DEFAULT_FAILURE_POLICY: Final = FailurePolicy()


@dataclass(frozen=True, slots=True)
class Retry:
    """Run the job again, not before `not_before` and never on `avoid_nodes`."""

    not_before: float
    avoid_nodes: tuple[str, ...]
    cause: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """End the job: FAILED (a user error, an input not blacklisted) or UNSUCCESSFUL.
    `cause` says why with the last failure's reason (the job's reason), `verdict` the
    same without it (for a message that has said the failure already)."""

    state: JobState
    cause: str
    verdict: str


RetryDecision = Retry | GiveUp


def decide_retry(
    failures: Sequence[AttemptFailure],
    queue: str,
    now: float,
    policy: FailurePolicy,
    *,
    blacklisted: frozenset[str] = frozenset(),
    forgiven: Mapping[str, float] = MappingProxyType({}),
) -> RetryDecision:
    """What follows the last of `failures` (the job's whole list, newest last).

    `forgiven`: nodes an operator resumed, and when; a failure on one of them before
    then is not a reason to avoid it."""
    last = failures[-1]
    same = sum(1 for f in failures if f.failure_class is last.failure_class)
    if last.failure_class is FailureClass.USER:
        limit = policy.user_retries_for(queue)
        if same > limit:
            verdict = "user error, not retried"
            return GiveUp(JobState.FAILED, f"{verdict}: {last.reason}", verdict)
        return Retry(now, (), f"user error {same} of {limit} allowed by queue {queue}; retrying")
    if last.failure_class is FailureClass.INPUT:
        if last.input_uri not in blacklisted:
            verdict = "it runs again if that input is blacklisted"
            return GiveUp(JobState.FAILED, f"{last.reason}; {verdict}", verdict)
        if same > policy.input_retries:
            verdict = f"{same} input failures (limit {policy.input_retries})"
            return GiveUp(JobState.UNSUCCESSFUL, verdict, verdict)
        return Retry(now, (), f"input {last.input_uri} is blacklisted now; retrying without it")
    if same > policy.infrastructure_retries:
        verdict = f"{same} infrastructure failures (limit {policy.infrastructure_retries} retries)"
        return GiveUp(JobState.UNSUCCESSFUL, f"{verdict}; last: {last.reason}", verdict)
    avoid = sorted(
        {
            n
            for f in failures
            if f.failure_class is FailureClass.INFRASTRUCTURE
            for n in (f.nodes if f.at_fault is None else f.at_fault)
            if f.at > forgiven.get(n, float("-inf"))
        }
    )
    delay = policy.backoff_s(same)
    return Retry(
        now + delay,
        tuple(avoid),
        f"infrastructure failure {same} of {policy.infrastructure_retries} retries: retry in "
        f"{delay:g}s, avoiding {', '.join(avoid) or 'no node'}",
    )


# --- black holes -------------------------------------------------------------------------

# How a black hole's drain reason begins (`black_hole`): the rule counts the nodes it
# drained by it.
BLACK_HOLE: Final = "black hole: "
# Failures blamed on a node within this many seconds of each other are one incident: a
# node lost, or a switch port down, takes every job there at once.
INCIDENT_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """An infrastructure failure blamed on a node (`AttemptFailure.at_fault`)."""

    at: float
    job_id: str
    reason: str


def black_hole(
    failures: Sequence[NodeFailure],
    now: float,
    policy: FailurePolicy,
    *,
    forgiven_at: float | None = None,
) -> str | None:
    """Why a node is a black hole, or None. It is one when the infrastructure failures
    blamed on it since the window began (and since an operator last resumed it) came in
    `black_hole_after` separate incidents (`INCIDENT_S` apart), of two jobs or more:
    a job that failed there avoids it, so the failures are of job after job. A single
    incident, however many jobs it took, is a node lost or a GPU fault, which are
    handled as such."""
    if policy.black_hole_after <= 0:
        return None
    since = now - policy.black_hole_window_s
    if forgiven_at is not None:
        since = max(since, forgiven_at)
    recent = sorted((f for f in failures if f.at > since), key=lambda f: f.at)
    incidents = 0
    last_at = float("-inf")
    for failure in recent:
        if failure.at - last_at > INCIDENT_S:
            incidents += 1
        last_at = failure.at
    jobs = sorted({f.job_id for f in recent}, key=job_sequence)
    if incidents < policy.black_hole_after or len(jobs) < 2:
        return None
    shown = ", ".join(jobs[:5]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
    window = f"{policy.black_hole_window_s / 60:g} min"
    return (
        f"{BLACK_HOLE}{incidents} infrastructure failures within {window}, of jobs {shown}; "
        f"last: {recent[-1].reason}"
    )
