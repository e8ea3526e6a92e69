"""The supervisor without Horovod: its device list through a refused grow (the workers
of its node claim GPUs from that list, so a grow refused without moving puts it back),
and sheds of lost nodes, one superseding another."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from schemas.commands import Resize
from schemas.jobs import NodeGpus
from tests.conftest import eventually
from workloads import devices
from workloads.supervisor import Supervisor, SupervisorConfig, parse_args, run


def supervisor_of(tmp_path: Path, np: int, **config: object) -> Supervisor:
    """A supervisor on node "a" of job 7, ready to resize, with no bus (no other node's
    worker host can be reached) and no workers."""
    made = Supervisor(
        SupervisorConfig(
            job_id="7",
            command=("train",),
            min_np=1,
            max_np=8,
            np=np,
            work_dir=tmp_path,
            node="a",
            **config,  # type: ignore[arg-type]
        )
    )
    made._prepare()
    return made


async def test_a_grow_refused_for_another_node_puts_this_node_s_gpus_back(
    tmp_path: Path,
) -> None:
    supervisor = supervisor_of(tmp_path, 2, gpus=(0, 1))
    assert supervisor.devices == (0, 1)
    placement = (NodeGpus(node="a", gpus=(0, 1, 2)), NodeGpus(node="b", gpus=(4,)))
    outcome = await supervisor.resize(4, placement)
    assert not outcome.ok and outcome.to_size == outcome.from_size == 2
    assert "node b" in outcome.reason
    assert supervisor.devices == (0, 1)  # not (0, 1, 2): GPU 2 goes back to the brain
    assert devices.read_devices(supervisor.gpu_dir) == (0, 1)


async def test_a_shed_of_more_lost_nodes_supersedes_the_one_before(tmp_path: Path) -> None:
    """A shrink off lost node b would wait for its survivors to step at 4; node c is
    lost too (they never will at 4). The newer command's shed, off b and c, makes the
    older give up, whether that one was under way or only queued (two commands that
    arrive together), and then runs itself."""
    supervisor = supervisor_of(tmp_path, 6, remote=(("b", 2), ("c", 2)))  # nothing steps
    a, c = NodeGpus(node="a", gpus=(0, 1)), NodeGpus(node="c", gpus=(0, 1))

    def shed(command_id: str, *placement: NodeGpus, lost: tuple[str, ...]) -> Resize:
        size = sum(len(part.gpus) for part in placement)
        return Resize(
            command_id=command_id,
            epoch=1,
            issued_at=0.0,
            job_id="7",
            world_size=size,
            placement=placement,
            lost=lost,
        )

    await supervisor._on_command(shed("shed-1", a, c, lost=("b",)), None)  # type: ignore[arg-type]
    await supervisor._on_command(shed("shed-2", a, lost=("b", "c")), None)  # type: ignore[arg-type]

    await eventually(lambda: len(supervisor.outcomes) == 1, timeout_s=60)
    [first] = supervisor.outcomes
    assert not first.ok and first.reason == "superseded by a resize off more lost nodes"
    await eventually(lambda: supervisor.remote == {})
    assert (tmp_path / "lost-nodes").read_text() == "b\nc\n"
    assert supervisor.slots == 2
    for task in list(supervisor._tasks):
        task.cancel()


async def test_a_supervisor_removes_the_work_directory_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `--work-dir` a supervisor makes its own (host list, GPU claims), and
    removes it when it ends; one it was given is left as it is."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(Supervisor, "horovodrun_command", lambda self: ["true"])
    sizes = ["--job-id", "7", "--np", "1", "--min-np", "1", "--max-np", "1"]
    made = parse_args([*sizes, "--", "train"])
    assert made.own_work_dir and made.work_dir.parent == tmp_path
    assert await run(made) == 0
    assert not made.work_dir.exists()

    given = parse_args([*sizes, f"--work-dir={tmp_path / 'mine'}", "--", "train"])
    assert not given.own_work_dir
    assert await run(given) == 0
    assert (tmp_path / "mine" / "hosts").exists()
