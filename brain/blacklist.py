"""Input blacklisting and pre-runs (Philly): the brain's part that owns them.

An input that breaks `blacklist_after_jobs` distinct jobs is blacklisted cluster-wide, and
a job that ended FAILED on it runs again without it; operators add and remove entries. A
pre-run that survived its trial on one GPU gives it back and waits for its full
allocation. brain/core/failures.py decides retries; this journals (brain/writer.py) and
stops. It reads state and never writes it but through the writer.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from pydantic import ValidationError

from brain.core.failures import FailurePolicy, GiveUp, bad_input_in, decide_retry
from brain.core.ordering import job_sequence
from brain.state import BrainState
from brain.writer import BlacklistRecords, Clock, JobRecords, Stops
from schemas.api import BlacklistRequest
from schemas.errors import ApiError
from schemas.events import InputError, JobExited
from schemas.jobs import BAD_INPUT_EXIT_CODE, FailureClass, JobState
from schemas.state import BlacklistEntry, Cause, CauseKind

log = logging.getLogger(__name__)

# The most the blacklist's entries may take, encoded. The whole list is one STATE entry
# (`BlacklistChanged`) and goes with every launch: kept well inside one NATS message
# (1 MiB), beside a job's own command and environment. A few thousand entries of
# ordinary URIs.
MAX_BLACKLIST_BYTES: Final = 256 * 1024


class Writes(JobRecords, BlacklistRecords, Stops, Protocol):
    pass


def blacklist_bytes(entries: Iterable[BlacklistEntry]) -> int:
    """What `entries` take of `MAX_BLACKLIST_BYTES`."""
    return sum(len(entry.model_dump_json()) + 1 for entry in entries)


def input_marked(exit: JobExited, reported: str | None) -> InputError | None:
    """The input a job failed on, as its log marked it (exit 66 and an `ALNAIR_BAD_INPUT
    <uri> [reason]` line) when it did not report it through the SDK: the same failure
    (brain/core/failures.py classifies both as `input`), so it counts the same toward the
    blacklist. Its id is the exit's, derived: a redelivered exit marks the same one."""
    if reported is not None or exit.exit_code != BAD_INPUT_EXIT_CODE:
        return None
    marked = bad_input_in(exit.log_tail)
    if marked is None:
        return None
    uri, reason = marked
    digest = hashlib.sha256(exit.event_id.encode()).hexdigest()[:40]
    try:
        return InputError(
            event_id=f"input-{digest}",
            node=exit.node,
            ts=exit.ts,
            job_id=exit.job_id,
            attempt=exit.attempt,
            uri=uri,
            reason=reason[:1000],
        )
    except ValidationError:
        return None  # not a URI an InputError can carry (too long): classified, not counted


class Blacklist:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: Writes,
        *,
        policy: FailurePolicy,
        clock: Clock,
    ) -> None:
        self._state = state
        self._writes = writes
        self._policy = policy
        self._clock = clock

    async def job_exited(self, event: JobExited) -> InputError | None:
        """Count the input a failed job's log marked (`input_marked`), before the exit is
        handled, as a report through the SDK would have been; returns it, for the caller
        to record as the job's input error (None: nothing marked, or recorded already)."""
        state = self._state()
        marked = input_marked(event, state.input_reports.get((event.job_id, event.attempt)))
        if marked is None or marked.event_id in state.seen_events:
            return None
        await self.input_error(marked)
        return marked

    async def input_error(self, event: InputError) -> None:
        """Count distinct jobs failing per input; blacklist the input at K of them."""
        state = self._state()
        if event.uri in state.blacklist:
            return
        # The event's own record is journaled after its effects: count its job here.
        jobs = state.input_failures.get(event.uri, set()) | {event.job_id}
        limit = self._policy.blacklist_after_jobs
        if len(jobs) < limit:
            return
        entry = BlacklistEntry(
            uri=event.uri,
            reason=f"{len(jobs)} jobs failed on it (limit {limit}); last: {event.reason}",
            jobs=tuple(sorted(jobs, key=job_sequence)),
            added_at=self._clock(),
            added_by="brain",
        )
        entries = {**state.blacklist, event.uri: entry}
        if blacklist_bytes(entries.values()) > MAX_BLACKLIST_BYTES:
            log.warning(
                "input %s is not blacklisted although %d jobs failed on it: the blacklist "
                "is full (%d entries); remove some (alnair blacklist remove URI)",
                event.uri,
                len(jobs),
                len(state.blacklist),
            )
            return
        await self.set_blacklist(
            entries,
            Cause(
                kind=CauseKind.BLACKLISTED,
                message=f"input {event.uri} blacklisted: jobs {', '.join(sorted(jobs))} "
                f"failed on it",
            ),
        )

    async def edit(self, operator: str, request: BlacklistRequest) -> None:
        uri = request.uri
        if uri is None:
            raise ApiError("invalid", f"blacklist {request.action} needs an input URI")
        entries = dict(self._state().blacklist)
        if request.action == "add":
            if uri in entries:
                return
            entries[uri] = BlacklistEntry(
                uri=uri, reason=request.reason, added_at=self._clock(), added_by=operator
            )
            size = blacklist_bytes(entries.values())
            if size > MAX_BLACKLIST_BYTES:
                raise ApiError(
                    "invalid",
                    f"the blacklist is full: {len(entries) - 1} entries; with this one it "
                    f"would take {size} bytes, over the {MAX_BLACKLIST_BYTES} it may (it goes "
                    "with every launch); remove some first (alnair blacklist remove URI)",
                )
            cause = Cause(
                kind=CauseKind.BLACKLISTED,
                message=f"input {uri} blacklisted by {operator}: {request.reason}",
            )
        else:
            if entries.pop(uri, None) is None:
                raise ApiError("not_found", f"input {uri} is not blacklisted")
            cause = Cause(
                kind=CauseKind.UNBLACKLISTED, message=f"input {uri} removed by {operator}"
            )
        await self.set_blacklist(entries, cause)

    async def set_blacklist(self, entries: dict[str, BlacklistEntry], cause: Cause) -> None:
        await self._writes.blacklist_changed(entries, cause)
        await self.retry_input_failures()

    async def retry_input_failures(self) -> None:
        """A job that ended FAILED on an input now blacklisted runs again without it."""
        state = self._state()
        for job in state.jobs_in(JobState.FAILED):
            last = job.failures[-1] if job.failures else None
            if (
                last is None
                or last.failure_class is not FailureClass.INPUT
                or last.input_uri not in state.blacklist
            ):
                continue
            decision = decide_retry(
                job.failures,
                job.spec.queue,
                self._clock(),
                self._policy,
                blacklisted=frozenset(state.blacklist),
            )
            if isinstance(decision, GiveUp):
                continue
            await self._writes.job_changed(
                job.model_copy(
                    update={
                        "state": JobState.PENDING,
                        "grants": (),
                        "started_at": None,
                        "finished_at": None,
                        "not_before": decision.not_before,
                        "reason": decision.cause,
                    }
                ),
                job.state,
                Cause(kind=CauseKind.RETRY_SCHEDULED, job_id=job.job_id, message=decision.cause),
            )

    async def check_preruns(self) -> None:
        """A pre-run that survived its trial gives its GPU back and waits for the full
        allocation (Philly's pre-run: fail fast on one GPU)."""
        now = self._clock()
        trial = self._policy.prerun_s
        for job in self._state().jobs_in(JobState.RUNNING):
            if job.prerun != "running" or job.started_at is None or now - job.started_at < trial:
                continue
            if not all(g.pid is not None for g in job.grants):
                continue  # not started yet: its trial has not begun
            passed = job.model_copy(
                update={
                    "state": JobState.PENDING,
                    "grants": (),
                    "started_at": None,
                    "prerun": "passed",
                    "reason": f"pre-run passed after {trial:g}s",
                }
            )
            await self._writes.job_changed(
                passed,
                job.state,
                Cause(
                    kind=CauseKind.PRERUN_PASSED,
                    job_id=job.job_id,
                    message=f"survived {trial:g}s on one GPU; now waits for {job.spec.gpus} GPUs",
                ),
            )
            await self._writes.stop_parts(job, "pre-run passed")
