"""Confined jobs: each runs as its tenant's Unix user, in its own cgroup, with a clean
environment.

The agent runs as root; a job never does. For each attempt this module:

- finds the tenant's user and group in the tenant map (schemas/tenants.py); a tenant
  with no entry, or a user this machine does not have, is refused (not retried: every
  node has the same map);
- builds the job's environment from nothing: PATH, HOME, USER, LOGNAME, LANG, the
  job's own variables and what the agent sets for it (ALNAIR_JOB_ID, ...). Nothing of
  the agent's own environment passes, so neither the node's NATS seed nor its TLS key
  does;
- makes a private runtime directory owned by the user (`<runtime root>/<job>-<attempt>`,
  mode 0700) holding the files the job must read: its input blacklist, the TLS CA and,
  without an auth callout, a copy of the node's *job* identity (bus/auth.py), never
  the node's own;
- under mutual TLS, gives the attempt its own short-lived client certificate, signed
  by the cluster's job issuer (bus/tls.py), in that directory; the agent renews it
  there before it expires (`Confined.renew_certificate`), and the job's connections
  read it again when they reconnect (bus/client.py);
- makes the job's log readable by root and the job's group only (0640, in a 0750
  directory);
- creates its cgroup (agents/cgroups.py) with memory and CPU limits from its launch and
  device access to the granted GPUs only, and starts the job through
  agents/confine_exec.py, which joins the cgroup and drops to the user before `exec`.

When the attempt ends, `Confined.finish` reads whether the cgroup's OOM killer fired,
kills what the job left behind, and removes the cgroup and the runtime directory.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from agents.cgroups import CgroupError, Cgroups, JobCgroup, Limits, gpu_device_rules
from bus.tls import JobIssuer, issue_job_certificate, job_certificate_name
from schemas.errors import AlnairError, BusError
from schemas.jobs import (
    BLACKLIST_FILE_ENV,
    DEFAULT_CPUS_PER_GPU,
    DEFAULT_MEMORY_MB_PER_GPU,
    JOB_PIDS_MAX,
)
from schemas.tenants import TenantMap

log = logging.getLogger(__name__)

SHIM: Final = Path(__file__).resolve().parent / "confine_exec.py"
NKEY_ENV: Final = "ALNAIR_NKEY"
# Passed from the agent's environment to a job: harmless, and programs expect them.
PASSED_FROM_AGENT: Final = ("LANG", "LC_ALL", "TZ", "ALNAIR_TLS_CA")
MIB: Final = 1024 * 1024
TLS_CA_ENV: Final = "ALNAIR_TLS_CA"
TLS_CERT_ENV: Final = "ALNAIR_TLS_CERT"
TLS_KEY_ENV: Final = "ALNAIR_TLS_KEY"
# A job's TLS client certificate lives this long, and is renewed at half of it.
JOB_CERT_TTL_S: Final = 3600.0


class ConfineError(AlnairError):
    def __init__(self, reason: str, *, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class JobUser:
    tenant: str
    name: str
    uid: int
    gid: int
    home: str


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What confinement needs to know of one launch."""

    job_id: str
    attempt: int
    tenant: str | None
    gpus: tuple[int, ...]
    command: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    memory_mb: int | None
    cpus: float | None


@dataclass
class JobCertificate:
    """An attempt's own TLS client certificate and key, in its private directory."""

    issuer: JobIssuer
    cert: Path
    key: Path
    name: str
    owner: tuple[int, int]
    ttl_s: float
    expires_at: float = 0.0

    def issue(self, now: float) -> None:
        try:
            self.expires_at = issue_job_certificate(
                self.issuer,
                self.cert,
                self.key,
                name=self.name,
                valid_s=self.ttl_s,
                now=now,
                owner=self.owner,
            )
        except (BusError, OSError) as error:
            raise ConfineError(
                f"TLS certificate for {self.name}: {error}", retryable=True
            ) from None

    def due(self, now: float) -> bool:
        """Past half its life: renew it, so that the file a job's connection reads
        before each reconnection (bus/client.py) has at least half a life left."""
        return now >= self.expires_at - self.ttl_s / 2


@dataclass
class Confined:
    """One confined attempt: how to start it, and what to undo when it ends."""

    argv: tuple[str, ...]
    env: dict[str, str]
    user: JobUser
    runtime_dir: Path
    cgroup: JobCgroup | None
    certificate: JobCertificate | None = None
    finished: bool = field(default=False)

    def renew_certificate(self, now: float) -> bool:
        """Issue the attempt a fresh certificate if its current one is due; whether
        it did. Blocking (openssl): the agent calls it from a thread."""
        if self.finished or self.certificate is None or not self.certificate.due(now):
            return False
        self.certificate.issue(now)
        return True

    async def finish(self) -> int | None:
        """Clean up; the memory limit in MiB if the cgroup's OOM killer fired."""
        if self.finished:
            return None
        self.finished = True
        oom: int | None = None
        if self.cgroup is not None:
            if self.cgroup.oom_killed():
                oom = self.cgroup.limits.memory_bytes // MIB
            await self.cgroup.remove()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return oom


@dataclass(frozen=True)
class Confinement:
    """How this agent confines its jobs (given once, at agent start)."""

    tenants: TenantMap
    runtime_root: Path
    # The PATH jobs get (the agent's own, normally: where `python` is the cluster's).
    path: str
    cgroups: Cgroups | None = None
    # Where the GPUs' device files are (/dev; a test directory in tests). None: no GPU
    # device files (simulated GPUs), so a job may open none.
    device_dir: Path | None = Path("/dev")
    # The seed file of this node's job identity (bus/auth.py role "job"), if any.
    job_nkey_seed: Path | None = None
    # Signs each attempt's own TLS client certificate, for servers that require one
    # (bus/tls.py); None: a job gets the CA alone.
    job_tls: JobIssuer | None = None
    job_cert_ttl_s: float = JOB_CERT_TTL_S
    agent_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def check(self) -> None:
        """Refuse to start an agent that could not confine anything."""
        if os.geteuid() != 0:
            raise ConfineError("running jobs as their tenants' users needs the agent to be root")
        self.runtime_root.mkdir(parents=True, exist_ok=True)
        os.chown(self.runtime_root, 0, 0)
        self.runtime_root.chmod(0o711)

    def close(self) -> None:
        """The agent is done: remove what `check` and the jobs left, if empty."""
        if self.cgroups is not None:
            self.cgroups.remove_empty()
        with contextlib.suppress(OSError):
            self.runtime_root.rmdir()

    def user_for(self, tenant: str | None) -> JobUser:
        entry = self.tenants.get(tenant or "")
        if entry is None:
            raise ConfineError(
                f"tenant {tenant or '(none)'} has no Unix user in the tenant map "
                f"{self.tenants.source}"
            )
        try:
            account = pwd.getpwnam(entry.user)
        except KeyError:
            raise ConfineError(
                f"tenant {entry.tenant}: user {entry.user} does not exist on this node"
            ) from None
        gid = account.pw_gid
        if entry.group is not None:
            try:
                gid = grp.getgrnam(entry.group).gr_gid
            except KeyError:
                raise ConfineError(
                    f"tenant {entry.tenant}: group {entry.group} does not exist on this node"
                ) from None
        if account.pw_uid == 0 or gid == 0:
            raise ConfineError(f"tenant {entry.tenant}: user {entry.user} is root; refused")
        return JobUser(entry.tenant, entry.user, account.pw_uid, gid, account.pw_dir)

    def limits(self, request: JobRequest) -> Limits:
        gpus = max(1, len(request.gpus))
        memory_mb = request.memory_mb or DEFAULT_MEMORY_MB_PER_GPU * gpus
        cpus = request.cpus or DEFAULT_CPUS_PER_GPU * gpus
        devices: tuple[str, ...] = ()
        if self.device_dir is not None:
            try:
                devices = gpu_device_rules(self.device_dir, request.gpus)
            except CgroupError as error:
                raise ConfineError(str(error), retryable=True) from None
        return Limits(memory_bytes=memory_mb * MIB, cpus=cpus, pids=JOB_PIDS_MAX, devices=devices)

    def prepare(self, request: JobRequest, log_path: Path) -> Confined:
        user = self.user_for(request.tenant)
        runtime = self.runtime_root / f"{request.job_id}-{request.attempt}"
        shutil.rmtree(runtime, ignore_errors=True)
        runtime.mkdir(mode=0o700)
        os.chown(runtime, user.uid, user.gid)
        env = self._environment(request, user, runtime)
        certificate = None
        if self.job_tls is not None:
            certificate = JobCertificate(
                self.job_tls,
                runtime / "tls-cert.pem",
                runtime / "tls-key.pem",
                name=job_certificate_name(request.job_id, request.attempt),
                owner=(user.uid, user.gid),
                ttl_s=self.job_cert_ttl_s,
            )
            try:
                certificate.issue(time.time())
            except ConfineError:
                shutil.rmtree(runtime, ignore_errors=True)
                raise
            env[TLS_CERT_ENV], env[TLS_KEY_ENV] = str(certificate.cert), str(certificate.key)
        _private_log(log_path, user)
        cgroup = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.create(
                    f"{request.job_id}-{request.attempt}", self.limits(request)
                )
            except (CgroupError, ConfineError):
                shutil.rmtree(runtime, ignore_errors=True)
                raise
        program = request.command[0]
        if shutil.which(program, path=env["PATH"]) is None and "/" not in program:
            # As the unconfined launcher does: a program that is not there is the
            # job's fault, said at launch rather than as exit code 127.
            shutil.rmtree(runtime, ignore_errors=True)
            if cgroup is not None:
                for directory in cgroup.directories:
                    directory.rmdir()
            raise ConfineError(f"cannot start {program!r}: No such file or directory")
        argv = [sys.executable, "-I", "-S", str(SHIM), "--uid", str(user.uid)]
        argv += ["--gid", str(user.gid), "--cwd", request.cwd or str(runtime)]
        for procs in cgroup.procs_files if cgroup is not None else ():
            argv += ["--join", str(procs)]
        return Confined((*argv, "--", *request.command), env, user, runtime, cgroup, certificate)

    def _environment(self, request: JobRequest, user: JobUser, runtime: Path) -> dict[str, str]:
        env = {k: self.agent_env[k] for k in PASSED_FROM_AGENT if self.agent_env.get(k)}
        env.update(PATH=self.path, HOME=user.home, TMPDIR=str(runtime))
        env.update(request.env)  # the job's own settings win, as unconfined
        env.update(USER=user.name, LOGNAME=user.name)
        env.pop(NKEY_ENV, None)
        blacklist = env.get(BLACKLIST_FILE_ENV)
        if blacklist:
            env[BLACKLIST_FILE_ENV] = str(_copy_for(Path(blacklist), runtime, user))
        ca = env.get(TLS_CA_ENV)
        if ca and Path(ca).is_file():
            # The agent's CA file sits with its keys, in a directory the job's user may
            # not enter (`alnair keys --tls` makes it 0700): a copy of its own.
            env[TLS_CA_ENV] = str(_copy_for(Path(ca), runtime, user))
        if self.job_nkey_seed is not None:
            # The same file name: its reply-inbox prefix is read from it (bus/auth.py).
            env[NKEY_ENV] = str(_copy_for(self.job_nkey_seed, runtime, user, mode=0o400))
        return env


def _copy_for(source: Path, runtime: Path, user: JobUser, *, mode: int = 0o440) -> Path:
    target = runtime / source.name
    shutil.copyfile(source, target)
    os.chown(target, user.uid, user.gid)
    target.chmod(mode)
    return target


def _private_log(log_path: Path, user: JobUser) -> None:
    """The job's log: written by the agent, read by its own group and root alone."""
    logs_root = log_path.parent.parent
    logs_root.chmod(0o711)  # others may pass through to their own job's directory
    os.chown(log_path.parent, 0, user.gid)
    log_path.parent.chmod(0o750)
    log_path.touch(mode=0o640, exist_ok=True)
    os.chown(log_path, 0, user.gid)
    log_path.chmod(0o640)
