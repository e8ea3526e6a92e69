"""The operator's side of the API: connect, ask the brain, turn refusals into errors."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Final, TypeVar

from pydantic import TypeAdapter

from bus.auth import READ_ONLY_VERBS, inbox_prefix_for_seed
from bus.client import Bus, ConnectOptions
from cli.config import TlsSettings
from schemas import subjects
from schemas.api import JOB_RESULT, OPERATOR_TENANT, ErrorReply, JobReply, SubmitRequest
from schemas.base import Message
from schemas.errors import (
    ApiError,
    BrainUnavailable,
    BusClosed,
    BusDenied,
    BusError,
    BusTimeout,
    InvalidMessage,
    NoDefiniteAnswer,
)
from schemas.jobs import JobRecord, JobSpec

R = TypeVar("R")


async def open_bus(
    servers: Sequence[str],
    *,
    name: str,
    credentials: str | None,
    nkey: str | None = None,
    tls: TlsSettings | None = None,
) -> Bus:
    return await Bus.connect(
        ConnectOptions(
            servers=tuple(servers),
            name=name,
            credentials=credentials,
            nkey_seed=nkey,
            inbox_prefix=inbox_prefix_for_seed(nkey) if nkey else None,
            tls_ca=tls.ca if tls else None,
            tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None,
            # An operator command should fail fast, not wait for ever for a server.
            max_reconnect_attempts=3,
        )
    )


log = logging.getLogger(__name__)

# How long a command asks again while no brain answers, or a read is answered
# `unavailable`: a failover (the lease's TTL, 5 s by default, then the takeover) or a
# NATS server restarting under the brain, not a cluster that is down.
FAILOVER_WAIT_S: Final = 10.0
# The first pause before asking again (each after doubles, to a second).
FIRST_RETRY_S: Final = 0.1


async def call(
    bus: Bus,
    tenant: str,
    verb: str,
    request: Message,
    reply: TypeAdapter[ErrorReply | R],
    *,
    timeout_s: float = 10.0,
    failover_s: float = FAILOVER_WAIT_S,
) -> R:
    """Ask the brain. Through a failover for up to `failover_s`, it asks again while no
    brain is subscribed (nobody got the request: safe for every verb) and, for a read,
    while the brain answers `unavailable` (a write so answered may have been stored:
    its caller decides, as `submit` does with its key)."""
    deadline = time.monotonic() + failover_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return await _call_once(bus, tenant, verb, request, reply, timeout_s=timeout_s)
        except BrainUnavailable as error:
            if time.monotonic() + delay > deadline:
                if failover_s > 0:
                    raise BrainUnavailable(error.subject, asked_for_s=failover_s) from None
                raise
            said = f"no brain is answering on {error.subject}"
        except ApiError as error:
            if error.code != "unavailable" or verb not in READ_ONLY_VERBS:
                raise
            if time.monotonic() + delay > deadline:
                raise
            said = f"the brain cannot answer {verb} now ({error.message})"
        if delay == FIRST_RETRY_S:
            # Once: a person waiting on a command that is silent for 10 s thinks it hung.
            log.warning("%s; asking again for up to %.0f s", said, failover_s)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def _call_once(
    bus: Bus,
    tenant: str,
    verb: str,
    request: Message,
    reply: TypeAdapter[ErrorReply | R],
    *,
    timeout_s: float,
) -> R:
    subject = subjects.api(tenant, verb)
    try:
        # Compact: a newer alnair asks an older brain anything it knows how to answer.
        result = await bus.request(subject, request, reply, timeout_s=timeout_s, compact=True)
    except BusDenied:
        raise BusError(_denied(tenant, verb, subject)) from None
    except InvalidMessage as error:
        # Replies are told apart by `ok` (schemas/api.py, `_result`): a reason about the
        # reply's own fields means the brain said it did what was asked.
        wrote = verb not in READ_ONLY_VERBS and not error.reason.startswith("ErrorReply")
        done = "; the brain says it was done" if wrote else ""
        raise InvalidMessage(
            f"the brain's answer to {verb} is not one this alnair can read ({error.reason})"
            f"{done}; a brain newer than this alnair answers with fields it does not know: "
            "upgrade alnair to the brain's version"
        ) from None
    if isinstance(result, ErrorReply):
        raise ApiError(result.code, result.error)
    return result


def _denied(tenant: str, verb: str, subject: str) -> str:
    """Why NATS refused a request, in the terms of the command that made it."""
    refused = f"NATS refused this identity publishing to {subject}"
    if tenant != OPERATOR_TENANT:
        return (
            f"{refused}: it is not tenant {tenant}'s; connect with that tenant's seed "
            "(--nkey), or pass the --tenant of the seed you have"
        )
    if verb in READ_ONLY_VERBS:
        return f"{refused}: it is not the operator's; connect with its seed (--nkey)"
    return (
        f"{refused}: over NATS the operator only reads ({', '.join(READ_ONLY_VERBS)}); "
        f"{verb} goes through the HTTP API with an operator token (docs/http.md)"
    )


async def submit(
    bus: Bus,
    tenant: str,
    spec: JobSpec,
    *,
    idempotency_key: str | None = None,
    retry_for_s: float = 30.0,
) -> JobRecord:
    """Submit, retrying through a brain failover without ever creating two jobs.

    Every try carries the same idempotency key, so a submission whose reply was lost
    (the brain died after storing it) is answered with the job it created.
    """
    key = idempotency_key or uuid.uuid4().hex
    request = SubmitRequest(spec=spec, idempotency_key=key)
    started = time.monotonic()
    deadline = started + retry_for_s
    delay = 0.1
    while True:
        try:
            reply: JobReply = await call(bus, tenant, "submit", request, JOB_RESULT, failover_s=0.0)
            return reply.job
        except (BrainUnavailable, BusTimeout) as error:
            retryable: Exception = error
        except BusClosed as error:
            # No try can follow on this connection: the answer is as undefined as at
            # the deadline, and the key says how to find it.
            raise NoDefiniteAnswer(key, time.monotonic() - started, error) from error
        except ApiError as error:
            if error.code != "unavailable":
                raise
            retryable = error
        if time.monotonic() + delay > deadline:
            raise NoDefiniteAnswer(key, retry_for_s, retryable) from retryable
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
