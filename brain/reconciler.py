"""The reconciler: stop what a node runs that the brain did not give it (any more), and
tell a node again which GPUs an elastic attempt holds there when it says otherwise.

It reads the nodes' latest heartbeats (brain/ingest.py) and state, and sends stops and
`Regrant`s (brain/writer.py `Stops`, `NodeCommands`); it changes no state. A stop for the
same process is not repeated more often than `RESTOP_AFTER_S`, counting stops sent for
any reason, nor is a regrant.

A heartbeat is read until the node's next one, so the latest may be older than the
node's report that a process exited (events and heartbeats travel apart): a process
whose exit its node reported after the heartbeat was sent (both on the node's own
clock) is not stopped for it. Without that, every job that ended was "stopped" once,
with a warning, in the half second before its node's next heartbeat.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Protocol

from brain.state import BrainState
from brain.writer import Clock, NodeCommands, Stops
from schemas.commands import Regrant
from schemas.events import JobExited
from schemas.jobs import JobRecord, JobState
from schemas.telemetry import Heartbeat

log = logging.getLogger(__name__)

# Do not repeat a reconciliation stop for the same process more often than this.
RESTOP_AFTER_S: Final = 10.0
# Exits remembered to check heartbeats against: a heartbeat is at most a few seconds
# old when read (a silent node's is not read), so only the latest exits matter.
EXITS_KEPT: Final = 4096


# Every node that reports processes is checked this often; in between, a tick checks
# only the nodes where what the brain runs changed, and those found running a stray.
# A heartbeat that changes what its node runs is checked as it comes.
SWEEP_EVERY_S: Final = 10.0


class Reporting(Protocol):
    """The nodes' latest word (brain.ingest.NodeIngest is one)."""

    def reporting(self, now: float, names: Iterable[str] | None = None) -> Iterable[Heartbeat]: ...

    def running(self, node: str) -> frozenset[tuple[str, int]]:
        """The (job, attempt) pairs the node's latest heartbeat reports."""
        ...


class Sends(Stops, NodeCommands, Protocol):
    pass


class Reconciler:
    def __init__(
        self,
        state: Callable[[], BrainState],
        nodes: Reporting,
        stops: Sends,
        *,
        stops_sent: Mapping[tuple[str, str, int], float],
        monotonic: Clock,
        clock: Clock,
    ) -> None:
        self._state = state
        self._nodes = nodes
        self._stops = stops
        self._clock = clock
        # (node, job, attempt) -> when a regrant for it was last sent (monotonic).
        self._regrants_sent: dict[tuple[str, str, int], float] = {}
        # (node, job, attempt) -> when a stop for it was last sent (monotonic).
        self._stops_sent = stops_sent
        self._monotonic = monotonic
        # (node, job, attempt) -> when its node saw the process exit (the node's clock).
        self._exits: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        # The state the last sweep read, when the next is due, and the nodes found
        # running strays at the last call.
        self._swept: BrainState | None = None
        self._next_sweep = 0.0
        self._suspects: set[str] = set()

    def exited(self, event: JobExited) -> None:
        """A node reported a process's exit: its heartbeats sent before then list it."""
        self._exits[(event.node, event.job_id, event.attempt)] = event.ts
        while len(self._exits) > EXITS_KEPT:
            self._exits.popitem(last=False)

    async def reconcile_all(self) -> None:
        """Reconcile the nodes that report processes where what the brain runs changed
        since the last call (a heartbeat that changes nothing is not handed to the
        loop), or that ran a stray then; every node, each `SWEEP_EVERY_S` and after
        state was loaded anew.

        A node whose processes are all the brain's (every node, nearly always) costs a
        subset check of the (job, attempt) pairs its heartbeat reports against those
        the brain runs there (`BrainState.attempts_on`), those reported as ingest keeps
        them."""
        state = self._state()
        now = self._monotonic()
        changed = state.take_attempts_changed()
        if state is not self._swept or now >= self._next_sweep:
            self._swept, self._next_sweep = state, now + SWEEP_EVERY_S
            if state.live_elastic:
                await self._regrant_where_told_otherwise(state, now)
            beats = self._nodes.reporting(now)
        elif changed or self._suspects:
            beats = self._nodes.reporting(now, sorted(changed | self._suspects))
        else:
            return
        running = self._nodes.running
        strays = [beat for beat in beats if not running(beat.node) <= state.attempts_on(beat.node)]
        self._suspects = {beat.node for beat in strays}
        for beat in strays:
            await self.reconcile(beat)

    async def reconcile(self, beat: Heartbeat) -> None:
        """Stop what a node runs that the brain did not give it (any more)."""
        now = self._monotonic()
        state = self._state()
        for running in beat.running:
            job = state.jobs.get(running.job_id)
            if _holds(job, beat.node, running.attempt):
                continue
            key = (beat.node, running.job_id, running.attempt)
            if now - self._stops_sent.get(key, -RESTOP_AFTER_S) < RESTOP_AFTER_S:
                continue
            if beat.ts <= self._exits.get(key, float("-inf")):
                continue  # the heartbeat predates its node's word that it exited
            log.warning(
                "node %s runs job %s attempt %d that it does not hold; stopping it",
                beat.node,
                running.job_id,
                running.attempt,
            )
            await self._stops.stop(
                running.job_id,
                beat.node,
                "stale: the brain no longer runs this attempt here",
                running.attempt,
            )

    async def _regrant_where_told_otherwise(self, state: BrainState, now: float) -> None:
        """An elastic attempt's GPUs change within the attempt, and the node learns it
        from a `Regrant` (brain/resizes.py); one that never arrived leaves the node
        counting GPUs the job gave back as its own (a launch onto them is refused) or
        not counting those it took. Where a node's heartbeat says an attempt with no
        resize in flight holds other GPUs there than its grant, it is told again."""
        # Not while a resize is in flight (its own regrants speak for it), nor just after
        # one committed (the node's heartbeat may predate the regrant the commit sent).
        settled = self._clock() - RESTOP_AFTER_S
        jobs = [
            j
            for j in state.jobs_in(JobState.RUNNING)
            if j.spec.elastic
            and j.resize is None
            and (j.last_resize_at is None or j.last_resize_at < settled)
        ]
        names = sorted({g.node for j in jobs for g in j.grants if g.pid is not None})
        if not names:
            return
        beats = {beat.node: beat for beat in self._nodes.reporting(now, names)}
        sent = self._regrants_sent
        for key in [k for k, at in sent.items() if now - at >= RESTOP_AFTER_S]:
            del sent[key]  # what may be sent again need not be remembered
        for job in jobs:
            for grant in job.grants:
                beat = beats.get(grant.node)
                if grant.pid is None or beat is None:
                    continue
                said = next(
                    (
                        r.gpus
                        for r in beat.running
                        if r.job_id == job.job_id and r.attempt == job.attempt
                    ),
                    None,
                )
                if said is None or sorted(said) == sorted(grant.gpus):
                    continue
                key = (grant.node, job.job_id, job.attempt)
                if key in sent:
                    continue
                sent[key] = now
                log.warning(
                    "node %s says job %s attempt %d holds GPUs %s there, not %s; telling it",
                    grant.node,
                    job.job_id,
                    job.attempt,
                    list(said),
                    list(grant.gpus),
                )
                issued = self._clock()
                await self._stops.command(
                    grant.node,
                    Regrant(
                        command_id=f"regrant-sync-{job.job_id}-{job.attempt}-{grant.node}-"
                        f"{issued:.3f}",
                        epoch=self._stops.epoch,
                        issued_at=issued,
                        job_id=job.job_id,
                        attempt=job.attempt,
                        gpus=grant.gpus,
                        reason="the brain's grant, told again",
                    ),
                )


def _holds(job: JobRecord | None, node: str, attempt: int) -> bool:
    """Does the brain run this attempt of the job on this node?"""
    return (
        job is not None
        and job.state is JobState.RUNNING
        and job.attempt == attempt
        and node in job.nodes
    )
