"""Elastic resizes: the brain's part that stages, commands, commits and rolls them back.

brain/elastic.py says what a resize changes; this journals it (brain/writer.py), sends
the supervisor its resize command once the records are stored (the journal's outbox), and
tells the job's nodes which GPUs the attempt holds (`Regrant`). A resize is asked by an
operator (`alnair resize`, which pins the job's size) or by the policy (`Resize`), and
ends when the supervisor answers (`ResizeCompleted`), or is rolled back when it refuses,
never answers within `resize_timeout_s`, or a grow's worker host cannot start. It reads
state and never writes it but through the writer.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from pydantic import BaseModel

from brain import elastic
from brain.core import Resize
from brain.core.failures import Classification
from brain.core.model import gpus_said
from brain.state import BrainState
from brain.writer import Clock, Commands, JobRecords
from schemas import subjects
from schemas.api import ResizeRequest
from schemas.commands import Regrant
from schemas.errors import ApiError
from schemas.events import ResizeCompleted
from schemas.jobs import (
    FailureClass,
    JobRecord,
    JobState,
    NodeGpus,
    describe_placement,
    placement_size,
)
from schemas.state import Cause, CauseKind

log = logging.getLogger(__name__)


class Writes(JobRecords, Commands, Protocol):
    pass


class Outbox(Protocol):
    """Publish after the unit's records are stored (brain.journal.Journal is one)."""

    def send_after(self, subject: str, message: BaseModel, msg_id: str) -> None: ...


class Supervisors(Protocol):
    """Which elastic jobs' supervisors have reported (brain.progress.ProgressTracker)."""

    def heard_from(self, job_id: str) -> bool: ...


# Fails an attempt with its class, then retries or ends the job (bound to
# brain.attempts.Attempts.fail_attempt, which is built after this part).
FailAttempt = Callable[[JobRecord, str, Classification], Awaitable[None]]


class Resizes:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: Writes,
        outbox: Outbox,
        supervisors: Supervisors,
        *,
        clock: Clock,
        timeout_s: float,
        leading: Callable[[], bool],
        fail_attempt: FailAttempt,
    ) -> None:
        self._state = state
        self._writes = writes
        self._outbox = outbox
        self._progress = supervisors
        self._clock = clock
        # A resize its supervisor has not answered within this long is rolled back.
        self._timeout_s = timeout_s
        self._leading = leading
        self._fail_attempt = fail_attempt

    async def resize_request(
        self, tenant: str, request: ResizeRequest, *, operator: bool
    ) -> JobRecord:
        """`alnair resize JOB N`: pin the job at N and stage the resize, or say why
        not (nothing changes then). Answered once staged; the commit (or roll-back)
        follows when the supervisor answers. `alnair resize JOB auto` lifts the pin."""
        job = self._state().jobs.get(request.job_id)
        if job is None or (job.tenant != tenant and not operator):
            raise ApiError("not_found", f"no job {request.job_id} for tenant {tenant}")
        who = "an operator" if operator and job.tenant != tenant else f"tenant {tenant}"
        if request.gpus == "auto":
            return await self.unpin(job, who)
        ready = self._progress.heard_from(job.job_id)
        refused = elastic.check_resizable(job, request.gpus, supervisor_ready=ready)
        if refused is not None:
            raise ApiError(refused.code, refused.reason)
        if placement_size(elastic.current_placement(job)) == request.gpus:
            return await self.pin(job, request.gpus, who)  # already that size
        free = self._state().free_gpus()
        target = elastic.choose_target(job, request.gpus, free)
        if isinstance(target, elastic.ResizeRefused):
            raise ApiError(target.code, target.reason)
        refused = elastic.check_target(job, target, free)
        if refused is not None:
            raise ApiError(refused.code, refused.reason)
        pinned = job.model_copy(update={"pinned_gpus": request.gpus})
        return await self.stage_resize(
            pinned, target, f"asked by {who}, who pins it at {gpus_said(request.gpus)}"
        )

    async def pin(self, job: JobRecord, gpus: int, who: str) -> JobRecord:
        message = f"pinned at {gpus_said(gpus)} by {who}: the policy leaves its size alone"
        return await self.set_pin(job, gpus, CauseKind.RESIZE_PINNED, message)

    async def unpin(self, job: JobRecord, who: str) -> JobRecord:
        if not job.spec.elastic:
            raise ApiError("invalid", elastic.not_elastic(job))
        if job.state.terminal:
            raise ApiError("conflict", f"job {job.job_id} is {job.state.value}")
        if job.pinned_gpus is None:
            return job  # not pinned: nothing to lift
        low, high = job.spec.gpu_range
        message = (
            f"pin at {gpus_said(job.pinned_gpus)} lifted by {who}: the policy sizes it again "
            f"within {low}..{high}"
        )
        return await self.set_pin(job, None, CauseKind.RESIZE_UNPINNED, message)

    async def set_pin(
        self, job: JobRecord, gpus: int | None, kind: CauseKind, message: str
    ) -> JobRecord:
        """Journal the job's new pin (None: none); nothing when it is already so."""
        if job.pinned_gpus == gpus:
            return job
        await self._writes.job_changed(
            job.model_copy(update={"pinned_gpus": gpus, "reason": message}),
            job.state,
            Cause(kind=kind, job_id=job.job_id, message=message),
        )
        return self._state().jobs[job.job_id]

    async def apply_resize(self, job: JobRecord, action: Resize) -> None:
        """The policy's resize, staged if it still holds against the live state."""
        target = tuple(NodeGpus(node=g.node, gpus=tuple(sorted(g.gpus))) for g in action.grants)
        current = elastic.current_placement(job)
        if job.state is JobState.RUNNING and elastic.same_placement(target, current):
            return
        refused = elastic.check_resize(
            job,
            target,
            self._state().free_gpus(),
            supervisor_ready=self._progress.heard_from(job.job_id),
        )
        if refused is not None:
            log.debug("policy resize of job %s not staged: %s", job.job_id, refused.reason)
            return
        if action.retreat:
            # The size it leaves did not earn its keep: not grown back on this evidence.
            size = placement_size(current)
            job = job.model_copy(update={"gain_ceiling": size, "gain_ceiling_at": self._clock()})
        await self.stage_resize(job, target, action.reason)

    async def stage_resize(
        self, job: JobRecord, target: elastic.Placement, cause: str, *, lost: str | None = None
    ) -> JobRecord:
        """Journal the resize to `target` and send its commands; `lost`: a lost node the
        job sheds (`elastic.stage_lost`), sent `Stop` for when it returns."""
        command_id = f"resize-{job.job_id}-{job.attempt}-{uuid.uuid4().hex[:12]}"
        now = self._clock()
        staged = (
            elastic.stage(job, target, command_id=command_id, now=now, cause=cause)
            if lost is None
            else elastic.stage_lost(job, lost, target, command_id=command_id, now=now, cause=cause)
        )
        assert staged.resize is not None
        await self._writes.job_changed(
            staged,
            job.state,
            Cause(
                kind=CauseKind.RESIZE_STAGED,
                node=staged.resize.node if lost is None else lost,
                job_id=job.job_id,
                message=f"resize {elastic.describe(staged.resize)} staged: {cause}",
            ),
        )
        current = self._state().jobs[job.job_id]
        if staged.resize.grow:
            # The added GPUs are the job's from now on: their nodes must know, and a
            # node new to the job starts its worker host (horovodrun's workers there
            # start through it).
            await self.regrant(current, command_id, "staged")
            await self._writes.send_launches(current)
        await self.send_resize(current)
        if lost is not None:
            await self._writes.stop(job.job_id, lost, cause, job.attempt)
        return current

    async def send_resize(self, job: JobRecord) -> None:
        command = elastic.resize_command(job, epoch=self._writes.epoch, issued_at=self._clock())
        self._outbox.send_after(subjects.job(job.job_id, "cmd"), command, command.command_id)

    async def regrant(self, job: JobRecord, resize_id: str, phase: str) -> None:
        """Tell the job's nodes which of their GPUs the attempt holds now (a node whose
        part has not started yet learns them from its launch)."""
        for grant in job.grants:
            if grant.pid is None:
                continue
            await self._writes.command(
                grant.node,
                Regrant(
                    # One id per node: JetStream de-duplicates across the stream.
                    command_id=f"regrant-{resize_id}-{phase}-{grant.node}",
                    epoch=self._writes.epoch,
                    issued_at=self._clock(),
                    job_id=job.job_id,
                    attempt=job.attempt,
                    gpus=grant.gpus,
                    reason=f"resize {phase}",
                ),
            )

    async def resend_staged_resizes(self) -> None:
        """A brain may have died between staging a resize and commanding it; the ids
        are the same, so the supervisor and the agent drop what they had already."""
        for job in self._state().jobs_in(JobState.RUNNING):
            if not self._leading():
                return  # stepped down meanwhile: the next leader re-sends them
            if job.resize is None:
                continue
            if job.resize.grow:
                await self.regrant(job, job.resize.command_id, "staged")
                await self._writes.send_launches(job)
            await self.send_resize(job)

    async def resize_completed(self, event: ResizeCompleted) -> None:
        job = self._state().jobs.get(event.job_id)
        staged = job.resize if job is not None else None
        if (
            job is None
            or job.state is not JobState.RUNNING
            or staged is None
            or staged.command_id != event.command_id
        ):
            log.info(
                "resize outcome %s of job %s matches no staged resize; ignored",
                event.command_id,
                event.job_id,
            )
            return
        if not event.ok and staged.lost:
            await self._lost_for_good(job, f"its supervisor refused: {event.reason}")
            return
        if not event.ok:
            # A supervisor that tried (to_size differs) may have moved part of the way.
            moved = event.to_size != event.from_size
            await self.roll_back_resize(
                job, f"its supervisor refused: {event.reason}", revert=moved
            )
            return
        if event.from_size != staged.from_size:
            log.warning(
                "job %s: the supervisor resized from %d workers, the brain thought %d",
                job.job_id,
                event.from_size,
                staged.from_size,
            )
        now = self._clock()
        kept = elastic.committed_placement(staged, event.placement)
        message = f"resized {elastic.describe(staged, kept)} in {event.duration_s:.1f}s"
        if event.placement and not elastic.same_placement(kept, event.placement):
            log.warning(
                "job %s: its supervisor says its workers hold GPUs %s, which does not fit "
                "the resize %s; keeping %s",
                job.job_id,
                describe_placement(event.placement),
                elastic.describe(staged),
                describe_placement(kept),
            )
        if staged.lost:
            message += f"; its part on lost node(s) {', '.join(staged.lost)} dropped"
        elif not staged.grow:
            message += f"; GPUs {describe_placement(elastic.released(staged, kept))} released"
        committed = elastic.commit(job, message, event.placement).model_copy(
            update={"last_resize_at": now, "last_resize_s": max(0.0, now - staged.staged_at)}
        )
        await self._writes.job_changed(
            committed,
            job.state,
            Cause(kind=CauseKind.RESIZED, node=staged.node, job_id=job.job_id, message=message),
        )
        if not staged.grow:
            # Its workers on the released GPUs have exited: they are free now (a node
            # the job left keeps its worker host, idle, holding none).
            await self.regrant(self._state().jobs[job.job_id], staged.command_id, "committed")

    async def roll_back_resize(
        self, job: JobRecord, why: str, *, revert: bool, drop: str | None = None
    ) -> None:
        """Back to the size before. With `revert` (the supervisor may have moved part of
        the way: it tried, or never answered) the old size is staged as a resize of its
        own, the job holding every GPU of both sizes until the supervisor confirms it: a
        grow's new workers may run on the added GPUs. A revert rolled back in turn ends
        holding them all, and is not reverted again. `drop`: a node the grow added
        whose worker host could not start; the job's part there goes."""
        staged = job.resize
        assert staged is not None
        message = f"resize {elastic.describe(staged)} rolled back: {why}"
        held = describe_placement(job.placement)
        if revert and not staged.reverting:
            message += f"; GPUs {held} stay the job's until its supervisor is back at "
            message += f"{staged.from_size}"
            changed = elastic.stage_revert(job, message, now=self._clock())
        else:
            if staged.reverting:
                message += f"; the job keeps GPUs {held} (its workers may use them)"
            changed = elastic.roll_back(job, message)
        if job.pinned_gpus == staged.to_size and not staged.reverting:
            # The size an operator pinned it at could not be reached: the job goes back
            # to the policy rather than being held at a size it does not run at.
            message += f"; the pin at {gpus_said(staged.to_size)} is lifted"
            changed = changed.model_copy(update={"pinned_gpus": None, "reason": message})
        if drop is not None:
            changed = elastic.drop_node(changed, drop)
        await self._writes.job_changed(
            changed,
            job.state,
            Cause(
                kind=CauseKind.RESIZE_ROLLED_BACK,
                node=staged.node,
                job_id=job.job_id,
                message=message,
            ),
        )
        current = self._state().jobs[job.job_id]
        if current.resize is not None:
            await self.send_resize(current)
        elif staged.grow and not staged.reverting:
            await self.regrant(current, staged.command_id, "rolled-back")
        if drop is not None:
            await self._writes.stop(job.job_id, drop, message, job.attempt)

    async def shrink_off_lost(self, job: JobRecord, node: str, why: str) -> bool:
        """`node` was lost (`why`: for how long it was silent), and its agent has surely
        fenced the job's part there: `shed`."""
        return await self.shed(job, node, f"node {node} was lost ({why})")

    async def shed(self, job: JobRecord, node: str, why: str) -> bool:
        """The job's part on `node` is gone or going without a word (`why`: its node was
        lost, or stopped it): an elastic job goes on without that part, in the same
        attempt, when it can (True). Its idle worker host there is dropped; GPUs there
        are shed by a shrink whose command tells the supervisor not to wait for those
        workers (`Resize.lost`); a grow onto the node that had not started fails as its
        launch failing would.
        False (the caller fails or requeues the attempt, as for any job): the job is
        not elastic, its supervisor ran there, what is left is under its minimum, its
        supervisor has not reported yet, or a resize other than a shed is under way (a
        shed under way is superseded by one off both nodes)."""
        if not job.spec.elastic or job.state is not JobState.RUNNING:
            return False
        if job.resize is not None:
            if node in job.resize.lost:
                return True  # already shed (the record still lists it: a stale read)
            if node in elastic.joining(job):
                return await self.join_failed(job, node, why)
            if not job.resize.lost:
                return False
            # Shedding lost nodes already (a rack gone, its nodes missed a tick apart):
            # one shrink off them all supersedes it.
        target = elastic.without_lost(job, node)
        if target is None or not self._progress.heard_from(job.job_id):
            return False
        part = next(g for g in job.grants if g.node == node)
        if not part.gpus:
            message = f"{why}; the job goes on without its idle worker host there"
            await self._writes.job_changed(
                elastic.drop_node(job, node).model_copy(update={"reason": message}),
                job.state,
                Cause(kind=CauseKind.NODE_LOST, node=node, job_id=job.job_id, message=message),
            )
            await self._writes.stop(job.job_id, node, message, job.attempt)  # for its return
            return True
        cause = f"{why}; the job goes on without its GPUs there"
        if job.pinned_gpus is not None:
            # It cannot be held at the size an operator pinned: back to the policy.
            cause += f"; the pin at {gpus_said(job.pinned_gpus)} is lifted"
            job = job.model_copy(update={"pinned_gpus": None})
        await self.stage_resize(job, target, cause, lost=node)
        return True

    async def _lost_for_good(self, job: JobRecord, why: str) -> None:
        """A shed that its supervisor refused or never answered: the part on that node
        is gone, so there is nothing to roll back onto; the attempt fails as any job's
        on a lost node does."""
        staged = job.resize
        assert staged is not None
        assert staged.lost
        lost = ", ".join(staged.lost)
        await self._fail_attempt(
            job.model_copy(update={"resize": None}),
            staged.lost[0],
            Classification(
                FailureClass.INFRASTRUCTURE,
                f"the job could not go on without its part on node {lost}: {why}",
                on_nodes=staged.lost,
            ),
        )

    async def join_failed(self, job: JobRecord, node: str, why: str) -> bool:
        """A launch failed on `node`: if it was a staged grow's worker host there, the
        grow fails, not the job (True)."""
        if node not in elastic.joining(job):
            return False
        await self.roll_back_resize(job, why, revert=False, drop=node)
        return True

    async def check_resizes(self) -> None:
        """Roll back a resize its supervisor has not answered in time (it died, or never
        heard the command); a shrink off a lost node fails the attempt instead."""
        now = self._clock()
        limit = self._timeout_s
        for job in self._state().jobs_in(JobState.RUNNING):
            if job.resize is None or now - job.resize.staged_at <= limit:
                continue
            if job.resize.lost:
                await self._lost_for_good(job, f"no answer from its supervisor within {limit:g}s")
            else:
                await self.roll_back_resize(
                    job, f"no answer from its supervisor within {limit:g}s", revert=True
                )
