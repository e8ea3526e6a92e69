"""The dashboard, opened in a real headless Chromium (Debian's `chromium`) against a real
brain and agent: it must show a submitted job and the node's GPUs. The browser is
driven through the DevTools protocol so the test waits for the page's JavaScript, and a
screenshot is written to tests/artifacts/dashboard.png for people to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from brain.core import QueueQuota
from brain.service import Brain
from schemas.jobs import JobState
from tests.conftest import eventually
from tests.httpkit import TOKENS, Api, api_factory
from tests.test_shares_live import PLAY

__all__ = ["api_factory"]

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
    "--window-size=1400,1000",
)


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class DevTools:
    """Just enough of the Chrome DevTools protocol: call a method, get its result."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async for message in self.ws:
            data = json.loads(message.data)
            if data.get("id") == call_id:
                if "error" in data:
                    raise AssertionError(f"{method} failed: {data['error']}")
                result: dict[str, Any] = data.get("result", {})
                return result
        raise AssertionError(f"the browser closed the DevTools connection during {method}")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@contextlib.asynccontextmanager
async def chromium(binary: str, profile_dir: Path) -> AsyncIterator[DevTools]:
    process = await asyncio.create_subprocess_exec(
        binary,
        *HEADLESS_FLAGS,
        f"--user-data-dir={profile_dir}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        endpoint = None
        while endpoint is None:
            line = await asyncio.wait_for(process.stderr.readline(), timeout=60)
            if not line:
                raise AssertionError("chromium exited before opening its DevTools port")
            found = re.search(rb"DevTools listening on (ws://\S+)", line)
            endpoint = found.group(1).decode() if found else None
        port = endpoint.split("/")[2].rsplit(":", 1)[1]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page = next(t for t in targets if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield DevTools(ws)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


def chromium_or_skip() -> str:
    binary = find_chromium()
    if binary is None:
        pytest.skip(f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)} on PATH)")
    return binary


@contextlib.asynccontextmanager
async def dashboard(binary: str, api: Api, tmp_path: Path) -> AsyncIterator[DevTools]:
    """Chromium on the API's dashboard, signed in as the operator."""
    async with chromium(binary, tmp_path / "chromium-profile") as browser:
        await browser.call("Page.enable")
        await browser.call("Page.navigate", url=f"{api.url}/#token={TOKENS['operator']}")
        yield browser


PAGE_STATE = """JSON.stringify({
  text: document.body.innerText,
  cells: document.querySelectorAll('.gpu-cell').length,
  held: document.querySelectorAll('.gpu-cell.held').length,
  events: document.querySelectorAll('#events li').length,
  census: Array.from(document.querySelectorAll('#census [data-count]'))
    .map(span => span.textContent),
  bars: document.querySelectorAll('#census .histogram div').length,
  profiled: Array.from(document.querySelectorAll('#running tbody tr td:nth-child(6)'))
    .map(td => td.textContent),
  queues: document.getElementById('queues-section').hidden ? [] :
    Array.from(document.querySelectorAll('#queues tbody tr'))
      .map(tr => Array.from(tr.cells).map(td => td.textContent).join('|'))
})"""


async def test_dashboard_shows_the_job_and_the_gpus(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    tmp_path: Path,
) -> None:
    binary = chromium_or_skip()
    brain = await brain_factory(queues=(QueueQuota("research", 1),))
    await agent_factory("gpu-node-1", gpus=4, model="H100")
    api = await api_factory(brain)
    await eventually(lambda: "gpu-node-1" in brain.telemetry)
    spec = {"spec": {"name": "resnet-demo", "command": ["sleep", "120"], "gpus": 2}}
    job_id = (await api.call("POST", "/v1/jobs", json=spec))[1]["job"]["job_id"]
    waiting = {"spec": {"name": "waits-for-4", "command": ["sleep", "1"], "gpus": 4}}
    await api.call("POST", "/v1/jobs", "bob", json=waiting)
    await eventually(lambda: brain.state.jobs[job_id].state.value == "RUNNING")

    async with dashboard(binary, api, tmp_path) as browser:

        async def shows_everything() -> dict[str, Any] | None:
            state = json.loads(await browser.evaluate(PAGE_STATE) or "{}")
            done = (
                "resnet-demo" in state.get("text", "")
                and "waits-for-4" in state.get("text", "")
                and state.get("cells") == 4
                and state.get("held") == 2
                and state.get("events", 0) > 0
                and any(cell.endswith("%") for cell in state.get("profiled", []))
                and len(state.get("queues", [])) == 2
                and "2 busy" in state.get("census", [])
            )
            return state if done else None

        state = await eventually(shows_everything, timeout_s=60, interval_s=0.25)
        assert "gpu-node-1" in state["text"] and f"job {job_id}" in state["text"]
        # The census: every GPU counted, and a bar per 10 % of utilisation.
        assert state["census"] == ["2 busy", "0 shared", "2 free", "0 drained", "0 on lost nodes"]
        assert state["bars"] == 10
        # Queues: the configured one, and the one the jobs use that is not configured
        # (queue|class|guaranteed|running|held|borrowed|pending|asked).
        assert state["queues"] == [
            "default (not listed)|train|0|1|2|2|1|4",
            "research|train|1|0|0|0|0|0",
        ]
        shot = await browser.call("Page.captureScreenshot", format="png")

    import base64

    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "dashboard.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"dashboard screenshot: {path}")
    assert path.stat().st_size > 10_000


async def test_dashboard_names_the_jobs_sharing_a_gpu(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    tmp_path: Path,
) -> None:
    """A shareable job holds its GPU whole and a share joins it: the GPU's cell names
    both, the host and the guest with its share."""
    binary = chromium_or_skip()
    brain = await brain_factory()
    await agent_factory("gpu-node-1", gpus=1, model="H100")
    api = await api_factory(brain)
    await eventually(lambda: "gpu-node-1" in brain.telemetry)

    async def submitted(spec: dict[str, Any]) -> str:
        return str((await api.call("POST", "/v1/jobs", json={"spec": spec}))[1]["job"]["job_id"])

    # Uses 20 % of its GPU and 16,000 MiB: room for a share once its profile says so.
    play = [sys.executable, "-c", PLAY, "16000", str(tmp_path / "never"), "16000"]
    host = await submitted({"command": play, "gpus": 1, "shareable": True})
    await eventually(lambda: host in brain.profiles.current(), timeout_s=30)
    guest = await submitted(
        {"command": ["sleep", "120"], "gpus": 1, "gpu_milli": 250, "gpu_memory_mib": 20000}
    )
    await eventually(lambda: brain.state.jobs[guest].state is JobState.RUNNING)

    async with dashboard(binary, api, tmp_path) as browser:
        cell = "Array.from(document.querySelectorAll('.gpu-cell .job')).map(s => s.textContent)"

        async def named() -> list[str] | None:
            jobs = json.loads(await browser.evaluate(f"JSON.stringify({cell})") or "[]")
            return jobs if jobs and f"{guest} 0.25" in jobs[0] else None

        assert await eventually(named, timeout_s=60, interval_s=0.25) == [
            f"job {host}, {guest} 0.25"
        ]
