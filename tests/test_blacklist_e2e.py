"""Input blacklisting: jobs report a bad input through the in-job SDK over NATS, or
mark it in their log and exit 66 (no SDK); after K distinct jobs the input is
blacklisted cluster-wide, the jobs that failed on it run again without it, and every
later job receives the blacklist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from brain.core.failures import FailurePolicy
from schemas.api import BlacklistReply, BlacklistRequest
from schemas.jobs import BLACKLIST_FILE_ENV, FailureClass, JobSpec, JobState
from tests.conftest import eventually
from tests.test_cluster_e2e import submit
from tests.test_failures_e2e import REPO, python

BAD = "s3://datasets/imagenet/shard-0007.tar"
# Skips the input once it is blacklisted; until then fails on it, reporting it.
TRAIN = python(
    "from workloads import sdk\n"
    f"if sdk.is_blacklisted({BAD!r}):\n"
    "    print('skipping', sorted(sdk.blacklisted_inputs()))\n"
    "else:\n"
    f"    sdk.fail_on_bad_input({BAD!r}, 'truncated tar header')\n"
)
# The same without the SDK: a shell script that marks the input in its log.
SCRIPT = (
    "sh",
    "-c",
    f'if grep -qxF {BAD} "$ALNAIR_BLACKLIST_FILE"; then echo skipping; '
    f'else echo "ALNAIR_BAD_INPUT {BAD} truncated tar header"; exit 66; fi',
)


@pytest.mark.parametrize("command", [TRAIN, SCRIPT], ids=["sdk", "log marker"])
async def test_input_failing_three_jobs_is_blacklisted_and_handed_on(
    brain_factory, agent_factory, command: tuple[str, ...]
) -> None:
    brain = await brain_factory(failures=FailurePolicy(blacklist_after_jobs=3))
    agent = await agent_factory("n1", gpus=4)
    await eventually(lambda: brain.state.nodes)
    spec = JobSpec(command=command, gpus=1, cwd=REPO)
    first_two = [await submit(brain.api, spec) for _ in range(2)]
    for job_id in first_two:
        job = await eventually(lambda j=job_id: (r := brain.state.jobs[j]).state.terminal and r)
        assert job.state is JobState.FAILED
        assert job.failures[-1].failure_class is FailureClass.INPUT
        assert job.failures[-1].input_uri == BAD
    listed = await brain.api.handle("default", BlacklistRequest())
    assert isinstance(listed, BlacklistReply) and not listed.entries
    assert listed.suspects == {BAD: tuple(sorted(first_two))}

    third = await submit(brain.api, spec)
    await eventually(lambda: BAD in brain.state.blacklist)
    entry = brain.state.blacklist[BAD]
    assert entry.jobs == (*first_two, third) and entry.added_by == "brain"
    # All three run again, now skipping the input, and succeed.
    for job_id in (*first_two, third):
        job = await eventually(
            lambda j=job_id: (r := brain.state.jobs[j]).state is JobState.SUCCEEDED and r
        )
        assert job.attempt == 2

    fourth = await submit(
        brain.api,
        JobSpec(
            command=python(f"import os; print(open(os.environ[{BLACKLIST_FILE_ENV!r}]).read())"),
            gpus=1,
        ),
    )
    job = await eventually(lambda: (r := brain.state.jobs[fourth]).state.terminal and r)
    assert job.state is JobState.SUCCEEDED
    (grant,) = job.grants
    assert grant.log_path is not None
    assert BAD in Path(grant.log_path).read_text().split()
    assert agent.launcher is not None


async def test_operator_edits_the_blacklist(brain_factory) -> None:
    brain = await brain_factory()
    add = BlacklistRequest(action="add", uri="file:///data/bad.bin", reason="corrupt")
    refused = await brain.api.handle("default", add)
    assert not isinstance(refused, BlacklistReply) and refused.code == "forbidden"
    added = await brain.api.handle("operator", add, operator=True)
    assert isinstance(added, BlacklistReply)
    assert [(e.uri, e.added_by) for e in added.entries] == [("file:///data/bad.bin", "operator")]
    removed = await brain.api.handle(
        "operator", BlacklistRequest(action="remove", uri="file:///data/bad.bin"), operator=True
    )
    assert isinstance(removed, BlacklistReply) and removed.entries == ()


def test_sdk_reads_the_blacklist_file(tmp_path: Path, monkeypatch) -> None:
    from workloads import sdk

    listing = tmp_path / "blacklist.txt"
    listing.write_text("s3://a\ns3://b\n")
    monkeypatch.setenv(BLACKLIST_FILE_ENV, str(listing))
    assert sdk.is_blacklisted("s3://a") and not sdk.is_blacklisted("s3://c")
    monkeypatch.delenv(BLACKLIST_FILE_ENV)
    assert sdk.blacklisted_inputs() == frozenset()
    for name in ("ALNAIR_NATS", "ALNAIR_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert sdk.report_bad_input("s3://a", "no bus here") is False
    assert "torch" not in os.environ.get("PYTHONPATH", "")
