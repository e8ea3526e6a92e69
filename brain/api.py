"""The brain's API: one implementation, served on NATS request/reply and over HTTP.

The tenant comes from the subject (`alnair.api.<tenant>.<verb>`), which NATS
permissions tie to the caller's identity, never from the payload. A tenant sees and
touches only its own jobs. Refusals are `ErrorReply` values with a code and a message
naming what was wrong; invalid requests are also dead-lettered.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Iterable, Mapping
from typing import Final

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from brain.census import CensusCache
from brain.core.ordering import job_sequence
from brain.history import FinishedQuery
from brain.inbox import WriteRequest
from brain.port import BrainPort
from brain.queues import queue_status
from brain.state import served, share_memory_limit
from schemas import subjects
from schemas.api import (
    OPERATOR_TENANT,
    REQUEST_TYPES,
    AttemptRow,
    BlacklistReply,
    BlacklistRequest,
    CancelRequest,
    DrainRequest,
    ErrorReply,
    GetJobRequest,
    GpuCensus,
    HistoryReply,
    HistoryRequest,
    JobReply,
    JobsReply,
    ListJobsRequest,
    ListNodesRequest,
    ListQueuesRequest,
    NodeReply,
    NodesReply,
    QueuesReply,
    ResizeRequest,
    ResumeRequest,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    ThrottleReply,
    ThrottleRequest,
    WhyEntry,
    WhyReply,
    WhyRequest,
)
from schemas.base import Message, decode, encode
from schemas.errors import ApiError, InvalidMessage, InvalidName, InvalidSubject
from schemas.jobs import JobRecord, JobState
from schemas.nodes import NodeStatus

log = logging.getLogger(__name__)

Reply = (
    JobReply
    | JobsReply
    | NodesReply
    | QueuesReply
    | NodeReply
    | StatusReply
    | HistoryReply
    | BlacklistReply
    | WhyReply
    | ThrottleReply
    | ErrorReply
)


# Requests answered at once. nats-py runs a subscription's callback one message at a
# time: each request is answered in a task of its own, so that concurrent submissions
# reach the inbox together and share a group commit. Past this many, the callback
# waits for one to finish (and NATS buffers the rest, as for any slow consumer).
IN_FLIGHT_MAX: Final = 1024

# A listing's page holds at most this many finished jobs gone from the brain's memory,
# each parsed from its last record in the history (on its writer's thread), however
# large the `limit` asked: the reply's `next_before` goes on from there.
HISTORY_PAGE: Final = 1_000


def _fitting(costs: Iterable[int], room: int) -> int:
    """How many of the items whose encoded sizes are `costs`, in that order, fit in
    `room` bytes (a comma each between them); at least one, whatever its size: the
    caller is then told that one item is too big, not sent round for ever."""
    kept = 0
    for cost in costs:
        if kept and cost + 1 > room:
            break
        room -= cost + 1
        kept += 1
    return kept


def fit_jobs(reply: JobsReply, limit: int) -> JobsReply:
    """`reply` cut to its newest jobs (and their profiles) that fit in a message of
    `limit` bytes, with `next_before` naming where the next page starts."""
    profiles = {p.job_id: p for p in reply.profiles}
    room = limit - len(encode(JobsReply(jobs=(), next_before="9" * 64)))
    kept = _fitting(
        (
            len(encode(job)) + (len(encode(p)) + 1 if (p := profiles.get(job.job_id)) else 0)
            for job in reversed(reply.jobs)
        ),
        room,
    )
    jobs = reply.jobs[len(reply.jobs) - kept :]
    held = {job.job_id for job in jobs}
    return JobsReply(
        jobs=jobs,
        profiles=tuple(p for p in reply.profiles if p.job_id in held),
        next_before=jobs[0].job_id if kept < len(reply.jobs) else reply.next_before,
    )


def fit_nodes(reply: NodesReply, limit: int) -> NodesReply:
    """`reply` cut to its first nodes that fit in a message of `limit` bytes, with
    `next_after` naming where the next page starts."""
    room = limit - len(encode(NodesReply(nodes=(), next_after="n" * 64)))
    kept = _fitting((len(encode(node)) for node in reply.nodes), room)
    nodes = reply.nodes[:kept]
    more = kept < len(reply.nodes)
    return NodesReply(nodes=nodes, next_after=nodes[-1].record.name if more else reply.next_after)


class ApiServer:
    def __init__(self, brain: BrainPort) -> None:
        self.brain = brain
        self._in_flight = asyncio.Semaphore(IN_FLIGHT_MAX)
        self._census = CensusCache()

    async def serve(self) -> Subscription:
        return await self.brain.bus.nc.subscribe(
            subjects.ALL_API, queue="brain", cb=self._on_request
        )

    async def _on_request(self, msg: Msg) -> None:
        await self._in_flight.acquire()
        self.brain.bus.spawn(self._serve(msg), name="api-request")

    async def _serve(self, msg: Msg) -> None:
        try:
            await self._respond(msg)
        except Exception:
            log.exception("answering %s failed", msg.subject)
        finally:
            self._in_flight.release()

    async def _respond(self, msg: Msg) -> None:
        reply = await self._answer(msg)
        if msg.reply:
            data = encode(reply)
            limit = self.brain.bus.nc.max_payload
            if len(data) > limit and isinstance(reply, JobsReply | NodesReply):
                # A listing pages instead: as much of it as one message holds.
                data = encode(
                    fit_jobs(reply, limit)
                    if isinstance(reply, JobsReply)
                    else fit_nodes(reply, limit)
                )
            if len(data) > limit:
                # NATS would refuse it, and the caller would see only a timeout.
                too_big = f"the answer ({len(data)} bytes) is over NATS's message limit "
                too_big += f"({limit} bytes): ask for less (a lower limit, a state, one job)"
                data = encode(ErrorReply(code="invalid", error=too_big))
            await msg.respond(data)

    async def _answer(self, msg: Msg) -> Reply:
        try:
            parsed = subjects.parse(msg.subject)
        except (InvalidSubject, InvalidName) as error:
            await self.brain.bus.dead_letter(msg.subject, msg.data, str(error))
            return ErrorReply(code="invalid", error=str(error))
        request_type = REQUEST_TYPES.get(parsed.channel)
        if request_type is None:
            reason = f"unknown API verb {parsed.channel!r}; known: {', '.join(REQUEST_TYPES)}"
            await self.brain.bus.dead_letter(msg.subject, msg.data, reason)
            return ErrorReply(code="invalid", error=reason)
        try:
            request = decode(msg.data, request_type, strict=True)
        except InvalidMessage as error:
            await self.brain.bus.dead_letter(msg.subject, msg.data, error.reason)
            return ErrorReply(
                code="invalid", error=f"invalid {parsed.channel} request: {error.reason}"
            )
        operator = parsed.identity == OPERATOR_TENANT
        return await self.handle(parsed.identity, request, operator=operator)

    async def handle(self, tenant: str, request: Message, *, operator: bool = False) -> Reply:
        """Answer one request from `tenant`; an operator may also read every tenant's jobs
        and drain or resume nodes. Callers authenticate the tenant: NATS by the subject,
        HTTP by the bearer token."""
        try:
            if not isinstance(request, WriteRequest | StatusRequest):
                # A read answers from state as stored, never from a unit's records while
                # its group is being appended (a failed append would take them back).
                # Status awaits other answers first, and waits for the writer after them.
                await self.brain.settled()
            return await self._dispatch(tenant, request, operator)
        except ApiError as error:
            return ErrorReply(code=error.code, error=error.message)
        except Exception as error:
            log.exception("API request failed")
            return ErrorReply(code="internal", error=f"internal error: {error!r}")

    async def _dispatch(self, tenant: str, request: Message, operator: bool) -> Reply:
        brain = self.brain
        if isinstance(request, SubmitRequest):
            job = await brain.call(tenant, request)
            assert isinstance(job, JobRecord)
            return JobReply(job=job)
        if isinstance(request, CancelRequest | ResizeRequest):
            # An operator may cancel or resize any tenant's job; a tenant only its own.
            job = await brain.call(tenant, request, operator=operator)
            assert isinstance(job, JobRecord)
            return JobReply(job=job)
        if isinstance(request, ThrottleRequest):
            # A tenant throttles its own arrays (an array is named within its tenant).
            jobs = await brain.call(tenant, request)
            assert isinstance(jobs, list)
            return ThrottleReply(array=request.array, limit=request.limit, jobs=tuple(jobs))
        if isinstance(request, GetJobRequest | HistoryRequest | WhyRequest):
            return await self._about_job(tenant, request, operator=operator)
        if isinstance(request, ListJobsRequest):
            jobs, older = await self._jobs(tenant, request, operator=operator)
            profiles = brain.profiles.live_profiles(j.job_id for j in jobs)
            return JobsReply(
                jobs=jobs, profiles=profiles, next_before=jobs[0].job_id if older else None
            )
        if isinstance(request, ListNodesRequest | ListQueuesRequest):
            return self._cluster(request)
        if isinstance(request, DrainRequest | ResumeRequest):
            verb = "drain" if isinstance(request, DrainRequest) else "resume"
            if not operator:
                raise ApiError("forbidden", f"only an operator may {verb} nodes, not {tenant}")
            await brain.call(tenant, request)
            return NodeReply(node=self._node_status(request.node))
        if isinstance(request, BlacklistRequest):
            if request.action != "list":
                if not operator:
                    raise ApiError(
                        "forbidden", f"only an operator may edit the blacklist, not {tenant}"
                    )
                await brain.call(tenant, request)
            await brain.settled()
            state = brain.state
            return BlacklistReply(
                entries=tuple(state.blacklist.values()),
                suspects={
                    uri: tuple(sorted(jobs))
                    for uri, jobs in state.input_failures.items()
                    if uri not in state.blacklist
                },
            )
        if isinstance(request, StatusRequest):
            return await self._status()
        raise ApiError("invalid", f"unsupported request {type(request).__name__}")

    def _cluster(self, request: ListNodesRequest | ListQueuesRequest) -> NodesReply | QueuesReply:
        """The nodes, or the queues: what every tenant may read of the cluster."""
        if isinstance(request, ListNodesRequest):
            if request.name is not None:
                return NodesReply(nodes=(self._node_status(request.name),))
            page, more = self._nodes(request.after, request.limit)
            return NodesReply(nodes=page, next_after=page[-1].record.name if more else None)
        state, config = self.brain.state, self.brain.config
        statuses = queue_status(
            config.queues, state.jobs_in(JobState.RUNNING), state.jobs_in(JobState.PENDING)
        )
        return QueuesReply(queues=tuple(statuses), strict=config.strict_queues)

    async def _about_job(
        self, tenant: str, request: GetJobRequest | HistoryRequest | WhyRequest, *, operator: bool
    ) -> JobReply | HistoryReply | WhyReply:
        """One job: its record, its attempts, or why it is where it is. A tenant is
        answered only about its own jobs."""
        brain = self.brain
        job = await self._own_job(tenant, request.job_id, operator=operator)
        if isinstance(request, GetJobRequest):
            node = brain.state.nodes.get(job.grants[0].node) if job.grants else None
            return JobReply(
                job=job,
                profile=brain.profiles.job_profile(job.job_id),
                gpu_memory_limit_mib=share_memory_limit(job, node),
            )
        if isinstance(request, HistoryRequest):
            rows = await brain.history.read_attempts(job.job_id)
            return HistoryReply(job=job, attempts=tuple(AttemptRow(**row) for row in rows))
        # The latest changes with their causes, from the history: a projection of the
        # log that the brain keeps current as it journals.
        changes, truncated = await brain.history.read_job_changes(job.job_id, request.limit)
        attained, executed = served(job, brain.clock())
        return WhyReply(
            job=job,
            attained_gpu_seconds=attained,
            executed_seconds=executed,
            order=brain.config.policy.order,
            decisions=tuple(
                WhyEntry(
                    seq=seq,
                    ts=record.ts,
                    state=record.job.state,
                    previous=record.previous,
                    cause=record.cause,
                    attempt=record.job.attempt,
                    grants=record.job.grants,
                    service_level=record.job.service_level,
                )
                for seq, record in changes
            ),
            truncated=truncated,
        )

    async def _own_job(self, tenant: str, job_id: str, *, operator: bool = False) -> JobRecord:
        job = await self.brain.job_record(job_id)
        if job is None or (job.tenant != tenant and not operator):
            raise ApiError("not_found", f"no job {job_id} for tenant {tenant}")
        return job

    async def _jobs(
        self, tenant: str, request: ListJobsRequest, *, operator: bool = False
    ) -> tuple[tuple[JobRecord, ...], bool]:
        """The newest `limit` jobs that match, oldest first (by job id: the order the log
        took them in), and whether older ones match too: those in memory, and the
        finished ones gone from it, read from the history (at most `HISTORY_PAGE` of
        them a page)."""
        state = self.brain.state
        wanted = set(request.states) if request.states else None
        queues = set(request.queues) if request.queues else None
        arrays = set(request.arrays) if request.arrays else None
        before = None if request.before is None else job_sequence(request.before)
        jobs = [
            j
            for j in state.jobs.values()
            if (operator or j.tenant == tenant)
            and (wanted is None or j.state in wanted)
            and (queues is None or j.spec.queue in queues)
            and (arrays is None or j.spec.array in arrays)
            and (before is None or job_sequence(j.job_id) < before)
        ]
        jobs.sort(key=lambda j: job_sequence(j.job_id))
        page = jobs[-request.limit :]
        older = len(page) < len(jobs)
        gone = tuple(
            s
            for s in (request.states or JobState)
            if s.terminal and state.finished_away.get(s, 0) > 0
        )
        if gone:
            page, older = await self._with_finished(
                page, older, tenant if not operator else None, request, gone
            )
        return tuple(map(state.shown, page)), older

    async def _with_finished(
        self,
        page: list[JobRecord],
        older: bool,
        tenant: str | None,
        request: ListJobsRequest,
        states: tuple[JobState, ...],
    ) -> tuple[list[JobRecord], bool]:
        """`page` (the newest jobs in memory, oldest first; `older`: more match there)
        merged with the newest finished jobs in `states` that are gone from memory, the
        newest `request.limit` of them all, and whether older ones match too."""
        history = self.brain.history
        take = min(request.limit, HISTORY_PAGE)
        query = FinishedQuery(
            states=states,
            tenant=tenant,
            queues=request.queues,
            arrays=request.arrays,
            before=request.before,
            # One more than it may take: whether any is left out.
            limit=take + 1,
            # Those in memory are in `page` or left out of it: the finished ones. (Live
            # ones are not finished in the history either, which follows the log.)
            skip=frozenset(self.brain.state.finished),
        )
        try:
            away = await history.read_finished_ids(query)
        except Exception:
            log.exception("listing finished jobs from the history failed")
            return page, older
        # Newest first, from either; the history's stop at `take` (the next of them is
        # newer than any it did not return).
        merged = sorted(
            [(job_sequence(j.job_id), j) for j in page]
            + [(job_sequence(i), i) for i in away if i not in self.brain.state.jobs],
            key=lambda pair: pair[0],
            reverse=True,
        )
        chosen: list[JobRecord | str] = []
        read = 0
        for _, item in merged:
            if len(chosen) == request.limit or (isinstance(item, str) and read == take):
                older = True
                break
            chosen.append(item)
            read += isinstance(item, str)
        wanted = [item for item in chosen if isinstance(item, str)]
        found: dict[str, JobRecord] = {}
        try:
            if wanted:
                found = {j.job_id: j for j in await history.read_last_jobs(wanted)}
        except Exception:
            log.exception("reading finished jobs from the history failed")
        kept = [
            item if isinstance(item, JobRecord) else found[item]
            for item in reversed(chosen)
            if isinstance(item, JobRecord) or item in found
        ]
        return kept, older

    def _nodes(self, after: str | None, limit: int) -> tuple[tuple[NodeStatus, ...], bool]:
        """The first `limit` nodes by name after `after`, and whether more follow. Only
        those are built: a dashboard asks for 256 of 20,000 every 2 s."""
        held = self.brain.state.allocated()
        names = sorted(self.brain.state.nodes)
        start = 0 if after is None else bisect.bisect_right(names, after)
        page = names[start : start + limit]
        more = start + limit < len(names)
        return tuple(self._node_status(name, held) for name in page), more

    def _node_status(
        self, name: str, held: Mapping[str, frozenset[int]] | None = None
    ) -> NodeStatus:
        brain = self.brain
        record = brain.state.nodes.get(name)
        if record is None:
            raise ApiError("not_found", f"no node {name}")
        held = brain.state.allocated() if held is None else held
        batch = brain.telemetry.get(name)
        return NodeStatus(
            record=record,
            allocated_gpus=tuple(sorted(held.get(name, ()))),
            jobs=tuple(j.job_id for j in brain.state.running_on(name)),
            last_seen_s_ago=brain.last_seen_ago(name),
            latest=batch.samples if batch is not None else (),
            shares=brain.shares(name),
            running=brain.processes(name),
        )

    async def _status(self) -> StatusReply:
        brain = self.brain
        me = brain.info()
        # The lease is one brain's: while this one leads, another's announcement as leader
        # is a dead leader's, left until the bucket's TTL (a live one that stepped down
        # says so at its next election round).
        others = [
            b
            for b in await brain.lease.brains()
            if b.brain_id != me.brain_id and not (me.leader and b.leader)
        ]
        census = await self.census()
        # State read last, with nothing awaited after the writer was seen free.
        await brain.settled()
        state = brain.state
        return StatusReply(
            brains=(me, *sorted(others, key=lambda b: b.since)),
            epoch=brain.epoch,
            brain_host=brain.host,
            brain_pid=brain.pid,
            started_at=brain.started_at,
            policy=brain.config.policy.describe(),
            jobs_by_state={s.value: n for s, n in state.counts_by_state().items()},
            nodes=len(state.nodes),
            gpus=state.capacity(),
            census=census,
            waiting=state.waits_by_kind(),
            commands_queued=brain.commands_queued(),
        )

    async def census(self) -> GpuCensus:
        """Every GPU counted by what it is doing (brain/census.py), at most CENSUS_TTL_S
        old: `status` and `/metrics` share the count."""
        return await self._census.get(self.brain.state, self.brain.telemetry)
