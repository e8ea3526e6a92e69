"""The first process of a confined job: join its cgroups, become its user, run it.

Run by the agent (as root) as `python -I -S confine_exec.py --uid U --gid G
[--join FILE]... [--cwd DIR] -- PROGRAM ARGS...`, with the job's environment already in
place. Joining before the job's program runs puts every process it will ever start in
the job's cgroups; dropping to the user before `exec` (supplementary groups cleared,
then gid, then uid) leaves it no way back. Standard library only, and no imports from
this project: it runs with site-packages off, and must start fast.

Exit 127 with a line on stderr (the job's log) when something here fails.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"alnair: cannot start the job: {message}\n")
    sys.stderr.flush()
    os._exit(127)


def _options(options: list[str]) -> tuple[int, int, str | None, list[str]]:
    values: dict[str, list[str]] = {"--uid": [], "--gid": [], "--cwd": [], "--join": []}
    for key, value in zip(options[::2], options[1::2], strict=False):
        if key not in values:
            _fail(f"unknown option {key}")
        values[key].append(value)
    uid = int(values["--uid"][0]) if values["--uid"] else -1
    gid = int(values["--gid"][0]) if values["--gid"] else -1
    cwd = values["--cwd"][0] if values["--cwd"] else None
    return uid, gid, cwd, values["--join"]


def main(argv: list[str]) -> None:
    if "--" not in argv:
        _fail("no program given")
    split = argv.index("--")
    program = argv[split + 1 :]
    uid, gid, cwd, joins = _options(argv[:split])
    if uid <= 0 or gid <= 0 or not program:
        _fail("refusing to run a job as root or with no program")
    pid = str(os.getpid())
    for procs in joins:
        try:
            with open(procs, "w") as f:
                f.write(pid)
        except OSError as error:
            _fail(f"cannot join cgroup {procs}: {error.strerror}")
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    except OSError as error:
        _fail(f"cannot become uid {uid} gid {gid}: {error.strerror}")
    os.umask(0o027)
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError as error:
            _fail(f"working directory {cwd}: {error.strerror} (as uid {uid})")
    try:
        os.execvp(program[0], program)
    except OSError as error:
        _fail(f"{program[0]!r}: {error.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
