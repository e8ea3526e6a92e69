"""Does this checkout's `decide()` decide exactly what another checkout's does?

    .venv/bin/python bench/decide_compare.py --before /path/to/old/checkout [--seeds 8]

For a speed-up that must change no decision: builds seeded synthetic snapshots
(bench/decide_scale.py's generator at small sizes, with and without quotas, some jobs
retried away from nodes or waiting long), runs every order under both preemption
plugins, with and without the starvation guard and a locality back-off, with every
`Wait` and without (`waits=False`, as the simulator decides), in this checkout and in
`--before` (a subprocess whose import path starts there), and compares a digest of every
action and the wake time. An action is digested by its kind, job, GPUs, band and the text
of its reason, not by its repr: a change to what an action holds then compares by what
it decides and says. Prints the cases that differ; exits 1 if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _digests(seeds: int) -> dict[str, str]:
    """In whichever checkout is first on the import path: a digest per case."""
    from bench.decide_scale import NOW, Size, build_snapshot
    from brain.core import ClusterSnapshot, Policy, decide
    from brain.core.ordering import ORDERINGS

    shapes = (Size("s", 24, 90, 160), Size("m", 96, 380, 900), Size("l", 224, 880, 2000))
    digests: dict[str, str] = {}
    for seed in range(seeds):
        for shape in shapes:
            base = build_snapshot(shape, seed=seed)
            pending = list(base.pending)
            # A few retried jobs avoiding a node, and some that waited long.
            for i in range(0, len(pending), 37):
                pending[i] = replace(pending[i], avoid_nodes=frozenset({f"n{i % shape.nodes}"}))
            for i in range(5, len(pending), 11):
                pending[i] = replace(pending[i], pending_since=NOW - 20_000.0 - i)
            snapshots: dict[str, ClusterSnapshot] = {
                "quotas": replace(base, pending=tuple(pending)),
                "no-quotas": replace(base, pending=tuple(pending), queues=()),
            }
            for label, snapshot in snapshots.items():
                for order in ORDERINGS:
                    for preemption in ("by-rank", "quota-only"):
                        for guard in (None, 9_000.0):
                            policy = Policy(
                                order=order,
                                preemption=preemption,
                                starvation_guard_s=guard,
                                relax_locality_after_s=600.0 if guard else 0.0,
                            )
                            # With every `Wait`, and without (the simulator's cycles).
                            for waits in (True, False):
                                decisions = decide(snapshot, NOW, policy, waits=waits)
                                text = repr(
                                    ([_said(a) for a in decisions.actions], decisions.wake_at)
                                )
                                case = (
                                    f"{seed}/{shape.label}/{label}/{order}/{preemption}/"
                                    f"{guard}/{'waits' if waits else 'no-waits'}"
                                )
                                digests[case] = hashlib.sha256(text.encode()).hexdigest()
    return digests


def _said(action: object) -> tuple[object, ...]:
    """What an action decides and says, whatever its class holds beside: its kind, job,
    GPUs (and those it takes), band and the text of its reason."""
    fields = ("job_id", "grants", "takes", "level", "since", "reason")
    return (type(action).__name__, *(getattr(action, name, None) for name in fields))


def _run(root: Path, seeds: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(REPO)!r}); "
        "import json, runpy; "
        f"m = runpy.run_path({str(Path(__file__).resolve())!r}); "
        f"print(json.dumps(m['_digests']({seeds})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    result: dict[str, str] = json.loads(out.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args(argv)
    before = _run(args.before.resolve(), args.seeds)
    after = _run(REPO, args.seeds)
    differ = sorted(case for case in after if before.get(case) != after[case])
    for case in differ:
        print(f"differs: {case}")
    print(f"{len(after)} cases, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
