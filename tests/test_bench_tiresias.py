"""bench/tiresias_ref.py: running a user-provided Tiresias simulator checkout.

Tiresias' code is not part of this project, so these tests run the harness on a
stand-in `run_sim.py` written here: one that needs exactly the adaptations the harness
makes (it fails under Python 3 without them), takes Tiresias' flags and writes a
`job.csv` as Tiresias' log does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiresias_ref import TiresiasCheckoutError, adapt, run, simulator_dir

# The shapes of what commit 959f9b0's run_sim.py holds where the adaptations apply.
STAND_IN = """
import argparse, csv, math, os, sys

start = sys.maxint
parser = argparse.ArgumentParser()
for flag in ("cluster_spec", "print", "scheme", "trace_file", "schedule", "log_path"):
    parser.add_argument("--" + flag)
FLAGS = parser.parse_args()

def jump(JOBS, rjob, qid, event_time, gjob):
    a = int(math.ceil((JOBS.queue_limit[qid] - rjob['executed_time'])/rjob['num_gpu']) + event_time)
    b = int(math.ceil((gjob.queue_limit[qid] - rjob['executed_time'])/rjob['num_gpu']) + event_time)
    c = int(math.ceil((JOBS.queue_limit[qid] - rjob['executed_time'])/rjob['num_gpu']) + event_time)
    return a, b, c

def index(e_sum, job_data, idx):
    e = round(e_sum / (job_data['num'] - idx), 5)
    return e

class Q:
    queue_limit = [3251]

assert jump(Q, {'executed_time': 0, 'num_gpu': 2}, 0, 0, Q) == (1625, 1625, 1625)
assert index(7, {'num': 3}, 1) == 3
assert os.path.exists("yarn-gput1000.csv"), "Tiresias reads its distribution from its folder"
os.makedirs(FLAGS.log_path)
with open(FLAGS.trace_file) as trace, open(os.path.join(FLAGS.log_path, "job.csv"), "w") as out:
    out.write("time,job_id,JCT\\n")
    for row in csv.DictReader(trace):
        jct = int(row["duration"]) * (2 if FLAGS.schedule == "fifo" else 1)
        out.write("0,%s,%d\\n" % (row["job_id"], jct))
"""


def checkout(tmp_path: Path, source: str = STAND_IN) -> Path:
    simulator = tmp_path / "Tiresias" / "simulator"
    simulator.mkdir(parents=True)
    (simulator / "run_sim.py").write_text(source)
    (simulator / "jobs.py").write_text("import sys\nRANK = sys.maxint\n")
    (simulator / "yarn-gput1000.csv").write_text("duration\n10\n")
    return simulator.parent


def test_runs_the_adapted_copy_and_reads_its_jobs(tmp_path: Path) -> None:
    repo = checkout(tmp_path)
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,num_gpu,submit_time,duration\n0,1,0,100\n1,2,5,300\n")
    result = run(repo, trace, 12, 4, "dlas-gpu")
    assert (result.schedule, result.avg_jct, result.jobs) == ("dlas-gpu", 200.0, 2)
    assert result.cpu_s > 0
    assert run(repo, trace, 12, 4, "fifo").avg_jct == 400.0
    # The checkout itself is left as it was.
    assert "sys.maxint" in (repo / "simulator" / "jobs.py").read_text()


def test_the_adaptations(tmp_path: Path) -> None:
    copy = adapt(simulator_dir(checkout(tmp_path)), tmp_path / "copy")
    text = (copy / "run_sim.py").read_text()
    assert "sys.maxint" not in text and "sys.maxsize" in text
    assert text.count(")//rjob['num_gpu'])") == 3
    assert "e_sum // (job_data['num'] - idx)" in text
    assert (copy / "jobs.py").read_text() == "import sys\nRANK = sys.maxsize\n"


def test_a_checkout_it_cannot_adapt_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TiresiasCheckoutError, match=r"no run_sim\.py"):
        simulator_dir(tmp_path)
    changed = STAND_IN.replace("e_sum / (job_data", "e_sum * 1.0 / (job_data")
    repo = checkout(tmp_path, changed)
    with pytest.raises(TiresiasCheckoutError, match="0 of the 1 or more integer divisions"):
        adapt(simulator_dir(repo), tmp_path / "copy")


def test_a_failing_run_says_why(tmp_path: Path) -> None:
    repo = checkout(tmp_path, STAND_IN.replace("start = sys.maxint", "raise SystemExit('no')"))
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,num_gpu,submit_time,duration\n0,1,0,100\n")
    with pytest.raises(TiresiasCheckoutError, match=r"dlas-gpu on trace.csv failed \(exit 1\)"):
        run(repo, trace, 1, 4, "dlas-gpu")
