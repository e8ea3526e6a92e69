"""The cluster's secret for an elastic job's worker starts across nodes.

A worker host (workloads/worker_host.py) starts whatever command an `ExecRequest`
carries, and under `--secure` every node may publish such requests (every node may host
workers). So each request carries an HMAC under a secret only that attempt's processes
know: the brain derives it from a cluster key and puts it in the attempt's `Launch`
environment (`ALNAIR_EXEC_SECRET`) on each of its nodes; another node, which never sees
those launches, cannot sign a request for it.

The key lives in a JetStream KV bucket that only brains may reach, created by the first
brain and read by every later one, so a new leader derives the same secrets (a re-sent
launch must carry the same one). Nothing secret enters the job's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from typing import Final

import nats.errors
import nats.js.errors

from bus.client import Bus

log = logging.getLogger(__name__)

SECRETS_BUCKET: Final = "alnair_secrets"
EXEC_KEY: Final = "exec"
# How long `exec_key` asks again while the bucket's stream cannot answer: in a JetStream
# cluster a bucket just created has no stream leader for a moment (its first write gets
# no responders), and one whose server died elects another.
KEY_RETRY_FOR_S: Final = 15.0
# JetStream not answering yet, as the KV client raises it.
NOT_ANSWERING: Final = (
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    TimeoutError,  # nats.errors.TimeoutError is one
)


async def exec_key(bus: Bus, *, retry_for_s: float = KEY_RETRY_FOR_S) -> bytes:
    """The cluster's key, created once (create-if-absent: racing brains agree); asked
    again, with back-off, while JetStream cannot answer, for up to `retry_for_s`."""
    deadline = time.monotonic() + retry_for_s
    delay = 0.1
    while True:
        try:
            return await _read_or_make_key(bus)
        except NOT_ANSWERING as error:
            if time.monotonic() + delay >= deadline:
                raise
            log.info("the cluster key's bucket does not answer yet (%r): asking again", error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _read_or_make_key(bus: Bus) -> bytes:
    try:
        bucket = await bus.js.key_value(SECRETS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        bucket = await bus.js.create_key_value(
            bucket=SECRETS_BUCKET, history=1, replicas=bus.replicas
        )
    # Another brain may have made it first: then the one it made is the key.
    with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
        await bucket.create(EXEC_KEY, os.urandom(32).hex().encode())
    entry = await bucket.get(EXEC_KEY)
    assert entry.value is not None
    return bytes.fromhex(entry.value.decode())


def exec_secret(key: bytes, job_id: str, attempt: int) -> str:
    """The secret of one attempt of one job."""
    return hmac.new(key, f"{job_id}:{attempt}".encode(), hashlib.sha256).hexdigest()


JOB_TOKEN_ENV: Final = "ALNAIR_JOB_TOKEN"
# How often a job's connections reconnect to renew the NATS user its token is admitted
# as (brain/credentials.py: the user expires).
JOB_RENEW_ENV: Final = "ALNAIR_JOB_RENEW_S"


def job_token(key: bytes, job_id: str, attempt: int) -> str:
    """What one attempt of one job connects to NATS with (brain/credentials.py):
    `<job>:<attempt>:<mac>`, the MAC under the cluster key."""
    mac = hmac.new(key, f"nats:{job_id}:{attempt}".encode(), hashlib.sha256).hexdigest()
    return f"{job_id}:{attempt}:{mac}"


def check_job_token(key: bytes, token: str) -> tuple[str, int] | None:
    """The (job, attempt) a token was made for, or None if it was not made with `key`."""
    job_id, _, rest = token.partition(":")
    attempt, _, _ = rest.partition(":")
    if not job_id or not attempt.isdigit():
        return None
    if not hmac.compare_digest(token, job_token(key, job_id, int(attempt))):
        return None
    return job_id, int(attempt)
