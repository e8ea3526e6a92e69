"""A ledger kept from one cycle to the next (brain/core/placement.py, `KeptLedger`)
reads as one built afresh; that it decides alike, beside a kept ranking, is in
tests/test_policy_ranking.py."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import Grant, KeptLedger, NodeView
from brain.core.placement import FreeGpus


def _observed(ledger: FreeGpus) -> tuple[object, ...]:
    """What a cycle can read of a ledger: free GPUs per node, totals, and every answer
    placement asks of it."""
    most = ledger.most_free()
    return (
        {name: ledger.lowest(name, ledger.free_on(name)) for name in ledger.nodes()},
        ledger.total_free(),
        ledger.total_capacity(),
        ledger.largest_node(),
        most,
        [ledger.best_fit(k) for k in range(1, 10)],
        [ledger.gather(k) for k in (1, 3, 8, 12, 20)],
        [ledger.fewest_nodes_in_a_switch(k) for k in (1, 3, 8, 12, 20)],
        # Every free GPU, gathered: each node with some, roomiest first.
        ledger.gather(ledger.total_free()) if ledger.total_free() else (),
    )


def _nodes(rng: random.Random, count: int) -> tuple[NodeView, ...]:
    return tuple(
        NodeView(
            f"n{i:02d}",
            tuple(range(4)),
            frozenset(g for g in range(4) if rng.random() < 0.6),
            switch=f"s{i // 3}",
        )
        for i in range(count)
    )


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cycles=st.integers(1, 8))
def test_a_kept_ledger_reads_as_one_built_afresh(seed: int, cycles: int) -> None:
    rng = random.Random(seed)
    kept = KeptLedger()
    nodes = _nodes(rng, rng.randint(1, 9))
    for _ in range(cycles):
        ledger = kept.for_nodes(nodes)
        assert _observed(ledger) == _observed(FreeGpus(nodes))
        # The cycle takes and gives as it decides.
        for _ in range(rng.randint(0, 6)):
            name = rng.choice(ledger.nodes())
            have = ledger.free_on(name)
            if rng.random() < 0.6 and have:
                ledger.take((Grant(name, ledger.lowest(name, rng.randint(1, have))),))
            else:
                ledger.give((Grant(name, (rng.randrange(4),)),))
        if rng.random() < 0.9:
            kept.done()  # else it ended by an error: the next is built anew
        # The next pass: some nodes' views rebuilt (same or other free GPUs), rarely a
        # node added or its GPUs changed.
        listed = list(nodes)
        for _ in range(rng.randint(0, 3)):
            at = rng.randrange(len(listed))
            free = frozenset(g for g in range(4) if rng.random() < 0.5)
            listed[at] = replace(listed[at], free=free if rng.random() < 0.7 else listed[at].free)
        if rng.random() < 0.1:
            listed.append(NodeView(f"n{len(listed):02d}", (0, 1), frozenset({0, 1}), switch="s9"))
        if rng.random() < 0.1:
            at = rng.randrange(len(listed))
            listed[at] = replace(listed[at], gpus=(0, 1, 2), free=frozenset({1}))
        nodes = tuple(listed)
    assert kept.built + kept.reused == cycles
