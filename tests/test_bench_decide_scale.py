"""bench/decide_scale.py's raw baseline (`bare_decide`) does the work it is timed for: a
baseline that granted a GPU twice, or placed nothing, would flatter nothing honestly."""

from __future__ import annotations

import pytest

from bench.decide_scale import ORDERS, Size, bare_decide, build_snapshot


@pytest.mark.parametrize("order", ORDERS)
def test_the_bare_baseline_grants_free_gpus_once_each(order: str) -> None:
    snapshot = build_snapshot(Size("s", 40, 150, 300))
    placements, preempted = bare_decide(snapshot, order)
    running = {job.job_id: job for job in snapshot.running}
    pending = {job.job_id: job for job in snapshot.pending}
    assert set(preempted) <= running.keys()
    free = {(node.name, gpu) for node in snapshot.nodes for gpu in node.free}
    for job_id in preempted:
        free |= {(g.node, gpu) for g in running[job_id].grants for gpu in g.gpus}
    taken: list[tuple[str, int]] = []
    for job_id, grants in placements:
        gpus = [(g.node, gpu) for g in grants for gpu in g.gpus]
        assert len(gpus) == pending[job_id].gpus
        taken += gpus
    assert len(taken) == len(set(taken)) and set(taken) <= free
    assert placements, "a nearly full cluster with new jobs: some are placed"
    if order == "fifo":
        assert not preempted  # fifo preempts no one, as Alnair's
    else:
        assert preempted  # new jobs outrank long-running ones
