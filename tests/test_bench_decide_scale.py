"""bench/decide_scale.py's raw baseline (`bare_decide`) does the work it is timed for: a
baseline that granted a GPU twice, or placed nothing, would flatter nothing honestly. Its
stage timer (`stages`) times every stage and leaves the core as it found it."""

from __future__ import annotations

import importlib

import pytest

from bench.decide_scale import ORDERS, STAGES, Size, bare_decide, build_snapshot, stages


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


def test_the_stages_add_up_and_are_put_back() -> None:
    core = importlib.import_module("brain.core.decide")
    before = {name: getattr(core, name) for name, _ in STAGES}
    orderings = dict(core.ORDERINGS)
    rows = stages("gittins", Size("s", 40, 150, 300), repeat=2)
    timed = dict(rows)
    assert rows[0][0] == "the order's ranks"
    assert {what for _, what in STAGES} <= timed.keys()
    # The stages are within the whole (the mean of two, each run's within its own).
    within = sum(seconds for what, seconds in rows if what not in ("the rest", "decide"))
    assert within <= timed["decide"] + 1e-6
    assert {name: getattr(core, name) for name, _ in STAGES} == before
    put_back = dict(core.ORDERINGS)
    assert put_back == orderings
