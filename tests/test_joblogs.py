"""Job logs use bounded disk on their node (agents/joblogs.py): a log over its cap keeps
its newest part, the job appending on; readers skip the dropped part and say so; logs of
attempts long ended are removed. Pure file tests, and one with a real agent, brain and
nats-server whose job writes past a 1 MiB cap while `alnair logs`' reader pages it."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

import pytest

from agents import joblogs
from agents.joblogs import PRUNE_EVERY_S, LogKeeper, data_start, punch_head
from agents.logserve import LogServer
from bus.logs import copy_log
from cli.main import UsageError, _local_log, _logs_total
from schemas.jobs import JobRecord, JobSpec, JobState, NodeGrant
from schemas.logs import LogChunk, LogMissing, LogRequest
from tests.conftest import eventually
from tests.test_cluster_e2e import submit

MIB = 1024 * 1024
DAY = 86_400.0


def _lines(first: int, count: int) -> bytes:
    return b"".join(b"line %07d\n" % i for i in range(first, first + count))  # 13 bytes


@pytest.fixture
def punchable(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 65536)
    try:
        with probe.open("r+b") as f:
            punch_head(f.fileno(), 4096)
    except OSError as error:
        pytest.skip(f"{tmp_path}'s filesystem cannot punch holes: {error.strerror}")
    finally:
        probe.unlink()


def _disk(path: Path) -> int:
    return path.stat().st_blocks * 512


def _capped_log(tmp_path: Path) -> tuple[Path, bytes]:
    """Job 7's first log, 3 MiB of numbered lines written, capped at 1 MiB."""
    path = tmp_path / "logs" / "7" / "attempt-1.log"
    path.parent.mkdir(parents=True)
    written = _lines(0, 3 * MIB // 13)
    path.write_bytes(written)
    LogKeeper("n1", tmp_path / "logs", max_bytes=MIB, keep_s=None).cap([path])
    return path, written


@pytest.mark.usefixtures("punchable")
def test_a_log_over_its_cap_keeps_its_newest_part_while_its_job_appends_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "logs" / "7" / "attempt-1.log"
    path.parent.mkdir(parents=True)
    written = _lines(0, 3 * MIB // 13)
    keeper = LogKeeper("n1", tmp_path / "logs", max_bytes=MIB, keep_s=None)
    with path.open("ab") as job:  # the job's stdout, as the launcher opens it
        job.write(written)
        job.flush()
        assert keeper.cap([path]) > MIB
        size = path.stat().st_size
        assert size == len(written)  # every offset keeps its meaning
        assert _disk(path) <= MIB
        job.write(_lines(10**6, 10))
        job.flush()
    data = path.read_bytes()
    assert len(data) == size + 130 and data.endswith(_lines(10**6, 10))
    with path.open("rb") as log_file:
        kept = data_start(log_file.fileno(), 0)
        assert kept % 4096 == 0 and MIB // 2 <= size - kept < MIB // 2 + 4096
        assert data_start(log_file.fileno(), kept + 5) == kept + 5
    assert data[kept:size] == written[kept:]  # the newest part, whole
    assert data[:kept] == bytes(kept)  # the dropped part: a hole
    assert keeper.cap([path]) == 0  # under the cap again


@pytest.mark.usefixtures("punchable")
def test_a_reader_of_a_capped_log_is_told_what_was_dropped_and_gets_the_rest(
    tmp_path: Path,
) -> None:
    path, written = _capped_log(tmp_path)
    server = LogServer("n1", tmp_path / "logs", lambda job, attempt: False)
    pages, offset = [], 0
    while True:
        chunk = server.read(LogRequest(job_id="7", attempt=1, offset=offset, max_bytes=65536))
        assert isinstance(chunk, LogChunk)
        pages.append(chunk.data)
        offset = chunk.next_offset
        if offset >= chunk.size:
            break
    with path.open("rb") as log_file:
        kept = data_start(log_file.fileno(), 0)
    # The kept part begins at a block boundary, in a line: the reader gets whole lines.
    first = written.index(b"\n", kept) + 1
    text = "".join(pages)
    note = (
        f"[alnair: the first {first} bytes of this log were dropped on node n1 to bound "
        "its disk use (`alnair agent --job-log-max`); what follows is its newest part]\n"
    )
    assert text == note + written[first:].decode()
    # A tail stays in the kept part: no note.
    tail = server.read(LogRequest(job_id="7", attempt=1, offset=-13))
    assert isinstance(tail, LogChunk) and tail.data == _lines(3 * MIB // 13 - 1, 1).decode()


@pytest.mark.usefixtures("punchable")
def test_alnair_logs_reading_this_machines_disk_skips_the_dropped_part_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The CLI's fallback when the node's agent does not answer and the log is here.
    path, _ = _capped_log(tmp_path)
    job = JobRecord(
        job_id="7",
        tenant="default",
        spec=JobSpec(command=("true",), gpus=1),
        state=JobState.RUNNING,
        submitted_at=0.0,
        attempt=1,
        grants=(NodeGrant(node="n1", gpus=(0,), log_path=str(path)),),
    )
    assert _local_log(job, "n1", 1)
    served = LogServer("n1", tmp_path / "logs", lambda job, attempt: False).read(
        LogRequest(job_id="7", attempt=1, max_bytes=65536)
    )
    assert isinstance(served, LogChunk)
    out = capsys.readouterr().out
    assert out.startswith(served.data) and out.endswith(_lines(3 * MIB // 13 - 1, 1).decode())


def test_a_filesystem_that_cannot_punch_holes_is_said_once_and_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def cannot(fd: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(joblogs, "punch_head", cannot)
    path = tmp_path / "logs" / "7" / "attempt-1.log"
    path.parent.mkdir(parents=True)
    path.write_bytes(_lines(0, MIB // 13))
    keeper = LogKeeper("n1", tmp_path / "logs", max_bytes=65536, keep_s=None)
    with caplog.at_level(logging.WARNING, "agents.joblogs"):
        assert keeper.cap([path]) == 0
        assert keeper.cap([path]) == 0
    (said,) = caplog.records
    assert "cannot punch holes" in said.getMessage() and "--job-log-max" in said.getMessage()
    assert path.stat().st_size == MIB // 13 * 13  # untouched


def test_logs_of_attempts_long_ended_are_removed_and_running_ones_kept(tmp_path: Path) -> None:
    now = 100 * DAY
    logs = tmp_path / "logs"

    def log_file(job: str, attempt: int, age_days: float) -> Path:
        path = logs / job / f"attempt-{attempt}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
        os.utime(path, (now - age_days * DAY, now - age_days * DAY))
        return path

    ended_long_ago = log_file("1", 1, 40)
    running_quietly = log_file("1", 2, 40)  # a job silent for 40 days still runs
    alone_and_old = log_file("2", 1, 31)
    recent = log_file("3", 1, 29)
    keeper = LogKeeper("n1", logs, max_bytes=None, keep_s=30 * DAY, clock=lambda: now)
    assert keeper.prune_due()
    empty = keeper.prune([running_quietly])
    assert not ended_long_ago.exists() and not alone_and_old.exists()
    assert running_quietly.exists() and recent.exists()
    assert empty == [logs / "2"]
    keeper.remove_empty(empty)
    assert sorted(p.name for p in logs.iterdir()) == ["1", "3"]
    assert not keeper.prune_due()
    now += PRUNE_EVERY_S
    assert keeper.prune_due()
    forever = LogKeeper("n1", logs, max_bytes=None, keep_s=None, clock=lambda: now)
    assert not forever.prune_due()
    # A reader asking for a log removed is told how long logs are kept.
    gone = LogServer("n1", logs, lambda job, attempt: False, keep_days=30).read(
        LogRequest(job_id="2", attempt=1)
    )
    assert isinstance(gone, LogMissing)
    assert gone.error == "no log of job 2 attempt 1 on node n1 (logs are kept 30 days)"


def test_past_the_nodes_total_the_least_recently_written_ended_logs_go_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Many attempts, each within its own cap, fill the disk as much as one unbounded
    log: all of them together are held to `max_total` too. Running logs stay, however
    old; the ended ones go oldest first, until the rest fit."""
    caplog.set_level(logging.INFO, "agents.joblogs")
    now = 10 * DAY
    logs = tmp_path / "logs"

    def log_file(job: str, age_s: float, mib: int = 1) -> Path:
        path = logs / job / "attempt-1.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * (mib * MIB))
        os.utime(path, (now - age_s, now - age_s))
        return path

    running_oldest = log_file("1", 900)
    ended = [log_file(str(job), 800 - job * 100) for job in range(2, 7)]  # 2 the oldest
    total = sum(_disk(p) for p in (running_oldest, *ended))
    keeper = LogKeeper(
        "n1", logs, max_bytes=None, keep_s=None, max_total=total - 2 * MIB, clock=lambda: now
    )
    assert keeper.prune_due()
    empty = keeper.prune([running_oldest])
    assert [p.exists() for p in (running_oldest, *ended)] == [True, False, False, True, True, True]
    assert sorted(empty) == [logs / "2", logs / "3"]
    assert "removed the 2 least recently written logs of ended attempts" in caplog.text

    # Running logs alone over it: said, and left.
    alone = LogKeeper("n1", logs, max_bytes=None, keep_s=None, max_total=MIB // 2)
    alone.prune([running_oldest])
    assert running_oldest.exists() and not any(p.exists() for p in ended)
    assert "job logs still hold 1 MiB, over --job-logs-max-total (0 MiB)" in caplog.text

    gone = LogServer("n1", logs, lambda job, attempt: False, keep_days=30, max_total=50 * MIB)
    missing = gone.read(LogRequest(job_id="2", attempt=1))
    assert isinstance(missing, LogMissing)
    assert missing.error == (
        "no log of job 2 attempt 1 on node n1 (logs are kept 30 days; the oldest are "
        "removed once all hold over 50 MiB)"
    )


@pytest.mark.parametrize(
    ("text", "fields"),
    [("10%", (None, 0.1)), ("50GiB", (50 * 1024, None)), ("0", (None, None))],
)
def test_the_agents_total_for_job_logs_is_a_share_of_the_disk_or_a_size(
    text: str, fields: tuple[int | None, float | None]
) -> None:
    assert _logs_total(text) == fields


@pytest.mark.parametrize("text", ["0%", "150%", "lots%", "-5GiB"])
def test_a_total_for_job_logs_that_is_not_one_is_refused_by_name(text: str) -> None:
    with pytest.raises(UsageError, match="--job-logs-max-total"):
        _logs_total(text)


@pytest.mark.usefixtures("punchable")
async def test_a_job_writing_past_its_nodes_cap_keeps_its_newest_output_readable(
    brain_factory, agent_factory, connect, tmp_path: Path
) -> None:
    brain = await brain_factory()
    agent = await agent_factory("n1", gpus=1, job_log_max_mib=1)
    await eventually(lambda: len(brain.state.nodes) == 1)
    # 4 MiB of numbered lines, then a last line, then it waits to be read.
    code = (
        "import sys, time\n"
        "for i in range(4 * 1024 * 1024 // 13): sys.stdout.write('line %07d\\n' % i)\n"
        "print('the end', flush=True)\n"
        "time.sleep(600)\n"
    )
    job_id = await submit(
        brain.api, JobSpec(command=(sys.executable, "-c", code), gpus=1, cwd=str(tmp_path))
    )
    await eventually(lambda: brain.state.jobs[job_id].state is JobState.RUNNING)
    (process,) = await eventually(lambda: agent.launcher.find(job_id, 1))
    path = process.log_path
    await eventually(lambda: path.read_bytes().endswith(b"the end\n"), timeout_s=60)
    await eventually(lambda: _disk(path) <= MIB, timeout_s=30)  # the agent's loop capped it
    out: list[str] = []
    await copy_log(await connect("reader"), "n1", job_id, 1, out.append)
    text = "".join(out)
    assert text.startswith("[alnair: the first ") and "dropped on node n1" in text
    body = text.split("\n", 1)[1]
    assert body.endswith("the end\n")
    numbers = [int(line.split()[1]) for line in body.splitlines()[:-1]]
    # What is kept is the newest part, in order, none missing.
    assert numbers == list(range(numbers[0], 4 * 1024 * 1024 // 13))
    assert len(body) >= MIB // 2
