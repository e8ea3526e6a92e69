"""`/metrics`, parsed with prometheus-client's own parser: every GPU under dcgm-exporter's
names and labels, and the scheduler's series, from a real brain and agent."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from brain.core.model import QueueQuota
from brain.metrics import GPU_LABELS, PROFILE_LABELS
from brain.service import Brain
from bus.client import Bus
from schemas.commands import InjectFault
from tests.conftest import eventually
from tests.httpkit import Api, api_factory

__all__ = ["api_factory"]

DCGM_FIELDS = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_TOTAL",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
)
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname"}
GRAFANA = Path(__file__).resolve().parent.parent / "infra" / "grafana" / "alnair-dashboard.json"


async def scrape(api: Api) -> dict[str, list[Sample]]:
    status, text = await api.call("GET", "/metrics", "operator")
    assert status == 200
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    return None


async def test_gpus_under_dcgm_names_and_the_schedulers_series(
    brain_factory: Callable[..., Awaitable[Brain]],
    agent_factory: Callable[..., Awaitable[Any]],
    api_factory: Callable[..., Awaitable[Api]],
    connect: Callable[[str], Awaitable[Bus]],
) -> None:
    # Guaranteed less than its job asks: the job waits over quota rather than reclaim.
    brain = await brain_factory(queues=(QueueQuota("research", 1),))
    agent = await agent_factory("n1", gpus=2, model="H100")
    api = await api_factory(brain)
    await eventually(lambda: "n1" in brain.telemetry)

    one = {"spec": {"name": "a", "command": ["sleep", "60"], "gpus": 1}}
    running = (await api.call("POST", "/v1/jobs", json=one))[1]["job"]["job_id"]
    await eventually(lambda: brain.state.jobs[running].nodes == ("n1",))
    gpu = str(brain.state.jobs[running].grants[0].gpus[0])
    two = {"spec": {"name": "b", "command": ["true"], "gpus": 2, "queue": "research"}}
    waiting = (await api.call("POST", "/v1/jobs", json=two))[1]["job"]["job_id"]
    # Its waiting reason (and the `Wait` counted) comes from a pass that explains: at
    # most one a second.
    await eventually(lambda: "needs 2 GPUs" in (brain.state.jobs[waiting].reason or ""))

    # An application XID (not a drain) on the other GPU, and a message no one can read.
    other = "1" if gpu == "0" else "0"
    reply = agent.inject(
        InjectFault(gpu=int(other), fault="xid", xid=13).model_dump_json().encode()
    )
    assert reply.ok, reply.detail
    bus = await connect("garbage")
    await bus.nc.publish("alnair.node.n1.heartbeat", b"{not json")

    async def ready() -> dict[str, list[Sample]] | None:
        metrics = await scrape(api)
        util = metrics.get("DCGM_FI_DEV_GPU_UTIL", [])
        held = value(util, "DCGM_FI_DEV_GPU_UTIL", gpu=gpu, alnair_job=running)
        xid = value(metrics.get("DCGM_FI_DEV_XID_ERRORS", []), "DCGM_FI_DEV_XID_ERRORS", gpu=other)
        dead = metrics.get("alnair_dead_letters", [])
        profiled = metrics.get("alnair_job_gpu_util_mean_percent", [])
        if held and xid == 13 and dead and profiled:
            return metrics
        return None

    metrics = await eventually(ready, timeout_s=30)
    for field in DCGM_FIELDS:
        samples = metrics[field]
        assert {s.labels["gpu"] for s in samples} == {"0", "1"}, field
        for sample in samples:
            assert set(sample.labels) >= DCGM_LABELS, (field, sample.labels)
            assert sample.labels["modelName"] == "NVIDIA H100 (simulated)"
            assert sample.labels["UUID"].startswith("GPU-")
            assert sample.labels["device"] == f"nvidia{sample.labels['gpu']}"
            assert sample.labels["node"] == "n1"
    fb_total = value(metrics["DCGM_FI_DEV_FB_TOTAL"], "DCGM_FI_DEV_FB_TOTAL", gpu=gpu)
    used = value(metrics["DCGM_FI_DEV_FB_USED"], "DCGM_FI_DEV_FB_USED", gpu=gpu)
    free = value(metrics["DCGM_FI_DEV_FB_FREE"], "DCGM_FI_DEV_FB_FREE", gpu=gpu)
    assert used is not None and free is not None and used + free == fb_total

    assert (
        value(metrics["alnair_queue_pending_jobs"], "alnair_queue_pending_jobs", queue="research")
        == 1
    )
    assert (
        value(metrics["alnair_queue_pending_gpus"], "alnair_queue_pending_gpus", queue="research")
        == 2
    )
    # Each queue's guarantee beside what it holds: research is owed 1 and holds none.
    quota = metrics["alnair_queue_guaranteed_gpus"]
    assert value(quota, "alnair_queue_guaranteed_gpus", queue="research", **{"class": "train"}) == 1
    assert value(quota, "alnair_queue_guaranteed_gpus", queue="default") is None
    held = metrics["alnair_queue_running_gpus"]
    assert value(held, "alnair_queue_running_gpus", queue="default") == 1
    assert value(held, "alnair_queue_running_gpus", queue="research") == 0
    assert (
        value(metrics["alnair_queue_running_jobs"], "alnair_queue_running_jobs", queue="default")
        == 1
    )
    pending = metrics["alnair_job_pending_seconds"]
    assert value(pending, "alnair_job_pending_seconds_count", queue="default") == 1
    decisions = metrics["alnair_scheduler_decisions"]
    assert (value(decisions, "alnair_scheduler_decisions_total", action="place") or 0) >= 1
    assert (value(decisions, "alnair_scheduler_decisions_total", action="wait") or 0) >= 1
    assert "alnair_scheduler_preemptions" in metrics
    transitions = metrics["alnair_job_transitions"]
    placed = value(transitions, "alnair_job_transitions_total", state="RUNNING", cause="placed")
    assert placed == 1
    dead = value(
        metrics["alnair_dead_letters"], "alnair_dead_letters_total", origin="node.heartbeat"
    )
    assert dead is not None and dead >= 1
    assert value(metrics["alnair_jobs"], "alnair_jobs", state="RUNNING") == 1
    # The waiting job counted by the kind of its wait, which its record keeps.
    kind = brain.state.jobs[waiting].wait_kind
    assert kind == "ranked_out"
    assert value(metrics["alnair_jobs_waiting"], "alnair_jobs_waiting", kind=kind) == 1
    # `alnair status` says it too.
    code, status = await api.call("GET", "/v1/status")
    assert code == 200 and status["waiting"] == {kind: 1}, status
    # Ingest: heartbeats arrive, few are news, and nothing was shed at this load.
    beats = value(metrics["alnair_ingest_heartbeats"], "alnair_ingest_heartbeats_total")
    news = value(
        metrics["alnair_ingest_heartbeats_forwarded"], "alnair_ingest_heartbeats_forwarded_total"
    )
    assert beats is not None and news is not None and 1 <= news <= beats
    assert value(metrics["alnair_telemetry_shed"], "alnair_telemetry_shed_total") == 0
    assert value(metrics["alnair_heartbeats_dropped"], "alnair_heartbeats_dropped_total") == 0
    # The log took its records in groups: never more groups than records.
    groups = value(metrics["alnair_journal_groups"], "alnair_journal_groups_total")
    stored = value(metrics["alnair_journal_records"], "alnair_journal_records_total")
    assert groups is not None and stored is not None and 1 <= groups <= stored
    # The running job's Launch went out through the journal's sender; nothing waits.
    sent = value(metrics["alnair_journal_commands_sent"], "alnair_journal_commands_sent_total")
    assert sent is not None and sent >= 1
    queued = metrics["alnair_journal_commands_queued"]
    assert value(queued, "alnair_journal_commands_queued") == 0
    assert value(metrics["alnair_gpus_allocated"], "alnair_gpus_allocated") == 1
    mean = value(
        metrics["alnair_job_gpu_util_mean_percent"],
        "alnair_job_gpu_util_mean_percent",
        alnair_job=running,
        tenant="alice",
    )
    assert mean is not None and mean > 50

    # Job outcomes by failure class: a cancelled job is no failure.
    assert (await api.call("POST", f"/v1/jobs/{waiting}/cancel"))[0] == 200

    async def counted() -> bool:
        outcomes = (await scrape(api)).get("alnair_job_outcomes", [])
        found = value(
            outcomes, "alnair_job_outcomes_total", state="CANCELLED", failure_class="none"
        )
        return found == 1

    await eventually(counted)

    # The Grafana dashboard in infra/ charts only series the brain exports.
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    charted = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for expr in exprs
        for name in re.findall(r"\b(DCGM_FI_\w+|alnair_\w+)", expr)
        if name not in (*GPU_LABELS, *PROFILE_LABELS)
    }
    exported = set(await scrape(api))
    assert charted and charted <= exported, charted - exported

    # The census: every GPU in one state, READY nodes' GPUs by utilisation (counted at
    # most CENSUS_TTL_S apart, so asked until it has seen the job).
    async def counted_gpus() -> dict[str, list[Sample]] | None:
        metrics = await scrape(api)
        busy = value(metrics["alnair_gpus_by_state"], "alnair_gpus_by_state", state="busy")
        return metrics if busy == 1 else None

    metrics = await eventually(counted_gpus, timeout_s=30)
    states = {s.labels["state"]: s.value for s in metrics["alnair_gpus_by_state"]}
    assert states == {"busy": 1, "shared": 0, "free": 1, "drained": 0, "unavailable": 0}
    by_util = metrics["alnair_gpus_by_utilisation"]
    assert [s.labels["percent"] for s in by_util][::9] == ["0-9", "90-100"]
    assert sum(s.value for s in by_util) == 2
    assert value(metrics["alnair_gpus_unreported"], "alnair_gpus_unreported") == 0

    # Gzipped for a scraper that asks (Prometheus does), plain text for one that does not.
    for accept, encoding in (("gzip", "gzip"), ("identity", None)):
        headers = {**api.auth("operator"), "Accept-Encoding": accept}
        async with api.session.get(f"{api.url}/metrics", headers=headers) as response:
            assert response.headers.get("Content-Encoding") == encoding
            assert "DCGM_FI_DEV_GPU_UTIL{" in await response.text()
