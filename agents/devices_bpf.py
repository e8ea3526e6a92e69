"""Device access on cgroup v2: an eBPF device program per job cgroup.

cgroup v2 has no devices controller. The kernel asks the `BPF_PROG_TYPE_CGROUP_DEVICE`
programs attached to a task's cgroup (and its ancestors) whether an open or mknod of a
device node may go ahead, as runc and systemd use it. This module assembles such a
program from the same rules the v1 controller takes (`"c 195:0 rwm"`, `"c 136:* rwm"`:
type, major, minor or `*`, access), loads it with `bpf(2)` and attaches it to a cgroup
directory, through ctypes: no compiler, no libbpf, no new dependency.

The program has v1's semantics: deny everything, allow what a rule names. Block
devices are denied unless a rule names them. It is attached with `BPF_F_ALLOW_MULTI`,
so a parent's program (systemd's, for a delegated unit) still applies: both must allow.
An attached program lives as long as the cgroup: removing the directory detaches it.

What this module must not do: decide which devices a job gets (agents/confine.py and
agents/cgroups.py do).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from schemas.errors import AlnairError

# bpf(2) commands, program and attach types (include/uapi/linux/bpf.h).
BPF_PROG_LOAD: Final = 5
BPF_PROG_ATTACH: Final = 8
BPF_PROG_DETACH: Final = 9
BPF_PROG_GET_FD_BY_ID: Final = 13
BPF_PROG_QUERY: Final = 16
BPF_PROG_TYPE_CGROUP_DEVICE: Final = 15
BPF_CGROUP_DEVICE: Final = 6
BPF_F_ALLOW_MULTI: Final = 2
SYSCALL_BPF: Final = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
ATTR_SIZE: Final = 128  # larger than any field used; the kernel accepts a zero tail
LICENSE: Final = b"Apache-2.0\0"  # no GPL-only helper is called
LOG_SIZE: Final = 64 * 1024

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }: access_type
# is (access << 16) | type.
DEV_BLOCK: Final = 1
DEV_CHAR: Final = 2
ACCESS_BITS: Final = {"m": 1, "r": 2, "w": 4}
ALL_ACCESS: Final = 7

# eBPF opcodes used (class | op | source).
LDX_MEM_W: Final = 0x61
ALU64_AND_K: Final = 0x57
ALU64_RSH_K: Final = 0x77
ALU64_MOV_K: Final = 0xB7
ALU64_MOV_X: Final = 0xBF
JMP_JNE_K: Final = 0x55
JMP_EXIT: Final = 0x95


class DeviceFilterError(AlnairError):
    def __init__(self, message: str, *, errno_: int = 0) -> None:
        super().__init__(message)
        self.errno = errno_


@dataclass(frozen=True, slots=True)
class DeviceRule:
    """One allow rule: `kind` "c", "b" or "a" (both); None for a `*` number."""

    kind: str
    major: int | None
    minor: int | None
    access: int

    @classmethod
    def parse(cls, text: str) -> DeviceRule:
        """A v1 `devices.allow` line: `TYPE MAJOR:MINOR ACCESS` (`a` alone: everything)."""
        parts = text.split()
        if parts == ["a"]:
            return cls("a", None, None, ALL_ACCESS)
        try:
            kind, numbers, access_text = parts
            major_text, minor_text = numbers.split(":")
            major = None if major_text == "*" else int(major_text)
            minor = None if minor_text == "*" else int(minor_text)
            access = 0
            for letter in access_text:
                access |= ACCESS_BITS[letter]
        except (ValueError, KeyError):
            raise DeviceFilterError(
                f"device rule {text!r}: expected 'TYPE MAJOR:MINOR ACCESS', e.g. 'c 195:0 rwm'"
            ) from None
        if kind not in ("a", "b", "c") or not 0 < access <= ALL_ACCESS:
            raise DeviceFilterError(f"device rule {text!r}: type a, b or c, access of r, w, m")
        for number in (major, minor):
            if number is not None and not 0 <= number < 2**31:
                raise DeviceFilterError(f"device rule {text!r}: device number out of range")
        return cls(kind, major, minor, access)


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _rule_block(rule: DeviceRule) -> list[bytes]:
    """Instructions that return 1 (allow) when the request matches `rule`, else fall
    through to the next block. Registers: r2 type, r3 access, r4 major, r5 minor."""
    tests: list[list[bytes]] = []
    if rule.kind != "a":
        tests.append([_insn(JMP_JNE_K, dst=2, imm=DEV_CHAR if rule.kind == "c" else DEV_BLOCK)])
    if rule.access != ALL_ACCESS:
        # Any access bit the rule does not grant: no match.
        tests.append(
            [
                _insn(ALU64_MOV_X, dst=1, src=3),
                _insn(ALU64_AND_K, dst=1, imm=ALL_ACCESS & ~rule.access),
                _insn(JMP_JNE_K, dst=1, imm=0),
            ]
        )
    if rule.major is not None:
        tests.append([_insn(JMP_JNE_K, dst=4, imm=rule.major)])
    if rule.minor is not None:
        tests.append([_insn(JMP_JNE_K, dst=5, imm=rule.minor)])
    allow = [_insn(ALU64_MOV_K, dst=0, imm=1), _insn(JMP_EXIT)]
    block: list[bytes] = []
    remaining = sum(len(t) for t in tests) + len(allow)
    for test in tests:
        remaining -= len(test)
        # Each test ends in its jump; a mismatch skips what is left of the block.
        *setup, jump = test
        code, regs, _, imm = struct.unpack("<BBhi", jump)
        block += [*setup, struct.pack("<BBhi", code, regs, remaining, imm)]
    return block + allow


def device_program(rules: Sequence[str]) -> bytes:
    """The eBPF instructions of a device program allowing exactly `rules`."""
    parsed = [DeviceRule.parse(rule) for rule in rules]
    program = [
        _insn(LDX_MEM_W, dst=2, src=1, off=0),
        _insn(ALU64_AND_K, dst=2, imm=0xFFFF),
        _insn(LDX_MEM_W, dst=3, src=1, off=0),
        _insn(ALU64_RSH_K, dst=3, imm=16),
        _insn(LDX_MEM_W, dst=4, src=1, off=4),
        _insn(LDX_MEM_W, dst=5, src=1, off=8),
    ]
    for rule in parsed:
        program += _rule_block(rule)
    program += [_insn(ALU64_MOV_K, dst=0, imm=0), _insn(JMP_EXIT)]
    return b"".join(program)


def _bpf(command: int, attr: ctypes.Array[ctypes.c_char], what: str) -> int:
    number = SYSCALL_BPF.get(platform.machine())
    if number is None:
        raise DeviceFilterError(f"bpf(2) on {platform.machine()} is not supported by Alnair")
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(
        libc.syscall(ctypes.c_long(number), ctypes.c_long(command), attr, ctypes.c_long(ATTR_SIZE))
    )
    if result < 0:
        code = ctypes.get_errno()
        raise DeviceFilterError(f"{what}: {os.strerror(code)}", errno_=code)
    return result


def _attr(fmt: str, *values: int) -> ctypes.Array[ctypes.c_char]:
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def load(rules: Sequence[str]) -> int:
    """A file descriptor of the loaded program (close it once attached)."""
    code = device_program(rules)
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(LICENSE, len(LICENSE))
    log_buf = ctypes.create_string_buffer(LOG_SIZE)
    attr = _attr(
        "<IIQQIIQ",
        BPF_PROG_TYPE_CGROUP_DEVICE,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license_),
        1,  # log level: the verifier says why it refused
        LOG_SIZE,
        ctypes.addressof(log_buf),
    )
    struct.pack_into("16s", attr, 48, b"alnair_devices")
    try:
        return _bpf(BPF_PROG_LOAD, attr, "cannot load the device program")
    except DeviceFilterError as error:
        verifier = log_buf.value.decode(errors="replace").strip()
        if verifier:
            message = f"{error} (verifier: {verifier[-500:]})"
            raise DeviceFilterError(message, errno_=error.errno) from None
        raise


def attach(cgroup_dir: Path, rules: Sequence[str]) -> None:
    """Allow the tasks of `cgroup_dir` (and its descendants) exactly `rules`."""
    directory = _open_dir(cgroup_dir)
    try:
        program = load(rules)
        try:
            attr = _attr("<IIII", directory, program, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)
            _bpf(BPF_PROG_ATTACH, attr, f"cannot attach the device program to {cgroup_dir}")
        finally:
            os.close(program)
    finally:
        os.close(directory)


def attached(cgroup_dir: Path) -> list[int]:
    """The ids of the device programs attached to `cgroup_dir` itself."""
    directory = _open_dir(cgroup_dir)
    try:
        ids = (ctypes.c_uint32 * 64)()
        attr = _attr("<IIIIQI", directory, BPF_CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), 64)
        _bpf(BPF_PROG_QUERY, attr, f"cannot list the device programs of {cgroup_dir}")
        count = struct.unpack_from("<I", attr, 24)[0]
        return list(ids[: min(count, 64)])
    finally:
        os.close(directory)


def detach_all(cgroup_dir: Path) -> int:
    """Detach every device program attached to `cgroup_dir`; how many were."""
    ids = attached(cgroup_dir)
    directory = _open_dir(cgroup_dir)
    try:
        for prog_id in ids:
            program = _bpf(BPF_PROG_GET_FD_BY_ID, _attr("<I", prog_id), "cannot open program")
            try:
                attr = _attr("<III", directory, program, BPF_CGROUP_DEVICE)
                _bpf(BPF_PROG_DETACH, attr, f"cannot detach program {prog_id} from {cgroup_dir}")
            finally:
                os.close(program)
    finally:
        os.close(directory)
    return len(ids)


def _open_dir(cgroup_dir: Path) -> int:
    try:
        return os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise DeviceFilterError(
            f"cannot open cgroup {cgroup_dir}: {error.strerror}", errno_=error.errno or errno.EIO
        ) from None
