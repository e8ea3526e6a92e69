"""Workers of an elastic job on nodes other than its supervisor's.

horovodrun (on the supervisor's node) starts every worker itself; for a host that is
not local it runs a remote command, which Alnair routes to the job's *worker host* on
that node (`workloads/worker_host.py`, the job's process there, launched by the node's
agent) instead of ssh. Request/reply on `alnair.job.<job>.exec`; the worker host relays
its workers' progress and exits to the supervisor on `alnair.job.<job>.workers`. Core
NATS: a lost reply is asked again (`poll`), a lost report replaced by the next.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from pydantic import Field

from schemas.base import Message, NodeName

# The attempt's secret, in the environment of its supervisor and its worker hosts.
EXEC_SECRET_ENV = "ALNAIR_EXEC_SECRET"


class ExecRequest(Message):
    """Start a worker on `node` (`start`), ask how it is (`poll`), or signal it; or set
    the GPUs the node's new workers claim and ask which its workers hold (`devices`)."""

    op: Literal["start", "poll", "signal", "devices"]
    exec_id: str = Field(min_length=1, max_length=64)
    node: NodeName
    # `start`: the shell command horovodrun built (cd, env, the training command).
    command: str = Field(default="", max_length=65536)
    # `signal`: which one (SIGTERM, when horovodrun stops the worker).
    signal: int | None = Field(default=None, ge=1, le=64)
    # `devices`: the job's GPUs on the node from now on (a grow's new workers claim the
    # added ones); empty: only ask which its workers hold.
    gpus: tuple[int, ...] = Field(default=(), max_length=4096)
    # HMAC-SHA256 of the request under the attempt's secret (`exec_mac`): the worker
    # host obeys only its own job's supervisor (brain/secrets.py says why).
    mac: str = Field(default="", max_length=128)

    def signed(self, secret: str) -> ExecRequest:
        return self.model_copy(update={"mac": exec_mac(secret, self)})

    def signed_by(self, secret: str) -> bool:
        return bool(secret) and hmac.compare_digest(self.mac, exec_mac(secret, self))


def exec_mac(secret: str, request: ExecRequest) -> str:
    fields = (
        request.op,
        request.exec_id,
        request.node,
        str(request.signal or ""),
        ",".join(map(str, request.gpus)),
    )
    text = "\n".join((*fields, request.command))
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


class ExecState(Message):
    """A worker host's answer: the worker's pid, and its exit code once it has ended;
    to `devices`, the GPUs its workers hold."""

    exec_id: str = Field(min_length=1, max_length=64)
    node: NodeName
    pid: int | None = Field(default=None, ge=1)
    running: bool = False
    exit_code: int | None = None
    # Why the request failed (an unknown exec id, a command that would not start).
    error: str = Field(default="", max_length=1000)
    # `devices`: the node's GPUs a live worker of the job holds (its claim's lock).
    held: tuple[int, ...] = Field(default=(), max_length=4096)


class WorkerRelay(Message):
    """A worker host -> the supervisor's node: one worker's progress datagram as the
    worker sent it, the pid of a worker that has exited, or a line of a worker's output
    (for the `remote_exec` that started it, which prints it where horovodrun reads it,
    as an ssh session would)."""

    node: NodeName
    report: str = Field(default="", max_length=8192)
    gone_pid: int | None = Field(default=None, ge=1)
    exec_id: str = Field(default="", max_length=64)
    output: str = Field(default="", max_length=8192)
