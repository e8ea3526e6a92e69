"""Schemathesis over `/openapi.json`, against a real brain on a real nats-server.

Every documented operation is called with generated valid and invalid requests; each
answer must be documented (status, content type, body schema) and no request may make
the brain fail (a 500). The brain has no nodes, so generated jobs stay pending and no
generated command ever runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from brain.service import Brain
from tests.httpkit import TOKENS, Api, api_factory

__all__ = ["api_factory"]

CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "unsupported_method",
        "ignored_auth",
    )
)


async def test_the_api_conforms_to_its_openapi_document(
    brain_factory: Callable[..., Awaitable[Brain]],
    api_factory: Callable[..., Awaitable[Api]],
    tmp_path: Path,
) -> None:
    api = await api_factory(await brain_factory())
    status, document = await api.call("GET", "/openapi.json", None)
    assert status == 200 and document["openapi"].startswith("3.1")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{api.url}/openapi.json",
        "--checks",
        CHECKS,
        "--header",
        f"Authorization: Bearer {TOKENS['alice']}",
        # A stream answers for as long as the client listens; tests/test_http_events.py
        # covers it.
        "--exclude-path",
        "/v1/events",
        "--max-examples",
        "25",
        "--seed",
        "1",
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        "10",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,  # its report and example database stay out of the tree
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-6000:]
