"""horovodrun, with the workers of other nodes started through Alnair.

    python -m workloads.hvdrun <horovodrun's arguments>

Horovod's elastic driver starts every worker itself; for a host that is not local it
runs `ssh <host> <command>` (`horovod.runner.gloo_run.get_remote_command`). This runs
horovodrun's own command line with that one function replaced: the command goes to the
job's worker host on that node through `workloads.remote_exec` (NATS), so no ssh keys
between nodes are needed and the worker runs as part of the job on that node's agent.
Variables that name this node's resources (its GPU directory, its progress address)
are not exported to remote workers: their worker host sets its own.

One fix to the elastic driver (`install_removal_fence`). A worker whose slot (host and
local rank) leaves the job (a shrink) ends with an error: its rendezvous says it has been
removed, and it aborts (exit 134). The driver ignores that exit only while the slot has
no rank. A remote worker's exit reaches horovodrun a poll or two late; if the slot has
been given a rank again by then (a grow back onto the node), the old worker's exit is
taken for its successor's: recorded as a failure of that slot, reported at the job's end
as the process that made the job fail, and grounds for blacklisting the host. So each
worker remembers how many times its slot had been removed when it started, and an exit
from before a removal is dropped, as the driver drops it while the slot has no rank.

And one to its host discovery (`install_host_order`): the driver ranks hosts it has
not seen before in the order of a `set`, which is random per process, so the first
worker (rank 0, the coordinator) started on another node about half of the time. The
driver tells only the coordinator that hosts changed; when the coordinator's host is
the one lost, the driver blocks on reaching it (holding the lock that re-forming the
job needs) for longer than a resize may take. New hosts are ranked in the order the
discovery script lists them instead, and the supervisor lists its own node first: rank
0 runs where the supervisor does, whose loss ends the job anyway.

Written against Horovod 0.28.1 (pinned by infra/build_horovod.sh); the supervisor runs
every job through it: a grow may add a node at any time.
"""

from __future__ import annotations

import logging
import shlex
import sys
import threading
from collections import Counter
from typing import Any, Final

from schemas.jobs import LAUNCH_ID_ENV
from schemas.workers import EXEC_SECRET_ENV
from workloads.devices import GPU_DIR_ENV
from workloads.progress import PROGRESS_ADDR_ENV
from workloads.remote_exec import LOST_NODES_ENV

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
    # The supervisor's file, for its remote_exec processes alone.
    LOST_NODES_ENV,
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


def removals(driver: Any) -> Counter[tuple[str, int]]:
    """How many times each slot (host, local rank) has left the driver's rank
    assignments."""
    counts: Counter[tuple[str, int]] | None = getattr(driver, "_alnair_removals", None)
    if counts is None:
        counts = driver._alnair_removals = Counter()
    return counts


def install_removal_fence() -> None:
    """Drop the exit of a worker whose slot left the job after it started (see the
    module's docstring). Replaces `ElasticDriver._start_worker_process` with Horovod
    0.28.1's own, plus that check, and counts removals where the driver reassigns
    ranks (`_update_host_assignments`)."""
    from horovod.runner.elastic.driver import ElasticDriver

    if getattr(ElasticDriver, "_alnair_fenced", False):
        return
    reassign = ElasticDriver._update_host_assignments

    def slots(assignments: Any) -> set[tuple[str, int]]:
        return {(host, slot.local_rank) for host, ranks in assignments.items() for slot in ranks}

    def update_host_assignments(self: Any, current_hosts: Any) -> Any:
        before = slots(self._host_assignments)
        pending = reassign(self, current_hosts)
        removals(self).update(before - slots(self._host_assignments))
        return pending

    def start_worker_process(self: Any, slot_info: Any) -> None:
        create_worker_fn = self._create_worker_fn
        shutdown_event = self._shutdown
        host_event = self._host_manager.get_host_event(slot_info.hostname)
        counts = removals(self)
        slot = (slot_info.hostname, slot_info.local_rank)
        removed_before = counts[slot]

        def run_worker() -> None:
            exit_code, timestamp = create_worker_fn(slot_info, [shutdown_event, host_event])
            if counts[slot] != removed_before:
                logging.info(
                    "%s[%d] ended (%s) after its slot left the job; ignoring its exit",
                    slot_info.hostname,
                    slot_info.local_rank,
                    exit_code,
                )
                return
            self._handle_worker_exit(slot_info, exit_code, timestamp)

        thread = threading.Thread(target=run_worker)
        thread.daemon = True
        thread.start()
        self._results.expect(thread)

    ElasticDriver._update_host_assignments = update_host_assignments
    ElasticDriver._start_worker_process = start_worker_process
    ElasticDriver._alnair_fenced = True


_discovered = threading.local()


def install_host_order() -> None:
    """Rank hosts new to the driver in the order its discovery script lists them (see
    the module's docstring); hosts it knows keep their order, as Horovod's contract
    has it. Wraps `HostDiscoveryScript._execute_discovery_script` (which notes the
    order of its output's lines, in the discovery's thread: Horovod parses them through
    a `set` too) and replaces `HostManager.order_available_hosts`."""
    from horovod.runner.elastic.discovery import HostDiscoveryScript, HostManager

    if getattr(HostManager, "_alnair_ordered", False):
        return
    execute = HostDiscoveryScript._execute_discovery_script

    def execute_discovery_script(self: Any) -> str:
        output: str = execute(self)
        lines = (line.partition(":")[0] for line in output.strip().split("\n"))
        _discovered.order = list(dict.fromkeys(host for host in lines if host))
        return output

    def order_available_hosts(available: Any, previous: list[str]) -> list[str]:
        listed = {host: i for i, host in enumerate(getattr(_discovered, "order", ()))}
        known = [host for host in previous if host in available]
        new = sorted(set(available) - set(known), key=lambda h: (listed.get(h, len(listed)), h))
        return known + new

    HostDiscoveryScript._execute_discovery_script = execute_discovery_script
    HostManager.order_available_hosts = staticmethod(order_available_hosts)
    HostManager._alnair_ordered = True


def install() -> None:
    from horovod.runner import gloo_run
    from horovod.runner.common.util import env as env_util

    gloo_run.get_remote_command = remote_command
    env_util.IGNORE_REGEXES.update(NODE_LOCAL_VARIABLES)
    install_removal_fence()
    install_host_order()


def main() -> None:
    install()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"
    run_commandline()


if __name__ == "__main__":
    main()
