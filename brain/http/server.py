"""The brain's HTTP face (aiohttp): the API, the event stream, `/metrics`, the dashboard.

Every API route turns its path, query and body into the NATS API's request message,
validated by the same model, and hands it to `ApiServer.handle` — the one
implementation — with the tenant the bearer token names (never one from the request).
Refusals come back as the same `ErrorReply`, with the HTTP status its code implies.

Only the leader answers API calls; a standby says where the leader's HTTP API is.
`/v1/events` reads the log and works on any brain. Brains that share one advertised
address (`alnair up --brains N`, or several brains behind one DNS name) instead listen
only while they lead (`follow_leadership`), so the address moves with the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from brain.http import events
from brain.http.auth import Caller, TokenTable
from brain.http.openapi import DrainBody, ResizeBody, Whoami, document
from brain.metrics import BrainMetrics
from bus.logs import LogUnavailable, attempt_nodes, read_chunk
from schemas.api import (
    CancelRequest,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    GetJobRequest,
    HistoryReply,
    HistoryRequest,
    JobReply,
    ListJobsRequest,
    ListNodesRequest,
    ListQueuesRequest,
    ResizeRequest,
    ResumeRequest,
    StatusRequest,
    SubmitRequest,
    ThrottleRequest,
    WhyRequest,
)
from schemas.base import MAX_MESSAGE_BYTES, Message, decode
from schemas.errors import AlnairError, InvalidMessage
from schemas.logs import LogRequest

if TYPE_CHECKING:
    from brain.service import Brain

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The longest request line read (aiohttp's default is 8,190 bytes): a listing's query
# may name 64 arrays of 128 characters each, percent-encoded, and queues and states
# beside them; a longer line is refused (400) before the API sees it.
MAX_REQUEST_LINE: Final = 128 * 1024
DASHBOARD_DIR: Final = Path(__file__).resolve().parent.parent / "dashboard"
STATUS_OF: Final[dict[str, int]] = {
    "invalid": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "internal": 500,
    "unavailable": 503,
}
CODE_OF: Final[dict[int, ErrorCode]] = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    503: "unavailable",
}


class InvalidAddress(AlnairError, ValueError):
    pass


# A query value read as an integer: ASCII digits only (`str.isdigit` takes `²`, which
# `int` refuses) and few enough that `int` does not refuse them either.
_DECIMAL: Final = re.compile(r"-?[0-9]{1,18}")


def _integer(value: str) -> int | str:
    """A query value as an integer where it is one; else as given, for the request's
    validation to refuse naming the field."""
    return int(value) if _DECIMAL.fullmatch(value) else value


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8470`, `:8470` for every interface) to a host and a port."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not _DECIMAL.fullmatch(port_text) or not 0 <= int(port_text) <= 65535:
        raise InvalidAddress(f"--http takes HOST:PORT (e.g. 127.0.0.1:8470), not {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port_text)


class HttpRefusal(Exception):
    """A request refused before it reached the API: answered as an ErrorReply."""

    def __init__(self, status: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reply = ErrorReply(code=code, error=message)


def _json(message: BaseModel, status: int = 200, **headers: str) -> web.Response:
    return web.Response(
        body=message.model_dump_json().encode(),
        status=status,
        content_type="application/json",
        headers=headers or None,
    )


class HttpServer:
    def __init__(
        self,
        brain: Brain,
        *,
        tokens: TokenTable,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_s: float = 15.0,
    ) -> None:
        self.brain = brain
        self.tokens = tokens
        self.host = host
        self.port = port
        self.heartbeat_s = heartbeat_s
        # Created with the server so its counters see the brain from its start.
        self.metrics = BrainMetrics(brain)
        self._openapi = json.dumps(document()).encode()
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self.app = web.Application(middlewares=[self._refusals], client_max_size=MAX_MESSAGE_BYTES)
        self._routes()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def public_url(self) -> str:
        """The URL others reach it at: the host name when it listens everywhere."""
        if self.host in ("0.0.0.0", "::"):
            return f"http://{socket.gethostname()}:{self.port}"
        return self.url

    def _routes(self) -> None:
        r = self.app.router
        r.add_get("/", self._dashboard)
        r.add_static("/dashboard/", DASHBOARD_DIR, append_version=False)
        r.add_get("/openapi.json", self._openapi_document)
        r.add_get("/metrics", self._metrics)
        r.add_get("/v1/whoami", self._whoami)
        r.add_get("/v1/status", self._status)
        r.add_get("/v1/jobs", self._list_jobs)
        r.add_post("/v1/jobs", self._submit)
        r.add_get("/v1/jobs/{job_id}", self._get_job)
        # DELETE is what a REST client tries first; the job's record stays, CANCELLED.
        r.add_delete("/v1/jobs/{job_id}", self._cancel)
        r.add_post("/v1/jobs/{job_id}/cancel", self._cancel)
        r.add_post("/v1/jobs/{job_id}/resize", self._resize)
        r.add_post("/v1/arrays/throttle", self._throttle)
        r.add_get("/v1/jobs/{job_id}/why", self._why)
        r.add_get("/v1/jobs/{job_id}/logs", self._logs)
        r.add_get("/v1/nodes", self._nodes)
        r.add_get("/v1/queues", self._queues)
        r.add_post("/v1/nodes/{node}/drain", self._drain)
        r.add_post("/v1/nodes/{node}/resume", self._resume)
        r.add_get("/v1/events", self._events)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as error:
            sock.close()
            raise InvalidAddress(
                f"cannot listen on {self.host}:{self.port}: {error.strerror or error}"
            ) from None
        sock.listen(128)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        # Open event streams are cancelled by stop(); nothing else needs long to finish.
        self._runner = web.AppRunner(
            self.app, access_log=None, shutdown_timeout=2.0, max_line_size=MAX_REQUEST_LINE
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        await self.metrics.start()
        log.info("HTTP API, metrics and dashboard on %s", self.url)

    @property
    def listening(self) -> bool:
        return self._runner is not None

    async def follow_leadership(self, stopping: asyncio.Event, poll_s: float = 0.1) -> None:
        """Listen while the brain leads and not otherwise, until `stopping` is set.

        A new leader may find the port still held by a deposed one that has not yet
        noticed; it retries until the port is free. Announces the address it serves
        with the brain's info only while it listens.
        """
        brain = self.brain
        while not stopping.is_set():
            if brain.leading.is_set() and not self.listening:
                try:
                    await self.start()
                except InvalidAddress as error:
                    log.info("HTTP: %s; retrying", error)
                else:
                    brain.config = dataclasses.replace(brain.config, http_address=self.public_url)
            elif not brain.leading.is_set() and self.listening:
                brain.config = dataclasses.replace(brain.config, http_address=None)
                await self.stop()
                log.info("HTTP API released: this brain no longer leads")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), poll_s)
        if self.listening:
            await self.stop()

    async def stop(self) -> None:
        for task in list(self._streams):
            task.cancel()
        await self.metrics.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plumbing --------------------------------------------------------------------

    @web.middleware
    async def _refusals(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except HttpRefusal as refusal:
            return _json(refusal.reply, refusal.status)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            # aiohttp's own 404/405/413 as the API's ErrorReply; keep `Allow` on a 405.
            reply = ErrorReply(
                code=CODE_OF.get(error.status, "invalid"),
                error=f"{error.reason}: {request.method} {request.path}",
            )
            allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else {}
            return _json(reply, error.status, **allow)

    def _caller(self, request: web.Request) -> Caller:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            # EventSource cannot send headers: the token may come in the query (RFC 6750).
            token = request.query.get("access_token", "")
        caller = self.tokens.caller(token.strip()) if token.strip() else None
        if caller is None:
            raise HttpRefusal(
                401,
                "unauthorized",
                "missing or unknown token: send `Authorization: Bearer <token>` "
                "with a token from the brain's tokens file",
            )
        return caller

    async def _leader(self) -> None:
        if self.brain.leading.is_set():
            return
        where = "no leader is known yet"
        with contextlib.suppress(Exception):
            for info in await self.brain.lease.brains():
                if info.leader and info.http:
                    where = f"the leader's HTTP API is at {info.http}"
        raise HttpRefusal(503, "unavailable", f"this brain is standing by; {where}")

    @staticmethod
    def _decode(model: type[M], data: bytes | dict[str, Any], verb: str) -> M:
        """The NATS API's decoding and error text: strict, as the OpenAPI document
        promises, so `0` is no boolean and `"2"` no number."""
        raw = data if isinstance(data, bytes) else json.dumps(data).encode()
        try:
            return decode(raw, model, strict=True)
        except InvalidMessage as error:
            raise HttpRefusal(400, "invalid", f"invalid {verb} request: {error.reason}") from None

    async def _call(
        self, request: web.Request, message: Message, *, created: bool = False
    ) -> web.Response:
        caller = self._caller(request)
        await self._leader()
        reply = await self.brain.api.handle(caller.tenant, message, operator=caller.operator)
        if isinstance(reply, ErrorReply):
            return _json(reply, STATUS_OF.get(reply.code, 500))
        if created and isinstance(reply, JobReply):
            return _json(reply, 201, Location=f"/v1/jobs/{reply.job.job_id}")
        return _json(reply)

    # -- routes ----------------------------------------------------------------------

    async def _dashboard(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(DASHBOARD_DIR / "index.html")

    async def _openapi_document(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._caller(request).operator:
            raise HttpRefusal(403, "forbidden", "/metrics is for operator tokens")
        gzip = "gzip" in request.headers.get("Accept-Encoding", "")
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        if gzip:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=await self.metrics.render(gzip=gzip), headers=headers)

    async def _whoami(self, request: web.Request) -> web.Response:
        caller = self._caller(request)
        return _json(Whoami(tenant=caller.tenant, operator=caller.operator))

    async def _status(self, request: web.Request) -> web.Response:
        return await self._call(request, StatusRequest())

    async def _list_jobs(self, request: web.Request) -> web.Response:
        data: dict[str, Any] = {}
        states = request.query.getall("state", [])
        if states:
            data["states"] = states
        queues = request.query.getall("queue", [])
        if queues:
            data["queues"] = queues
        arrays = request.query.getall("array", [])
        if arrays:
            data["arrays"] = arrays
        if "limit" in request.query:
            limit = request.query["limit"]
            data["limit"] = _integer(limit)
        if "before" in request.query:
            data["before"] = request.query["before"]
        return await self._call(request, self._decode(ListJobsRequest, data, "jobs"))

    async def _submit(self, request: web.Request) -> web.Response:
        self._caller(request)  # refuse an unknown caller before reading its body
        message = self._decode(SubmitRequest, await request.read(), "submit")
        return await self._call(request, message, created=True)

    async def _get_job(self, request: web.Request) -> web.Response:
        message = self._decode(GetJobRequest, {"job_id": request.match_info["job_id"]}, "job")
        return await self._call(request, message)

    async def _cancel(self, request: web.Request) -> web.Response:
        data = {"job_id": request.match_info["job_id"]}
        return await self._call(request, self._decode(CancelRequest, data, "cancel"))

    async def _why(self, request: web.Request) -> web.Response:
        data: dict[str, Any] = {"job_id": request.match_info["job_id"]}
        if "limit" in request.query:
            limit = request.query["limit"]
            data["limit"] = _integer(limit)
        return await self._call(request, self._decode(WhyRequest, data, "why"))

    async def _logs(self, request: web.Request) -> web.Response:
        """The attempt's log from the node that ran it, over NATS (bus/logs.py); the
        brain's history, read as the caller's tenant, says which node that was."""
        caller = self._caller(request)
        await self._leader()
        job_id = request.match_info["job_id"]
        query = {
            k: request.query[k] for k in ("attempt", "offset", "max_bytes") if k in request.query
        }
        numbers = {k: _integer(v) for k, v in query.items()}
        wanted = numbers.pop("attempt", None)
        if wanted is not None and (not isinstance(wanted, int) or wanted < 1):
            raise HttpRefusal(400, "invalid", f"invalid logs request: attempt {wanted!r}")
        history = await self.brain.api.handle(
            caller.tenant,
            self._decode(HistoryRequest, {"job_id": job_id}, "logs"),
            operator=caller.operator,
        )
        if isinstance(history, ErrorReply):
            return _json(history, STATUS_OF.get(history.code, 500))
        assert isinstance(history, HistoryReply)
        job = history.job
        rows = [(a.attempt, a.nodes) for a in history.attempts]
        try:
            attempt, nodes = attempt_nodes(rows, (job.attempt, job.nodes), wanted)
            node = request.query.get("node", nodes[0])
            if node not in nodes:
                raise LogUnavailable(
                    node, f"attempt {attempt} did not run on {node}", answered=True
                )
            chunk = await read_chunk(
                self.brain.bus,
                node,
                self._decode(LogRequest, {"job_id": job_id, "attempt": attempt, **numbers}, "logs"),
            )
        except LogUnavailable as error:
            code = "not_found" if error.answered else "unavailable"
            return _json(ErrorReply(code=code, error=error.reason), STATUS_OF[code])
        return _json(chunk)

    async def _resize(self, request: web.Request) -> web.Response:
        self._caller(request)
        body = self._decode(ResizeBody, await request.read(), "resize")
        data = {"job_id": request.match_info["job_id"], "gpus": body.gpus}
        return await self._call(request, self._decode(ResizeRequest, data, "resize"))

    async def _throttle(self, request: web.Request) -> web.Response:
        self._caller(request)  # refuse an unknown caller before reading its body
        message = self._decode(ThrottleRequest, await request.read(), "throttle")
        return await self._call(request, message)

    async def _nodes(self, request: web.Request) -> web.Response:
        data: dict[str, Any] = {}
        for name in ("after", "name"):
            if name in request.query:
                data[name] = request.query[name]
        if "limit" in request.query:
            limit = request.query["limit"]
            data["limit"] = _integer(limit)
        return await self._call(request, self._decode(ListNodesRequest, data, "nodes"))

    async def _queues(self, request: web.Request) -> web.Response:
        return await self._call(request, ListQueuesRequest())

    async def _drain(self, request: web.Request) -> web.Response:
        self._caller(request)
        raw = await request.read()
        body = self._decode(DrainBody, raw, "drain") if raw.strip() else DrainBody()
        data = {
            "node": request.match_info["node"],
            "reason": body.reason,
            "gpu": body.gpu,
            "requeue": body.requeue,
        }
        return await self._call(request, self._decode(DrainRequest, data, "drain"))

    async def _resume(self, request: web.Request) -> web.Response:
        data = {"node": request.match_info["node"]}
        return await self._call(request, self._decode(ResumeRequest, data, "resume"))

    async def _events(self, request: web.Request) -> web.StreamResponse:
        caller = self._caller(request)
        try:
            query = events.parse_query(request)
        except events.BadEventQuery as error:
            raise HttpRefusal(400, "invalid", f"invalid events request: {error}") from None
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        try:
            return await events.stream(
                request,
                bus=self.brain.bus,
                caller=caller,
                jobs=lambda: self.brain.state.jobs,
                query=query,
                heartbeat_s=self.heartbeat_s,
            )
        finally:
            self._streams.discard(task)
