"""The HTTP API's OpenAPI 3.1 document, built from the same pydantic models the API uses.

Request and reply bodies are the NATS API's messages (`schemas/api.py`), so the two
cannot drift; the paths, parameters and status codes are written here.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from schemas.api import (
    ErrorReply,
    JobReply,
    JobsReply,
    NodeReply,
    NodesReply,
    QueuesReply,
    StatusReply,
    SubmitRequest,
    ThrottleReply,
    ThrottleRequest,
    WhyReply,
)
from schemas.jobs import MAX_GPUS_PER_JOB, JobState
from schemas.logs import MAX_LOG_CHUNK, LogChunk

# Names of nodes, tenants and queues (schemas/base.py checks them; JSON Schema shows it).
NAME_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
BEARER: Final[list[dict[str, list[str]]]] = [{"bearerAuth": []}]


class DrainBody(BaseModel):
    """The body of `POST /v1/nodes/{node}/drain`; the node is the path's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str = Field(default="drained by an operator", min_length=1, max_length=500)
    # One GPU of the node rather than all of it.
    gpu: int | None = Field(default=None, ge=0, le=255)
    # Also stop what runs there and put it back in its queue (`DrainRequest.requeue`).
    requeue: bool = False


class ResizeBody(BaseModel):
    """The body of `POST /v1/jobs/{job_id}/resize`; the job is the path's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The elastic job's new size, within its min_gpus..max_gpus: the job is pinned
    # there (the policy leaves it at that size); "auto" lifts the pin.
    gpus: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_JOB)] | Literal["auto"]


class Whoami(BaseModel):
    """The caller a token names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str
    operator: bool


_MODELS: Final[tuple[tuple[type[BaseModel], JsonSchemaMode], ...]] = (
    (SubmitRequest, "validation"),
    (DrainBody, "validation"),
    (ResizeBody, "validation"),
    (ThrottleRequest, "validation"),
    (ThrottleReply, "serialization"),
    (JobReply, "serialization"),
    (JobsReply, "serialization"),
    (NodesReply, "serialization"),
    (QueuesReply, "serialization"),
    (NodeReply, "serialization"),
    (StatusReply, "serialization"),
    (WhyReply, "serialization"),
    (ErrorReply, "serialization"),
    (Whoami, "serialization"),
    (LogChunk, "serialization"),
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    meaning = {
        400: "invalid request: the message names the field and the problem",
        401: "missing or unknown token",
        403: "the token's tenant may not do this",
        404: "no such job (for this tenant) or node",
        409: "conflict with the job's or node's state",
        500: "internal error",
        503: "this brain is not the leader, or the leader stepped down",
    }
    return {str(code): _json(_ref("ErrorReply"), meaning[code]) for code in (*codes, 500, 503)}


def _operation(
    summary: str,
    ok: dict[str, Any],
    *,
    errors: tuple[int, ...],
    parameters: list[dict[str, Any]] | None = None,
    body: str | None = None,
    body_required: bool = True,
    ok_status: int = 200,
    operation_id: str,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "operationId": operation_id,
        "security": BEARER,
        "responses": {str(ok_status): ok, **_errors(401, *errors)},
    }
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = {
            "required": body_required,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


def _path_param(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


JOB_ID: Final = _path_param("job_id", {"type": "string", "minLength": 1, "maxLength": 64})
NODE: Final = _path_param("node", {"type": "string", "pattern": NAME_PATTERN})


def _events_parameters() -> list[dict[str, Any]]:
    def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
        return {"name": name, "in": "query", "schema": schema, "description": description}

    return [
        query("since", {"type": "integer", "minimum": 1}, "first log sequence to send"),
        query("tail", {"type": "integer", "minimum": 0}, "start this many entries back"),
        query("follow", {"type": "boolean", "default": True}, "keep streaming new entries"),
        query("format", {"enum": ["ndjson", "sse"]}, "NDJSON (default) or Server-Sent Events"),
        query("job", {"type": "string"}, "only this job's entries"),
        query("node", {"type": "string"}, "only this node's entries"),
        {
            "name": "kind",
            "in": "query",
            "schema": {"type": "array", "items": {"type": "string"}},
            "style": "form",
            "explode": True,
            "description": "only these kinds (a cause kind, or a node event's kind)",
        },
        {
            "name": "Last-Event-ID",
            "in": "header",
            "schema": {"type": "integer", "minimum": 0},
            "description": "SSE resumption: continue after this sequence",
        },
    ]


def _paths() -> dict[str, Any]:
    jobs_params: list[dict[str, Any]] = [
        {
            "name": "state",
            "in": "query",
            "schema": {"type": "array", "items": {"enum": [s.value for s in JobState]}},
            "style": "form",
            "explode": True,
            "description": "only jobs in these states",
        },
        {
            "name": "queue",
            "in": "query",
            "schema": {
                "type": "array",
                "items": {"type": "string", "pattern": NAME_PATTERN},
                "maxItems": 64,
            },
            "style": "form",
            "explode": True,
            "description": "only jobs of these queues",
        },
        {
            "name": "array",
            "in": "query",
            "schema": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 128},
                "maxItems": 64,
            },
            "style": "form",
            "explode": True,
            "description": "only jobs of these arrays (`JobSpec.array`)",
        },
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": 100_000, "default": 1000},
            "description": "at most this many, newest",
        },
        {
            "name": "before",
            "in": "query",
            "schema": {"type": "string", "minLength": 1, "maxLength": 64},
            "description": "only jobs before this one (a reply's next_before: the next page)",
        },
    ]

    def cancel(summary: str, operation_id: str) -> dict[str, Any]:
        reply = _json(_ref("JobReply"), "the job, CANCELLED")
        return _operation(
            summary, reply, errors=(400, 404, 409), parameters=[JOB_ID], operation_id=operation_id
        )

    stream = {
        "type": "string",
        "description": "one JSON object per line: {seq, subject, ...the STATE record}",
    }
    return {
        "/v1/whoami": {
            "get": _operation(
                "The tenant the token names",
                _json(_ref("Whoami"), "the caller"),
                errors=(),
                operation_id="whoami",
            )
        },
        "/v1/status": {
            "get": _operation(
                "The brain, its epoch and the cluster's size",
                _json(_ref("StatusReply"), "status"),
                errors=(),
                operation_id="status",
            )
        },
        "/v1/jobs": {
            "get": _operation(
                "The caller's jobs (an operator's: everyone's), oldest first",
                _json(_ref("JobsReply"), "jobs and the profiles of those that have one"),
                errors=(400,),
                parameters=jobs_params,
                operation_id="listJobs",
            ),
            "post": _operation(
                "Submit a job",
                _json(_ref("JobReply"), "the new job, PENDING"),
                errors=(400,),
                body="SubmitRequest",
                ok_status=201,
                operation_id="submitJob",
            ),
        },
        "/v1/jobs/{job_id}": {
            "get": _operation(
                "One job and its utilisation profile",
                _json(_ref("JobReply"), "the job"),
                errors=(400, 404),
                parameters=[JOB_ID],
                operation_id="getJob",
            ),
            "delete": cancel(
                "Cancel a job, as POST /v1/jobs/{job_id}/cancel (its record stays, CANCELLED)",
                "deleteJob",
            ),
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": cancel(
                "Cancel a job (its processes are stopped): the caller's own, or, with an "
                "operator token, any tenant's",
                "cancelJob",
            )
        },
        "/v1/jobs/{job_id}/resize": {
            "post": _operation(
                "Resize a running elastic job: staged now, committed when its supervisor "
                "has every worker stepping at the new size (see `resize` on the job)",
                _json(_ref("JobReply"), "the job, with its staged resize (if any)"),
                errors=(400, 404, 409),
                parameters=[JOB_ID],
                body="ResizeBody",
                operation_id="resizeJob",
            )
        },
        "/v1/arrays/throttle": {
            "post": _operation(
                "Change how many of one of the caller's job arrays may hold GPUs at once: "
                "every job of it that has not ended takes the limit (null: none)",
                _json(_ref("ThrottleReply"), "the array's jobs that have not ended"),
                errors=(400, 404),
                body="ThrottleRequest",
                operation_id="throttleArray",
            )
        },
        "/v1/jobs/{job_id}/why": {
            "get": _operation(
                "The job's latest changes with their causes: placements, waits, "
                "preemptions, service levels, retries",
                _json(_ref("WhyReply"), "the job and its latest changes, oldest first"),
                errors=(400, 404),
                parameters=[
                    JOB_ID,
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 20},
                        "description": "at most this many changes, the newest",
                    },
                ],
                operation_id="whyJob",
            )
        },
        "/v1/jobs/{job_id}/logs": {
            "get": _operation(
                "A chunk of one attempt's log, read from the node that ran it (page on "
                "with offset=next_offset; follow a running attempt by asking again)",
                _json(_ref("LogChunk"), "the chunk, the log's size so far, whether it runs"),
                errors=(400, 404),
                parameters=[
                    JOB_ID,
                    {
                        "name": "attempt",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1},
                        "description": "the attempt (default: the latest)",
                    },
                    {
                        "name": "node",
                        "in": "query",
                        "schema": {"type": "string", "pattern": NAME_PATTERN},
                        "description": "of an attempt on several nodes, this node's log "
                        "(default: the first node's)",
                    },
                    {
                        "name": "offset",
                        "in": "query",
                        "schema": {"type": "integer", "default": 0},
                        "description": "from this byte; negative: that many bytes before the end",
                    },
                    {
                        "name": "max_bytes",
                        "in": "query",
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_LOG_CHUNK,
                            "default": 65536,
                        },
                        "description": "at most this many bytes",
                    },
                ],
                operation_id="jobLogs",
            )
        },
        "/v1/nodes": {
            "get": _operation(
                "Nodes, by name, their GPUs' latest telemetry and what runs on them",
                _json(_ref("NodesReply"), "nodes"),
                errors=(400, 404),
                parameters=[
                    {
                        "name": "after",
                        "in": "query",
                        "schema": {"type": "string", "pattern": NAME_PATTERN},
                        "description": "only nodes after this one (a reply's next_after)",
                    },
                    {
                        "name": "name",
                        "in": "query",
                        "schema": {"type": "string", "pattern": NAME_PATTERN},
                        "description": "only this node (404 if there is none)",
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 100_000,
                            "default": 100_000,
                        },
                        "description": "at most this many, the first by name",
                    },
                ],
                operation_id="listNodes",
            )
        },
        "/v1/queues": {
            "get": _operation(
                "Each queue's guarantee beside what its jobs hold and ask",
                _json(_ref("QueuesReply"), "queues"),
                errors=(),
                operation_id="listQueues",
            )
        },
        "/v1/nodes/{node}/drain": {
            "post": _operation(
                "Take a node's GPUs out of scheduling (operators only)",
                _json(_ref("NodeReply"), "the node, DRAINED"),
                errors=(400, 403, 404),
                parameters=[NODE],
                body="DrainBody",
                body_required=False,
                operation_id="drainNode",
            )
        },
        "/v1/nodes/{node}/resume": {
            "post": _operation(
                "Give a drained node's GPUs back to scheduling (operators only)",
                _json(_ref("NodeReply"), "the node"),
                errors=(400, 403, 404, 409),
                parameters=[NODE],
                operation_id="resumeNode",
            )
        },
        "/v1/events": {
            "get": _operation(
                "The STATE log as a stream: job and node changes, node events",
                {
                    "description": "the stream (NDJSON; SSE with format=sse)",
                    "content": {
                        "application/x-ndjson": {"schema": stream},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                errors=(400,),
                parameters=_events_parameters(),
                operation_id="events",
            )
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics: GPUs under dcgm-exporter's names, the scheduler's",
                "operationId": "metrics",
                "security": BEARER,
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401, 403),
                },
            }
        },
    }


# What JobSpec's validators check beyond the types (schemas/jobs.py, schemas/base.py),
# stated in JSON Schema so that clients and fuzzers know it.
ENV_NAME_PATTERN: Final = r"^(?!ALNAIR_|CUDA_VISIBLE_DEVICES|CUDA_MPS_)[A-Za-z_][A-Za-z0-9_]*$"


def _state_validators(schemas: dict[str, Any]) -> None:
    for name, schema in schemas.items():
        if not name.startswith("JobSpec"):
            continue
        fields = schema["properties"]
        fields["queue"]["pattern"] = NAME_PATTERN
        fields["command"]["prefixItems"] = [{"type": "string", "pattern": r"\S"}]
        fields["env"]["propertyNames"] = {"pattern": ENV_NAME_PATTERN}
        fields["gpu_types"]["items"]["pattern"] = r"^[^,|]*\S[^,|]*$"


def document(*, version: str = "1") -> dict[str, Any]:
    _, top = models_json_schema(_MODELS, ref_template="#/components/schemas/{model}")
    _state_validators(top.get("$defs", {}))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Alnair brain API",
            "version": version,
            "description": (
                "The same API as NATS request/reply on alnair.api.<tenant>.<verb>, over HTTP. "
                "Authenticate with `Authorization: Bearer <token>` (or `access_token=` in the "
                "query, for EventSource). A tenant sees and touches only its own jobs."
            ),
        },
        "paths": _paths(),
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
