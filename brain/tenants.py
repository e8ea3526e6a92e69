"""The brain's side of the tenant map (schemas/tenants.py): read it, and refuse a
submission from a tenant it does not name, so that no job is placed that no node
could run as anyone."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import ApiError
from schemas.events import InputError, NodeEvent, ResizeCompleted
from schemas.tenants import TenantMap, TenantMapError, parse_tenant_map
from schemas.yamlfile import read_text


def load_tenant_map(path: str | Path) -> TenantMap:
    try:
        text = read_text(path)
    except OSError as error:
        raise TenantMapError(f"{path}: cannot read: {error.strerror or error}") from None
    return parse_tenant_map(text, where=str(path))


def check_tenant(tenants: frozenset[str] | None, tenant: str) -> None:
    """Raise the API's refusal when a tenant map is configured and lacks `tenant`."""
    if tenants is not None and tenant not in tenants:
        raise ApiError(
            "forbidden",
            f"tenant {tenant} has no Unix user in this cluster's tenant map, so its jobs "
            "could run nowhere; an operator must add it (alnair brain --tenant-users)",
        )


def job_event_refusal(subject: str, event: NodeEvent) -> str | None:
    """Why an event on `alnair.job.<job>.event` is refused, or None. A job (its
    supervisor, its SDK) may report its resizes and its bad inputs, and only its own;
    exits, faults and the rest are its node's to report."""
    tokens = subject.split(".")
    job = tokens[2] if len(tokens) == 4 else ""
    if not isinstance(event, ResizeCompleted | InputError):
        return f"a job may not report {event.kind} events"
    if event.job_id != job:
        return f"payload names job {event.job_id!r} but the subject is {job!r}"
    return None
