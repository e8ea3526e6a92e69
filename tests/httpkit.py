"""Shared by the HTTP, metrics and dashboard tests: a brain with its HTTP server on a free
port, tokens for two tenants and an operator, and a client session. Real everything."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from brain.http import HttpServer, TokenTable
from brain.service import Brain

TOKENS = {
    "alice": "alice-token-0123456789",
    "bob": "bob-token-0123456789ab",
    "operator": "operator-token-0123456789",
}


def write_tokens(path: Path) -> Path:
    entries = [
        {"token": TOKENS["alice"], "tenant": "alice"},
        {"token": TOKENS["bob"], "tenant": "bob"},
        {"token": TOKENS["operator"], "tenant": "operator", "operator": True},
    ]
    path.write_text(json.dumps({"tokens": entries}))
    return path


@dataclass
class Api:
    server: HttpServer
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url

    @staticmethod
    def auth(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKENS[who]}"}

    async def call(
        self, method: str, path: str, who: str | None = "alice", **kwargs: Any
    ) -> tuple[int, Any]:
        headers = {**(self.auth(who) if who else {}), **kwargs.pop("headers", {})}
        async with self.session.request(
            method, self.url + path, headers=headers, **kwargs
        ) as response:
            text = await response.text()
            body = json.loads(text) if response.content_type == "application/json" else text
            return response.status, body


@pytest.fixture
async def api_factory(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[Api]]]:
    """Serve a brain over HTTP: `api = await api_factory(brain)`."""
    servers: list[HttpServer] = []
    session = aiohttp.ClientSession()

    async def make(brain: Brain, **options: Any) -> Api:
        tokens = TokenTable.load(write_tokens(tmp_path / "tokens.json"))
        server = HttpServer(brain, tokens=tokens, host="127.0.0.1", port=0, **options)
        await server.start()
        servers.append(server)
        return Api(server, session)

    try:
        yield make
    finally:
        for server in reversed(servers):
            with contextlib.suppress(Exception):
                await server.stop()
        await session.close()
