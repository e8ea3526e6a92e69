"""The in-job SDK for failure handling: bad inputs and the input blacklist.

A job tells the brain which input broke it, so that an input that breaks several jobs
is blacklisted cluster-wide (Philly), and asks whether an input is blacklisted so it
can skip it. Progress reporting lives in `workloads/progress.py`. This module imports
neither torch nor horovod; nats-py and the schemas load only when a report is sent.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from bus.client import ConnectOptions

# --- failures: bad inputs and the input blacklist -------------------------------------
# A job tells the brain which input broke it, so that an input that breaks several jobs
# is blacklisted cluster-wide (Philly). Over NATS when the agent gave the job its
# address, and always as a marker line in the job's log, which the brain also reads
# when the job exits with BAD_INPUT_EXIT_CODE.


def _blacklist_constants() -> tuple[int, str, str]:
    from schemas.jobs import BAD_INPUT_EXIT_CODE, BAD_INPUT_MARKER, BLACKLIST_FILE_ENV

    return BAD_INPUT_EXIT_CODE, BAD_INPUT_MARKER, BLACKLIST_FILE_ENV


def blacklisted_inputs() -> frozenset[str]:
    """The cluster's input blacklist as it was when this attempt started."""
    path = os.environ.get(_blacklist_constants()[2])
    if not path:
        return frozenset()
    try:
        with open(path, encoding="utf-8") as handle:
            return frozenset(line.strip() for line in handle if line.strip())
    except OSError:
        return frozenset()


def is_blacklisted(uri: str) -> bool:
    """Whether the cluster has blacklisted this input: skip it."""
    return uri in blacklisted_inputs()


def report_bad_input(uri: str, reason: str = "", *, timeout_s: float = 5.0) -> bool:
    """Report that this job fails on `uri`. Returns whether the brain's event stream
    stored the report; the marker line in the log is written either way."""
    _, marker, _ = _blacklist_constants()
    print(f"{marker} {uri} {reason}".rstrip(), file=sys.stderr, flush=True)
    env = os.environ
    server, job_id = env.get("ALNAIR_NATS"), env.get("ALNAIR_JOB_ID")
    attempt, node = env.get("ALNAIR_ATTEMPT"), env.get("ALNAIR_NODE")
    if not (server and job_id and attempt and node):
        return False
    try:
        return asyncio.run(
            _publish_bad_input(server, job_id, int(attempt), node, uri, reason, timeout_s)
        )
    except Exception:
        # Reporting must never add a failure of its own; the log marker remains.
        return False


async def _publish_bad_input(
    server: str, job_id: str, attempt: int, node: str, uri: str, reason: str, timeout_s: float
) -> bool:
    import dataclasses
    import uuid

    from bus.client import Bus
    from schemas import subjects
    from schemas.events import InputError

    event = InputError(
        event_id=uuid.uuid4().hex,
        node=node,
        ts=time.time(),
        job_id=job_id,
        attempt=attempt,
        uri=uri,
        reason=reason[:1000],
    )
    options = dataclasses.replace(
        job_connect_options(server, f"sdk:{job_id}"),
        connect_timeout_s=timeout_s,
        max_reconnect_attempts=1,
    )
    bus = await Bus.connect(options)
    try:
        await bus.publish_durable(subjects.job(job_id, "event"), event, msg_id=event.event_id)
        return True
    finally:
        await bus.close()


def job_connect_options(servers: str, name: str) -> ConnectOptions:
    """How a job's own processes (its supervisor, this SDK) reach NATS: every server the
    agent named, and under --secure / --tls the credential and TLS files it was given:
    its attempt's token (ALNAIR_JOB_TOKEN, admitted by the brain's auth callout as a
    user of its own job's subjects, renewed every ALNAIR_JOB_RENEW_S), else its node's
    job identity (ALNAIR_NKEY), and ALNAIR_TLS_CA/_CERT/_KEY (a confined job's own
    certificate, renewed on disk by its agent and read again at each reconnection)."""
    from bus.auth import inbox_prefix_for_seed, job_inbox_prefix
    from bus.client import ConnectOptions

    env = os.environ
    token = env.get("ALNAIR_JOB_TOKEN") or None
    nkey = None if token else env.get("ALNAIR_NKEY") or None
    inbox = inbox_prefix_for_seed(nkey) if nkey else None
    renew_s = None
    if token:
        job_id, _, rest = token.partition(":")
        inbox = job_inbox_prefix(job_id, int(rest.partition(":")[0] or 0))
        renew_s = _renew_interval(env.get("ALNAIR_JOB_RENEW_S", ""))
    return ConnectOptions(
        servers=tuple(url for url in servers.split(",") if url),
        name=name,
        nkey_seed=nkey,
        token=token,
        inbox_prefix=inbox,
        tls_ca=env.get("ALNAIR_TLS_CA") or None,
        tls_cert=env.get("ALNAIR_TLS_CERT") or None,
        tls_key=env.get("ALNAIR_TLS_KEY") or None,
        renew_s=renew_s,
    )


def _renew_interval(text: str) -> float | None:
    """ALNAIR_JOB_RENEW_S, as the brain wrote it; None (no renewal) when absent."""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"ALNAIR_JOB_RENEW_S: a positive number of seconds, not {text!r}")
    return value


def fail_on_bad_input(uri: str, reason: str = "") -> NoReturn:
    """Report `uri` as the input this job fails on, and exit with the documented code."""
    report_bad_input(uri, reason)
    sys.exit(_blacklist_constants()[0])
