"""The brain's side of elastic jobs: how one is launched (under its supervisor).

It owns the translation of an elastic JobSpec into the command the agent runs: the
user's training command wrapped by `workloads.supervisor`, which starts horovodrun in
elastic mode and obeys Resize commands on `alnair.job.<job>.cmd`. The supervisor reads
the job id, node and NATS URL from the environment the agent sets (ALNAIR_*), so
nothing here needs the live state. It must not import torch or horovod.

Not built yet (see docs/elastic.md): staging a Resize decision, committing it on the
supervisor's ResizeCompleted, and the elasticity policy stage.
"""

from __future__ import annotations

import sys

from schemas.jobs import JobSpec


def launch_command(spec: JobSpec, granted_gpus: int | None = None) -> tuple[str, ...]:
    """The command an agent runs for `spec`: its own for a rigid job, else supervised.

    `granted_gpus` is the size the job starts at (what placement granted); it defaults
    to the spec's `gpus`.
    """
    if not spec.elastic:
        return spec.command
    low, high = spec.gpu_range
    start = spec.gpus if granted_gpus is None else granted_gpus
    start = min(max(start, low), high)
    return (
        sys.executable,
        "-m",
        "workloads.supervisor",
        f"--min-np={low}",
        f"--max-np={high}",
        f"--np={start}",
        "--",
        *spec.command,
    )
