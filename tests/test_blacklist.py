"""The blacklist and pre-runs without a server (brain/blacklist.py): inputs counted per
distinct job, operators' edits, FAILED jobs run again without a blacklisted input, and
pre-runs that survive their trial."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from brain.blacklist import MAX_BLACKLIST_BYTES, Blacklist, blacklist_bytes
from brain.core.failures import DEFAULT_FAILURE_POLICY
from schemas.api import BlacklistRequest
from schemas.errors import ApiError
from schemas.events import InputError, JobExited
from schemas.jobs import AttemptFailure, FailureClass, JobState, NodeGrant
from schemas.state import CauseKind
from tests.parts import Clock, Shell

URI = "s3://bucket/shard-7"
POLICY = dataclasses.replace(DEFAULT_FAILURE_POLICY, blacklist_after_jobs=3, prerun_s=30.0)


def blacklist(shell: Shell, clock: Clock | None = None) -> Blacklist:
    return Blacklist(lambda: shell.state, shell, policy=POLICY, clock=clock or shell.clock)


def input_error(job_id: str, number: int = 1, uri: str = URI) -> InputError:
    return InputError(
        event_id=f"e-{job_id}-{number}",
        node="n1",
        ts=0.0,
        job_id=job_id,
        attempt=1,
        uri=uri,
        reason="corrupt record",
    )


@pytest.mark.parametrize(
    ("earlier_jobs", "blacklisted"),
    [
        pytest.param((), False, id="first job"),
        pytest.param(("1",), False, id="second job"),
        pytest.param(("1", "1"), False, id="the same job twice counts once"),
        pytest.param(("1", "2"), True, id="third distinct job"),
    ],
)
async def test_an_input_is_blacklisted_once_k_distinct_jobs_failed_on_it(
    earlier_jobs: tuple[str, ...], blacklisted: bool
) -> None:
    shell = Shell()
    for number, job_id in enumerate(earlier_jobs):
        shell.record_event(input_error(job_id, number))
    made = blacklist(shell)

    await made.input_error(input_error("3"))

    assert (URI in shell.state.blacklist) is blacklisted
    if blacklisted:
        entry = shell.state.blacklist[URI]
        assert entry.jobs == ("1", "2", "3") and entry.added_by == "brain"
        assert shell.causes[-1].kind is CauseKind.BLACKLISTED


async def test_an_input_already_blacklisted_changes_nothing() -> None:
    shell = Shell()
    made = blacklist(shell)
    await made.edit("ops", BlacklistRequest(action="add", uri=URI, reason="known bad"))
    records = shell.state.last_seq

    for job_id in ("1", "2", "3"):
        await made.input_error(input_error(job_id))

    assert shell.state.last_seq == records and shell.state.blacklist[URI].added_by == "ops"


async def test_operators_add_and_remove_entries() -> None:
    shell = Shell()
    made = blacklist(shell)

    await made.edit("ops", BlacklistRequest(action="add", uri=URI, reason="known bad"))
    await made.edit("ops", BlacklistRequest(action="add", uri=URI, reason="again"))
    assert shell.state.blacklist[URI].reason == "known bad" and len(shell.causes) == 1

    await made.edit("ops", BlacklistRequest(action="remove", uri=URI))
    assert URI not in shell.state.blacklist
    assert shell.causes[-1].kind is CauseKind.UNBLACKLISTED


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (BlacklistRequest(action="remove", uri=URI), "not_found"),
        (BlacklistRequest(action="add", uri=None), "invalid"),
    ],
)
async def test_an_edit_that_cannot_apply_is_refused(request_: BlacklistRequest, code: str) -> None:
    shell = Shell()
    with pytest.raises(ApiError) as refused:
        await blacklist(shell).edit("ops", request_)
    assert refused.value.code == code and shell.state.last_seq == 0


def failed_on(shell: Shell, number: int, failure_class: FailureClass, uri: str | None) -> None:
    job = shell.add_job(number, node="n1")
    failure = AttemptFailure(
        attempt=1,
        failure_class=failure_class,
        reason="bad input",
        nodes=("n1",),
        at=0.0,
        input_uri=uri,
    )
    shell.put_job(
        job.model_copy(
            update={"state": JobState.FAILED, "failures": (failure,), "finished_at": 1.0}
        )
    )


async def test_a_job_failed_on_an_input_runs_again_once_it_is_blacklisted() -> None:
    shell = Shell()
    shell.add_node("n1")
    failed_on(shell, 1, FailureClass.INPUT, URI)
    failed_on(shell, 2, FailureClass.INPUT, "s3://bucket/other")
    failed_on(shell, 3, FailureClass.USER, None)

    await blacklist(shell).edit("ops", BlacklistRequest(action="add", uri=URI, reason="bad"))

    states = {j: shell.state.jobs[j].state for j in ("1", "2", "3")}
    assert states == {"1": JobState.PENDING, "2": JobState.FAILED, "3": JobState.FAILED}
    assert shell.state.jobs["1"].finished_at is None
    assert shell.causes[-1].kind is CauseKind.RETRY_SCHEDULED


@pytest.mark.parametrize(
    ("ran_s", "started", "passes"),
    [
        pytest.param(29.0, True, False, id="within its trial"),
        pytest.param(30.0, True, True, id="survived its trial"),
        pytest.param(60.0, False, False, id="not started yet"),
    ],
)
async def test_a_prerun_that_survives_its_trial_waits_for_its_full_allocation(
    ran_s: float, started: bool, passes: bool
) -> None:
    shell, clock = Shell(), Clock(1_000.0)
    shell.add_node("n1")
    job = shell.add_job(1, node="n1")
    grant = NodeGrant(node="n1", gpus=(0,), pid=4242 if started else None)
    shell.put_job(
        job.model_copy(
            update={"prerun": "running", "started_at": clock.now - ran_s, "grants": (grant,)}
        )
    )

    await blacklist(shell, clock).check_preruns()

    after = shell.state.jobs["1"]
    if passes:
        assert (after.state, after.prerun, after.grants) == (JobState.PENDING, "passed", ())
        assert [(s.node, s.reason) for s in shell.stops] == [("n1", "pre-run passed")]
    else:
        assert after.state is JobState.RUNNING and shell.stops == []


def exited(job_id: str, code: int, *log: str, event_id: str | None = None) -> JobExited:
    return JobExited(
        event_id=event_id or f"x-{job_id}",
        node="n1",
        ts=0.0,
        job_id=job_id,
        attempt=1,
        exit_code=code,
        runtime_s=1.0,
        log_tail=log,
    )


MARKED = f"ALNAIR_BAD_INPUT {URI} checksum mismatch"


async def test_an_input_a_jobs_log_marked_counts_like_one_it_reported() -> None:
    # A job without the SDK (a shell script, no NATS) marks its bad input in its log
    # and exits 66: classified `input`, but it was never counted toward the blacklist,
    # so three jobs failing on one input blacklisted nothing.
    shell = Shell()
    made = blacklist(shell)
    for job_id in ("1", "2", "3"):
        marked = await made.job_exited(exited(job_id, 66, "reading", MARKED))
        assert marked is not None and (marked.uri, marked.reason) == (URI, "checksum mismatch")
        shell.record_event(marked)
    entry = shell.state.blacklist[URI]
    assert entry.jobs == ("1", "2", "3") and "checksum mismatch" in entry.reason


@pytest.mark.parametrize(
    ("code", "log", "reported", "counted"),
    [
        pytest.param(66, (MARKED,), False, True, id="marked"),
        pytest.param(1, (MARKED,), False, False, id="not exit 66: not an input failure"),
        pytest.param(66, ("no marker",), False, False, id="exit 66 without a marker"),
        pytest.param(66, (MARKED,), True, False, id="reported through the SDK: counted there"),
    ],
)
async def test_only_an_unreported_marked_input_failure_is_counted_from_the_log(
    code: int, log: tuple[str, ...], reported: bool, counted: bool
) -> None:
    shell = Shell()
    if reported:
        shell.record_event(input_error("1"))
    marked = await blacklist(shell).job_exited(exited("1", code, *log))
    assert (marked is not None) is counted


async def test_a_redelivered_exit_marks_its_input_once() -> None:
    shell = Shell()
    made = blacklist(shell)
    marked = await made.job_exited(exited("1", 66, MARKED))
    assert marked is not None
    shell.record_event(marked)
    assert await made.job_exited(exited("1", 66, MARKED)) is None


async def test_a_full_blacklist_refuses_more_and_keeps_what_it_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole blacklist is one log entry and goes with every launch: past
    MAX_BLACKLIST_BYTES an operator's add is refused, naming the limit, and an input
    that reaches K failures is not added (said in the log); nothing already listed is
    lost. Unbounded, a list of a few hundred long URIs outgrew a NATS message and the
    brain could not journal it."""
    caplog.set_level(logging.WARNING, logger="brain.blacklist")
    shell = Shell()
    made = blacklist(shell)
    long = "x" * 4000
    added = 0
    while blacklist_bytes(shell.state.blacklist.values()) + 4200 <= MAX_BLACKLIST_BYTES:
        await made.edit(
            "ops", BlacklistRequest(action="add", uri=f"s3://bucket/{added:04d}/{long}")
        )
        added += 1
    one_more = BlacklistRequest(action="add", uri=f"s3://bucket/{added:04d}/{long}")
    with pytest.raises(ApiError) as refused:
        await made.edit("ops", one_more)
    assert refused.value.code == "invalid"
    assert f"the blacklist is full: {added} entries" in str(refused.value)
    assert f"over the {MAX_BLACKLIST_BYTES} it may (it goes" in str(refused.value)
    assert len(shell.state.blacklist) == added > 50
    assert blacklist_bytes(shell.state.blacklist.values()) <= MAX_BLACKLIST_BYTES

    # Filled to within 100 bytes, too little for the entry K failures would add.
    room = MAX_BLACKLIST_BYTES - blacklist_bytes(shell.state.blacklist.values())
    probe = "s3://filler/"
    await made.edit("ops", BlacklistRequest(action="add", uri=probe))
    overhead = blacklist_bytes(shell.state.blacklist.values()) - (MAX_BLACKLIST_BYTES - room)
    await made.edit("ops", BlacklistRequest(action="remove", uri=probe))
    filler = probe + "f" * (room - overhead - 100)
    await made.edit("ops", BlacklistRequest(action="add", uri=filler))
    for number, job_id in enumerate(("1", "2")):
        shell.record_event(input_error(job_id, number))
    records = shell.state.last_seq
    await made.input_error(input_error("3"))
    assert URI not in shell.state.blacklist and shell.state.last_seq == records
    assert f"input {URI} is not blacklisted although 3 jobs failed on it" in caplog.text

    # Room again once one is removed.
    await made.edit("ops", BlacklistRequest(action="remove", uri=f"s3://bucket/0000/{long}"))
    await made.edit("ops", BlacklistRequest(action="add", uri=URI))
    assert URI in shell.state.blacklist
