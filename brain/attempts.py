"""Attempts and their failures: the brain's part that turns node events about a job's
attempt into state, and retries or ends a failed one.

An event counts only for the attempt the job runs now, on a node it runs on
(`current_attempt`); a stale one changes nothing. A failed attempt is classified (user,
infrastructure, input) and brain/core/failures.py decides whether it runs again
(elsewhere, after a back-off) or ends; a critical GPU fault drains the GPU or its node and
fails what runs there as infrastructure. This journals (brain/writer.py) and stops; it
reads state and never writes it but through the writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from brain.core.failures import (
    BLACK_HOLE,
    AttemptEnd,
    Classification,
    FailurePolicy,
    GiveUp,
    black_hole,
    classify,
    decide_retry,
    fault_action,
)
from brain.state import BrainState, served
from brain.writer import Clock, JobRecords, NodeRecords, Stops
from schemas.errors import ApiError
from schemas.events import CommandRejected, GpuFault, JobExited, JobStarted, LaunchFailed
from schemas.jobs import (
    AttemptFailure,
    FailureClass,
    JobRecord,
    JobState,
    clock_text,
    job_limits,
)
from schemas.nodes import DrainedGpu, NodeRecord, NodeState
from schemas.state import Cause, CauseKind

log = logging.getLogger(__name__)


def launch_id(job_id: str, attempt: int, node: str) -> str:
    """The id of an attempt's launch on a node (one per node: JetStream de-duplicates
    across the stream)."""
    return f"launch-{job_id}-{attempt}-{node}"


def current_attempt(state: BrainState, job_id: str, attempt: int, node: str) -> JobRecord | None:
    """The job, if `attempt` on `node` is what it runs now; else the event is stale."""
    job = state.jobs.get(job_id)
    if job is None or job.state is not JobState.RUNNING or job.attempt != attempt:
        return None
    return job if node in job.nodes else None


def resumed_nodes(state: BrainState) -> dict[str, float]:
    """Nodes an operator resumed, and when (`decide_retry`'s `forgiven`)."""
    return {name: n.resumed_at for name, n in state.nodes.items() if n.resumed_at is not None}


def with_grant(job: JobRecord, node: str, **update: object) -> JobRecord:
    grants = tuple(g.model_copy(update=update) if g.node == node else g for g in job.grants)
    return job.model_copy(update={"grants": grants})


class Writes(JobRecords, NodeRecords, Stops, Protocol):
    pass


class Joins(Protocol):
    """Elastic jobs' parts that end without the job (brain.resizes.Resizes): a failed
    launch that was a staged grow's worker host (the grow fails, not the job), and a
    part its node stopped (the job goes on without it); True when so."""

    async def join_failed(self, job: JobRecord, node: str, why: str) -> bool: ...

    async def shed(self, job: JobRecord, node: str, why: str) -> bool: ...


class Attempts:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: Writes,
        joins: Joins,
        *,
        policy: FailurePolicy,
        clock: Clock,
    ) -> None:
        self._state = state
        self._writes = writes
        self._joins = joins
        self._policy = policy
        self._clock = clock

    async def requeue(self, job: JobRecord, cause: Cause) -> None:
        """Back to PENDING, keeping its attempt count; stop whatever still runs. A job
        that has run its time limit by now ends instead (`_end_at_time_limit`): placed
        again, it would run until the next tick stopped it."""
        ran = self._ran_out(job, self._clock())
        if ran is not None:
            await self._end_at_time_limit(job, ran, f"{cause.message}; ")
            return
        pending = job.model_copy(
            update={
                "state": JobState.PENDING,
                "grants": (),
                "started_at": None,
                "reason": cause.message,
            }
        )
        await self._writes.job_changed(pending, job.state, cause)
        await self._writes.stop_parts(job, f"requeued: {cause.message}")

    async def job_started(self, event: JobStarted) -> None:
        job = current_attempt(self._state(), event.job_id, event.attempt, event.node)
        if job is None:
            return
        started = with_grant(job, event.node, pid=event.pid, log_path=event.log_path)
        message = f"process {event.pid} started on {event.node}"
        unenforced = [] if event.limits_enforced else _asked_limits(job, event.node)
        if unenforced:
            message += (
                f"; its limits are not enforced there: {', '.join(unenforced)} "
                "(its agent does not confine jobs: docs/security.md)"
            )
        await self._writes.job_changed(
            started,
            job.state,
            Cause(kind=CauseKind.STARTED, node=event.node, job_id=job.job_id, message=message),
        )

    async def job_exited(self, event: JobExited) -> None:
        job = current_attempt(self._state(), event.job_id, event.attempt, event.node)
        if job is None:
            return
        updated = with_grant(
            job, event.node, exited=True, exit_code=event.exit_code, signal=event.signal
        )
        how = f"exit code {event.exit_code}" if event.signal is None else f"signal {event.signal}"
        if event.stopped:
            # Stopped by its node, not by this brain (the agent fenced it or shut
            # down): not the job's fault, so it runs again, or an elastic job goes on
            # without that part.
            why = f"its part on node {event.node} was stopped by that node ({how})"
            if await self._joins.shed(job, event.node, why):
                return
            await self.requeue(
                updated,
                Cause(
                    kind=CauseKind.EXITED,
                    node=event.node,
                    job_id=job.job_id,
                    message=f"stopped by node {event.node} ({how})",
                ),
            )
            return
        if event.exit_code == 0:
            # An elastic job across nodes ends with its supervisor (the first node's
            # process): its worker hosts on the others run until they are stopped.
            supervised = job.spec.elastic and event.node == job.grants[0].node
            if supervised or all(g.exited for g in updated.grants):
                done = updated.model_copy(
                    update={
                        "state": JobState.SUCCEEDED,
                        "finished_at": self._clock(),
                        "exit_code": 0,
                        "reason": "exited 0",
                    }
                )
                await self._writes.job_changed(
                    done,
                    job.state,
                    Cause(
                        kind=CauseKind.EXITED,
                        node=event.node,
                        job_id=job.job_id,
                        message=f"exited 0 after {event.runtime_s:.1f}s",
                    ),
                )
                if supervised:
                    await self._writes.stop_parts(
                        updated, "the job's supervisor finished", except_node=event.node
                    )
            else:
                await self._writes.job_changed(
                    updated,
                    job.state,
                    Cause(
                        kind=CauseKind.EXITED,
                        node=event.node,
                        job_id=job.job_id,
                        message=f"part on {event.node} exited 0; waiting for the others",
                    ),
                )
            return
        end = AttemptEnd(
            exit_code=event.exit_code,
            signal=event.signal,
            log_tail=event.log_tail,
            runtime_s=event.runtime_s,
            oom_limit_mb=event.oom_limit_mb,
            gpu_memory_over=(
                (event.gpu_memory_used_mib or 0.0, event.gpu_memory_limit_mib)
                if event.gpu_memory_limit_mib is not None
                else None
            ),
        )
        reported = self._state().input_reports.get((job.job_id, job.attempt))
        await self.fail_attempt(updated, event.node, classify(end, (), reported), end)

    async def launch_failed(self, event: LaunchFailed) -> None:
        job = current_attempt(self._state(), event.job_id, event.attempt, event.node)
        if job is None:
            return
        why = f"the job's worker host did not start on {event.node}: {event.reason}"
        if await self._joins.join_failed(job, event.node, why):
            return
        updated = with_grant(job, event.node, exited=True)
        cause = Cause(
            kind=CauseKind.LAUNCH_FAILED,
            node=event.node,
            job_id=job.job_id,
            message=f"launch failed on {event.node}: {event.reason}",
        )
        failure_class = FailureClass.INFRASTRUCTURE if event.retryable else FailureClass.USER
        await self.fail_attempt(updated, event.node, Classification(failure_class, cause.message))

    async def command_rejected(self, event: CommandRejected) -> None:
        log.warning("node %s rejected %s: %s", event.node, event.command_id, event.reason)
        if event.job_id is None or not event.command_id.startswith("launch-"):
            return
        job = self._state().jobs.get(event.job_id)
        if job is None or job.state is not JobState.RUNNING:
            return
        if event.command_id != launch_id(job.job_id, job.attempt, event.node):
            return
        why = f"node {event.node} refused the job's worker host: {event.reason}"
        if not await self._joins.join_failed(job, event.node, why):
            await self.requeue(
                job,
                Cause(
                    kind=CauseKind.LAUNCH_FAILED,
                    node=event.node,
                    job_id=job.job_id,
                    message=f"node {event.node} refused the launch: {event.reason}",
                ),
            )

    # -- failures (brain/core/failures.py decides; this journals and stops) ---------

    async def fail_attempt(
        self,
        job: JobRecord,
        node: str,
        classification: Classification,
        end: AttemptEnd | None = None,
    ) -> None:
        """Record a failed attempt with its class, then retry it or end it."""
        now = self._clock()
        user = classification.failure_class is FailureClass.USER
        nodes = job.nodes or (node,)
        failure = AttemptFailure(
            attempt=max(1, job.attempt),
            failure_class=classification.failure_class,
            reason=classification.reason,
            nodes=nodes,
            at_fault=nodes if classification.between_nodes else classification.on_nodes or (node,),
            at=now,
            exit_code=end.exit_code if end is not None else None,
            signal=end.signal if end is not None else None,
            input_uri=classification.input_uri,
            log_tail=end.log_tail[-5:] if end is not None and user else (),
        )
        failures = (*job.failures, failure)
        decision = decide_retry(
            failures,
            job.spec.queue,
            now,
            self._policy,
            blacklisted=frozenset(self._state().blacklist),
            forgiven=resumed_nodes(self._state()),
        )
        what = f"{classification.failure_class.value} failure on {node}: {classification.reason}"
        if isinstance(decision, GiveUp):
            kind = (
                CauseKind.RETRIES_EXHAUSTED
                if decision.state is JobState.UNSUCCESSFUL
                else CauseKind.FAILURE_CLASSIFIED
            )
            ended = _ended(job, decision.state, now, failures, decision.cause)
            cause = Cause(
                kind=kind, node=node, job_id=job.job_id, message=f"{what}; {decision.verdict}"
            )
            await self._writes.job_changed(ended, job.state, cause)
            await self._writes.stop_parts(job, f"failed: {classification.reason}", except_node=node)
            await self._drain_black_holes(failure)
            return
        ran = self._ran_out(job, now)
        if ran is not None:
            # A retry would have no time left: the attempt's failure is kept, and the
            # job ends at its limit.
            await self._end_at_time_limit(job, ran, f"{what}; ", failure=failure, at=node)
            await self._drain_black_holes(failure)
            return
        pending = job.model_copy(
            update={
                "state": JobState.PENDING,
                "grants": (),
                "started_at": None,
                "failures": failures,
                "not_before": decision.not_before,
                "avoid_nodes": decision.avoid_nodes,
                # A pre-run that failed for reasons not its own tries its pre-run again.
                "prerun": "pending" if job.prerun == "running" else job.prerun,
                "reason": f"{what}; {decision.cause}",
            }
        )
        cause = Cause(
            kind=CauseKind.RETRY_SCHEDULED,
            node=node,
            job_id=job.job_id,
            message=f"{what}; {decision.cause}",
        )
        await self._writes.job_changed(pending, job.state, cause)
        await self._writes.stop_parts(job, f"retrying elsewhere: {classification.reason}")
        await self._drain_black_holes(failure)

    async def check_time_limits(self) -> None:
        """Stop every running job that has run its time limit (`JobSpec.time_limit_s`,
        its run time over all its attempts): FAILED, a user failure, never retried (a
        retry would have no time left). Looks over the time-limited jobs only."""
        state = self._state()
        if not state.time_limited:
            return
        now = self._clock()
        for job_id in list(state.time_limited):
            job = state.jobs[job_id]
            ran = self._ran_out(job, now)
            if ran is not None:
                await self._end_at_time_limit(job, ran)

    @staticmethod
    def _ran_out(job: JobRecord, now: float) -> float | None:
        """How long `job` has run, if that is its time limit or more; else None."""
        limit = job.spec.time_limit_s
        if limit is None:
            return None
        _, ran = served(job, now)
        return ran if ran >= limit else None

    async def _end_at_time_limit(
        self,
        job: JobRecord,
        ran: float,
        before: str = "",
        *,
        failure: AttemptFailure | None = None,
        at: str | None = None,
    ) -> None:
        """End `job`, which has run `ran` seconds, at its time limit: FAILED, never
        retried, whatever of it runs stopped. `before`: what else happened to it now (a
        preemption, a failed attempt), for the cause; `failure`: the attempt's own, on
        `at`, recorded in place of a time-limit failure (its exit and log tail say more)."""
        assert job.spec.time_limit_s is not None
        now = self._clock()
        reason = f"time limit {clock_text(job.spec.time_limit_s)} reached"
        node = at or (job.nodes[0] if job.nodes else "")
        if failure is None:
            failure = AttemptFailure(
                attempt=max(1, job.attempt),
                failure_class=FailureClass.USER,
                reason=reason,
                nodes=job.nodes,
                at_fault=(),
                at=now,
            )
        ended = _ended(job, JobState.FAILED, now, (*job.failures, failure), reason)
        cause = Cause(
            kind=CauseKind.FAILURE_CLASSIFIED,
            node=node or None,
            job_id=job.job_id,
            message=f"{before}{reason} after {clock_text(ran)} run; not retried",
        )
        await self._writes.job_changed(ended, job.state, cause)
        await self._writes.stop_parts(job, reason, except_node=at)

    async def _drain_black_holes(self, failure: AttemptFailure) -> None:
        """Drain the nodes an infrastructure failure is blamed on that have become
        black holes (`black_hole`), as long as the rule has drained fewer than its share
        of the cluster: past it the failures are likelier the cluster's than a node's,
        and are only logged."""
        if failure.failure_class is not FailureClass.INFRASTRUCTURE:
            return
        state, policy, now = self._state(), self._policy, self._clock()
        for name in failure.nodes if failure.at_fault is None else failure.at_fault:
            node = state.nodes.get(name)
            if node is None or node.drain_reason is not None:
                continue
            reason = black_hole(
                state.node_failures.get(name, ()), now, policy, forgiven_at=node.resumed_at
            )
            if reason is None:
                continue
            most = max(1, int(policy.black_hole_max_share * len(state.nodes)))
            holes = sum(
                1
                for n in state.nodes.values()
                if n.drain_reason is not None and n.drain_reason.startswith(BLACK_HOLE)
            )
            if holes >= most:
                log.warning(
                    "node %s looks like a black hole (%s), but %d node(s) are drained as "
                    "such already, the most this rule drains: left in service",
                    name,
                    reason,
                    holes,
                )
                continue
            await self._writes.node_changed(
                node.model_copy(
                    update={
                        "state": NodeState.DRAINED if node.state is NodeState.READY else node.state,
                        "drain_reason": reason,
                    }
                ),
                node.state,
                Cause(kind=CauseKind.NODE_DRAINED, node=name, message=reason),
            )

    async def gpu_fault(self, event: GpuFault) -> None:
        """Critical faults drain the GPU or the node; jobs on it fail as infrastructure."""
        action = fault_action(event.fault, event.xid, event.gpu)
        node = self._state().nodes.get(event.node)
        if node is None or action.drain == "none":
            log.info("node %s: %s (drains nothing)", event.node, action.reason)
            return
        if action.drain == "node":
            affected = self._state().running_on(node.name)
            if node.drain_reason is None:
                await self._writes.node_changed(
                    node.model_copy(
                        update={
                            "state": NodeState.DRAINED
                            if node.state is NodeState.READY
                            else node.state,
                            "drain_reason": action.reason,
                        }
                    ),
                    node.state,
                    Cause(kind=CauseKind.NODE_DRAINED, node=node.name, message=action.reason),
                )
        else:
            affected = [
                j
                for j in self._state().running_on(node.name)
                if any(g.node == node.name and event.gpu in g.gpus for g in j.grants)
            ]
            await self.drain_gpu(node, event.gpu, action.reason)
        for job in affected:
            await self.fail_attempt(
                job, node.name, Classification(FailureClass.INFRASTRUCTURE, action.reason)
            )

    async def forgive_node(self, node: str, why: str) -> None:
        """An operator resumed `node`: the jobs that avoid it for failing there (retried
        after an infrastructure failure) may run there again. Their later retries forgive
        it too (`decide_retry`, `forgiven`), as long as they do not fail there again."""
        for job in self._state().jobs_in(JobState.PENDING, JobState.RUNNING):
            if node not in job.avoid_nodes:
                continue
            avoid = tuple(n for n in job.avoid_nodes if n != node)
            await self._writes.job_changed(
                job.model_copy(update={"avoid_nodes": avoid}),
                job.state,
                Cause(
                    kind=CauseKind.NODE_RESUMED,
                    node=node,
                    job_id=job.job_id,
                    message=f"{why}: it may run there again, where it failed before",
                ),
            )

    async def drain_gpu(self, node: NodeRecord, gpu: int, reason: str) -> None:
        if gpu not in {g.index for g in node.gpus}:
            raise ApiError("not_found", f"node {node.name} has no GPU {gpu}")
        if any(d.index == gpu for d in node.drained_gpus):
            return
        drained = (*node.drained_gpus, DrainedGpu(index=gpu, reason=reason, at=self._clock()))
        await self._writes.node_changed(
            node.model_copy(update={"drained_gpus": drained}),
            node.state,
            Cause(kind=CauseKind.GPU_DRAINED, node=node.name, message=reason),
        )


def _asked_limits(job: JobRecord, node: str) -> list[str]:
    """The memory and CPUs the job asked for on `node`, as its cgroup there would have
    them (`job_limits`); the defaults an agent applies to a job that asked none are not
    the job's request, and go unsaid."""
    spec = job.spec
    here = sum(len(g.gpus) for g in job.grants if g.node == node)
    memory_mb, cpus = job_limits(spec, here)
    asked = []
    if spec.memory_mib is not None or spec.memory_mb_per_gpu is not None:
        asked.append(f"memory {memory_mb} MiB")
    if spec.cpus is not None or spec.cpus_per_gpu is not None:
        asked.append(f"{cpus:g} CPU{'' if cpus == 1 else 's'}")
    return asked


def _ended(
    job: JobRecord,
    state: JobState,
    now: float,
    failures: tuple[AttemptFailure, ...],
    reason: str,
) -> JobRecord:
    """`job` ended in `state` at `now` by the last of its `failures`, whose exit code and
    signal are the job's."""
    last = failures[-1]
    return job.model_copy(
        update={
            "state": state,
            "finished_at": now,
            "exit_code": last.exit_code,
            "signal": last.signal,
            "failures": failures,
            "reason": reason,
        }
    )
