"""Wire schemas and subjects: round-trips and rejects, no server."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects
from schemas.api import (
    BlacklistRequest,
    CancelRequest,
    DrainRequest,
    ErrorReply,
    JobReply,
    ListJobsRequest,
    ListNodesRequest,
    ResizeRequest,
    StatusRequest,
    SubmitRequest,
)
from schemas.base import MAX_MESSAGE_BYTES, SCHEMA_VERSION, decode, encode, encode_request
from schemas.commands import NODE_COMMAND, Launch, Stop
from schemas.dlq import DeadLetter
from schemas.errors import InvalidMessage, InvalidName, InvalidSubject
from schemas.events import NODE_EVENT, GpuFault, JobExited, JobStarted, LaunchFailed
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.nodes import NodeRecord, NodeState
from schemas.state import STATE_RECORD, Cause, CauseKind, JobChanged, NodeChanged
from schemas.telemetry import GpuInfo, GpuSample, Heartbeat, RunningJob, TelemetryBatch

SPEC = JobSpec(command=("python", "-c", "print(42)"), gpus=2, env={"SEED": "1"})
GPU = GpuInfo(index=0, uuid="GPU-1", model="H100", memory_mib=81559)
SAMPLE = GpuSample(
    index=0,
    util_gpu_pct=50,
    util_mem_pct=20,
    mem_used_mib=100,
    mem_total_mib=81559,
    power_w=300,
    temp_c=60,
    sm_clock_mhz=1980,
    mem_clock_mhz=2619,
)
JOB = JobRecord(
    job_id="7",
    tenant="team-a",
    spec=SPEC,
    state=JobState.RUNNING,
    attempt=1,
    submitted_at=1.0,
    grants=(NodeGrant(node="n1", gpus=(0, 1), pid=42),),
)
NODE = NodeRecord(
    name="n1",
    state=NodeState.READY,
    hostname="h",
    backend="sim",
    instance="i",
    gpus=(GPU,),
    joined_at=1.0,
)

EXAMPLES = [
    TelemetryBatch(node="n1", ts=1.0, samples=(SAMPLE,)),
    Heartbeat(
        node="n1",
        ts=1.0,
        seq=1,
        instance="abc",
        hostname="h",
        backend="sim",
        interval_s=1.0,
        gpus=(GPU,),
        running=(RunningJob(job_id="7", attempt=1, pid=9, gpus=(0,)),),
    ),
    JobStarted(
        event_id="e1", node="n1", ts=1.0, job_id="7", attempt=1, pid=9, gpus=(0,), log_path="/l"
    ),
    JobExited(
        event_id="e2",
        node="n1",
        ts=1.0,
        job_id="7",
        attempt=1,
        exit_code=1,
        runtime_s=2.0,
        log_tail=("Traceback", "ValueError: x"),
    ),
    LaunchFailed(event_id="e3", node="n1", ts=1.0, job_id="7", attempt=1, reason="no such file"),
    GpuFault(event_id="e4", node="n1", ts=1.0, gpu=0, fault="xid", xid=79),
    Launch(
        command_id="c1",
        epoch=3,
        issued_at=1.0,
        job_id="7",
        attempt=1,
        gpus=(0, 1),
        command=("true",),
        expires_at=61.0,
    ),
    Stop(command_id="c2", epoch=3, issued_at=1.0, job_id="7", reason="cancelled"),
    SubmitRequest(spec=SPEC),
    JobReply(job=JOB),
    ErrorReply(code="not_found", error="no job 9"),
    JobChanged(
        record_id="r1",
        ts=1.0,
        epoch=1,
        job=JOB,
        previous=JobState.PENDING,
        cause=Cause(kind=CauseKind.PLACED, message="placed"),
    ),
    NodeChanged(
        record_id="r2",
        ts=1.0,
        epoch=1,
        node=NODE,
        previous=None,
        cause=Cause(kind=CauseKind.NODE_JOINED, message="joined"),
    ),
    DeadLetter(
        subject="alnair.node.n1.heartbeat",
        reason="bad",
        received_at=1.0,
        by="brain",
        payload_bytes=3,
        payload_preview="xyz",
    ),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message) -> None:
    data = encode(message)
    assert json.loads(data)["v"] == SCHEMA_VERSION
    assert decode(data, type(message)) == message


REQUESTS = [
    SubmitRequest(spec=SPEC, idempotency_key="k"),
    SubmitRequest(spec=SPEC.model_copy(update={"after_any": ("3",), "time_limit_s": 60.0})),
    SubmitRequest(spec=SPEC.model_copy(update={"array": "sweep", "array_limit": 4})),
    CancelRequest(job_id="4"),
    ListJobsRequest(states=(JobState.RUNNING,), limit=10),
    ListNodesRequest(name="n1"),
    DrainRequest(node="n1", reason="maintenance", requeue=True),
    BlacklistRequest(action="add", uri="s3://bucket/shard-7"),
    ResizeRequest(job_id="4", gpus="auto"),
    StatusRequest(),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda m: type(m).__name__)
def test_a_compact_request_is_read_back_as_sent_and_says_its_version(request_) -> None:
    """`alnair` asks with the fields at their defaults left out, so that a brain older
    than it reads what uses nothing new; the brain decodes requests strictly."""
    data = encode_request(request_)
    assert json.loads(data)["v"] == SCHEMA_VERSION
    assert decode(data, type(request_), strict=True) == request_
    assert len(data) <= len(encode(request_))


def test_a_compact_submission_leaves_out_what_it_does_not_use() -> None:
    sent = json.loads(encode_request(SubmitRequest(spec=SPEC)))
    assert sent == {
        "v": SCHEMA_VERSION,
        "spec": {"command": ["python", "-c", "print(42)"], "gpus": 2, "env": {"SEED": "1"}},
    }


def test_unions_pick_the_kind() -> None:
    assert isinstance(decode(encode(EXAMPLES[3]), NODE_EVENT), JobExited)
    assert isinstance(decode(encode(EXAMPLES[7]), NODE_COMMAND), Stop)
    assert isinstance(decode(encode(EXAMPLES[12]), STATE_RECORD), NodeChanged)


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"not json", "Invalid JSON"),
        (b'{"v": 2, "node": "n1", "ts": 1, "samples": []}', "v:"),
        (b'{"v": 1, "node": "n1", "ts": 1, "samples": [], "extra": 1}', "extra"),
        (b'{"v": 1, "node": "a.b", "ts": 1, "samples": []}', "invalid node name"),
        (b'{"v": 1, "node": "n1", "ts": "soon", "samples": []}', "ts"),
        (b"[]", "Input should be"),
    ],
)
def test_rejects_name_what_is_wrong(payload: bytes, fragment: str) -> None:
    with pytest.raises(InvalidMessage) as caught:
        decode(payload, TelemetryBatch)
    assert fragment in caught.value.reason


def test_oversized_is_rejected_before_parsing() -> None:
    with pytest.raises(InvalidMessage, match="exceeds"):
        decode(b" " * (MAX_MESSAGE_BYTES + 1), TelemetryBatch)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"command": [], "gpus": 1}, "command"),
        ({"command": ["x"], "gpus": 0}, "gpus"),
        (
            {"command": ["x"], "gpus": 0.5},
            "spec.gpus: 0.5 is a share of a GPU: ask gpus 1 and gpu_milli 500",
        ),
        ({"command": ["x"], "gpus": 1, "queue": "a b"}, "queue"),
        ({"command": ["x"], "gpus": 1, "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "set by Alnair"),
        ({"command": ["x"], "gpus": 1, "env": {"1BAD": "0"}}, "invalid environment"),
        ({"command": [" "], "gpus": 1}, "empty"),
        # No process can be started with a NUL in its arguments, environment or
        # directory: refused at submit, not retried at every launch.
        ({"command": ["\0"], "gpus": 1}, "spec: command: word 0 contains a NUL character"),
        ({"command": ["x", "a\0b"], "gpus": 1}, "command: word 1 contains a NUL"),
        ({"command": ["x"], "gpus": 1, "env": {"A": "x\0y"}}, "env: A's value contains a NUL"),
        ({"command": ["x"], "gpus": 1, "cwd": "/tmp/\0"}, "spec: cwd: the working directory"),
        ({"command": ["x"], "gpus": 1, "cwd": "rel/dir"}, "must be an absolute path"),
        (
            {"command": ["x"], "gpus": 1, "array_limit": 4},
            "array_limit: a limit is of an array: give array too",
        ),
        ({"command": ["x"], "gpus": 1, "array": "a", "array_limit": 0}, "array_limit"),
    ],
)
def test_job_spec_rejects(fields: dict, fragment: str) -> None:
    with pytest.raises(InvalidMessage) as caught:
        decode(json.dumps({"v": 1, "spec": fields}).encode(), SubmitRequest)
    assert fragment in caught.value.reason


def test_subjects_build_and_parse() -> None:
    assert subjects.node("n1", "heartbeat") == "alnair.node.n1.heartbeat"
    assert subjects.api("team-a", "submit") == "alnair.api.team-a.submit"
    assert subjects.state_job("12") == "alnair.state.job.12"
    parsed = subjects.parse("alnair.api.team-a.submit")
    assert (parsed.kind, parsed.identity, parsed.channel) == ("api", "team-a", "submit")
    assert subjects.parse("alnair.node.n1.event").channel == "event"
    assert subjects.dlq_origin("alnair.node.n1.heartbeat") == "node.heartbeat"
    assert subjects.dlq_origin("alnair.api.t.submit") == "api.submit"
    assert subjects.dlq_origin("elsewhere") == "unknown"


@pytest.mark.parametrize(
    "subject", ["alnair.node.n1", "other.node.n1.event", "alnair.node.n1.gossip", "alnair.x.y.z"]
)
def test_parse_rejects(subject: str) -> None:
    with pytest.raises(InvalidSubject):
        subjects.parse(subject)


@pytest.mark.parametrize("name", ["", "a.b", "a*", "a>", "a b", "x" * 65])
def test_names_that_cannot_be_subject_tokens(name: str) -> None:
    with pytest.raises(InvalidName):
        subjects.node(name, "heartbeat")


@given(st.binary(max_size=2048))
def test_decode_never_raises_anything_but_invalid_message(data: bytes) -> None:
    for kind in (TelemetryBatch, Heartbeat, NODE_EVENT, NODE_COMMAND, SubmitRequest):
        with contextlib.suppress(InvalidMessage):
            decode(data, kind)


@pytest.mark.parametrize("gpus", [0, 5000, "big", True, 1.5, "4"])
def test_a_resize_to_a_size_that_is_none_says_what_a_size_is(gpus: object) -> None:
    payload = json.dumps({"v": 1, "job_id": "1", "gpus": gpus}).encode()
    with pytest.raises(InvalidMessage) as caught:
        decode(payload, ResizeRequest, strict=True)
    assert caught.value.reason == (
        f'gpus: a whole number of GPUs from 1 to 4096, or "auto"; not {gpus!r}'
    )


def test_a_stored_job_that_submit_would_refuse_now_still_loads() -> None:
    """A record accepted before submit refused a relative directory (or a NUL) is read
    back from the log and snapshots as it is: losing it would lose the job."""
    spec = JobSpec(command=("train",), gpus=1, cwd="work")
    assert JobSpec.model_validate_json(spec.model_dump_json()).cwd == "work"
    with pytest.raises(ValueError, match="cwd: the working directory must be an absolute"):
        SubmitRequest(spec=spec)
