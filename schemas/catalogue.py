"""Renders docs/messages.md from the models themselves, so the catalogue cannot drift.

`python -m schemas.catalogue > docs/messages.md` rewrites it; a test fails when the
file differs from what this prints.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel

from schemas import (
    api,
    commands,
    dlq,
    events,
    jobs,
    logs,
    nodes,
    profiles,
    progress,
    state,
    telemetry,
    workers,
)

PIPE: Final = "\\|"  # a literal | inside a markdown table cell


@dataclass(frozen=True, slots=True)
class Entry:
    subject: str
    direction: str
    transport: str
    models: tuple[type[BaseModel], ...]
    notes: str


ENTRIES: Final = (
    Entry(
        "alnair.node.<node>.telemetry",
        "agent → brain",
        "core NATS (loss tolerated)",
        (telemetry.TelemetryBatch,),
        "One message per node per interval, every GPU in it.",
    ),
    Entry(
        "alnair.node.<node>.heartbeat",
        "agent → brain",
        "core NATS",
        (telemetry.Heartbeat,),
        "Inventory, health and running jobs. A node silent for the brain's node timeout "
        "is LOST. The brain stops any running job a heartbeat lists that it did not give "
        "to that node (reconciliation), unless the node's `job_exited` for that attempt is "
        "newer than the heartbeat's `ts`.",
    ),
    Entry(
        "alnair.node.<node>.event",
        "agent → brain",
        "JetStream `EVENTS`",
        (
            events.JobStarted,
            events.JobExited,
            events.LaunchFailed,
            events.CommandRejected,
            events.GpuFault,
        ),
        "Discriminated by `kind`. `Nats-Msg-Id` is `event_id`; the agent retries until "
        "stored, in order. The brain reads this subject and `alnair.job.<job>.event` with one "
        "consumer, in the order stored (it still takes `ResizeCompleted` and `InputError` "
        "here, from a node).",
    ),
    Entry(
        "alnair.node.<node>.logs",
        "CLI / brain → agent",
        "request/reply",
        (logs.LogRequest, logs.LogChunk, logs.LogMissing),
        "A chunk of one attempt's log (at most 256 KiB), from `offset`; the agent answers "
        "for the logs it holds, at a bounded byte rate. `alnair logs` and "
        "`GET /v1/jobs/{id}/logs` page through it by `next_offset`.",
    ),
    Entry(
        "alnair.node.<node>.cmd",
        "brain → agent",
        "JetStream `COMMANDS`",
        (commands.Launch, commands.Stop, commands.Regrant),
        "Discriminated by `kind`. `Nats-Msg-Id` is `command_id`; agents de-duplicate by it "
        "and refuse a command whose `epoch` is older than the newest they obeyed.",
    ),
    Entry(
        "alnair.job.<job>.cmd",
        "brain → supervisor",
        "JetStream `COMMANDS`",
        (commands.Resize,),
        "An elastic job's supervisor de-duplicates by `command_id`, refuses an older "
        "`epoch` than the newest it obeyed, and answers with `ResizeCompleted` on its "
        "job's event subject (see docs/elastic.md).",
    ),
    Entry(
        "alnair.job.<job>.event",
        "supervisor, SDK → brain",
        "JetStream `EVENTS`",
        (events.ResizeCompleted, events.InputError),
        "What a job reports itself, under its own NATS identity (docs/security.md). "
        "`Nats-Msg-Id` is `event_id`. The brain takes only these kinds here, and only about "
        "the job the subject names; others are dead-lettered.",
    ),
    Entry(
        "alnair.job.<job>.progress",
        "supervisor → brain",
        "core NATS (loss tolerated)",
        (progress.Progress,),
        "Rank 0's last step, throughput and loss at the current world size, with each "
        "worker's step, pid and parameter digest. The leading brain keeps each job's "
        "throughput per world size from these (in memory) for the elasticity policy.",
    ),
    Entry(
        "alnair.job.<job>.exec",
        "supervisor's horovodrun → worker host",
        "request/reply (core NATS)",
        (workers.ExecRequest, workers.ExecState),
        "Starts, polls and signals an elastic job's worker on a node other than its "
        "supervisor's; only the worker host on `node` answers (docs/elastic.md).",
    ),
    Entry(
        "alnair.job.<job>.workers",
        "worker host → supervisor",
        "core NATS (loss tolerated)",
        (workers.WorkerRelay,),
        "Progress datagrams of the workers on another node, and their exits.",
    ),
    Entry(
        "alnair.api.<tenant>.<verb>",
        "CLI/API → brain",
        "request/reply",
        tuple(api.REQUEST_TYPES.values()),
        "Verbs: " + ", ".join(f"`{v}`" for v in api.API_VERBS) + ". The tenant is the "
        "subject's token, never a payload field.",
    ),
    Entry(
        "(reply to the above)",
        "brain → caller",
        "request/reply",
        (
            api.JobReply,
            api.JobsReply,
            api.NodesReply,
            api.NodeReply,
            api.StatusReply,
            api.HistoryReply,
            api.BlacklistReply,
            api.WhyReply,
            api.QueuesReply,
            api.ThrottleReply,
            api.ErrorReply,
        ),
        "`ok` tells a refusal (`ErrorReply`, with `code` one of invalid, not_found, "
        "conflict, unavailable, internal, unauthorized, forbidden) from a result. `drain` "
        "and `resume`, and blacklist edits, are an operator's (tenant `operator`).",
    ),
    Entry(
        "alnair.state.job.<job> / alnair.state.node.<node>",
        "brain → world",
        "JetStream `STATE`",
        (state.JobChanged, state.NodeChanged, state.NodeEventRecorded, state.BlacklistChanged),
        "The brain's journal, discriminated by `kind`. A job or node entry carries the "
        "whole record after the change and its `cause`; the brain's state is the fold of "
        "this log. Node events the brain folded are recorded under the node's subject; "
        "the input blacklist, whole after each change, on `alnair.state.blacklist.inputs`.",
    ),
    Entry(
        "alnair.node.<node>.inject",
        "CLI → agent",
        "request/reply",
        (commands.InjectFault, commands.InjectFaultReply),
        "`alnair inject`: a simulated GPU suffers a fault, reported as a `GpuFault` event. "
        "An agent with real GPUs (NVML) refuses with `ok` false.",
    ),
    Entry(
        "alnair.dlq.<origin>",
        "anyone",
        "core NATS",
        (dlq.DeadLetter,),
        "`origin` is the refused message's subject class (`node.heartbeat`, `api.submit`, "
        "...). Every component dead-letters what it cannot validate, and goes on.",
    ),
)

NESTED: Final[tuple[type[BaseModel], ...]] = (
    jobs.JobSpec,
    jobs.JobRecord,
    jobs.NodeGrant,
    jobs.AttemptFailure,
    jobs.StagedResize,
    jobs.NodeGpus,
    nodes.DrainedGpu,
    state.BlacklistEntry,
    api.AttemptRow,
    api.WhyEntry,
    api.QueueStatus,
    api.BrainInfo,
    api.GpuCensus,
    nodes.NodeRecord,
    nodes.NodeStatus,
    profiles.JobProfile,
    telemetry.GpuInfo,
    telemetry.GpuSample,
    telemetry.ShareSample,
    telemetry.GpuShares,
    telemetry.ShareUse,
    telemetry.RunningJob,
    progress.WorkerProgress,
    state.Cause,
    state.Preemption,
)


def _type_name(annotation: object) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    for prefix in (
        "typing.",
        "schemas.jobs.",
        "schemas.nodes.",
        "schemas.telemetry.",
        "schemas.state.",
        "schemas.events.",
        "schemas.api.",
        "schemas.commands.",
        "schemas.progress.",
        "schemas.workers.",
        "schemas.profiles.",
    ):
        text = text.replace(prefix, "")
    text = text.replace("NoneType", "None")
    return text.replace("|", PIPE)


def _model_table(model: type[BaseModel]) -> list[str]:
    hints = typing.get_type_hints(model, include_extras=False)
    lines = [f"#### `{model.__name__}`", ""]
    doc = (model.__doc__ or "").strip().splitlines()
    if doc and not doc[0].startswith(("Usage docs", "!!!")):
        lines += [doc[0], ""]
    lines += ["| field | type | required | default |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        required = "yes" if field.is_required() else ""
        default = "" if field.is_required() else repr(field.get_default(call_default_factory=True))
        default = default.replace("|", PIPE)
        kind = _type_name(hints.get(name, field.annotation))
        lines.append(f"| `{name}` | {kind} | {required} | {default} |")
    return [*lines, ""]


def render() -> str:
    out = [
        "# Message catalogue",
        "",
        "Generated from `schemas/` by `python -m schemas.catalogue`; a test keeps it current.",
        "Every message is JSON, carries the schema version `v` (now 1) and refuses unknown",
        "fields. Names of nodes, tenants and queues are 1 to 64 letters, digits, `_` or `-`.",
        "",
        "| subject | direction | transport | messages |",
        "|---|---|---|---|",
    ]
    for entry in ENTRIES:
        names = ", ".join(f"`{m.__name__}`" for m in entry.models)
        out.append(f"| `{entry.subject}` | {entry.direction} | {entry.transport} | {names} |")
    out.append("")
    for entry in ENTRIES:
        out += [f"## `{entry.subject}`", "", entry.notes, ""]
        for model in entry.models:
            out += _model_table(model)
    out += ["## Records inside messages", ""]
    for model in NESTED:
        out += _model_table(model)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
