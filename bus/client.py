"""Typed access to NATS for every Alnair component.

`Bus` owns one connection. It validates every inbound message at the edge and sends
what fails to `alnair.dlq.<origin>` with the reason; no bad message, and no failing
handler, ever stops a subscription loop. JetStream publishes carry `Nats-Msg-Id` and
are retried with the same id on timeout: the outcome of a timed-out publish is
unknown, not failed, and the server's de-duplication makes the retry safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import re
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import (
    DEFAULT_SUB_PENDING_BYTES_LIMIT,
    DEFAULT_SUB_PENDING_MSGS_LIMIT,
    Subscription,
)
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ClusterInfo,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from pydantic import BaseModel, TypeAdapter

from schemas import subjects
from schemas.base import decode, encode, encode_request
from schemas.dlq import DLQ_PAYLOAD_PREVIEW_BYTES, DeadLetter
from schemas.errors import (
    BrainUnavailable,
    BusClosed,
    BusDenied,
    BusError,
    BusTimeout,
    HandBack,
    InvalidMessage,
    MessageTooLarge,
    SequenceConflict,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
Decoder = type[T] | TypeAdapter[T]
Handler = Callable[[T, Msg], Awaitable[None]]

DAY_S: Final = 86_400.0
DEDUP_WINDOW_S: Final = 120.0
# JetStream's error code for a failed Nats-Expected-Last-Sequence check.
WRONG_LAST_SEQUENCE: Final = 10071
WRONG_LAST_MSG_ID: Final = 10070
# How long one fetch waits for messages: also how long a loop takes to notice a stop.
FETCH_WAIT_S: Final = 0.5
# What one fetch of `read` asks for at most, in bytes (see there).
READ_BYTES: Final = 8 * 1024 * 1024
# What the headers of a JetStream append may add to its payload: its id and fences
# (`Nats-Msg-Id`, `Nats-Expected-Last-Sequence`, `Nats-Expected-Last-Msg-Id`).
HEADERS_ROOM: Final = 512
# While NATS cannot be reached, a component says so this often (it keeps trying).
UNREACHABLE_LOG_EVERY_S: Final = 30.0
# What nats-py hands the error callback when the server refuses a publish (lowercased).
_DENIED: Final = re.compile(r'permissions violation for publish to "?([^"\s]+)"?')
# A poison message is dead-lettered after this many failed deliveries.
MAX_HANDLER_ATTEMPTS: Final = 5
# JetStream keeps at most 5 copies; Alnair uses 1 (one server) or 3 (a cluster).
MAX_REPLICAS: Final = 5


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float | None
    description: str
    # Readers may get a message by subject straight from any replica (the snapshot
    # manifest, `js.get_msg`).
    allow_direct: bool = False


# What JetStream answers (or fails to) while it cannot serve yet: no meta leader, no
# quorum, nobody listening on its API.
_JETSTREAM_NOT_READY: Final = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.NoRespondersError,
    TimeoutError,  # nats.errors.TimeoutError is one
)
# How long `ensure_streams` waits for each answer of JetStream's API before asking again.
STREAM_API_TIMEOUT_S: Final = 1.0
# JetStream's error code for "stream name already in use" (created meanwhile by another).
_STREAM_NAME_IN_USE: Final = 10058

STREAMS: Final = (
    StreamSpec(
        subjects.STREAM_EVENTS,
        (subjects.ALL_NODE_EVENTS, subjects.ALL_JOB_EVENTS),
        7 * DAY_S,
        "node events: job exits, GPU faults (agent -> brain); job events: resizes done, "
        "input errors (a job's supervisor or SDK -> brain)",
    ),
    StreamSpec(
        subjects.STREAM_COMMANDS,
        (subjects.ALL_NODE_COMMANDS, subjects.ALL_JOB_COMMANDS),
        DAY_S,
        "commands to agents and supervisors, fenced by the brain's epoch",
    ),
    StreamSpec(
        subjects.STREAM_STATE,
        (subjects.ALL_STATE,),
        None,
        "the brain's journal: every job and node state change with its cause",
    ),
    StreamSpec(
        subjects.STREAM_SNAPSHOTS,
        (subjects.ALL_SNAPSHOTS,),
        None,
        "the brain's state snapshots: chunks, then a manifest (brain/snapshots.py)",
        allow_direct=True,
    ),
)


def _same_stream(stored: StreamConfig, wanted: StreamConfig) -> bool:
    """Whether a stream as stored already has what `ensure_streams` sets: then it is
    not updated (an update is a proposal to the JetStream cluster's meta leader, at
    every brain's start)."""

    def key(config: StreamConfig) -> tuple[Any, ...]:
        return (
            config.description,
            sorted(config.subjects or ()),
            config.retention,
            config.storage,
            config.discard,
            config.max_age or 0.0,
            config.duplicate_window or 0.0,
            config.num_replicas or 1,
            bool(config.allow_direct),
        )

    return key(stored) == key(wanted)


class Consumer:
    """A running pull-consumer loop that can be stopped without cancelling a fetch."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def stop(self, *, timeout_s: float = 3.0) -> None:
        self.stopping.set()
        if self.task is None:
            return
        done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        if not done:
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1.0)


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    servers: tuple[str, ...]
    name: str
    credentials: str | None = None
    # A file holding this identity's nkey seed (see bus/auth.py), and the reply-inbox
    # prefix its permissions allow.
    nkey_seed: str | None = None
    inbox_prefix: str | None = None
    # A token the brain's auth callout turns into a user (a job's, brain/credentials.py).
    token: str | None = None
    # TLS (bus/tls.py): the CA that signed the servers' certificate, and this client's
    # certificate and key, which servers that verify clients require.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # Reconnect this often, so that the server asks the auth callout again and the
    # user it admits, which expires (a job's, brain/credentials.py), is a fresh one.
    # nats-py closes a connection whose user expired for good rather than reconnect.
    renew_s: float | None = None
    connect_timeout_s: float = 5.0
    # Keep trying for ever: a component outlives a restart of its NATS server.
    max_reconnect_attempts: int = -1
    # A server that stops answering (its host partitioned: no reset, no EOF) is given
    # up after this many unanswered PINGs this far apart, and another one tried;
    # nats-py's defaults (2 x 120 s) leave a client on a dead link for minutes.
    ping_interval_s: float = 3.0
    max_outstanding_pings: int = 2


def _say_if_it_died(task: asyncio.Task[None]) -> None:
    """A spawned loop that ends in an exception is logged at once: one that stops
    silently (an agent no longer sending its events, say) is found only by its effects."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("task %s died: %r", task.get_name(), error, exc_info=error)


class Bus:
    def __init__(self, nc: NatsClient, *, component: str, replicas: int = 1) -> None:
        _check_replicas(replicas)
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=5.0)
        self.component = component
        self.replicas = replicas
        self.dead_lettered: Counter[str] = Counter()
        # Messages this client dropped because a subscription's pending limit was full
        # (nats-py's client-side slow consumer), by the subscription's subject.
        self.dropped: Counter[str] = Counter()
        # How it was connected, when through `connect`: `sibling` opens another so.
        self.options: ConnectOptions | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pull_subs: list[JetStreamContext.PullSubscription] = []
        self._consumers: list[Consumer] = []
        # Pipelined JetStream publishes awaiting their acknowledgement, by reply token.
        self._ack_prefix: str | None = None
        self._acks: dict[str, asyncio.Future[int]] = {}
        self._ack_tokens = 0
        # How many times `renew_s` reconnected this connection.
        self.renewals = 0
        # Set by `close`: the disconnection that follows is no news.
        self.closing = False
        # Requests waiting, by subject (lowercased, as nats-py reports a refusal), to be
        # told the server refused to publish them; subjects whose refusal was logged.
        self._refusals: dict[str, set[asyncio.Future[None]]] = {}
        self._refused_logged: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------

    @classmethod
    async def connect(cls, options: ConnectOptions, *, replicas: int = 1) -> Bus:
        _check_replicas(replicas)
        # The error callback counts drops on the Bus, which exists only once connected.
        made: list[Bus] = []

        def closing() -> bool:
            return bool(made) and made[0].closing

        # Only a connection that tries for ever says it is still trying; one that gives
        # up (a CLI's) says why when it does.
        forever = options.max_reconnect_attempts < 0
        unreachable = _Unreachable(options.name, options.servers) if forever else None

        handshake = _FirstHandshake()

        async def on_error(error: Exception) -> None:
            handshake.saw(error)
            if made and made[0]._handled(error):
                return
            if unreachable is None or not unreachable.said(error):
                await _log_error(error)

        kwargs: dict[str, Any] = {
            "servers": list(options.servers),
            "name": options.name,
            "connect_timeout": options.connect_timeout_s,
            "max_reconnect_attempts": options.max_reconnect_attempts,
            "reconnect_time_wait": 0.5,
            "ping_interval": options.ping_interval_s,
            "max_outstanding_pings": options.max_outstanding_pings,
            "allow_reconnect": True,
            "error_cb": on_error,
            "disconnected_cb": _log_disconnected(options.name, closing),
            "reconnected_cb": _log_reconnected(options.name),
        }
        if options.credentials:
            kwargs["user_credentials"] = options.credentials
        if options.nkey_seed:
            kwargs["nkeys_seed"] = options.nkey_seed
        if options.inbox_prefix:
            kwargs["inbox_prefix"] = options.inbox_prefix
        if options.token:
            kwargs["token"] = options.token
        if options.tls_ca or options.tls_cert:
            kwargs["tls"] = context = tls_context(options)
            if options.tls_cert and options.tls_key:
                # nats-py handshakes each reconnection with this same context: a
                # certificate renewed on disk (a job's, agents/confine.py) is read
                # before it reconnects, rather than the expired one presented.
                kwargs["disconnected_cb"] = _reload_on_disconnect(options, context, closing)
        try:
            nc = await handshake.connect(kwargs, again=forever)
        except _GAVE_UP as error:
            raise _cannot_connect(options, error) from error
        bus = cls(nc, component=options.name, replicas=replicas)
        bus.options = options
        made.append(bus)
        if options.renew_s is not None:
            bus.spawn(bus._renew(options.renew_s), name="renew-credential")
        return bus

    async def _renew(self, every_s: float) -> None:
        """Reconnect every `every_s`: the server asks the auth callout again and admits
        this connection as a fresh user before the current one expires. While no
        brain answers, the reconnection waits for one (as a first connection does)."""
        while True:
            await asyncio.sleep(every_s)
            if self.nc.is_connected:
                self.renewals += 1
                await self.nc.force_reconnect()

    async def sibling(self, name: str) -> Bus:
        """Another connection made as this one was, under its own `name`, sharing this
        bus's dead-letter counts: a flood on it (and the server dropping it as a slow
        consumer) does not touch this one. Without known options, this bus itself."""
        if self.options is None:
            return self
        options = dataclasses.replace(self.options, name=name)
        other = await Bus.connect(options, replicas=self.replicas)
        other.dead_lettered = self.dead_lettered
        return other

    async def close(self) -> None:
        self.closing = True
        await asyncio.gather(*(c.stop() for c in self._consumers))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: see Consumer for why a cancelled fetch may never finish.
            await asyncio.wait(tasks, timeout=3.0)
        # A pull subscription whose fetch was cancelled would hold drain() for its
        # whole timeout: let go of them first.
        for psub in self._pull_subs:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        self._pull_subs.clear()
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
        if not self.nc.is_closed:
            await self.nc.close()

    def spawn(self, coro: Awaitable[None], *, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_say_if_it_died)
        return task

    # -- streams ---------------------------------------------------------------------

    async def ensure_streams(self, *, ready_within_s: float = 120.0) -> None:
        """Create or update Alnair's streams; safe to call from every component.

        JetStream that cannot answer yet (a cluster still electing its meta leader,
        or short of a quorum because its other servers are still starting) is waited
        for, up to `ready_within_s`: components started together with their servers
        wait for them rather than fail."""
        deadline = time.monotonic() + ready_within_s
        delay = 0.1
        for spec in STREAMS:
            while True:
                try:
                    await self._ensure_stream(spec)
                    break
                except _JETSTREAM_NOT_READY as error:
                    if time.monotonic() + delay > deadline:
                        raise BusError(
                            f"JetStream did not answer in {ready_within_s:.0f} s "
                            f"({error!r}): is a quorum of its servers up?"
                        ) from error
                    log.info("JetStream not ready (%r); creating streams again soon", error)
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)

    async def _ensure_stream(self, spec: StreamSpec) -> None:
        config = StreamConfig(
            name=spec.name,
            description=spec.description,
            subjects=list(spec.subjects),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=spec.max_age_s,
            duplicate_window=DEDUP_WINDOW_S,
            num_replicas=self.replicas,
            allow_direct=spec.allow_direct,
        )
        # A short wait for each answer: of two components creating the same stream at
        # once (brains starting together), one is never answered while the other's
        # create goes through, and the loop in `ensure_streams` asks again.
        js = self.nc.jetstream(timeout=STREAM_API_TIMEOUT_S)
        try:
            try:
                info = await js.stream_info(spec.name)
            except nats.js.errors.NotFoundError:
                try:
                    await js.add_stream(config)
                except nats.js.errors.BadRequestError as error:
                    if error.err_code != _STREAM_NAME_IN_USE:
                        raise
                    await js.update_stream(config)  # another component made it meanwhile
            else:
                if not _same_stream(info.config, config):
                    await js.update_stream(config)
        except _JETSTREAM_NOT_READY:
            raise
        except nats.js.errors.APIError as error:
            raise BusError(
                f"cannot create stream {spec.name} with {self.replicas} replica(s) on "
                f"{self.nc.connected_url.netloc if self.nc.connected_url else 'NATS'}: "
                f"{error.description or error} (more than 1 replica needs a NATS cluster "
                "of at least that many JetStream servers)"
            ) from error

    # -- publishing ------------------------------------------------------------------

    async def publish(self, subject: str, message: BaseModel) -> None:
        """Core NATS: fire and forget (telemetry, heartbeats, progress)."""
        await self.nc.publish(subject, encode(message))

    async def publish_durable(
        self,
        subject: str,
        message: BaseModel,
        *,
        msg_id: str,
        retry_for_s: float = 30.0,
        attempt_timeout_s: float = 2.0,
    ) -> int:
        """Publish to JetStream and return the stream sequence once it is stored.

        Retries a timed-out, unanswered or refused-for-now (503) publish with the same
        `Nats-Msg-Id` until `retry_for_s` has passed: the server keeps one copy however
        many arrive. (Fenced appends, the brain's log, go through `append_many`.)
        """
        payload = encode(message)
        headers = {"Nats-Msg-Id": msg_id}
        self._check_size(subject, payload)
        deadline = time.monotonic() + retry_for_s
        delay = 0.05
        while True:
            try:
                ack = await self.js.publish(
                    subject, payload, timeout=attempt_timeout_s, headers=headers
                )
                return int(ack.seq)
            except (
                TimeoutError,  # nats.errors.TimeoutError is one too
                nats.js.errors.NoStreamResponseError,
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError,
                # A stream that cannot store it now: a cluster electing a leader, a
                # full store. What else it refuses (400, 404) is no use retrying.
                nats.js.errors.ServiceUnavailableError,
            ) as error:
                if time.monotonic() + delay >= deadline:
                    raise BusTimeout(subject, retry_for_s) from error
                log.warning(
                    "publish to %s unconfirmed (%r); retrying as %s", subject, error, msg_id
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def append_many(
        self,
        stream: str,
        entries: list[tuple[str, BaseModel, str]],
        *,
        after: int,
        retry_for_s: float = 30.0,
        attempt_timeout_s: float = 2.0,
    ) -> int:
        """Append `entries` (subject, message, msg id) to `stream` as one group, in
        order, right after sequence `after`; return the last one's sequence.

        Pipelined: every entry is sent before any acknowledgement is awaited, each
        fenced on the one before it (`Nats-Expected-Last-Sequence` = after + i and, past
        the first, `Nats-Expected-Last-Msg-Id` = the previous entry's id), so the group
        lands contiguously, each entry right after its predecessor, or its tail not at
        all. What is unconfirmed is sent
        again, with the same ids and fences, until `retry_for_s` has passed; an entry
        that meets a moved fence is looked up where it would be, and counts as stored
        if it is ours (a first try that landed). SequenceConflict when another writer
        got there first; BusTimeout when it stays unconfirmed.
        """
        payloads = [(subject, encode(message), msg_id) for subject, message, msg_id in entries]
        for subject, payload, _ in payloads:
            self._check_size(subject, payload)  # before any is sent: none of them is
        deadline = time.monotonic() + retry_for_s
        stored = 0  # entries[:stored] are known to be in the stream
        delay = 0.05
        while stored < len(payloads):
            acks: list[asyncio.Future[int]] = []
            try:
                for i in range(stored, len(payloads)):
                    subject, payload, msg_id = payloads[i]
                    headers = {
                        "Nats-Msg-Id": msg_id,
                        "Nats-Expected-Last-Sequence": str(after + i),
                    }
                    if i > 0:
                        # The sequence alone would take another writer's entry, landed
                        # where our refused one should be, for ours.
                        headers["Nats-Expected-Last-Msg-Id"] = payloads[i - 1][2]
                    acks.append(await self._publish_acked(subject, payload, headers))
                if acks:
                    await asyncio.wait(acks, timeout=attempt_timeout_s)
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                pass  # what went out is looked at below; the rest is sent again
            try:
                stored, error = await self._confirmed(stream, after, payloads, stored, acks)
            finally:
                for ack in acks:
                    if not ack.done():
                        ack.cancel()
                    elif not ack.cancelled():
                        ack.exception()  # retrieved: no "never retrieved" warning
            if stored == len(payloads):
                break
            if time.monotonic() + delay >= deadline:
                raise BusTimeout(payloads[stored][0], retry_for_s) from error
            log.warning(
                "append of %d entries to %s unconfirmed from #%d (%r); sending them again",
                len(payloads),
                stream,
                stored,
                error,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        return after + len(payloads)

    async def _confirmed(
        self,
        stream: str,
        after: int,
        payloads: list[tuple[str, bytes, str]],
        stored: int,
        acks: list[asyncio.Future[int]],
    ) -> tuple[int, BaseException | None]:
        """Walk one try's acknowledgements in order (`acks[i]` is for entry stored + i):
        how many entries are known stored now, and why the next is not (None: all are).
        Raises SequenceConflict when another writer's entry sits where ours would."""
        for ack in acks:
            if not ack.done():
                return stored, TimeoutError("no acknowledgement in time")
            error = ack.exception()
            if error is None:
                stored += 1
                continue
            if not isinstance(error, nats.js.errors.APIError):
                return stored, error  # no stream answered, say: sent again
            if error.err_code not in (WRONG_LAST_SEQUENCE, WRONG_LAST_MSG_ID):
                raise error
            # The fence moved. By an earlier try of this very entry, stored after all?
            if not await self._stored_as(stream, after + stored + 1, payloads[stored][2]):
                raise SequenceConflict(stream, after + stored) from error
            stored += 1
        return stored, None

    async def publish_many_durable(
        self, messages: list[tuple[str, BaseModel, str]], *, retry_for_s: float = 30.0
    ) -> None:
        """Publish (subject, message, msg id) to JetStream, pipelined, and return once
        every one is stored; retried with the same ids (the server keeps one copy)."""
        if len(messages) == 1:
            subject, message, msg_id = messages[0]
            await self.publish_durable(subject, message, msg_id=msg_id, retry_for_s=retry_for_s)
            return
        pending = [(subject, encode(message), msg_id) for subject, message, msg_id in messages]
        deadline = time.monotonic() + retry_for_s
        delay = 0.05
        while pending:
            acks = []
            try:
                for subject, payload, msg_id in pending:
                    headers = {"Nats-Msg-Id": msg_id}
                    acks.append(await self._publish_acked(subject, payload, headers))
                if acks:
                    await asyncio.wait(acks, timeout=2.0)
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                pass
            left = []
            error: BaseException | None = None
            for entry, ack in zip(pending, acks, strict=False):
                if ack.done() and not ack.cancelled() and ack.exception() is None:
                    continue
                if ack.done() and not ack.cancelled():
                    error = ack.exception()
                    if isinstance(error, nats.js.errors.APIError) and not isinstance(
                        error, nats.js.errors.ServiceUnavailableError
                    ):
                        raise error
                else:
                    ack.cancel()
                left.append(entry)
            left += pending[len(acks) :]
            pending = left
            if pending:
                if time.monotonic() + delay >= deadline:
                    raise BusTimeout(pending[0][0], retry_for_s) from error
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _check_size(self, subject: str, payload: bytes) -> None:
        """Refuse a JetStream message the server would refuse by closing the connection.
        nats-py checks the payload alone; the server counts the headers too (ids and
        fences: `HEADERS_ROOM` at most)."""
        limit = self.nc.max_payload
        if limit and len(payload) + HEADERS_ROOM > limit:
            raise MessageTooLarge(subject, len(payload) + HEADERS_ROOM, limit)

    async def _publish_acked(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[int]:
        """Publish to JetStream without waiting: the future gets the stored sequence, or
        the stream's refusal as nats-py's APIError. (nats-py's own `publish_async`
        never completes a future whose answer is an error: `APIError.from_error`
        raises inside its reply handler.) In order: one connection, sent as called."""
        if self._ack_prefix is None:
            self._ack_prefix = f"{self.nc.new_inbox()}."
            await self.nc.subscribe(f"{self._ack_prefix}*", cb=self._on_ack)
        self._ack_tokens += 1
        token = str(self._ack_tokens)
        ack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._acks[token] = ack
        ack.add_done_callback(lambda _: self._acks.pop(token, None))
        await self.nc.publish(subject, payload, reply=f"{self._ack_prefix}{token}", headers=headers)
        return ack

    async def _on_ack(self, msg: Msg) -> None:
        assert self._ack_prefix is not None
        ack = self._acks.get(msg.subject[len(self._ack_prefix) :])
        if ack is None or ack.done():
            return  # answered after its try gave up: the retry asks again
        if msg.headers and msg.headers.get("Status") == "503":
            ack.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            answer = json.loads(msg.data)
            if "error" in answer:
                nats.js.errors.APIError.from_error(answer["error"])  # raises it
            ack.set_result(int(answer["seq"]))
        except Exception as error:
            ack.set_exception(error)

    async def _stored_as(self, stream: str, seq: int, msg_id: str) -> int | None:
        try:
            stored = await self.js.get_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            return None
        headers = stored.headers or {}
        return seq if headers.get("Nats-Msg-Id") == msg_id else None

    # -- receiving -------------------------------------------------------------------

    async def dead_letter(self, subject: str, data: bytes, reason: str) -> None:
        origin = subjects.dlq_origin(subject)
        self.dead_lettered[origin] += 1
        log.warning("dead-lettered message on %s: %s", subject, reason)
        letter = DeadLetter(
            subject=subject[:512],
            reason=reason[:4000],
            received_at=time.time(),
            by=self.component,
            payload_bytes=len(data),
            payload_preview=data[:DLQ_PAYLOAD_PREVIEW_BYTES].decode("utf-8", "replace"),
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.dlq(origin), encode(letter))

    async def subscribe(
        self,
        subject: str,
        decoder: Decoder[T],
        handler: Handler[T],
        *,
        queue: str = "",
        pending_msgs_limit: int = DEFAULT_SUB_PENDING_MSGS_LIMIT,
        pending_bytes_limit: int = DEFAULT_SUB_PENDING_BYTES_LIMIT,
        accept: Callable[[], bool] | None = None,
        known: Callable[[Msg], bool] | None = None,
    ) -> Subscription:
        """Core subscription; invalid messages go to the DLQ, handler errors are logged.

        Past `pending_msgs_limit` messages or `pending_bytes_limit` bytes waiting for the
        handler, this client drops what arrives (counted in `dropped`) instead of letting
        the server fall behind on the whole connection and cut it. While `accept()` is
        false, messages are dropped unread, before decoding (counted in `dropped` too).
        A message `known(msg)` says it has already taken in (a repeat of one it decoded
        before) is neither decoded nor handled."""

        async def on_message(msg: Msg) -> None:
            if accept is not None and not accept():
                self.dropped[subject] += 1
                return
            if known is not None and known(msg):
                return
            try:
                message = decode(msg.data, decoder)
            except InvalidMessage as error:
                await self.dead_letter(msg.subject, msg.data, error.reason)
                return
            try:
                await handler(message, msg)
            except Exception:
                log.exception("handler for %s failed", msg.subject)

        return await self.nc.subscribe(
            subject,
            queue=queue,
            cb=on_message,
            pending_msgs_limit=pending_msgs_limit,
            pending_bytes_limit=pending_bytes_limit,
        )

    async def follow_new(
        self,
        stream: str,
        name: str,
        filter_subject: str,
        decoder: Decoder[T],
        handler: Handler[T],
        *,
        inactive_s: float = 30.0,
    ) -> Subscription:
        """Messages stored in `stream` on `filter_subject` from now on, pushed to this
        connection's own reply inbox by a named consumer without acks.

        For a client whose identity may create such a consumer but not pull from one
        (an elastic job's supervisor under `--secure`: pulling is permitted per consumer
        name, which NATS cannot confine to a prefix). The consumer goes away `inactive_s`
        after its subscriber does. A message pushed while this connection is away is not
        delivered again: use it where the sender re-sends or times out (Resize).
        """
        sub = await self.subscribe(self.nc.new_inbox(), decoder, handler)
        config = ConsumerConfig(
            name=name,
            deliver_subject=sub.subject,
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.NONE,
            filter_subject=filter_subject,
            inactive_threshold=inactive_s,
        )
        try:
            await self.js.add_consumer(stream, config)
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise
        return sub

    async def consume(
        self,
        stream: str,
        durable: str,
        filter_subject: str,
        decoder: Decoder[T],
        handler: Handler[T],
        *,
        deliver_new: bool = False,
        batch: int = 64,
    ) -> Consumer:
        """Run a durable pull consumer: each message is acked after its handler returns.

        A handler that raises gets the message again (after a pause) up to
        MAX_HANDLER_ATTEMPTS deliveries; then it is dead-lettered. Invalid messages are
        dead-lettered at once and acknowledged.
        """
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
            # Short, so a message a dead consumer held comes back soon to its successor.
            ack_wait=10.0,
            max_ack_pending=1000,
            filter_subject=filter_subject,
        )
        psub = await self.js.pull_subscribe(
            filter_subject, durable=durable, stream=stream, config=config
        )
        self._pull_subs.append(psub)

        async def one(msg: Msg) -> None:
            try:
                message = decode(msg.data, decoder)
            except InvalidMessage as error:
                await self.dead_letter(msg.subject, msg.data, error.reason)
                await msg.ack()
                return
            try:
                await handler(message, msg)
            except HandBack as back:
                log.info("handing %s back for redelivery: %s", msg.subject, back.reason)
                await msg.nak(delay=1.0)
                return
            except Exception as error:
                log.exception("handler for %s failed", msg.subject)
                if msg.metadata.num_delivered >= MAX_HANDLER_ATTEMPTS:
                    await self.dead_letter(msg.subject, msg.data, f"handler failed: {error!r}")
                    await msg.term()
                else:
                    await msg.nak(delay=1.0)
                return
            await msg.ack()

        consumer = Consumer(durable)

        async def loop() -> None:
            while not consumer.stopping.is_set() and not self.nc.is_closed:
                try:
                    msgs = await psub.fetch(batch, timeout=FETCH_WAIT_S)
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as error:
                    # Disconnects, a restarting server, a consumer lost with it: wait
                    # and fetch again; the consumer is durable.
                    log.warning("fetch on %s failed: %r", durable, error)
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    try:
                        await one(msg)
                    except (nats.errors.Error, OSError) as error:
                        # An ack lost in a disconnect: the message comes back, and the
                        # handlers are idempotent.
                        log.warning("ack on %s failed: %r", durable, error)

        consumer.task = self.spawn(loop(), name=f"consume:{durable}")
        self._consumers.append(consumer)
        return consumer

    async def stream_cluster(self, stream: str, *, timeout_s: float = 5.0) -> ClusterInfo | None:
        """Which server leads `stream` and how its replicas fare; None on one server."""
        info = await self.nc.jetstream(timeout=timeout_s).stream_info(stream)
        return info.cluster

    async def last_seq(self, stream: str) -> int:
        info = await self.js.stream_info(stream)
        return int(info.state.last_seq)

    async def read(
        self,
        stream: str,
        decoder: Decoder[T],
        *,
        start_seq: int = 1,
        filter_subject: str | None = None,
        follow: bool = False,
        stop: asyncio.Event | None = None,
        batch: int = 512,
    ) -> AsyncIterator[tuple[T | InvalidMessage, int, str]]:
        """Read a stream in order from `start_seq`: (message, sequence, subject).

        Without `follow`, stops at the last message stored when called; with it, waits
        for new ones until `stop` is set (checked between fetches: cancelling a task
        inside nats-py's fetch does not reliably end it). An entry that fails validation
        is yielded as the InvalidMessage, so a reader can report it and go on.

        Every entry is yielded once, in order, whatever happens to the connection. The
        pull consumer delivers without acks, so what the server sent and the client
        never got (a connection dropped as a slow consumer, a server restarted) is
        gone from that consumer. Its deliveries are numbered: when one is missing, or
        the consumer says it sent more than arrived, or is gone, the reader goes on
        from the next sequence it needs with a new consumer.
        """
        info = await self.js.stream_info(stream)
        until = int(info.state.last_seq)
        if not follow and until < start_seq:
            return
        # Fetch at most about READ_BYTES at a time: the server drops a connection
        # that more than its pending limit (64 MiB) waits on as a slow consumer, and a
        # batch of 512 records of a few hundred KB each is more. Sized by the larger
        # of the stream's average message and the largest of the last batch.
        average = int(info.state.bytes) // max(1, int(info.state.messages))
        largest = 0
        needed = max(1, start_seq)  # the next stream sequence not yet yielded
        psub = await self._pull_from(stream, needed, filter_subject)
        delivered = 0  # the last delivery of this consumer that arrived
        reconnects = self.nc.stats["reconnects"]
        try:
            while True:
                want = max(1, min(batch, READ_BYTES // max(1, average, largest)))
                msgs = await self._fetch(psub, want)
                largest = max(map(len, (msg.data for msg in msgs)), default=0)
                lost = False
                for msg in msgs:
                    if msg.metadata.sequence.consumer != delivered + 1:
                        lost = True  # deliveries between never arrived
                        break
                    delivered += 1
                    seq = int(msg.metadata.sequence.stream)
                    if seq < needed:
                        continue  # never from a consumer made at `needed`; kept as a guard
                    needed = seq + 1
                    try:
                        item: T | InvalidMessage = decode(msg.data, decoder)
                    except InvalidMessage as error:
                        item = error
                    yield item, seq, msg.subject
                    if not follow and seq >= until:
                        return
                if (
                    not lost
                    and len(msgs) < want
                    and (not follow or self.nc.stats["reconnects"] != reconnects)
                ):
                    # A short batch: the stream has no more for now, or the connection
                    # lost the rest. The consumer knows which. (A follower meets short
                    # batches all the time and asks only after a reconnect: nothing is
                    # lost in transit without one.)
                    reconnects = self.nc.stats["reconnects"]
                    pending = await self._pending(psub, delivered)
                    lost = pending is None
                    if pending == 0 and not follow:
                        return
                if lost:
                    with contextlib.suppress(Exception):
                        await psub.unsubscribe()  # the server forgets it when inactive
                    psub = await self._pull_from(stream, needed, filter_subject)
                    delivered = 0
                if stop is not None and stop.is_set():
                    return
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    @staticmethod
    async def _fetch(psub: JetStreamContext.PullSubscription, want: int) -> list[Msg]:
        """Up to `want` entries, none when there are none before FETCH_WAIT_S."""
        try:
            return await psub.fetch(want, timeout=FETCH_WAIT_S)
        except nats.js.errors.ServiceUnavailableError:
            # The stream is electing a leader (a JetStream cluster lost one), or the
            # server restarted without this consumer.
            await asyncio.sleep(FETCH_WAIT_S)
        except (nats.errors.TimeoutError, TimeoutError):
            pass
        return []

    async def first_seq_since(self, stream: str, when: float) -> int:
        """The sequence of `stream`'s first entry stored at or after `when` (seconds
        since the epoch, by the server's clock), or of the next one to be stored when
        there is none: where `read` starts to give what was stored since then."""
        info = await self.js.stream_info(stream)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.datetime.fromtimestamp(when, datetime.UTC),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
        )
        psub = await self.js.pull_subscribe(">", durable=None, stream=stream, config=config)
        try:
            msgs = await self._fetch(psub, 1)
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        return int(msgs[0].metadata.sequence.stream) if msgs else int(info.state.last_seq) + 1

    async def _pull_from(
        self, stream: str, seq: int, filter_subject: str | None
    ) -> JetStreamContext.PullSubscription:
        """An ephemeral pull consumer of `stream` delivering from `seq`, unacknowledged;
        waits out a reconnect or a leader election."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=seq,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
            filter_subject=filter_subject,
        )
        while True:
            try:
                return await self.js.pull_subscribe(
                    filter_subject or ">", durable=None, stream=stream, config=config
                )
            except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
                await asyncio.sleep(FETCH_WAIT_S)

    async def _pending(self, psub: JetStreamContext.PullSubscription, delivered: int) -> int | None:
        """What the consumer still holds for its reader, or None where it delivered more
        than the reader's `delivered`, or is gone (with the server that held it), or
        cannot say: then a new consumer from the next sequence needed is right."""
        try:
            info = await psub.consumer_info()
        except (
            nats.js.errors.NotFoundError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.TimeoutError,
            TimeoutError,
        ):
            return None
        if info.delivered is None or int(info.delivered.consumer_seq) != delivered:
            return None
        return int(info.num_pending or 0)

    async def request(
        self,
        subject: str,
        message: BaseModel,
        reply: Decoder[R],
        *,
        timeout_s: float = 5.0,
        compact: bool = False,
    ) -> R:
        """Ask and decode the answer. A publish the server refuses this identity
        (its permissions) raises `BusDenied` at once rather than waiting out the
        timeout: the server says so, asynchronously, and nothing will answer.
        `compact`: without the fields at their defaults (`encode_request`)."""
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._refusals.setdefault(subject.lower(), set())
        waiting.add(refused)
        data = encode_request(message) if compact else encode(message)
        asking = asyncio.ensure_future(self.nc.request(subject, data, timeout=timeout_s))
        try:
            either: set[asyncio.Future[Any]] = {asking, refused}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not asking.done():
                asking.cancel()
                raise BusDenied(subject)
            msg = asking.result()
        except nats.errors.NoRespondersError:
            raise BrainUnavailable(subject) from None
        except nats.errors.ConnectionClosedError:
            raise BusClosed(subject) from None
        except (
            nats.errors.TimeoutError,
            # Our server is away: no answer yet, as with a timeout (the caller may retry).
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
            nats.errors.StaleConnectionError,
        ):
            raise BusTimeout(subject, timeout_s) from None
        finally:
            if not asking.done():
                asking.cancel()
            waiting.discard(refused)
            if not waiting:
                self._refusals.pop(subject.lower(), None)
        return decode(msg.data, reply)

    def _handled(self, error: Exception) -> bool:
        """Whether the error callback's `error` is one this bus accounts for: a message
        dropped for a slow subscription (counted), or a refused publish."""
        if isinstance(error, nats.errors.SlowConsumerError):
            self.dropped[error.sub.subject if error.sub else error.subject] += 1
            return True
        return self._denied(error)

    def _denied(self, error: Exception) -> bool:
        """Whether `error` is the server refusing a publish; if so, the requests waiting
        on that subject are told, or, for a publish nobody waits on, it is logged once
        per subject (a component whose permissions do not match what it does is
        misconfigured)."""
        found = _DENIED.search(str(error))
        if found is None:
            return False
        subject = found[1]
        waiting = self._refusals.get(subject, set())
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)
        # A request raises BusDenied to its caller; a refused publish would go unseen.
        if not waiting and subject not in self._refused_logged:
            self._refused_logged.add(subject)
            log.warning("%s: NATS refused to let it publish to %s", self.component, subject)
        return True


def _check_replicas(replicas: int) -> None:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise BusError(f"stream replicas must be 1 to {MAX_REPLICAS}, not {replicas}")


class _HarmlessSslNotice(logging.Filter):
    """asyncio warns at each close of a TLS connection that nats-py's stream protocol
    asks to keep it half-open, which TLS cannot; nothing is lost, so say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


_SSL_NOTICE_FILTER: Final = _HarmlessSslNotice()


def tls_context(options: ConnectOptions) -> ssl.SSLContext:
    """The client side of TLS: trust `tls_ca` (else the system's CAs) and present
    `tls_cert`/`tls_key` when given. A missing or unreadable file is named."""
    logging.getLogger("asyncio").addFilter(_SSL_NOTICE_FILTER)  # once: filters are a set
    if bool(options.tls_cert) != bool(options.tls_key):
        raise BusError("TLS: give both a client certificate and its key, or neither")
    try:
        context = ssl.create_default_context(cafile=options.tls_ca)
        if options.tls_cert and options.tls_key:
            context.load_cert_chain(options.tls_cert, options.tls_key)
    except (OSError, ssl.SSLError) as error:
        files = [f for f in (options.tls_ca, options.tls_cert, options.tls_key) if f]
        raise BusError(f"TLS files unusable ({', '.join(files)}): {error}") from error
    return context


TLS_HINT: Final = (
    " (TLS: is the CA given (--tls-ca, $ALNAIR_TLS_CA) the one that signed the servers'"
    " certificates, and a client certificate given where the servers verify clients?)"
)
# How long a first connection whose TLS handshake failed is given to go on by itself
# before it is taken for hung (`_FirstHandshake`), and how long a component waits after.
HANDSHAKE_GRACE_S: Final = 0.5
HANDSHAKE_RETRY_S: Final = 2.0


def _cannot_connect(options: ConnectOptions, error: Exception) -> BusError:
    hint = TLS_HINT if isinstance(error, ssl.SSLError | _DroppedBeforeTls) else ""
    return BusError(
        f"cannot connect to NATS at {', '.join(options.servers)}: {error or 'timeout'}{hint}"
    )


# How nats-py says a first connection gave up (`Bus.connect` names it `_cannot_connect`).
_GAVE_UP: Final = (TimeoutError, OSError, nats.errors.NoServersError)
# How a server is seen to close a connection on its client, not refuse it.
_DROPS: Final = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _DroppedBeforeTls(ConnectionError):
    """A first TLS connection that the server closed, every time, before it was up,
    with no TLS error seen: a server verifying clients closes on one without a
    certificate, and the client reads its alert, or, as often under load, only the
    closed socket (a reset, a broken pipe). Named with the TLS hint, as the alert is."""

    def __init__(self, dropped: Exception) -> None:
        super().__init__(
            f"the server closed the connection before TLS was up "
            f"({type(dropped).__name__}: {dropped})"
        )


class _FirstHandshake:
    """A first connection past a failed TLS handshake. nats-py, after one fails on a
    first connection, waits for ever for the dropped socket to close (nats-io/nats.py
    #718) rather than try the next server or raise: a CLI or a job's SDK given the
    wrong CA hung, and a component whose server failed a handshake (restarting, say)
    never connected. The attempt is given up once that error has been seen and it has
    not gone on; a component (`again`) tries anew, anyone else is told why."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.error: ssl.SSLError | None = None
        # The last time the server closed the connection on it (`_DroppedBeforeTls`).
        self.dropped: Exception | None = None

    def saw(self, error: Exception) -> None:
        """Any error the connection reports (those after a first connection, too:
        nothing waits on them then)."""
        if isinstance(error, ssl.SSLError):
            self.error = error
            self.failed.set()
        elif isinstance(error, _DROPS):
            self.dropped = error

    async def connect(self, kwargs: dict[str, Any], *, again: bool) -> NatsClient:
        while True:
            self.failed.clear()
            self.error = None
            attempt = asyncio.ensure_future(nats.connect(**kwargs))
            failed = asyncio.ensure_future(self.failed.wait())
            try:
                await asyncio.wait({attempt, failed}, return_when=asyncio.FIRST_COMPLETED)
                if not attempt.done():
                    await asyncio.wait({attempt}, timeout=HANDSHAKE_GRACE_S)
            finally:
                failed.cancel()
                if not attempt.done():
                    attempt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await attempt
            if not attempt.cancelled():
                given_up = attempt.exception()
                if self.error is not None and isinstance(given_up, _GAVE_UP):
                    # nats-py gave up by itself, through its reconnect attempts, before
                    # it hung: with "no servers available", whose cause is the handshake.
                    raise self.error from given_up
                if self.dropped is not None and "tls" in kwargs and isinstance(given_up, _GAVE_UP):
                    raise _DroppedBeforeTls(self.dropped) from given_up
                return attempt.result()
            assert self.error is not None
            if not again:
                raise self.error
            await asyncio.sleep(HANDSHAKE_RETRY_S)


class _Unreachable:
    """Says, at most every `UNREACHABLE_LOG_EVERY_S`, that no server answers: nats-py
    retries a first connection and a lost one for ever, through the error callback, and
    an agent given a wrong `--nats` (or started before its servers) looked hung."""

    def __init__(self, name: str, servers: tuple[str, ...]) -> None:
        self.name = name
        self.servers = ", ".join(servers)
        self.said_at: float | None = None

    def said(self, error: Exception) -> bool:
        """Whether `error` is one of not reaching a server (and so was handled here)."""
        if isinstance(error, ssl.SSLError) or not isinstance(error, OSError | TimeoutError):
            return False
        now = time.monotonic()
        if self.said_at is None or now - self.said_at >= UNREACHABLE_LOG_EVERY_S:
            self.said_at = now
            log.warning(
                "%s: cannot reach NATS at %s (%s); still trying",
                self.name,
                self.servers,
                str(error) or type(error).__name__,
            )
        return True


async def _log_error(error: Exception) -> None:
    if isinstance(error, ssl.SSLError):
        # Retried (`_FirstHandshake`); say why, or a wrong certificate looks like a hang.
        log.warning("nats: TLS handshake failed: %s", error)
    else:
        log.debug("nats: %r", error)


def _reload_on_disconnect(
    options: ConnectOptions, context: ssl.SSLContext, closing: Callable[[], bool]
) -> Callable[[], Awaitable[None]]:
    logged = _log_disconnected(options.name, closing)

    async def callback() -> None:
        await logged()
        if closing():
            return
        try:
            context.load_cert_chain(str(options.tls_cert), str(options.tls_key))
        except (OSError, ssl.SSLError) as error:
            log.warning("%s: keeping the TLS certificate loaded: %s", options.name, error)

    return callback


def _log_disconnected(name: str, closing: Callable[[], bool]) -> Callable[[], Awaitable[None]]:
    """Say that the connection dropped, unless it was closed on purpose (nats-py calls
    the same callback for both)."""

    async def callback() -> None:
        if not closing():
            log.info("%s: disconnected from NATS", name)

    return callback


def _log_reconnected(name: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        log.info("%s: reconnected to NATS", name)

    return callback
