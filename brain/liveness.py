"""Liveness of nodes: the brain's part that judges them joined, changed, lost or
drained, and takes back what runs on a lost one.

A heartbeat with news (brain/ingest.py keeps the rest out) journals the node's inventory
and agent instance; a node silent past `node_timeout_s` is LOST, and its jobs run
elsewhere only once its agent has surely fenced them (`fenced_after`; never while this
brain's own hearing is in doubt, brain/hearing.py). Attempts an agent restarted without
fail a node timeout later; launches no node confirmed are requeued; operators drain and
resume nodes. This journals (brain/writer.py) and hands failures to brain/attempts.py;
it reads state and never writes it but through the writer. Liveness is not in the log:
its clock is monotonic, and a new leader gives every node a fresh grace period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from brain import elastic
from brain.attempts import current_attempt
from brain.core import Policy
from brain.core.failures import Classification
from brain.state import BrainState
from brain.writer import Clock, NodeRecords
from schemas.api import DrainRequest, ResumeRequest
from schemas.errors import ApiError
from schemas.jobs import FailureClass, JobRecord
from schemas.nodes import NodeRecord, NodeState
from schemas.state import Cause, CauseKind
from schemas.telemetry import Heartbeat

log = logging.getLogger(__name__)


class LivenessSettings(Protocol):
    """brain.service.BrainConfig is one."""

    @property
    def node_timeout_s(self) -> float: ...

    @property
    def fence_margin_s(self) -> float: ...

    @property
    def keep_disconnected_s(self) -> float: ...

    @property
    def launch_ttl_s(self) -> float: ...

    @property
    def policy(self) -> Policy: ...


class Heard(Protocol):
    """What the nodes' heartbeats said (brain.ingest.NodeIngest is one)."""

    def known(self, node: str) -> bool: ...

    def running(self, node: str) -> frozenset[tuple[str, int]]: ...

    def silent(self, now: float) -> Iterable[tuple[str, float]]: ...


class Hearing(Protocol):
    """Whether this brain could hear heartbeats lately (brain.hearing.Hearing)."""

    def deaf_within(self, window_s: float) -> bool: ...


class Failures(Protocol):
    """brain.attempts.Attempts is one."""

    async def fail_attempt(
        self, job: JobRecord, node: str, classification: Classification
    ) -> None: ...

    async def requeue(self, job: JobRecord, cause: Cause) -> None: ...

    async def drain_gpu(self, node: NodeRecord, gpu: int, reason: str) -> None: ...

    async def forgive_node(self, node: str, why: str) -> None: ...


class LostParts(Protocol):
    """Whether a job goes on without its part on a lost node (brain.resizes.Resizes:
    an elastic job sheds it in the same attempt)."""

    async def shrink_off_lost(self, job: JobRecord, node: str, why: str) -> bool: ...


class Liveness:
    def __init__(
        self,
        state: Callable[[], BrainState],
        writes: NodeRecords,
        failures: Failures,
        nodes: Heard,
        hearing: Hearing,
        parts: LostParts,
        *,
        settings: LivenessSettings,
        clock: Clock,
        monotonic: Clock,
    ) -> None:
        self._state = state
        self._writes = writes
        self._failures = failures
        self._nodes = nodes
        self._hearing = hearing
        self._parts = parts
        self._settings = settings
        self._clock = clock
        self._monotonic = monotonic
        # (job, attempt, node) -> when its node's agent came back as a new instance
        # without it: the process went with the old agent (`check_vanished`).
        self.vanishing: dict[tuple[str, int, str], float] = {}

    async def heartbeat(self, beat: Heartbeat) -> None:
        """A heartbeat with news (brain/ingest.py): journal what changed (the brain
        reconciles what the node runs after this)."""
        now = self._monotonic()
        known = self._state().nodes.get(beat.node)
        if known is not None and known.instance != beat.instance:
            self.agent_restarted(beat, now)
        drain_reason = known.drain_reason if known is not None else None
        fresh = NodeRecord(
            name=beat.node,
            state=NodeState.DRAINED if drain_reason else NodeState.READY,
            hostname=beat.hostname,
            backend=beat.backend,
            instance=beat.instance,
            gpus=beat.gpus,
            joined_at=known.joined_at if known is not None else self._clock(),
            drain_reason=drain_reason,
            drained_gpus=known.drained_gpus if known is not None else (),
            resumed_at=known.resumed_at if known is not None else None,
            cpu_milli=beat.cpu_milli,
            memory_mib=beat.memory_mib,
        )
        if known is None or known.instance != beat.instance:
            self.check_fence(beat)
        if known is None:
            await self._writes.node_changed(
                fresh,
                None,
                Cause(
                    kind=CauseKind.NODE_JOINED,
                    node=beat.node,
                    message=f"joined with {len(beat.gpus)} GPUs ({beat.backend})",
                ),
            )
        elif known.state is NodeState.LOST:
            await self._writes.node_changed(
                fresh,
                known.state,
                Cause(kind=CauseKind.NODE_RETURNED, node=beat.node, message="heartbeats resumed"),
            )
        elif fresh != known:
            await self._writes.node_changed(
                fresh,
                known.state,
                Cause(
                    kind=CauseKind.NODE_UPDATED,
                    node=beat.node,
                    message="inventory or agent instance changed",
                ),
            )

    def agent_restarted(self, beat: Heartbeat, now: float) -> None:
        """A new agent instance does not know the processes of the old one (it stops any
        it finds left over): attempts it does not report are suspects. They are failed
        a node timeout later, if no exit from the old instance has arrived by then."""
        reported = {(r.job_id, r.attempt) for r in beat.running}
        for job in self._state().running_on(beat.node):
            grant = next(g for g in job.grants if g.node == beat.node)
            known = (job.job_id, job.attempt) in reported
            if grant.pid is not None and not grant.exited and not known:
                self.vanishing.setdefault((job.job_id, job.attempt, beat.node), now)

    async def check_vanished(self) -> None:
        now = self._monotonic()
        for key, since in list(self.vanishing.items()):
            if now - since < self._settings.node_timeout_s:
                continue
            del self.vanishing[key]
            job_id, attempt, node = key
            job = current_attempt(self._state(), job_id, attempt, node)
            if (
                job is None
                or not self._nodes.known(node)
                or (job_id, attempt) in self._nodes.running(node)
            ):
                continue
            if any(g.exited for g in job.grants if g.node == node):
                continue
            await self._failures.fail_attempt(
                job,
                node,
                Classification(
                    FailureClass.INFRASTRUCTURE,
                    f"the agent of node {node} restarted and attempt {attempt}'s process "
                    "went with the old agent",
                ),
            )

    async def drain(self, operator: str, request: DrainRequest) -> None:
        """Take a node's GPUs out of scheduling; what runs there goes on, or with
        `requeue` is stopped and goes back to its queue. A drained node stays drained
        through being lost and returning, until it is resumed."""
        node = self.known_node(request.node)
        if request.gpu is not None:
            await self._failures.drain_gpu(
                node, request.gpu, f"drained by {operator}: {request.reason}"
            )
        elif node.drain_reason != request.reason:
            await self._drain_node(operator, node, request.reason)
        if request.requeue:
            await self._requeue_from(operator, request)

    async def _requeue_from(self, operator: str, request: DrainRequest) -> None:
        """Stop every job with a part on the drained node (on the drained GPU) and put
        it back in its queue, whole (it starts again from its checkpoint, as after a
        preemption); but an elastic job that can shrink off what was drained does so in
        place (`_evacuates`)."""
        where = request.node if request.gpu is None else f"{request.node} GPU {request.gpu}"
        state = self._state()
        for job in state.running_on(request.node):
            if state.on_lost_node(job):
                # Its stop cannot arrive: the node's loss frees it once its agent has
                # fenced it, as for a preemption (brain.scheduler).
                continue
            held = {gpu for g in job.grants if g.node == request.node for gpu in g.gpus}
            if request.gpu is not None and request.gpu not in held:
                continue
            if self._evacuates(job, request.node, 1 if request.gpu is not None else len(held)):
                continue
            await self._failures.requeue(
                job,
                Cause(
                    kind=CauseKind.NODE_DRAINED,
                    node=request.node,
                    job_id=job.job_id,
                    message=f"requeued: {where} drained by {operator}: {request.reason}",
                ),
            )

    def _evacuates(self, job: JobRecord, node: str, drained: int) -> bool:
        """Whether an elastic job leaves `drained` of its GPUs on `node` by shrinking in
        place, without a restart (docs/elastic.md, policy step 4: the elasticity stage
        does it at the next pass): not pinned, down to its minimum at most, and not from
        its supervisor's last GPU on its first node."""
        if not job.spec.elastic or self._settings.policy.elasticity == "none":
            return False
        if job.pinned_gpus is not None or job.gpu_count - drained < job.spec.gpu_range[0]:
            return False
        first = job.grants[0]
        return first.node != node or len(first.gpus) > drained

    async def _drain_node(self, operator: str, node: NodeRecord, reason: str) -> None:
        await self._writes.node_changed(
            node.model_copy(
                update={
                    "state": NodeState.DRAINED if node.state is NodeState.READY else node.state,
                    "drain_reason": reason,
                }
            ),
            node.state,
            Cause(
                kind=CauseKind.NODE_DRAINED,
                node=node.name,
                message=f"drained by {operator}: {reason}",
            ),
        )

    async def resume(self, operator: str, request: ResumeRequest) -> None:
        node = self.known_node(request.node)
        if node.drain_reason is None and not node.drained_gpus:
            raise ApiError("conflict", f"node {node.name} is not drained")
        await self._writes.node_changed(
            node.model_copy(
                update={
                    "state": NodeState.READY if node.state is NodeState.DRAINED else node.state,
                    "drain_reason": None,
                    "drained_gpus": (),
                    "resumed_at": self._clock(),
                }
            ),
            node.state,
            Cause(
                kind=CauseKind.NODE_RESUMED,
                node=node.name,
                message=f"resumed by {operator}: its GPUs are schedulable again",
            ),
        )
        # The operator vouches for it: jobs that failed there may go back.
        await self._failures.forgive_node(node.name, f"node {node.name} resumed by {operator}")

    def known_node(self, name: str) -> NodeRecord:
        node = self._state().nodes.get(name)
        if node is None:
            raise ApiError("not_found", f"no node {name}")
        return node

    async def check_nodes(self) -> None:
        if self._hearing.deaf_within(self._settings.node_timeout_s):
            return  # heartbeats may have been sent and lost on our side: judge none
        for name, silent in list(self._nodes.silent(self._monotonic())):
            node = self._state().nodes.get(name)
            if node is None:
                continue
            # A drained node can be lost too: its running jobs must be taken back.
            if node.state is not NodeState.LOST:
                await self._writes.node_changed(
                    node.model_copy(update={"state": NodeState.LOST}),
                    node.state,
                    Cause(
                        kind=CauseKind.NODE_LOST,
                        node=name,
                        message=f"no heartbeat for {silent:.1f}s "
                        f"(limit {self._settings.node_timeout_s:g}s)",
                    ),
                )
            for job in self._state().running_on(name):
                # Not before its agent has fenced it: never two attempts at once.
                unheard_for = self.fenced_after(job)
                if silent < unheard_for:
                    continue
                why = (
                    f"no heartbeat for {silent:.1f}s; its agent stops the job after "
                    f"{unheard_for - self._settings.fence_margin_s:g}s without NATS, margin "
                    f"{self._settings.fence_margin_s:g}s"
                )
                if await self._parts.shrink_off_lost(job, name, why):
                    continue  # an elastic job goes on without its part there
                await self._failures.fail_attempt(
                    job,
                    name,
                    Classification(FailureClass.INFRASTRUCTURE, f"node {name} was lost ({why})"),
                )

    def check_fence(self, beat: Heartbeat) -> None:
        """Say so when a node's agent may run its jobs on past the moment this brain
        runs them elsewhere (docs/operations.md, "Partitions")."""
        limit = self._settings.node_timeout_s + self._settings.fence_margin_s
        if beat.fence_s is None:
            log.warning(
                "node %s does not fence itself: a partition of it may run its jobs twice",
                beat.node,
            )
        elif beat.fence_s >= limit:
            log.warning(
                "node %s stops its jobs %gs after losing NATS, not before this brain runs "
                "them elsewhere (node timeout + fence margin = %gs): a partition of it may "
                "run them twice",
                beat.node,
                beat.fence_s,
                limit,
            )

    def fenced_after(self, job: JobRecord) -> float:
        """How long a job's node must be silent before the job may run elsewhere."""
        if job.spec.on_disconnect == "keep":
            return self._settings.keep_disconnected_s + self._settings.fence_margin_s
        return self._settings.node_timeout_s + self._settings.fence_margin_s

    async def check_launches(self) -> None:
        """Requeue a job whose launch a node never confirmed nor refused."""
        now = self._clock()
        for job in self._state().unconfirmed():
            if job.started_at is None or now - job.started_at < self._settings.launch_ttl_s + 5:
                continue
            for grant in job.grants:
                if grant.pid is not None or grant.exited:
                    continue
                if grant.node in elastic.joining(job):
                    continue  # launched by a grow: the resize's own timeout covers it
                if (job.job_id, job.attempt) in self._nodes.running(grant.node):
                    continue
                await self._failures.requeue(
                    job,
                    Cause(
                        kind=CauseKind.LAUNCH_FAILED,
                        node=grant.node,
                        job_id=job.job_id,
                        message=f"node {grant.node} never confirmed the launch",
                    ),
                )
                break
