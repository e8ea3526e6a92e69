"""Tenants confined on the node (issue #16), against a real nats-server under --secure,
with real Unix users and real cgroups: a job runs as its tenant's user, cannot read
another tenant's log, cannot act as its node on the bus, opens only its granted GPUs'
device files, and dies at its memory limit as a user failure.

Needs root, useradd and cgroup v1 with the devices controller (as on these machines
and in CI), and for the v2 device program a cgroup2 mount and bpf(2); skipped, saying
why, elsewhere. The users, cgroups and directories each
test makes are removed when it ends.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import nats
import pytest

from agents import cgroups, devices_bpf
from agents.agent import Agent
from agents.confine import SHIM, Confinement
from bus.auth import Identity
from bus.server import EmbeddedNats
from bus.tls import JobIssuer, TlsFiles, write_tls_files
from cli.client import submit
from schemas.errors import ApiError
from schemas.jobs import FailureClass, JobRecord, JobSpec, JobState
from schemas.tenants import TenantMap, TenantUser
from tests.conftest import elastic_train_spec, eventually
from tests.test_auth import (
    HOROVODRUN,
    REPO,
    grows_to_two_and_ends,
    keys,
    open_as,
    secure_cluster,
    secure_server,
)

__all__ = ["keys", "secure_server"]  # fixtures, used by name

NVIDIA_MAJOR = 195
FAKE_GPUS = 4
# Jobs run as unprivileged users, who cannot reach this interpreter when it lives under
# root's home (pyenv here): they get the system's Python of the same minor version,
# with this environment's packages on their path.
JOB_PYTHON = "/usr/bin/python3"
JOB_ENV = {"PYTHONPATH": sysconfig.get_paths()["purelib"]}


def _why_not() -> str | None:
    if cgroups.detect() != "v1" or not (cgroups.CGROUP_ROOT / "devices").is_dir():
        return "needs cgroup v1 with the devices controller"
    return _why_no_users()


def _why_no_users() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to switch users and write cgroups)"
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        return "needs useradd and userdel"
    try:
        version = subprocess.run(
            [JOB_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"needs {JOB_PYTHON} for the jobs' users"
    if version != str(sys.version_info[:2]) or not os.stat(JOB_PYTHON).st_mode & stat.S_IXOTH:
        return f"needs {JOB_PYTHON} of Python {sys.version_info[:2]}, executable by all"
    return None


needs_root = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _why_code_out_of_reach() -> str | None:
    """Jobs that import Alnair or its packages run as the tenants' users, from this
    checkout and its virtual environment: every directory above them must let others
    through (a clean clone under a 0700 `mktemp -d` does not)."""
    for path in (Path(JOB_ENV["PYTHONPATH"]), REPO):
        for directory in (path, *path.parents):
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                return f"needs {path} reachable by the jobs' users ({directory} is not)"
    return None


needs_code_in_reach = pytest.mark.skipif(
    _why_code_out_of_reach() is not None, reason=_why_code_out_of_reach() or ""
)


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, pwd.struct_passwd]]:
    """Two throwaway unprivileged users, one per tenant (a, b)."""
    made: dict[str, pwd.struct_passwd] = {}
    try:
        for tenant in ("a", "b"):
            name = f"alt16{tenant}{os.getpid() % 100000}"
            subprocess.run(
                ["useradd", "--system", "--user-group", "--no-create-home", name],
                check=True,
                capture_output=True,
            )
            made[tenant] = pwd.getpwnam(name)
        yield made
    finally:
        for account in made.values():
            subprocess.run(["userdel", account.pw_name], check=False, capture_output=True)
            subprocess.run(["groupdel", account.pw_name], check=False, capture_output=True)


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory every user may pass through (pytest's own are root's alone), with
    fake GPU device files: character devices of NVIDIA's major, which no driver here
    serves (opening one that the cgroup allows fails ENXIO; one it denies, EPERM)."""
    base = Path(tempfile.mkdtemp(prefix="alnair-confine-"))
    try:
        base.chmod(0o711)
        dev = base / "dev"
        dev.mkdir()
        dev.chmod(0o755)
        for minor, name in [*((i, f"nvidia{i}") for i in range(FAKE_GPUS)), (255, "nvidiactl")]:
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
            (dev / name).chmod(0o666)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def cgroup_parent() -> Iterator[str]:
    parent = f"alnair-test-{os.getpid()}"
    try:
        yield parent
    finally:
        for controller in ("memory", "cpu", "pids", "devices"):
            top = cgroups.CGROUP_ROOT / controller / parent
            for directory in sorted(top.glob("**/"), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def _job_cgroups(parent: str, node: str) -> list[Path]:
    return [
        child
        for controller in ("memory", "cpu", "pids", "devices")
        if (cgroups.CGROUP_ROOT / controller / parent / node).is_dir()
        for child in (cgroups.CGROUP_ROOT / controller / parent / node).iterdir()
        if child.is_dir()
    ]


@contextlib.asynccontextmanager
async def confined_cluster(
    server: EmbeddedNats,
    ids: dict[str, Identity],
    users: dict[str, pwd.struct_passwd],
    place: Path,
    parent: str,
    tls: TlsFiles | None = None,
    on_agent: Callable[[Agent], None] | None = None,
) -> AsyncIterator[tuple[object, object]]:
    """With `tls`, over mutual TLS: each job attempt gets its own client certificate
    from the job issuer next to the CA, and the CA in ALNAIR_TLS_CA. `on_agent` sees
    each agent before it starts."""
    tenant_map = TenantMap(tuple(TenantUser(t, u.pw_name) for t, u in users.items()), "test")

    def confinement(node: str) -> Confinement:
        return Confinement(
            tenants=tenant_map,
            runtime_root=place / "run" / node,
            path=os.pathsep.join([str(Path(sys.executable).parent), os.defpath]),
            cgroups=cgroups.Cgroups("v1", parent=parent, node=node),
            device_dir=place / "dev",
            job_tls=JobIssuer.in_dir(tls.ca.parent) if tls else None,
            agent_env={"ALNAIR_TLS_CA": str(tls.ca)} if tls else {},
        )

    async with secure_cluster(
        server,
        ids,
        place,
        {"n1": FAKE_GPUS},
        tenants=tenant_map.tenants,
        confinement=confinement,
        tls=tls,
        on_agent=on_agent,
    ) as (brain, tenant):
        yield brain, tenant


async def _finished(brain, job: JobRecord, timeout_s: float = 60) -> JobRecord:
    return await eventually(
        lambda: (j := brain.state.jobs[job.job_id]).state.terminal and j, timeout_s=timeout_s
    )


def _log(job: JobRecord) -> str:
    assert job.grants and job.grants[0].log_path
    return Path(job.grants[0].log_path).read_text()


def _python(code: str) -> tuple[str, ...]:
    return (JOB_PYTHON, "-c", textwrap.dedent(code))


@needs_root
@pytest.mark.timeout(120)
async def test_a_job_runs_as_its_tenant_and_cannot_read_another_tenants_log(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    ids = keys[0]
    async with confined_cluster(secure_server, ids, users, place, cgroup_parent) as (brain, a):
        b = await open_as(secure_server, ids["tenant:b"])
        try:
            job_b = await submit(b, "b", JobSpec(command=_python("print('secret of b')"), gpus=1))
        finally:
            await b.close()
        done_b = await _finished(brain, job_b)
        assert done_b.state is JobState.SUCCEEDED, done_b.reason
        b_log = Path(done_b.grants[0].log_path or "")
        assert "secret of b" in b_log.read_text()
        mode = b_log.stat()
        assert (stat.S_IMODE(mode.st_mode), mode.st_uid, mode.st_gid) == (
            0o640,
            0,
            users["b"].pw_gid,
        )

        node_seed = ids["node:n1"].seed_path
        probe = f"""
            import os
            print("uid", os.getuid(), "gid", os.getgid())
            for what, path in (("b-log", {str(b_log)!r}), ("own-log", os.environ["OWN_LOG"])):
                try:
                    open(path).read()
                    print(what, "readable")
                except OSError as error:
                    print(what, type(error).__name__)
            print("nkey", os.environ.get("ALNAIR_NKEY"))
            print("token", os.environ["ALNAIR_JOB_TOKEN"].startswith("2:1:"))
            try:
                open({str(node_seed)!r}).read()
                print("node-seed readable")
            except OSError as error:
                print("node-seed", type(error).__name__)
            print("agent-env", sorted(k for k in os.environ if k.startswith("PYTEST")))
            """
        own_log = place / "n1" / "logs" / "2" / "attempt-1.log"  # the next job's id is 2
        spec = JobSpec(command=_python(probe), gpus=1, env={"OWN_LOG": str(own_log), **JOB_ENV})
        job_a = await submit(a, "a", spec)
        assert job_a.job_id == "2"
        done_a = await _finished(brain, job_a)
        assert done_a.state is JobState.SUCCEEDED, done_a.reason
        out = _log(done_a)
        assert f"uid {users['a'].pw_uid} gid {users['a'].pw_gid}" in out
        assert "b-log PermissionError" in out
        assert "own-log readable" in out
        assert "nkey None" in out  # no node-wide identity: its attempt's token
        assert "token True" in out
        assert "node-seed PermissionError" in out
        assert "agent-env []" in out
        await eventually(lambda: not _job_cgroups(cgroup_parent, "n1"))


@needs_code_in_reach
@needs_root
@pytest.mark.timeout(120)
async def test_a_job_reaches_only_its_own_subjects_while_its_attempt_runs(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    """Its token admits it as a user of its own job's subjects: the server refuses its
    publishes on its node's subjects and on another job's; once the attempt has ended
    the same token admits nobody."""
    ids = keys[0]
    probe = """
        import asyncio, os, nats

        async def main():
            errors = []

            async def on_error(error):
                errors.append(str(error))

            token = os.environ["ALNAIR_JOB_TOKEN"]
            job, attempt, _ = token.split(":")
            print("token", token)
            nc = await nats.connect(
                os.environ["ALNAIR_NATS"],
                token=token,
                inbox_prefix=f"_INBOX_job_{job}_{attempt}",
                error_cb=on_error,
                allow_reconnect=False,
            )
            for subject in (
                f"alnair.job.{job}.progress",
                "alnair.node.n1.event",
                "alnair.node.n1.heartbeat",
                "alnair.job.999.progress",
            ):
                await nc.publish(subject, b"{}")
            await nc.flush()
            for _ in range(200):
                if len(errors) >= 3:
                    break
                await asyncio.sleep(0.05)
            for error in errors:
                print("server said:", error)
            await nc.close()

        asyncio.run(main())
        """
    async with confined_cluster(secure_server, ids, users, place, cgroup_parent) as (brain, a):
        job = await submit(a, "a", JobSpec(command=_python(probe), gpus=1, env=JOB_ENV))
        done = await _finished(brain, job)
        assert done.state is JobState.SUCCEEDED, done.reason
        out = _log(done)
        said = [line.lower() for line in out.splitlines() if line.startswith("server said:")]
        for subject in (
            "alnair.node.n1.event",
            "alnair.node.n1.heartbeat",
            "alnair.job.999.progress",
        ):
            assert any(f'permissions violation for publish to "{subject}"' in s for s in said), said
        assert not any(f'"alnair.job.{job.job_id}.progress"' in s for s in said), said
        assert brain.credentials is not None and brain.credentials.admitted >= 1

        token = next(line.split()[1] for line in out.splitlines() if line.startswith("token "))
        with pytest.raises(Exception) as refused:  # noqa: PT011 - nats-py raises its own kinds
            await nats.connect(
                secure_server.url,
                token=token,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=10,
            )
        assert "authorization violation" in str(refused.value).lower()
        del refused
        gc.collect()  # the refused transport, under this test's filters
        assert brain.credentials.refused >= 1


@pytest.fixture
def tls_server(tmp_path: Path, keys) -> Iterator[tuple[EmbeddedNats, TlsFiles]]:
    """The secure server, over TLS that requires a client certificate (`verify`)."""
    files = write_tls_files(tmp_path / "tls")
    server = EmbeddedNats(data_dir=tmp_path / "nats-tls", config_file=keys[1], tls=files)
    server.start()
    try:
        yield server, files
    finally:
        server.stop()


@needs_code_in_reach
@needs_root
@pytest.mark.timeout(120)
async def test_under_mutual_tls_a_confined_job_connects_with_its_own_certificate(
    tls_server, keys, users, place, cgroup_parent
) -> None:
    """A job that reports through the SDK's connection (`job_connect_options`), as its
    tenant's user, reaches a server that verifies clients with the certificate its agent
    issued to its attempt, and still only its own subjects; without the certificate the
    server would not have it."""
    server, files = tls_server
    ids = keys[0]
    probe = """
        import asyncio, os, ssl, nats
        from bus.client import Bus, tls_context
        from workloads.sdk import job_connect_options

        async def main():
            options = job_connect_options(os.environ["ALNAIR_NATS"], "sdk-probe")
            print("cert", options.tls_cert)
            print("renew", options.renew_s)
            bus = await Bus.connect(options)
            job = os.environ["ALNAIR_JOB_ID"]
            await bus.nc.publish(f"alnair.job.{job}.progress", b"{}")
            await bus.nc.flush(timeout=5)
            print("sdk connected", bus.nc.is_connected)
            await bus.close()

            errors = []

            async def on_error(error):
                errors.append(str(error))

            nc = await nats.connect(
                options.servers[0],
                token=options.token,
                inbox_prefix=options.inbox_prefix,
                tls=tls_context(options),
                error_cb=on_error,
                allow_reconnect=False,
            )
            await nc.publish("alnair.node.n1.event", b"{}")
            await nc.flush()
            for _ in range(200):
                if errors:
                    break
                await asyncio.sleep(0.05)
            for error in errors:
                print("server said:", error)
            await nc.close()

            bare = ssl.create_default_context(cafile=options.tls_ca)
            try:
                await nats.connect(
                    options.servers[0],
                    token=options.token,
                    tls=bare,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    connect_timeout=5,
                )
                print("without a certificate: connected")
            except Exception as error:
                print("without a certificate: refused", type(error).__name__)

        asyncio.run(main())
        """
    env = {**JOB_ENV, "PYTHONPATH": os.pathsep.join([JOB_ENV["PYTHONPATH"], str(REPO)])}
    async with confined_cluster(server, ids, users, place, cgroup_parent, tls=files) as (
        brain,
        a,
    ):
        job = await submit(a, "a", JobSpec(command=_python(probe), gpus=1, env=env))
        done = await _finished(brain, job)
        out = _log(done)
        assert done.state is JobState.SUCCEEDED, (done.reason, out)
        runtime = place / "run" / "n1" / f"{job.job_id}-1"
        assert f"cert {runtime / 'tls-cert.pem'}" in out, out
        assert "renew 1800" in out, out  # half of the brain's default hour
        assert "sdk connected True" in out, out
        said = [line.lower() for line in out.splitlines() if line.startswith("server said:")]
        assert any('permissions violation for publish to "alnair.node.n1.event"' in s for s in said)
        assert "without a certificate: refused" in out, out
        assert brain.credentials is not None and brain.credentials.admitted >= 2
        assert not runtime.exists()  # its certificate went with its private directory


@needs_root
@pytest.mark.timeout(120)
async def test_a_job_opens_only_its_granted_gpus_device_files(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    ids = keys[0]
    probe = f"""
        import errno, os
        print("granted", os.environ["CUDA_VISIBLE_DEVICES"])
        for name in [*(f"nvidia{{i}}" for i in range({FAKE_GPUS})), "nvidiactl"]:
            try:
                os.close(os.open(os.path.join({str(place / "dev")!r}, name), os.O_RDWR))
                print(name, "opened")
            except OSError as error:
                print(name, errno.errorcode[error.errno])
        """
    async with confined_cluster(secure_server, ids, users, place, cgroup_parent) as (brain, a):
        job = await submit(a, "a", JobSpec(command=_python(probe), gpus=2))
        done = await _finished(brain, job)
        assert done.state is JobState.SUCCEEDED, done.reason
        lines = dict(line.split(" ", 1) for line in _log(done).splitlines() if " " in line)
        granted = {int(g) for g in lines["granted"].split(",")}
        assert len(granted) == 2
        for gpu in range(FAKE_GPUS):
            # Allowed: the kernel reaches the (absent) driver. Denied: the cgroup says no.
            assert lines[f"nvidia{gpu}"] == ("ENXIO" if gpu in granted else "EPERM"), lines
        assert lines["nvidiactl"] == "ENXIO"


@pytest.fixture
def cgroup2(place: Path) -> Iterator[Path]:
    """A cgroup2 mount (the host's unified hierarchy, mounted again here) with a fresh
    directory in it: a device program attached there is enforced for its tasks, on a
    cgroup v1 host as on a v2 one. Skips, saying why, where it cannot be had."""
    if os.geteuid() != 0:
        pytest.skip("needs root (to mount cgroup2 and load eBPF programs)")
    mount = place / "cgroup2"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "cgroup2", "none", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount cgroup2: {mounted.stderr.strip()}")
    directory = mount / f"alnair-test-{os.getpid()}"
    try:
        directory.mkdir()
        yield directory
    finally:
        with contextlib.suppress(devices_bpf.DeviceFilterError):
            devices_bpf.detach_all(directory)
        with contextlib.suppress(OSError):
            directory.rmdir()
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)


@pytest.mark.skipif(_why_no_users() is not None, reason=_why_no_users() or "")
def test_on_cgroup_v2_a_job_opens_only_its_granted_gpus_device_files(users, place, cgroup2) -> None:
    """The v2 device program, from the rules the v1 controller gets: a job started as
    the agent starts it (the exec shim joins the cgroup, then drops to the tenant's
    user) opens its granted GPUs and the control device (ENXIO: no driver behind them)
    and the harmless devices, and no other GPU (EPERM)."""
    granted = (1, 3)
    rules = (*cgroups.BASE_DEVICES, *cgroups.gpu_device_rules(place / "dev", granted))
    try:
        devices_bpf.attach(cgroup2, rules)
    except devices_bpf.DeviceFilterError as error:
        if error.errno in (errno.EPERM, errno.EINVAL, errno.ENOSYS):
            pytest.skip(f"cgroup device programs are not permitted here: {error}")
        raise
    assert len(devices_bpf.attached(cgroup2)) == 1
    probe = f"""
        import errno, os
        print("uid", os.getuid())
        names = [*(f"nvidia{{i}}" for i in range({FAKE_GPUS})), "nvidiactl"]
        for path in [*(os.path.join({str(place / "dev")!r}, n) for n in names), "/dev/null"]:
            try:
                os.close(os.open(path, os.O_RDWR))
                print(os.path.basename(path), "opened")
            except OSError as error:
                print(os.path.basename(path), errno.errorcode[error.errno])
        """
    user = users["a"]
    shim = [sys.executable, "-I", "-S", str(SHIM), "--uid", str(user.pw_uid)]
    shim += ["--gid", str(user.pw_gid), "--join", str(cgroup2 / "cgroup.procs")]
    done = subprocess.run(
        [*shim, "--", *_python(probe)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["uid"] == str(user.pw_uid)
    for gpu in range(FAKE_GPUS):
        assert lines[f"nvidia{gpu}"] == ("ENXIO" if gpu in granted else "EPERM"), lines
    assert lines["nvidiactl"] == "ENXIO"
    assert lines["null"] == "opened"
    # The job has ended: its cgroup is empty and goes, taking its program with it.
    assert devices_bpf.detach_all(cgroup2) == 1
    assert devices_bpf.attached(cgroup2) == []


@needs_root
@pytest.mark.timeout(120)
async def test_a_job_is_killed_at_its_memory_limit_as_a_user_failure(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    ids = keys[0]
    hog = "data = b'x' * (512 << 20)\nprint('survived', len(data))"
    spec = JobSpec(command=_python(hog), gpus=1, memory_mb_per_gpu=64)
    async with confined_cluster(secure_server, ids, users, place, cgroup_parent) as (brain, a):
        job = await submit(a, "a", spec)
        done = await _finished(brain, job)
        assert done.state is JobState.FAILED, done.reason
        assert done.attempt == 1  # not retried
        failure = done.failures[-1]
        assert failure.failure_class is FailureClass.USER
        assert failure.reason == "out of memory (limit 64 MiB)"
        assert "survived" not in _log(done)
        await eventually(lambda: not _job_cgroups(cgroup_parent, "n1"))
    # The agent stopped: it left no cgroup directory and no runtime directory behind.
    for controller in ("memory", "cpu", "pids", "devices"):
        assert not (cgroups.CGROUP_ROOT / controller / cgroup_parent).exists()
    assert not (place / "run" / "n1").exists()


@needs_root
@pytest.mark.timeout(60)
async def test_a_tenant_with_no_user_is_refused_by_name(
    secure_server, keys, users, place, cgroup_parent
) -> None:
    ids = keys[0]
    only_a = {"a": users["a"]}
    async with confined_cluster(secure_server, ids, only_a, place, cgroup_parent) as (_, _a):
        b = await open_as(secure_server, ids["tenant:b"])
        try:
            with pytest.raises(ApiError) as refused:
                await submit(b, "b", JobSpec(command=("true",), gpus=1))
        finally:
            await b.close()
    assert refused.value.code == "forbidden"
    assert "tenant b has no Unix user" in refused.value.message


@needs_code_in_reach
@needs_root
@pytest.mark.slow
@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed")
@pytest.mark.timeout(180)
async def test_a_confined_elastic_job_resizes_with_its_job_identity(
    secure_server, keys, users, place, cgroup_parent, monkeypatch
) -> None:
    """Horovod's driver and workers run as tenant a's user in the job's cgroup, and the
    supervisor reaches NATS with the node's job identity: it hears the Resize, reports
    progress and the outcome."""
    # The brain starts the supervisor with its own interpreter, which a's user cannot
    # reach here (see JOB_PYTHON); the job's own command is built from it too.
    monkeypatch.setattr(sys, "executable", JOB_PYTHON)

    ids = keys[0]
    scratch = place / "scratch"
    scratch.mkdir()
    os.chown(scratch, users["a"].pw_uid, users["a"].pw_gid)
    stop_file = scratch / "stop"
    try:
        async with confined_cluster(secure_server, ids, users, place, cgroup_parent) as (
            brain,
            a,
        ):
            spec = elastic_train_spec(1, stop_file, max_gpus=2)
            spec = spec.model_copy(update={"env": {**spec.env, **JOB_ENV}})
            job = await submit(a, "a", spec)
            await eventually(lambda: brain.progress.world_size(job.job_id) == 1, timeout_s=90)
            pid = brain.state.jobs[job.job_id].grants[0].pid
            assert os.stat(f"/proc/{pid}").st_uid == users["a"].pw_uid
            assert f"/{cgroup_parent}/n1/" in Path(f"/proc/{pid}/cgroup").read_text()
            await grows_to_two_and_ends(brain, a, job, stop_file)
    finally:
        stop_file.touch()
