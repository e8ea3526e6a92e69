"""workloads/hvdrun.py's fix to Horovod's elastic driver: a worker's exit from before
its host left the job is not taken for its successor's. Horovod's own driver class,
given the state its rank assignment reads; the workers are stand-ins that end when told."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from workloads import hvdrun

driver_module = pytest.importorskip("horovod.runner.elastic.driver")
discovery = pytest.importorskip("horovod.runner.elastic.discovery")


class Workers:
    """Started workers, each running until `end` gives its exit code."""

    def __init__(self) -> None:
        self.exits: dict[tuple[str, int], list[Any]] = {}
        self.started: list[tuple[str, int]] = []

    def create(self, slot_info: Any, events: list[threading.Event]) -> tuple[int, float]:
        key = (slot_info.hostname, slot_info.local_rank)
        outcome: list[Any] = [threading.Event()]
        self.exits.setdefault(key, []).append(outcome)
        self.started.append(key)
        outcome[0].wait(30)
        return outcome[1], 0.0

    def end(self, host: str, slot: int, generation: int, code: int) -> None:
        outcome = self.exits[(host, slot)][generation]
        outcome.append(code)
        outcome[0].set()


def driver(workers: Workers) -> tuple[Any, list[tuple[str, int, int]]]:
    hvdrun.install_removal_fence()
    handled: list[tuple[str, int, int]] = []
    d = driver_module.ElasticDriver.__new__(driver_module.ElasticDriver)
    d._host_assignments, d._min_num_proc, d._max_num_proc = {}, 1, 4
    d._rendezvous = SimpleNamespace(init=lambda assignments: None)
    d._create_worker_fn = workers.create
    d._shutdown = threading.Event()
    d._host_manager = SimpleNamespace(
        get_host_event=lambda host: threading.Event(), is_blacklisted=lambda host: False
    )
    d._results = driver_module.ResultsRecorder()
    d._handle_worker_exit = lambda slot, code, ts: handled.append(
        (slot.hostname, slot.local_rank, code)
    )
    return d, handled


def assign(d: Any, **slots: int) -> None:
    hosts = discovery.DiscoveredHosts(host_slots=slots, host_assignment_order=list(slots))
    d._start_worker_processes(d._update_host_assignments(hosts))


def test_an_exit_from_before_the_host_left_is_not_its_successor_s() -> None:
    workers = Workers()
    d, handled = driver(workers)
    assign(d, n1=2, n2=2)  # 4 workers
    assign(d, n1=2)  # a shrink: n2's workers abort, their exits not yet heard
    assign(d, n1=2, n2=1)  # a grow back onto n2 before they are
    assert workers.started.count(("n2", 0)) == 2
    # Horovod's own check (the host has a rank) would let the old worker's exit count.
    assert d.has_rank_assignment("n2", 0)

    workers.end("n2", 0, 0, 134)  # the removed worker's abort, heard late
    workers.end("n2", 1, 0, 134)
    workers.end("n2", 0, 1, 0)  # its successor's exit
    workers.end("n1", 0, 0, 0)
    workers.end("n1", 1, 0, 0)
    d._results.get_results()  # every worker's thread has run its exit
    assert sorted(handled) == [("n1", 0, 0), ("n1", 1, 0), ("n2", 0, 0)]
    assert hvdrun.removals(d) == {("n2", 0): 1, ("n2", 1): 1}


def test_an_exit_from_before_its_slot_left_is_not_its_successor_s() -> None:
    """A shrink by one worker on a node that stays, and a grow back onto it."""
    workers = Workers()
    d, handled = driver(workers)
    assign(d, n1=2, n2=2)
    assign(d, n1=2, n2=1)  # n2[1] retires
    assign(d, n1=2, n2=2)  # a new n2[1] starts before the old one's exit is heard
    assert workers.started.count(("n2", 1)) == 2 and d.has_rank_assignment("n2", 1)

    workers.end("n2", 1, 0, 134)
    for host, slot, generation in (("n1", 0, 0), ("n1", 1, 0), ("n2", 0, 0), ("n2", 1, 1)):
        workers.end(host, slot, generation, 0)
    d._results.get_results()
    assert sorted(handled) == [("n1", 0, 0), ("n1", 1, 0), ("n2", 0, 0), ("n2", 1, 0)]


def test_the_fence_is_installed_once() -> None:
    hvdrun.install_removal_fence()
    start = driver_module.ElasticDriver._start_worker_process
    hvdrun.install_removal_fence()
    assert driver_module.ElasticDriver._start_worker_process is start


def test_new_hosts_are_ranked_in_the_order_the_discovery_script_lists_them(
    tmp_path: Any,
) -> None:
    """Rank 0 (the coordinator, the only worker told that hosts changed) starts on the
    first host listed, the supervisor's; hosts already known keep their order."""
    hvdrun.install_host_order()
    listed = [f"host-{i:02d}" for i in range(24)]  # a set of these is in another order
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in listed))
    script.chmod(0o755)
    manager = discovery.HostManager(discovery.HostDiscoveryScript(str(script), 1))

    manager.update_available_hosts()
    assert manager.current_hosts.host_assignment_order == listed

    # A host listed first later is new, so it goes after those already ranked.
    script.write_text("#!/bin/sh\necho late:1\n" + "".join(f"echo {h}:1\n" for h in listed))
    manager.update_available_hosts()
    assert manager.current_hosts.host_assignment_order == [*listed, "late"]
