"""The supervisor's device list through a refused grow, without Horovod: the workers of
its node claim GPUs from that list, so a grow refused without moving puts it back."""

from __future__ import annotations

from pathlib import Path

from schemas.jobs import NodeGpus
from workloads import devices
from workloads.supervisor import Supervisor, SupervisorConfig


async def test_a_grow_refused_for_another_node_puts_this_node_s_gpus_back(
    tmp_path: Path,
) -> None:
    config = SupervisorConfig(
        job_id="7",
        command=("train",),
        min_np=1,
        max_np=8,
        np=2,
        work_dir=tmp_path,
        node="a",
        gpus=(0, 1),
    )
    supervisor = Supervisor(config)  # no bus: node b's worker host cannot be reached
    supervisor._prepare()
    assert supervisor.devices == (0, 1)
    placement = (NodeGpus(node="a", gpus=(0, 1, 2)), NodeGpus(node="b", gpus=(4,)))
    outcome = await supervisor.resize(4, placement)
    assert not outcome.ok and outcome.to_size == outcome.from_size == 2
    assert "node b" in outcome.reason
    assert supervisor.devices == (0, 1)  # not (0, 1, 2): GPU 2 goes back to the brain
    assert devices.read_devices(supervisor.gpu_dir) == (0, 1)
