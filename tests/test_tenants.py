"""The pieces of job confinement that need no root: the tenant map, job limits, the
OOM classification, the brain's check of a job's own events, and the cgroup code paths
against a fake cgroup tree, and the v2 device program's instructions (the kernel's v1,
and the v2 device program on a cgroup2 mount, are tested as root in tests/test_confine.py)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import nkeys
import pytest

from agents import cgroups, devices_bpf
from agents.confine import SHIM, ConfineError, Confinement
from brain.core.failures import AttemptEnd, classify
from brain.credentials import DEFAULT_TTL_S, JobCredentials
from brain.secrets import check_job_token, job_token
from brain.tenants import check_tenant, job_event_refusal, load_tenant_map
from bus import natsjwt
from cli.confine import unreachable_by_others
from schemas.errors import ApiError
from schemas.events import GpuFault, InputError, ResizeCompleted
from schemas.jobs import DEFAULT_MEMORY_MB_PER_GPU, FailureClass, JobSpec, job_limits
from schemas.tenants import TenantMap, TenantMapError, TenantUser, parse_tenant_map


def test_the_tenant_map_reads_users_and_groups(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  a: {user: alnair-a}\n  b: {user: bob, group: research}\n")
    tenants = load_tenant_map(path)
    assert tenants.get("a") == TenantUser("a", "alnair-a", None)
    assert tenants.get("b") == TenantUser("b", "bob", "research")
    assert tenants.get("c") is None
    assert tenants.tenants == {"a", "b"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tenants:\n  a: {user: root}\n", "tenant a: jobs may not run as root"),
        ("tenants:\n  a: {user: 'x y'}\n", "tenant a: user 'x y' is not a valid Unix name"),
        ("tenants:\n  a: {group: g}\n", "tenant a: expected {user: NAME[, group: NAME]}"),
        ("tenants:\n  a: {user: u, shell: sh}\n", "tenant a: unknown keys shell"),
        ("users:\n  a: {user: u}\n", "expected a 'tenants' mapping"),
        ("tenants: [a]\n", "expected a 'tenants' mapping"),
        ("tenants:\n  'a b': {user: u}\n", "a b"),
        # A name given twice: the first is not dropped without a word.
        (
            "tenants:\n  alice: {user: bob}\n  alice: {user: carol}\n",
            "key 'alice' is given twice (first on line 2)",
        ),
        # What YAML reads as another type than the name written.
        (
            "tenants:\n  no: {user: bob}\n",
            "tenant name False is not text (YAML reads it as bool): quote it",
        ),
        (
            "tenants:\n  a: {user: 0755}\n",
            "tenant a: user 493 is not text (YAML reads it as int): quote it",
        ),
    ],
)
def test_a_bad_tenant_map_says_where_and_what(text: str, says: str) -> None:
    with pytest.raises(TenantMapError) as error:
        parse_tenant_map(text, where="t.yaml")
    assert str(error.value).startswith("t.yaml: ")
    assert says in str(error.value)


def test_an_unreadable_tenant_map_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TenantMapError, match=r"missing\.yaml: cannot read"):
        load_tenant_map(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(TenantMapError, match=r"binary\.yaml: cannot read: not UTF-8 text"):
        load_tenant_map(binary)


def test_a_brain_with_a_map_refuses_a_tenant_it_does_not_name() -> None:
    check_tenant(None, "anyone")
    check_tenant(frozenset({"a"}), "a")
    with pytest.raises(ApiError) as refused:
        check_tenant(frozenset({"a"}), "b")
    assert refused.value.code == "forbidden"
    assert "tenant b has no Unix user" in refused.value.message


def test_limits_scale_with_gpus_and_an_elastic_job_is_sized_for_its_maximum() -> None:
    rigid = JobSpec(command=("x",), gpus=2)
    assert job_limits(rigid, 2) == (2 * DEFAULT_MEMORY_MB_PER_GPU, 8.0)
    asked = JobSpec(command=("x",), gpus=1, memory_mb_per_gpu=100, cpus_per_gpu=0.5)
    assert job_limits(asked, 3) == (300, 1.5)
    elastic = JobSpec(command=("x",), gpus=1, elastic=True, max_gpus=4, memory_mb_per_gpu=20)
    assert job_limits(elastic, 1)[0] == 80


def test_an_oom_kill_by_its_own_cgroup_is_a_user_failure() -> None:
    end = AttemptEnd(signal=9, oom_limit_mb=64, log_tail=("Out of memory: Killed process 1",))
    verdict = classify(end)
    assert verdict.failure_class is FailureClass.USER
    assert verdict.reason == "out of memory (limit 64 MiB)"
    # A SIGKILL nobody explains is still the infrastructure's (the node's OOM killer).
    assert classify(AttemptEnd(signal=9)).failure_class is FailureClass.INFRASTRUCTURE


def _resize(job_id: str) -> ResizeCompleted:
    return ResizeCompleted(
        event_id="e",
        node="n1",
        ts=0.0,
        job_id=job_id,
        command_id="c",
        from_size=1,
        to_size=2,
        ok=True,
        duration_s=1.0,
    )


def test_a_job_reports_only_its_own_resizes_and_inputs() -> None:
    assert job_event_refusal("alnair.job.7.event", _resize("7")) is None
    bad_input = InputError(event_id="e", node="n1", ts=0, job_id="7", attempt=1, uri="s3://x")
    assert job_event_refusal("alnair.job.7.event", bad_input) is None
    assert "names job '8'" in (job_event_refusal("alnair.job.7.event", _resize("8")) or "")
    fault = GpuFault(event_id="e", node="n1", ts=0, gpu=0, fault="lost")
    assert "may not report gpu_fault" in (job_event_refusal("alnair.job.7.event", fault) or "")


def test_cgroup_v2_limits_are_written_down_a_fake_tree(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    assert cgroups.detect(tmp_path) == "v2"
    tree = cgroups.Cgroups("v2", parent="alnair", node="n1", root=tmp_path)
    limits = cgroups.Limits(memory_bytes=64 << 20, cpus=1.5, pids=100, devices=None)
    group = tree.create("3-1", limits)
    where = tmp_path / "alnair" / "n1" / "3-1"
    assert group.directories == (where,)
    assert (where / "memory.max").read_text() == str(64 << 20)
    assert (where / "cpu.max").read_text() == "150000 100000"
    assert (where / "pids.max").read_text() == "100"
    assert (tmp_path / "alnair" / "n1" / "cgroup.subtree_control").exists()
    assert group.procs_files == (where / "cgroup.procs",)
    assert not group.oom_killed()
    (where / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_killed()


def test_a_v2_device_program_that_cannot_be_attached_fails_the_cgroup(tmp_path: Path) -> None:
    # A fake tree is no cgroup: the program cannot attach (or, not root, load) there.
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    tree = cgroups.Cgroups("v2", parent="alnair", node="n1", root=tmp_path)
    limits = cgroups.Limits(memory_bytes=64 << 20, cpus=1.0, pids=100, devices=("c 195:0 rwm",))
    with pytest.raises(cgroups.CgroupError, match=r"device access of cgroup .*/alnair/n1/3-1: "):
        tree.create("3-1", limits)


def _decoded(program: bytes) -> list[tuple[int, int, int, int]]:
    """(opcode, dst|src<<4, offset, immediate) of each eBPF instruction."""
    return [struct.unpack_from("<BBhi", program, i) for i in range(0, len(program), 8)]


def test_the_v2_device_program_allows_what_each_rule_names_and_denies_the_rest() -> None:
    program = _decoded(devices_bpf.device_program(["c 195:1 rwm", "c 136:* rw", "a"]))
    jne, mov, exit_ = devices_bpf.JMP_JNE_K, devices_bpf.ALU64_MOV_K, devices_bpf.JMP_EXIT
    # Six loads of the context, then one block per rule, then "deny".
    body = program[6:]
    assert body[-2:] == [(mov, 0, 0, 0), (exit_, 0, 0, 0)]
    # c 195:1 rwm: type, major, minor; each mismatch skips to the next rule's block.
    assert body[:5] == [
        (jne, 2, 4, devices_bpf.DEV_CHAR),
        (jne, 4, 3, 195),
        (jne, 5, 2, 1),
        (mov, 0, 0, 1),
        (exit_, 0, 0, 0),
    ]
    # c 136:* rw: no minor test, and an access test (no mknod: bit 1 must be clear).
    assert body[5:12] == [
        (jne, 2, 6, devices_bpf.DEV_CHAR),
        (devices_bpf.ALU64_MOV_X, 1 | 3 << 4, 0, 0),
        (devices_bpf.ALU64_AND_K, 1, 0, 1),
        (jne, 1, 3, 0),
        (jne, 4, 2, 136),
        (mov, 0, 0, 1),
        (exit_, 0, 0, 0),
    ]
    assert body[12:14] == [(mov, 0, 0, 1), (exit_, 0, 0, 0)]  # "a": everything


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ("c 195 rwm", "expected 'TYPE MAJOR:MINOR ACCESS'"),
        ("c 195:x rwm", "expected 'TYPE MAJOR:MINOR ACCESS'"),
        ("c 195:0 rwx", "expected 'TYPE MAJOR:MINOR ACCESS'"),
        ("p 195:0 rwm", "type a, b or c"),
        ("c -1:0 rwm", "out of range"),
    ],
)
def test_a_bad_device_rule_is_named(rule: str, says: str) -> None:
    with pytest.raises(devices_bpf.DeviceFilterError, match=f"device rule '{rule}'.*{says}"):
        devices_bpf.device_program([rule])


def test_cgroup_v1_limits_are_written_per_controller_on_a_fake_tree(tmp_path: Path) -> None:
    for controller in ("memory", "cpu", "pids", "devices"):
        (tmp_path / controller).mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("max")
    assert cgroups.detect(tmp_path) == "v1"
    tree = cgroups.Cgroups("v1", parent="alnair", node="n1", root=tmp_path)
    group = tree.create("3-1", cgroups.Limits(64 << 20, 0.5, 10, devices=None))
    assert len(group.directories) == 3  # no devices controller asked for
    assert (tmp_path / "memory/alnair/n1/3-1/memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (tmp_path / "cpu/alnair/n1/3-1/cpu.cfs_quota_us").read_text() == "50000"
    assert (tmp_path / "pids/alnair/n1/3-1/pids.max").read_text() == "10"
    (tmp_path / "memory/alnair/n1/3-1/memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    )
    assert group.oom_killed()


def test_a_granted_gpu_without_a_device_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(cgroups.CgroupError, match="nvidia3 does not exist"):
        cgroups.gpu_device_rules(tmp_path, [3])
    (tmp_path / "nvidia0").write_text("")
    with pytest.raises(cgroups.CgroupError, match="not a character device"):
        cgroups.gpu_device_rules(tmp_path, [0])


def test_a_tenant_missing_from_the_map_or_the_node_is_refused_at_launch(tmp_path: Path) -> None:
    tenants = TenantMap((TenantUser("a", "no-such-user-here"),), "t.yaml")
    confinement = Confinement(tenants=tenants, runtime_root=tmp_path, path="/usr/bin")
    with pytest.raises(ConfineError, match=r"tenant b has no Unix user in the tenant map t\.yaml"):
        confinement.user_for("b")
    with pytest.raises(ConfineError, match="user no-such-user-here does not exist on this node"):
        confinement.user_for("a")


def test_the_exec_shim_never_runs_a_job_as_root() -> None:
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(SHIM), "--uid", "0", "--gid", "0", "--", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 127
    assert "refusing to run a job as root" in done.stderr


# -- jobs' NATS identity: the auth callout's answers, without a server -----------------


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _request(server: nkeys.KeyPair, user: str, token: str) -> bytes:
    """An authorization request as nats-server signs it."""
    claims = {
        "sub": "ACALLOUT",
        "aud": "nats-authorization-request",
        "nats": {
            "server_id": {"id": server.public_key.decode(), "name": "s"},
            "user_nkey": user,
            "connect_opts": {"auth_token": token, "name": "supervisor:7"},
            "type": "authorization_request",
            "version": 2,
        },
    }
    return natsjwt.encode(claims, server).encode()


async def test_the_callout_admits_a_running_attempt_to_its_own_subjects_only() -> None:
    key = os.urandom(32)
    server = _keypair(nkeys.PREFIX_BYTE_SERVER)
    signer = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user = _keypair(nkeys.PREFIX_BYTE_USER).public_key.decode()
    running = {("7", 2)}

    async def cluster_key() -> bytes:
        return key

    callout = JobCredentials(signer, cluster_key, lambda j, a: (j, a) in running, clock=lambda: 1e9)
    token = job_token(key, "7", 2)
    assert check_job_token(key, token) == ("7", 2)
    assert check_job_token(os.urandom(32), token) is None
    assert check_job_token(key, "7:2:forged") is None

    answer = natsjwt.decode((await callout.answer(_request(server, user, token))).decode())
    assert answer["sub"] == user
    assert answer["aud"] == server.public_key.decode()
    assert answer["iss"] == signer.public_key.decode()
    granted = natsjwt.decode(answer["nats"]["jwt"])
    assert (granted["sub"], granted["aud"]) == (user, "$G")
    # It expires; the job's connections renew it (tests/test_job_credentials.py).
    assert granted["exp"] == int(1e9 + DEFAULT_TTL_S)
    allowed = granted["nats"]["pub"]["allow"]
    assert "alnair.job.7.progress" in allowed and "alnair.job.7.event" in allowed
    assert not any(s.startswith("alnair.node.") or "job.*" in s for s in allowed), allowed
    assert granted["nats"]["sub"]["allow"][0] == "_INBOX_job_7_2.>"

    running.clear()  # the attempt ended: the same token admits nobody
    refused = natsjwt.decode((await callout.answer(_request(server, user, token))).decode())
    assert refused["nats"]["error"] == "job 7 attempt 2 is not running"
    assert "jwt" not in refused["nats"]
    other = natsjwt.decode((await callout.answer(_request(server, user, "x"))).decode())
    assert other["nats"]["error"] == "not a job token of this cluster"
    assert (callout.admitted, callout.refused) == (1, 2)


def test_a_forged_request_does_not_verify() -> None:
    server = _keypair(nkeys.PREFIX_BYTE_SERVER)
    head, body, _ = _request(server, "U", "t").decode().split(".")
    other = _keypair(nkeys.PREFIX_BYTE_SERVER)
    forged = f"{head}.{body}." + _request(other, "U", "t").decode().split(".")[2]
    with pytest.raises(natsjwt.JwtError, match="does not verify"):
        natsjwt.parse_auth_request(forged.encode())


def test_up_can_tell_an_interpreter_other_users_cannot_reach() -> None:
    # Not under tmp_path: pytest keeps that closed to others.
    base = Path(tempfile.mkdtemp(prefix="alnair-reach-"))
    try:
        base.chmod(0o755)
        closed = base / "closed"
        (closed / "bin").mkdir(parents=True)
        program = closed / "bin" / "python"
        program.write_text("")
        program.chmod(0o755)
        closed.chmod(0o700)
        assert unreachable_by_others(program) == closed
        closed.chmod(0o755)
        assert unreachable_by_others(program) is None
        program.chmod(0o750)
        assert unreachable_by_others(program) == program
    finally:
        shutil.rmtree(base, ignore_errors=True)
