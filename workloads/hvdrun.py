"""horovodrun, with the workers of other nodes started through Alnair.

    python -m workloads.hvdrun <horovodrun's arguments>

Horovod's elastic driver starts every worker itself; for a host that is not local it
runs `ssh <host> <command>` (`horovod.runner.gloo_run.get_remote_command`). This runs
horovodrun's own command line with that one function replaced: the command goes to the
job's worker host on that node through `workloads.remote_exec` (NATS), so no ssh keys
between nodes are needed and the worker runs as part of the job on that node's agent.
Variables that name this node's resources (its GPU directory, its progress address)
are not exported to remote workers: their worker host sets its own.

Written against Horovod 0.28.1 (pinned by infra/build_horovod.sh); the supervisor runs
every job through it: a grow may add a node at any time.
"""

from __future__ import annotations

import shlex
import sys
from typing import Final

from schemas.jobs import LAUNCH_ID_ENV
from schemas.workers import EXEC_SECRET_ENV
from workloads.devices import GPU_DIR_ENV
from workloads.progress import PROGRESS_ADDR_ENV

# Set by the worker host for its own node, not inherited from the supervisor's.
NODE_LOCAL_VARIABLES: Final = (
    GPU_DIR_ENV,
    PROGRESS_ADDR_ENV,
    "ALNAIR_NODE",
    "ALNAIR_NODE_RANK",
    # Names the launch on this node whose processes they are (agents/processes.py).
    LAUNCH_ID_ENV,
    # Never in a command line: it would travel in every ExecRequest.
    EXEC_SECRET_ENV,
)


def remote_command(
    local_command: str,
    host: str,
    port: int | None = None,
    identity_file: str | None = None,
    timeout_s: int | None = None,
) -> str:
    """What horovodrun runs for a worker on `host`: `local_command` is already quoted
    as one shell word."""
    runner = f"{shlex.quote(sys.executable)} -m workloads.remote_exec"
    return f"{runner} --host {shlex.quote(host)} -- {local_command}"


def install() -> None:
    from horovod.runner import gloo_run
    from horovod.runner.common.util import env as env_util

    gloo_run.get_remote_command = remote_command
    env_util.IGNORE_REGEXES.update(NODE_LOCAL_VARIABLES)


def main() -> None:
    install()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"
    run_commandline()


if __name__ == "__main__":
    main()
