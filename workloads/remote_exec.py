"""One worker of an elastic job on another node, as horovodrun sees it.

Alnair's launcher (`workloads/hvdrun.py`) makes horovodrun run this where it would run
`ssh <host> <command>`: it asks the job's worker host on that node
(`workloads/worker_host.py`) to start the command, then polls until the worker ends and
exits with its exit code, so horovodrun's elastic driver watches it as it would an ssh
session, and prints the worker's output as it comes (relayed by the worker host; the
node's own job log has all of it, should a line be lost here). Stopped (SIGTERM,
SIGINT), it passes the signal on and waits briefly for the worker to end.

    python -m workloads.remote_exec --host NODE -- 'cd DIR ; env ... python train.py'

The job id, the NATS servers and the identity come from the environment the agent gave
the supervisor (`ALNAIR_JOB_ID`, `ALNAIR_NATS`, `ALNAIR_NKEY`, `ALNAIR_TLS_*`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Final

from nats.aio.msg import Msg

from bus.client import Bus
from schemas import subjects
from schemas.errors import BusError
from schemas.workers import EXEC_SECRET_ENV, ExecRequest, ExecState, WorkerRelay
from workloads.sdk import job_connect_options

log = logging.getLogger(__name__)

# The worker host starts with the job's other ranks: it may not listen yet.
START_WAIT_S: Final = 60.0
POLL_S: Final = 0.5
# A worker host unheard of this long (its node gone) counts as a failed worker.
LOST_AFTER_S: Final = 60.0
# The file (set by the supervisor) listing, one to a line, the nodes the brain found
# lost: a worker there is given up at the next poll rather than after LOST_AFTER_S,
# so that Horovod's driver, which waits for it, re-forms the job at once.
LOST_NODES_ENV: Final = "ALNAIR_LOST_NODES_FILE"
SIGNAL_GRACE_S: Final = 10.0
OUTPUT_LINGER_S: Final = 0.5
NO_WORKER_EXIT: Final = 255


async def ask(bus: Bus, job_id: str, request: ExecRequest, *, timeout_s: float = 2.0) -> ExecState:
    """`request` to the job's worker hosts, signed with the attempt's secret (from the
    environment the agent gave this process); raises BusError when none answers."""
    signed = request.signed(os.environ.get(EXEC_SECRET_ENV, ""))
    return await bus.request(subjects.job(job_id, "exec"), signed, ExecState, timeout_s=timeout_s)


async def run(job_id: str, node: str, command: str, bus: Bus) -> int:
    exec_id = uuid.uuid4().hex

    async def on_relay(relay: WorkerRelay, msg: Msg) -> None:
        if relay.exec_id == exec_id and relay.output:
            sys.stdout.write(relay.output)
            sys.stdout.flush()

    await bus.subscribe(subjects.job(job_id, "workers"), WorkerRelay, on_relay)
    code = await _run(job_id, node, command, bus, exec_id)
    # The last lines may still be on their way.
    await asyncio.sleep(OUTPUT_LINGER_S)
    return code


def found_lost(node: str) -> bool:
    """Has the brain found `node` lost (`LOST_NODES_ENV`)?"""
    path = os.environ.get(LOST_NODES_ENV)
    if not path:
        return False
    try:
        with open(path) as listed:
            return node in listed.read().split()
    except FileNotFoundError:
        return False


def _given_up(job_id: str, node: str, unheard_s: float) -> str | None:
    """Why a worker whose host does not answer is given up, if it is."""
    if found_lost(node):
        return f"node {node} was lost (the brain says so)"
    if unheard_s > LOST_AFTER_S:
        return f"lost the worker host of job {job_id} on {node}"
    return None


async def _run(job_id: str, node: str, command: str, bus: Bus, exec_id: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    start = ExecRequest(op="start", exec_id=exec_id, node=node, command=command)
    deadline = time.monotonic() + START_WAIT_S
    while True:
        try:
            state = await ask(bus, job_id, start)
            break
        except BusError as error:  # nobody answers yet: the worker host is starting
            if time.monotonic() > deadline or stop.is_set() or found_lost(node):
                print(f"alnair: no worker host for job {job_id} on {node}: {error}", flush=True)
                return NO_WORKER_EXIT
            await asyncio.sleep(POLL_S)
    if state.error or state.pid is None:
        print(f"alnair: worker on {node} did not start: {state.error}", flush=True)
        return NO_WORKER_EXIT

    heard = time.monotonic()
    signalled_at: float | None = None
    while True:
        if stop.is_set() and signalled_at is None:
            signalled_at = time.monotonic()
            request = ExecRequest(
                op="signal", exec_id=exec_id, node=node, signal=int(signal.SIGTERM)
            )
        else:
            request = ExecRequest(op="poll", exec_id=exec_id, node=node)
        try:
            state = await ask(bus, job_id, request)
            heard = time.monotonic()
        except BusError:
            given_up = _given_up(job_id, node, time.monotonic() - heard)
            if given_up is not None:
                print(f"alnair: {given_up}", flush=True)
                return NO_WORKER_EXIT
        if not state.running:
            return state.exit_code if state.exit_code is not None else NO_WORKER_EXIT
        if signalled_at is not None and time.monotonic() - signalled_at > SIGNAL_GRACE_S:
            return 128 + int(signal.SIGTERM)
        if stop.is_set():
            await asyncio.sleep(POLL_S)
        else:  # woken at once by a stop, to pass it on
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=POLL_S)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workloads.remote_exec")
    parser.add_argument("--host", required=True, help="the node to run the worker on")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not words:
        parser.error("no command given")
    args.command = " ".join(words)
    return args


async def _main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    job_id, servers = os.environ.get("ALNAIR_JOB_ID"), os.environ.get("ALNAIR_NATS")
    if not (job_id and servers):
        print("alnair: ALNAIR_JOB_ID and ALNAIR_NATS must be set", file=sys.stderr)
        return NO_WORKER_EXIT
    bus = await Bus.connect(job_connect_options(servers, f"remote-exec:{job_id}:{args.host}"))
    try:
        return await run(job_id, args.host, args.command, bus)
    finally:
        await bus.close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    sys.exit(asyncio.run(_main(sys.argv[1:])))


if __name__ == "__main__":
    main()
