"""The reconciler: stop what a node runs that the brain did not give it (any more).

It reads the nodes' latest heartbeats (brain/ingest.py) and state, and sends stops
(brain/writer.py `Stops`); it changes no state. A stop for the same process is not
repeated more often than `RESTOP_AFTER_S`, counting stops sent for any reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Protocol

from brain.state import BrainState
from brain.writer import Clock, Stops
from schemas.jobs import JobState
from schemas.telemetry import Heartbeat

log = logging.getLogger(__name__)

# Do not repeat a reconciliation stop for the same process more often than this.
RESTOP_AFTER_S: Final = 10.0


class Reporting(Protocol):
    """The nodes' latest word (brain.ingest.NodeIngest is one)."""

    def reporting(self, now: float) -> Iterable[Heartbeat]: ...


class Reconciler:
    def __init__(
        self,
        state: Callable[[], BrainState],
        nodes: Reporting,
        stops: Stops,
        *,
        stops_sent: Mapping[tuple[str, str, int], float],
        monotonic: Clock,
    ) -> None:
        self._state = state
        self._nodes = nodes
        self._stops = stops
        # (node, job, attempt) -> when a stop for it was last sent (monotonic).
        self._stops_sent = stops_sent
        self._monotonic = monotonic

    async def reconcile_all(self) -> None:
        """Reconcile every node that reports processes: a heartbeat that changes nothing
        is not handed to the loop, and what the brain holds may have changed since."""
        for beat in list(self._nodes.reporting(self._monotonic())):
            await self.reconcile(beat)

    async def reconcile(self, beat: Heartbeat) -> None:
        """Stop what a node runs that the brain did not give it (any more)."""
        now = self._monotonic()
        state = self._state()
        for running in beat.running:
            job = state.jobs.get(running.job_id)
            if (
                job is not None
                and job.state is JobState.RUNNING
                and job.attempt == running.attempt
                and beat.node in job.nodes
            ):
                continue
            key = (beat.node, running.job_id, running.attempt)
            if now - self._stops_sent.get(key, -RESTOP_AFTER_S) < RESTOP_AFTER_S:
                continue
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
