"""Subject names: builders and parsers, pure.

The node or tenant sits at a fixed token so that NATS permissions can confine each
identity to its own subjects (an agent may publish only `alnair.node.<its node>.>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

from schemas.base import check_name
from schemas.errors import InvalidSubject

PREFIX: Final = "alnair"

STREAM_EVENTS: Final = "EVENTS"
STREAM_COMMANDS: Final = "COMMANDS"
STREAM_STATE: Final = "STATE"
# The brain's snapshots of its state: chunks, then the manifest naming them (brain/snapshots.py).
STREAM_SNAPSHOTS: Final = "SNAPSHOTS"
SNAPSHOT_CHUNKS: Final = f"{PREFIX}.snapshot.chunk"
SNAPSHOT_MANIFEST: Final = f"{PREFIX}.snapshot.manifest"
ALL_SNAPSHOTS: Final = f"{PREFIX}.snapshot.>"

# `inject` is request/reply: `alnair inject` asks a simulated node to suffer a GPU fault.
NodeChannel = Literal["telemetry", "heartbeat", "event", "cmd", "inject", "logs"]
# `exec` and `workers`: an elastic job's workers on other nodes (schemas/workers.py).
JobChannel = Literal["cmd", "progress", "exec", "workers", "event"]

ALL_TELEMETRY: Final = f"{PREFIX}.node.*.telemetry"
ALL_HEARTBEATS: Final = f"{PREFIX}.node.*.heartbeat"
ALL_NODE_EVENTS: Final = f"{PREFIX}.node.*.event"
ALL_NODE_COMMANDS: Final = f"{PREFIX}.node.*.cmd"
ALL_JOB_COMMANDS: Final = f"{PREFIX}.job.*.cmd"
ALL_JOB_PROGRESS: Final = f"{PREFIX}.job.*.progress"
# What a job itself reports (a resize done, a bad input): in the EVENTS stream too.
ALL_JOB_EVENTS: Final = f"{PREFIX}.job.*.event"
# Both, as the brain reads them: one consumer, so a job's report (its bad input) comes
# before its node's report of its exit, as they were stored.
ALL_EVENTS: Final = f"{PREFIX}.*.*.event"
ALL_API: Final = f"{PREFIX}.api.*.>"
ALL_STATE: Final = f"{PREFIX}.state.>"
ALL_DLQ: Final = f"{PREFIX}.dlq.>"


def node(node_name: str, channel: NodeChannel) -> str:
    return f"{PREFIX}.node.{check_name('node', node_name)}.{channel}"


def job(job_id: str, channel: JobChannel) -> str:
    return f"{PREFIX}.job.{check_name('job', job_id)}.{channel}"


def api(tenant: str, verb: str) -> str:
    return f"{PREFIX}.api.{check_name('tenant', tenant)}.{check_name('verb', verb)}"


def state_job(job_id: str) -> str:
    return f"{PREFIX}.state.job.{check_name('job', job_id)}"


def state_node(node_name: str) -> str:
    return f"{PREFIX}.state.node.{check_name('node', node_name)}"


STATE_BLACKLIST: Final = f"{PREFIX}.state.blacklist.inputs"


def dlq(origin: str) -> str:
    """Dead-letter subject; `origin` is the subject class the message came in on."""
    return f"{PREFIX}.dlq.{origin}"


def dlq_origin(subject: str) -> str:
    """The dead-letter origin for an inbound subject: its class, without identities.

    `alnair.node.n1.heartbeat` -> `node.heartbeat`, `alnair.api.t.submit` -> `api.submit`.
    A subject that is not Alnair's at all is filed under `unknown`.
    """
    tokens = subject.split(".")
    if len(tokens) >= 4 and tokens[0] == PREFIX and tokens[1] in ("node", "job", "api"):
        return f"{tokens[1]}.{tokens[3]}"
    return "unknown"


@dataclass(frozen=True, slots=True)
class ParsedSubject:
    kind: Literal["node", "job", "api", "state"]
    identity: str
    channel: str


def parse(subject: str) -> ParsedSubject:
    tokens = subject.split(".")
    if len(tokens) != 4 or tokens[0] != PREFIX:
        raise InvalidSubject(subject, f"expected {PREFIX}.<kind>.<id>.<channel>")
    kind = tokens[1]
    if kind == "node":
        check_name("node", tokens[2])
        if tokens[3] not in get_args(NodeChannel):
            raise InvalidSubject(subject, f"unknown node channel {tokens[3]!r}")
        return ParsedSubject("node", tokens[2], tokens[3])
    if kind == "job":
        check_name("job", tokens[2])
        if tokens[3] not in get_args(JobChannel):
            raise InvalidSubject(subject, f"unknown job channel {tokens[3]!r}")
        return ParsedSubject("job", tokens[2], tokens[3])
    if kind == "api":
        check_name("tenant", tokens[2])
        return ParsedSubject("api", tokens[2], tokens[3])
    if kind == "state" and tokens[2] in ("job", "node", "blacklist"):
        return ParsedSubject("state", tokens[3], tokens[2])
    raise InvalidSubject(subject, f"unknown subject kind {kind!r}")
