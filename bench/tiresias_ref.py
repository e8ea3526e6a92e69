"""Run Tiresias' own simulator (a checkout the user provides) on a trace, for a side
by side comparison in the same run (`bench/policies.py --tiresias-dir DIR`).

Its code is not part of this project: `DIR` is a checkout of SymbioticLab/Tiresias
(the repository, or its `simulator/` folder). It was written for Python 2; it runs
under Python 3 with the adaptations ../shared/data/README.md lists for the reference
numbers, applied here at run time to a private copy (the checkout is not changed):

- `sys.maxint` reads as `sys.maxsize` (every module);
- Python 2's integer division is kept where `run_sim.py` divides integers: the next
  band crossing, `ceil((limit - executed_time) / num_gpu)` (three places), and the
  Gittins index's expected service, `e_sum / (num - idx)` (one place).

A checkout where any of those is not found is refused, naming what is missing: the
copy would not be the simulator the reference numbers came from.

It is run as `run_sim.py --scheme=count --schedule=S` with a cluster spec file of one
switch of `nodes` nodes, in its own folder (it reads `yarn-gput1000.csv` from the
working directory), with its output discarded; its average JCT is read back from the
`job.csv` it writes, and its CPU time is that of the child process (user + system).
"""

from __future__ import annotations

import csv
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# (pattern, replacement, how many times at least it must be found in run_sim.py). The
# band crossing is in `dlas_sim_jobs` (the one `dlas-gpu` and `dlas-gpu-gittins` run),
# `multi_dlas_sim_jobs` and `dlas_pack_sim_jobs`: every one found is kept.
_DIVISIONS: tuple[tuple[str, str, int], ...] = (
    (
        r"math\.ceil\(\((\w+)\.queue_limit\[qid\] - rjob\['executed_time'\]\)/rjob\['num_gpu'\]\)",
        r"math.ceil((\1.queue_limit[qid] - rjob['executed_time'])//rjob['num_gpu'])",
        1,
    ),
    (
        r"e = round\(e_sum / \(job_data\['num'\] - idx\), 5\)",
        r"e = round(e_sum // (job_data['num'] - idx), 5)",
        1,
    ),
)


class TiresiasCheckoutError(RuntimeError):
    """The directory is not a Tiresias simulator checkout this bench can adapt."""


@dataclass(frozen=True)
class TiresiasRun:
    schedule: str
    avg_jct: float
    jobs: int
    cpu_s: float

    @property
    def jobs_per_cpu_s(self) -> float:
        return self.jobs / self.cpu_s if self.cpu_s > 0 else float("inf")


def simulator_dir(checkout: Path) -> Path:
    """The folder holding `run_sim.py`: the checkout itself or its `simulator/`."""
    for candidate in (checkout, checkout / "simulator"):
        if (candidate / "run_sim.py").is_file():
            return candidate
    raise TiresiasCheckoutError(
        f"--tiresias-dir {checkout}: no run_sim.py there or in its simulator/ folder"
    )


def adapt(source: Path, into: Path) -> Path:
    """Copy the simulator's folder to `into` with the Python 3 adaptations applied."""
    shutil.copytree(source, into, ignore=shutil.ignore_patterns("result-*", "*.pyc"))
    for module in into.glob("*.py"):
        text = module.read_text()
        patched = text.replace("sys.maxint", "sys.maxsize")
        if module.name == "run_sim.py":
            for pattern, replacement, count in _DIVISIONS:
                patched, found = re.subn(pattern, replacement, patched)
                if found < count:
                    raise TiresiasCheckoutError(
                        f"--tiresias-dir {source}: run_sim.py has {found} of the {count} or more "
                        f"integer divisions `{pattern}` to keep; not the simulator of "
                        "commit 959f9b0 the reference numbers came from"
                    )
        if patched != text:
            module.write_text(patched)
    return into


def run(checkout: Path, trace: Path, nodes: int, gpus_per_node: int, schedule: str) -> TiresiasRun:
    """Replay `trace` on `nodes` x `gpus_per_node` under Tiresias' `schedule`."""
    source = simulator_dir(checkout)
    with tempfile.TemporaryDirectory(prefix="tiresias-") as scratch:
        work = adapt(source, Path(scratch) / "simulator")
        spec = work / "alnair_cluster.csv"
        spec.write_text(
            "num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n"
            f"1,{nodes},{gpus_per_node},64,256\n"
        )
        log = Path(scratch) / "log"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [
                sys.executable,
                "run_sim.py",
                f"--cluster_spec={spec.name}",
                "--print=False",
                "--scheme=count",
                f"--trace_file={trace.resolve()}",
                f"--schedule={schedule}",
                f"--log_path={log}",
            ],
            cwd=work,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-5:]
            raise TiresiasCheckoutError(
                f"Tiresias' run_sim.py --schedule={schedule} on {trace.name} failed "
                f"(exit {done.returncode}): " + " | ".join(tail)
            )
        with open(log / "job.csv", newline="") as handle:
            jcts = [float(row["JCT"]) for row in csv.DictReader(handle)]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if not jcts:
        raise TiresiasCheckoutError(f"Tiresias' {schedule} on {trace.name} finished no job")
    return TiresiasRun(schedule, sum(jcts) / len(jcts), len(jcts), cpu)
