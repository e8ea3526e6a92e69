"""The command line of job confinement: `--tenant-users` for brains and agents, the
agent's confinement settings, and `alnair up --secure`'s users (one per tenant it knows).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Final

from schemas.errors import AlnairError
from schemas.tenants import TenantUser, render_tenant_map

if TYPE_CHECKING:
    from agents.confine import Confinement
    from bus.tls import JobIssuer

log = logging.getLogger(__name__)

USER_PREFIX: Final = "alnair-"
NOLOGIN: Final = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false")
MIN_CREDENTIAL_TTL_S: Final = 10.0


def add_tenant_users_arg(p: argparse.ArgumentParser, *, agent: bool) -> None:
    who = "runs each job as its tenant's user" if agent else "refuses tenants not listed"
    p.add_argument(
        "--tenant-users",
        metavar="FILE",
        default=os.environ.get("ALNAIR_TENANT_USERS") or None,
        help=f"the tenant map (YAML: tenants: {{NAME: {{user: U, group: G}}}}); with it the "
        f"{'agent' if agent else 'brain'} {who} (default: $ALNAIR_TENANT_USERS; see "
        "docs/security.md)",
    )


def add_brain_args(p: argparse.ArgumentParser) -> None:
    add_tenant_users_arg(p, agent=False)
    p.add_argument(
        "--callout-seed",
        metavar="FILE",
        default=os.environ.get("ALNAIR_CALLOUT_SEED") or None,
        help="the account seed (keys/callout-issuer.nk from `alnair keys`) this brain signs "
        "jobs' NATS users with, answering the server's auth callout while it leads; each "
        "job attempt then gets a token (ALNAIR_JOB_TOKEN) good for its own subjects while "
        "it runs (default: $ALNAIR_CALLOUT_SEED)",
    )
    p.add_argument(
        "--job-credential-ttl",
        metavar="SECONDS",
        type=_ttl,
        default=None,
        help="how long a job's NATS user lives; its connections reconnect every half of "
        "it to renew it, so a process left behind by an ended attempt is cut off within "
        "it; 0: never expires (default: 3600)",
    )


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"seconds >= 0, not {text!r}")
    if 0 < value < MIN_CREDENTIAL_TTL_S:
        raise argparse.ArgumentTypeError(
            f"at least {MIN_CREDENTIAL_TTL_S:g} s (the server's "
            f"expiry has one-second steps and a renewal takes a reconnection), not {text!r}"
        )
    return value


def add_agent_args(p: argparse.ArgumentParser) -> None:
    add_tenant_users_arg(p, agent=True)
    p.add_argument(
        "--job-nkey",
        metavar="FILE",
        default=os.environ.get("ALNAIR_JOB_NKEY") or None,
        help="the seed of this node's job identity (keys/job-NODE.nk from `alnair keys`), "
        "given to its jobs instead of the node's own, for clusters whose brains run no auth "
        "callout (--callout-seed); it lets a job use every job's subjects (default: "
        "$ALNAIR_JOB_NKEY)",
    )
    p.add_argument(
        "--gpu-device-dir",
        metavar="DIR",
        help="where the GPUs' device files (nvidia<N>, nvidiactl, ...) are, for confined "
        "jobs' device access (default: /dev with --gpus nvml; with simulated GPUs none: a "
        "job may open no GPU device file)",
    )
    p.add_argument(
        "--job-tls-issuer",
        metavar="CERT,KEY",
        default=os.environ.get("ALNAIR_JOB_TLS_ISSUER") or None,
        help="the job issuer's certificate and key (keys/tls/jobs-ca.pem,jobs-ca-key.pem "
        "from `alnair keys --tls`): under mutual TLS, each confined job attempt gets its "
        "own short-lived client certificate signed by it (default: $ALNAIR_JOB_TLS_ISSUER)",
    )
    p.add_argument(
        "--cgroup-parent",
        default="alnair",
        help="confined jobs' cgroups go under <cgroup root>/.../PARENT/NODE.TAG/, TAG naming "
        "the agent's --data-dir (default alnair)",
    )
    p.add_argument(
        "--job-runtime-dir",
        metavar="DIR",
        help="confined jobs' private directories (default: <tmp>/alnair/NODE.TAG, TAG naming "
        "the agent's --data-dir)",
    )


def agent_scope(node: str, data_dir: Path) -> str:
    """This agent's level in its jobs' cgroups and private directories: the node's name
    and a tag of the agent's data directory.

    Node names are unique within one cluster only: two clusters' agents on one machine
    (two `alnair up` homes; a staging and a production agent) both run job 1 attempt 1 on
    "node-1". Under the node's name alone the second attempt would join the first's
    cgroup (its limits, its processes), end the first's processes when its own attempt
    ended, and remove the first's private directory (its TLS key) as it started. The data
    directory holds the agent's process ledger, so an agent restarted on it has the same
    tag and finds what a crashed one left."""
    tag = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]
    return f"{node}.{tag}"


def agent_confinement(args: argparse.Namespace, node: str, data_dir: Path) -> Confinement | None:
    """The agent's Confinement from its flags, or None without `--tenant-users`."""
    if not args.tenant_users:
        if args.job_tls_issuer:
            log.warning("--job-tls-issuer ignored: jobs are not confined (no --tenant-users)")
        return None
    from agents import cgroups
    from agents.confine import Confinement
    from brain.tenants import load_tenant_map

    tenants = load_tenant_map(args.tenant_users)
    version = cgroups.detect()
    if version is None:
        log.warning("no usable cgroup filesystem: confined jobs run without limits")
    device_dir = Path(args.gpu_device_dir) if args.gpu_device_dir else None
    if device_dir is None and args.gpus == "nvml":
        device_dir = Path("/dev")
    scope = agent_scope(node, data_dir)
    runtime = args.job_runtime_dir or Path(tempfile.gettempdir()) / "alnair" / scope
    tree = cgroups.Cgroups(version, parent=args.cgroup_parent, node=scope) if version else None
    job_tls = job_tls_issuer(args.job_tls_issuer) if args.job_tls_issuer else None
    return Confinement(
        tenants=tenants,
        runtime_root=Path(runtime),
        path=os.environ.get("PATH", os.defpath),
        cgroups=tree,
        device_dir=device_dir,
        job_nkey_seed=Path(args.job_nkey).resolve() if args.job_nkey else None,
        job_tls=job_tls,
    )


def job_tls_issuer(text: str) -> JobIssuer:
    """`--job-tls-issuer CERT,KEY`, both files there."""
    from bus.tls import JobIssuer

    cert, comma, key = text.partition(",")
    if not comma or not cert or not key or "," in key:
        raise AlnairError(f"--job-tls-issuer: expected CERT,KEY (two files), not {text!r}")
    issuer = JobIssuer(Path(cert).resolve(), Path(key).resolve())
    issuer.check()
    return issuer


def ensure_tenant_users(tenants: list[str], path: Path) -> Path | None:
    """`alnair up --secure`: an unprivileged user per tenant (made with useradd when
    missing), and the tenant map naming them. None, said plainly, when this process is
    not root (jobs then run as its own user)."""
    if os.geteuid() != 0:
        print("alnair up: not root: jobs run as this user, unconfined (docs/security.md)")
        return None
    useradd = shutil.which("useradd")
    shell = next((s for s in NOLOGIN if Path(s).exists()), "/bin/false")
    users = []
    for tenant in tenants:
        name = f"{USER_PREFIX}{tenant}"[:32].lower()
        try:
            pwd.getpwnam(name)
        except KeyError:
            if useradd is None:
                raise AlnairError(f"no user {name} and no useradd to make one") from None
            command = [useradd, "--system", "--user-group", "--no-create-home"]
            command += ["--home-dir", "/nonexistent", "--shell", shell, name]
            subprocess.run(command, check=True, capture_output=True)
            print(f"alnair up: created user {name} for tenant {tenant}'s jobs")
        users.append(TenantUser(tenant, name))
    path.write_text(
        "# Written by `alnair up --secure`: the Unix user each tenant's jobs run as.\n"
        + render_tenant_map(tuple(users))
    )
    blocked = unreachable_by_others(Path(sys.executable))
    if blocked is not None:
        print(
            f"alnair up: warning: {sys.executable} is not reachable by the tenants' users "
            f"({blocked} is closed to others): a job that runs `python` from PATH fails; "
            "use an interpreter outside it (docs/security.md)"
        )
    return path


def unreachable_by_others(program: Path) -> Path | None:
    """The first directory (or the file) on the way to `program`, links followed, that
    a user other than its owner and group may not pass; None if all may."""
    target = program.resolve()
    for step in [*reversed(target.parents), target]:
        try:
            mode = step.stat().st_mode
        except OSError:
            return step
        if not mode & stat.S_IXOTH:
            return step
    return None
