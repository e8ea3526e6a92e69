"""Alnair on a machine with real NVIDIA GPUs: what only a GPU can show. Not a test.

    python bench/gpu_check.py --out DIR [--secure] [--python /path/to/python-with-cuda-torch]
        (as root, on a GPU machine, from the checkout)

It starts the one-machine cluster (`alnair up --fresh`: a nats-server, a brain, one agent
with `--gpus nvml`) under a private ALNAIR_HOME, and then, in order:

1. telemetry: the brain's `/metrics` (dcgm-exporter's names, from the agent's NVML
   samples) beside `nvidia-smi --query-gpu` read at the same moment, idle and under load;
2. a whole-GPU job (workloads/examples/gpu_probe.py): the environment the agent gave it,
   and the GPUs CUDA then shows it;
3. two half-GPU shares with a GPU memory limit each, at the same time: the MPS daemon the
   agent starts, each share's MPS environment, what `nvidia-smi` and NVML's per-process
   figures show, and whether CUDA refuses a share an allocation past its limit;
4. a share that takes memory until CUDA refuses it: what NVML then reports beside the
   limit the agent stops a share at;
5. one share with two CUDA processes (one out of the job's process group): MPS limits
   each, so the agent's sum over the job is what stops it;
6. co-location: a barely used `--shareable` job, a share placed beside it, then the host's
   memory grown on cue toward the GPU's: the share is moved off, with the cause;
7. an XID: a job writes to an unmapped address; the driver's XID as NVML's event stream
   gave it to the agent (its log, `/metrics` DCGM_FI_DEV_XID_ERRORS), the kernel's log,
   what the brain did with it (an application XID drains nothing), and how the job's
   failure was classified.

`--secure` runs the cluster as `alnair up --secure` does: each job as its tenant's user in
its own cgroup, with only its GPUs' device files open to it. `--python` is the
interpreter the probe jobs run: it needs a CUDA build of torch (and CuPy for the XID).

Writes DIR/gpu_check.json (every reading) and DIR/gpu_check.md (the tables), and the
cluster's log as DIR/up.log. Each step records what it saw, or the error that stopped
it, and the next step still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
PROBE_MODULE: Final = ("-m", "workloads.examples.gpu_probe")
SMI_FIELDS: Final = (
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "power.draw",
    "temperature.gpu",
    "clocks.sm",
    "clocks.mem",
)
# dcgm-exporter's name for each nvidia-smi field above.
DCGM_FOR: Final = {
    "utilization.gpu": "DCGM_FI_DEV_GPU_UTIL",
    "memory.used": "DCGM_FI_DEV_FB_USED",
    "memory.total": "DCGM_FI_DEV_FB_TOTAL",
    "power.draw": "DCGM_FI_DEV_POWER_USAGE",
    "temperature.gpu": "DCGM_FI_DEV_GPU_TEMP",
    "clocks.sm": "DCGM_FI_DEV_SM_CLOCK",
    "clocks.mem": "DCGM_FI_DEV_MEM_CLOCK",
}
TERMINAL: Final = {"SUCCEEDED", "FAILED", "CANCELLED"}


def sh(*argv: str, timeout: float = 30.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"({argv[0]}: {error})"
    return (done.stdout + done.stderr).strip()


class Cluster:
    """`alnair up` in the background, and the CLI and HTTP API pointed at it."""

    def __init__(self, home: Path, log_path: Path, gpus: str, *, secure: bool, python: str) -> None:
        self.home = home
        self.env = {
            **os.environ,
            "ALNAIR_HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        self.log_path = log_path
        self.secure = secure
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [
                *[sys.executable, "-m", "cli", "up", "--fresh", "--gpus", gpus],
                *(["--nodes", "1"] if gpus.startswith("sim:") else []),
                *(["--secure"] if secure else []),
                *["--http", "127.0.0.1:0"],
            ],
            cwd=ROOT,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.http = ""
        self.token = ""
        # The job that reports what it sees, run by the interpreter given.
        self.probe = (python, *PROBE_MODULE)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            found = re.search(r"HTTP API (http://\S+)", text)
            if "alnair up: ready" in text and found:
                self.http = found[1]
                tokens = json.loads((self.home / "http-tokens.json").read_text())["tokens"]
                self.token = next(t["token"] for t in tokens if t.get("operator"))
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"alnair up exited with {self.process.returncode}")
            time.sleep(0.5)
        raise TimeoutError("alnair up did not say it was ready")

    def cli(self, *argv: str, timeout: float = 60.0) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "cli", *argv],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"alnair {' '.join(argv)}: {done.stderr.strip() or done.stdout}")
        return done.stdout

    def submit(self, *argv: str) -> str:
        record = json.loads(self.cli("submit", "--json", *argv))
        return str(record["job_id"])

    def events(self, job_id: str) -> str:
        # The STATE log is the operator's to read on a secure cluster.
        operator = ("--nkey", str(self.home / "keys" / "operator-operator.nk"))
        return self.cli("events", "--job", job_id, *(operator if self.secure else ()))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(json.loads(self.cli("job", job_id, "--json")))

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.job(job_id)
            if record["state"] in states or time.monotonic() > deadline:
                return record
            time.sleep(0.5)

    def metrics(self) -> str:
        request = urllib.request.Request(
            f"{self.http}/metrics", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return str(reply.read().decode())

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()


def metric_values(text: str, name: str) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus page, by their label text."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            found[labels[len(name) :]] = float(value)
    return found


def smi_now() -> list[dict[str, str]]:
    out = sh(
        "nvidia-smi",
        f"--query-gpu=index,{','.join(SMI_FIELDS)}",
        "--format=csv,noheader,nounits",
    )
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(",")]
        rows.append(dict(zip(("index", *SMI_FIELDS), cells, strict=False)))
    return rows


def side_by_side(cluster: Cluster, label: str) -> list[dict[str, Any]]:
    """One reading of every field from the brain and from nvidia-smi, GPU by GPU."""
    page = cluster.metrics()
    smi = smi_now()
    rows = []
    for gpu in smi:
        for field in SMI_FIELDS:
            ours = {
                k: v
                for k, v in metric_values(page, DCGM_FOR[field]).items()
                if f'gpu="{gpu["index"]}"' in k
            }
            rows.append(
                {
                    "when": label,
                    "gpu": gpu["index"],
                    "field": field,
                    "nvidia-smi": gpu.get(field),
                    "alnair": next(iter(ours.values()), None),
                }
            )
    return rows


def logs(cluster: Cluster, job_id: str) -> str:
    try:
        return cluster.cli("logs", job_id)
    except RuntimeError as error:
        return f"(no log: {error})"


def probe_lines(text: str) -> list[dict[str, Any]]:
    seen = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict) and "env" in value:
                seen.append(value)
    return seen


def step_facts(_: Cluster) -> dict[str, Any]:
    return {
        "nvidia-smi -L": sh("nvidia-smi", "-L"),
        "driver": sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "kernel": sh("uname", "-r"),
        "cgroup": sh("stat", "-fc", "%T", "/sys/fs/cgroup"),
        "mps control": shutil.which("nvidia-cuda-mps-control") or "not on PATH",
        "python": sys.version.split()[0],
    }


def step_telemetry_idle(cluster: Cluster) -> dict[str, Any]:
    time.sleep(2.5)  # a sample or two after the agent joined
    nodes = json.loads(cluster.cli("nodes", "--json"))
    return {
        "inventory": [gpu for node in nodes for gpu in node["record"]["gpus"]],
        "backend": [node["record"]["backend"] for node in nodes],
        "readings": side_by_side(cluster, "idle"),
    }


def step_whole_gpu(cluster: Cluster) -> dict[str, Any]:
    job = cluster.submit("--gpus", "1", "--", *cluster.probe, "--seconds", "20", "--hold-gib", "8")
    started = cluster.wait_state(job, {"RUNNING", *TERMINAL}, 60)
    readings: list[dict[str, Any]] = []
    apps = ""
    if started["state"] == "RUNNING":
        time.sleep(10)  # torch's start, then a few seconds of load in the samples
        for _ in range(3):
            readings += side_by_side(cluster, "loaded")
            time.sleep(1.0)
        apps = sh("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv")
    final = cluster.wait_state(job, TERMINAL, 90)
    text = logs(cluster, job)
    return {
        "job": job,
        "state": final["state"],
        "record": final,
        "probe": probe_lines(text),
        "log": text[-3000:],
        "readings": readings,
        "compute apps (nvidia-smi)": apps,
    }


def step_shares(cluster: Cluster) -> dict[str, Any]:
    # Each holds 6 GiB under a 16 GiB limit, then asks for 24 GiB more.
    share = ("--gpus", "0.5", "--gpu-memory", "16GiB")
    load = ("--seconds", "25", "--hold-gib", "6", "--try-gib", "24")
    jobs = [
        cluster.submit(*share, "--name", f"share-{i}", "--", *cluster.probe, *load) for i in (1, 2)
    ]
    for job in jobs:
        cluster.wait_state(job, {"RUNNING", *TERMINAL}, 60)
    time.sleep(12)
    seen = {
        "nvidia-smi": sh("nvidia-smi"),
        "compute apps": sh(
            "nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"
        ),
        "mps processes": sh("pgrep", "-a", "nvidia-cuda-mps"),
        "alnair nodes": cluster.cli("nodes"),
        "alnair jobs": cluster.cli("jobs"),
        "share metrics": "\n".join(
            line for line in cluster.metrics().splitlines() if line.startswith("alnair_gpu_share")
        ),
    }
    finals = [cluster.wait_state(job, TERMINAL, 120) for job in jobs]
    texts = [logs(cluster, job) for job in jobs]
    return {
        "jobs": jobs,
        "states": [f["state"] for f in finals],
        "records": finals,
        "probes": [probe_lines(t) for t in texts],
        "logs": [t[-3000:] for t in texts],
        "while running": seen,
        "mps processes after": sh("pgrep", "-a", "nvidia-cuda-mps"),
    }


def share_metrics(cluster: Cluster) -> str:
    return "\n".join(
        line for line in cluster.metrics().splitlines() if line.startswith("alnair_gpu_share")
    )


def compute_apps() -> str:
    return sh("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv")


def wait_probe(cluster: Cluster, job: str, key: str, timeout_s: float) -> dict[str, Any]:
    """The probe's first report that holds `key` (empty if none came in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r for r in probe_lines(logs(cluster, job)) if key in r]
        if found:
            return found[0]
        if cluster.job(job)["state"] in TERMINAL:
            break
        time.sleep(0.5)
    return {}


def step_share_at_limit(cluster: Cluster) -> dict[str, Any]:
    # A share takes GPU memory until MPS refuses it: what NVML then reports of it beside
    # its limit, and whether the agent (which stops a share over its limit) agrees.
    job = cluster.submit(
        *("--gpus", "0.5", "--gpu-memory", "4GiB", "--name", "fill", "--"),
        *(*cluster.probe, "--fill", "--idle-s", "12"),
    )
    cluster.wait_state(job, {"RUNNING", *TERMINAL}, 60)
    filled = wait_probe(cluster, job, "fill", 90)
    time.sleep(4)  # samples of it full
    seen = {
        "compute apps": compute_apps(),
        "alnair nodes": cluster.cli("nodes"),
        "share metrics": share_metrics(cluster),
    }
    final = cluster.wait_state(job, TERMINAL, 60)
    return {
        "job": job,
        "state": final["state"],
        "reason": final["reason"],
        "record": final,
        "fill": filled.get("fill"),
        "while full": seen,
        "log": logs(cluster, job)[-3000:],
    }


def step_two_processes(cluster: Cluster) -> dict[str, Any]:
    # One 4 GiB share, two CUDA processes of 3 GiB each (the second in a session of its
    # own): MPS limits each process, so only the agent's sum over the job stops it.
    job = cluster.submit(
        *("--gpus", "0.5", "--gpu-memory", "4GiB", "--name", "two", "--"),
        *(*cluster.probe, "--children", "1", "--hold-gib", "3", "--idle-s", "40"),
    )
    cluster.wait_state(job, {"RUNNING", *TERMINAL}, 60)
    # Both on the GPU, if the agent has not stopped the job first.
    deadline = time.monotonic() + 60
    apps = compute_apps()
    while apps.count("python") < 2 and time.monotonic() < deadline:
        if cluster.job(job)["state"] in TERMINAL:
            break
        apps = compute_apps()
    final = cluster.wait_state(job, TERMINAL, 60)
    time.sleep(1)
    return {
        "job": job,
        "state": final["state"],
        "reason": final["reason"],
        "record": final,
        "compute apps": apps,
        "compute apps after": compute_apps(),
        "log": logs(cluster, job)[-3000:],
    }


def step_colocation(cluster: Cluster) -> dict[str, Any]:
    # A barely used whole-GPU job that opted in (--shareable) takes a share beside it;
    # then its memory grows toward the GPU's, and the brain moves the share off first.
    cue_dir = Path(tempfile.mkdtemp(prefix="alnair-gpu-check-cue-"))
    cue_dir.chmod(0o755)  # a confined job's user looks for the cue here
    cue = cue_dir / "grow"
    total = int(json.loads(cluster.cli("nodes", "--json"))[0]["record"]["gpus"][0]["memory_mib"])
    host = cluster.submit(
        *("--gpus", "1", "--shareable", "--name", "host", "--"),
        *(*cluster.probe, "--hold-gib", "1", "--idle-s", "150"),
        *("--grow-when", str(cue), "--grow-gib", str(round(0.93 * total / 1024 - 4, 1))),
    )
    guest = ""
    try:
        cluster.wait_state(host, {"RUNNING", *TERMINAL}, 60)
        wait_probe(cluster, host, "devices", 60)
        time.sleep(8)  # samples, then its profile: barely used
        profiled = json.loads(cluster.cli("job", host))["profile"]
        guest = cluster.submit(
            *("--gpus", "0.5", "--gpu-memory", "4GiB", "--name", "guest", "--"),
            *(*cluster.probe, "--hold-gib", "2", "--idle-s", "120"),
        )
        placed = cluster.wait_state(guest, {"RUNNING", *TERMINAL}, 60)
        wait_probe(cluster, guest, "devices", 60)
        time.sleep(3)
        beside = {
            "host profile then": profiled,
            "guest": {k: placed[k] for k in ("state", "grants", "reason")},
            "compute apps": compute_apps(),
            "alnair nodes": cluster.cli("nodes"),
            "alnair jobs": cluster.cli("jobs"),
        }
        cue.touch()
        grew = wait_probe(cluster, host, "grew", 30)
        deadline = time.monotonic() + 45
        moved = cluster.job(guest)
        while moved["state"] == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
            moved = cluster.job(guest)
        after = {
            "guest": {k: moved[k] for k in ("state", "attempt", "reason")},
            "host": cluster.job(host)["state"],
            "memory.used": sh("nvidia-smi", "--query-gpu=memory.used", "--format=csv"),
            "compute apps": compute_apps(),
            "events": cluster.events(guest),
        }
        return {
            "host": host,
            "guest": guest,
            "gpu memory mib": total,
            "host profile": json.loads(cluster.cli("job", host))["profile"],
            "beside": beside,
            "host grew": grew.get("grew"),
            "after": after,
            "host log": logs(cluster, host)[-2000:],
            "guest log": logs(cluster, guest)[-2000:],
        }
    finally:
        for job in filter(None, (host, guest)):
            with contextlib.suppress(RuntimeError):
                cluster.cli("cancel", job)
        shutil.rmtree(cue_dir, ignore_errors=True)


def step_xid(cluster: Cluster) -> dict[str, Any]:
    before = sh("dmesg")
    job = cluster.submit("--gpus", "1", "--name", "poke", "--", *cluster.probe, "--illegal-address")
    final = cluster.wait_state(job, TERMINAL, 90)
    time.sleep(3)  # the event's way from the watcher thread to the brain
    page = cluster.metrics()
    after = sh("dmesg")
    seen_before = set(before.splitlines())
    new_kernel_lines = [line for line in after.splitlines() if line not in seen_before]
    agent_lines = [
        line
        for line in cluster.log_path.read_text(errors="replace").splitlines()
        if re.search(r"xid|XID|fault|NVML", line)
    ]
    return {
        "job": job,
        "state": final["state"],
        "record": final,
        "log": logs(cluster, job)[-3000:],
        "kernel log (new lines with Xid)": [ln for ln in new_kernel_lines if "Xid" in ln],
        "DCGM_FI_DEV_XID_ERRORS": metric_values(page, "DCGM_FI_DEV_XID_ERRORS"),
        "cluster log lines on faults": agent_lines[-20:],
        "nodes": json.loads(cluster.cli("nodes", "--json")),
    }


STEPS: Final[tuple[tuple[str, Callable[[Cluster], dict[str, Any]]], ...]] = (
    ("facts", step_facts),
    ("telemetry idle", step_telemetry_idle),
    ("whole GPU job", step_whole_gpu),
    ("two shares", step_shares),
    ("share at its limit", step_share_at_limit),
    ("two processes", step_two_processes),
    ("co-location", step_colocation),
    ("xid", step_xid),
)


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)\n"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def report(results: dict[str, Any]) -> str:
    parts = ["# gpu_check\n"]
    for name, result in results.items():
        parts.append(f"\n## {name}\n")
        if "readings" in result:
            parts.append(table(result["readings"]))
        rest = {k: v for k, v in result.items() if k not in ("readings", "record", "records")}
        parts.append("```\n" + json.dumps(rest, indent=1, default=str)[:12000] + "\n```\n")
    return "".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check"))
    p.add_argument(
        "--gpus", default="nvml", help="the agent's --gpus (sim:1xH100 to try the script)"
    )
    p.add_argument("--steps", nargs="*", default=[name for name, _ in STEPS])
    p.add_argument(
        "--python",
        default="python3",
        help="the interpreter the probe jobs run, with a CUDA build of torch (and CuPy for "
        "the XID): the virtual environment's torch is the CPU build (default: python3 "
        "from the jobs' PATH, which starts with this interpreter's directory)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="`alnair up --secure`: as root, each job runs as its tenant's user in its own "
        "cgroup, with only its GPUs' device files open to it",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="alnair-gpu-check-"))
    results: dict[str, Any] = {}
    cluster = Cluster(home, args.out / "up.log", args.gpus, secure=args.secure, python=args.python)
    try:
        cluster.wait_ready()
        for name, step in STEPS:
            if name not in args.steps:
                continue
            started = time.monotonic()
            try:
                results[name] = step(cluster)
            except Exception as error:  # a step that breaks must not hide the others
                results[name] = {"error": f"{type(error).__name__}: {error}"}
            results[name]["seconds"] = round(time.monotonic() - started, 1)
            print(f"gpu_check: {name}: {results[name]['seconds']} s", flush=True)
    finally:
        cluster.stop()
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "gpu_check.md").write_text(report(results))
        shutil.rmtree(home, ignore_errors=True)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
