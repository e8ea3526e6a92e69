"""Submissions and cancellations: the brain's part that admits a job or refuses it,
and ends one at its owner's word.

A job is refused at submit, with what was wrong, when it could never run: its tenant
is not in the tenant map, its spec is too large for the log, it asks more GPUs than the
cluster has registered (up or not: a job must not be refused because nodes are briefly
away), its queue is unknown under strict queues or could never grant its size, or no
registered node could ever hold what it asks (GPU type, share, memory, CPUs). A
submission with a known idempotency key is answered with the job it made, live or long
finished, and makes nothing. An admitted job is journaled PENDING, and the next pass is
prompt. This journals (brain/writer.py) and stops; it reads state and never writes it
but through the writer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from brain import queues as queue_config
from brain.core import QueueQuota
from brain.core.failures import FailurePolicy
from brain.core.model import gpus_said
from brain.core.ordering import job_sequence
from brain.core.shares import never_fits
from brain.state import BrainState, job_demand
from brain.tenants import check_tenant
from brain.writer import Clock, JobRecords, Stops
from schemas.api import SubmitRequest, ThrottleRequest
from schemas.errors import ApiError
from schemas.jobs import MAX_SPEC_BYTES, JobRecord, JobState
from schemas.state import Cause, CauseKind


class Writes(JobRecords, Stops, Protocol):
    pass


class AdmissionSettings(Protocol):
    """brain.service.BrainConfig is one."""

    @property
    def tenants(self) -> frozenset[str] | None: ...

    @property
    def queues(self) -> tuple[QueueQuota, ...]: ...

    @property
    def strict_queues(self) -> bool: ...

    @property
    def failures(self) -> FailurePolicy: ...


class Submissions:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: Writes,
        settings: AdmissionSettings,
        *,
        clock: Clock,
        job_record: Callable[[str], Awaitable[JobRecord | None]],
        submitted: Callable[[], None],
    ) -> None:
        """`job_record`: a job as it stands, from memory or, once finished and gone
        from it, from the history; `submitted`: told of each job admitted."""
        self._state = state
        self._writes = writes
        self._settings = settings
        self._clock = clock
        self._job_record = job_record
        self._submitted = submitted

    async def submit(self, tenant: str, request: SubmitRequest) -> JobRecord:
        state, settings, spec = self._state(), self._settings, request.spec
        check_tenant(settings.tenants, tenant)
        if request.idempotency_key is not None:
            known = state.job_for_key(tenant, request.idempotency_key)
            if known is not None:
                return known
            away = state.job_away_for_key(tenant, request.idempotency_key)
            if away is not None:
                # Finished long ago: answered from the history. The key is that job's,
                # whether or not the history can say so now: never a second job for it.
                finished = await self._job_record(away)
                if finished is None:
                    raise ApiError(
                        "unavailable",
                        f"the job submitted with this idempotency key ({away}) has finished "
                        "and its record could not be read from the history; try again",
                    )
                return finished
        self._refuse_if_never_runs(state, request)
        to_succeed = await self._jobs_before(tenant, spec.after)
        to_end = await self._jobs_before(tenant, spec.after_any, succeeded=False)
        job = JobRecord(
            job_id=state.next_job_id(),
            tenant=tenant,
            spec=spec,
            state=JobState.PENDING,
            submitted_at=self._clock(),
            reason=_waiting_for(to_succeed, to_end),
            idempotency_key=request.idempotency_key,
            prerun="pending" if settings.failures.wants_prerun(spec.queue, spec.gpus) else None,
        )
        await self._writes.job_changed(
            job,
            None,
            Cause(
                kind=CauseKind.SUBMITTED, message=f"submitted by tenant {tenant}", job_id=job.job_id
            ),
        )
        self._submitted()
        return job

    async def _jobs_before(
        self, tenant: str, after: tuple[str, ...], *, succeeded: bool = True
    ) -> list[str]:
        """Of the jobs a submission is to run after (`JobSpec.after`, or with not
        `succeeded` `after_any`), those that have not SUCCEEDED (ended) yet; refused:
        one that is not the tenant's, or for `after` one that ended otherwise (the job
        could never start)."""
        field = "after" if succeeded else "after_any"
        waits = []
        for job_id in after:
            job = self._state().jobs.get(job_id) or await self._job_record(job_id)
            if job is None or job.tenant != tenant:
                raise ApiError("invalid", f"{field}: tenant {tenant} has no job {job_id}")
            if job.state is JobState.SUCCEEDED or (job.state.terminal and not succeeded):
                continue
            if job.state.terminal:
                raise ApiError(
                    "invalid",
                    f"after: job {job_id} ended {job.state.value}: this job could never start",
                )
            waits.append(job_id)
        return waits

    async def cancel_orphans(self) -> None:
        """Cancel the pending jobs one of whose jobs to run after ended otherwise than
        SUCCEEDED (`BrainState.doomed`): they can never start."""
        state = self._state()
        for job_id, why in list(state.doomed.items()):
            job = state.jobs.get(job_id)
            if job is None or job.state is not JobState.PENDING:
                continue
            await self._cancel(job, why, why)

    def _refuse_if_never_runs(self, state: BrainState, request: SubmitRequest) -> None:
        spec, settings = request.spec, self._settings
        size = len(spec.model_dump_json())
        if size > MAX_SPEC_BYTES:
            env = sum(len(name) + len(value) for name, value in spec.env.items())
            raise ApiError(
                "invalid",
                f"the job's spec is {size} bytes (its environment {env}), over the "
                f"{MAX_SPEC_BYTES} a job may take: pass large data in files",
            )
        # Against every registered GPU, not only those up right now: a job must not be
        # refused because nodes are briefly away (a NATS restart, a network blip).
        total, largest = state.registered_gpus()
        if state.nodes and spec.gpus > total:
            nodes = len(state.nodes)
            raise ApiError(
                "invalid",
                f"job asks for {gpus_said(spec.gpus)} but the cluster has {total} "
                f"({nodes} node{'' if nodes == 1 else 's'}, at most {largest} on one node)",
            )
        if settings.strict_queues:
            unlisted = queue_config.unlisted(settings.queues, spec.queue)
            if unlisted is not None:
                raise ApiError("invalid", unlisted)
        never = queue_config.never_within(settings.queues, spec.queue, spec.gpu_range[0])
        if never is not None:
            raise ApiError("invalid", never)
        demand = job_demand(spec)
        if demand is not None:
            never = never_fits(demand, spec.gpus, state.registered_views())
            if never is not None:
                raise ApiError("invalid", f"no node could ever run this job: {never}")

    async def cancel(self, tenant: str, job_id: str, *, operator: bool = False) -> JobRecord:
        """End a job of `tenant`'s, or (`operator`) of any tenant's, CANCELLED."""
        job = await self._job_record(job_id)
        if job is None or (job.tenant != tenant and not operator):
            raise ApiError("not_found", f"no job {job_id} for tenant {tenant}")
        if job.state is JobState.CANCELLED:
            # Asked again (a retry whose first answer was lost): what it asked for holds.
            return job
        if job.state.terminal:
            raise ApiError("conflict", f"job {job_id} already ended {job.state.value}")
        if job.tenant == tenant:
            reason, message = "cancelled by its owner", f"cancelled by tenant {tenant}"
        else:
            reason = message = "cancelled by an operator"
        cancelled = await self._cancel(job, reason, message)
        # As stored (its service accounted up to the cancellation), as a retry sees it.
        return await self._job_record(job_id) or cancelled

    async def throttle(self, tenant: str, request: ThrottleRequest) -> list[str]:
        """Hold every job of the tenant's array that has not ended to `request.limit`
        (`JobSpec.array_limit`; None: no limit): the ids, in job order. Jobs already
        held to it are not journaled again, so a request retried changes nothing."""
        array, limit = request.array, request.limit
        jobs = sorted(
            (
                job
                for job in self._state().jobs.values()
                if job.tenant == tenant and job.spec.array == array and not job.state.terminal
            ),
            key=lambda job: job_sequence(job.job_id),
        )
        if not jobs:
            raise ApiError("not_found", f"tenant {tenant} has no job of array {array} left to run")
        said = _at_once(limit)
        for job in jobs:
            was = job.spec.array_limit
            if was == limit:
                continue
            spec = job.spec.model_copy(update={"array_limit": limit})
            cause = Cause(
                kind=CauseKind.ARRAY_THROTTLED,
                message=f"array {array} throttled by tenant {tenant}: {said} (was {_at_once(was)})",
                job_id=job.job_id,
            )
            await self._writes.job_changed(job.model_copy(update={"spec": spec}), job.state, cause)
        return [job.job_id for job in jobs]

    async def _cancel(self, job: JobRecord, reason: str, message: str) -> JobRecord:
        """End `job` CANCELLED for `reason` (the cause's `message`), stopping what of it
        runs."""
        cancelled = job.model_copy(
            update={"state": JobState.CANCELLED, "finished_at": self._clock(), "reason": reason}
        )
        cause = Cause(kind=CauseKind.CANCELLED, message=message, job_id=job.job_id)
        await self._writes.job_changed(cancelled, job.state, cause)
        await self._writes.stop_parts(job, "cancelled")
        return cancelled


def _waiting_for(to_succeed: list[str], to_end: list[str]) -> str:
    """A new job's reason while jobs it runs after have not SUCCEEDED (`to_succeed`) or
    ended (`to_end`)."""
    said = [
        f"job{'s' if len(ids) > 1 else ''} {', '.join(ids)} to {what}"
        for ids, what in ((to_succeed, "succeed"), (to_end, "end"))
        if ids
    ]
    return f"waiting for {' and '.join(said)}" if said else "submitted"


def _at_once(limit: int | None) -> str:
    """An array's limit (`JobSpec.array_limit`), as a throttle's cause says it."""
    return "no limit" if limit is None else f"at most {limit} at once"
