"""The queues file: which queues have a quota, how many GPUs each is guaranteed, and
their class. Read by `alnair brain --queues`, `alnair up --queues` and `alnair sim
--queues`; `alnair sim --quota NAME=GPUS[:CLASS]` says the same on the command line.

```yaml
queues:
  - name: interactive
    guaranteed_gpus: 4
    class: build          # fixed quota, never preempted, never borrows
  - name: research
    guaranteed_gpus: 8    # class defaults to train: borrows idle GPUs, preemptible
```

A queue not listed is a `train` queue with no guarantee, or, under `--strict-queues`,
refused at submit (`unlisted`). This module only parses and
validates; an error names the file, the entry and what is wrong with it. The policy
that reads the quotas is `brain/core/quota.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, cast

import yaml

from brain.core.model import JobClass, QueueQuota, gpus_said
from schemas.api import QueueStatus
from schemas.base import check_name
from schemas.errors import AlnairError, InvalidName
from schemas.jobs import GPU_MILLI as MILLI
from schemas.jobs import JobRecord
from schemas.yamlfile import load_yaml, read_text

JOB_CLASSES: Final[tuple[JobClass, ...]] = ("build", "train")
KEYS: Final = ("name", "guaranteed_gpus", "class")
EXAMPLE: Final = "queues:\n  - name: research\n    guaranteed_gpus: 8\n    class: train"


class QueueConfigError(AlnairError, ValueError):
    """A queues file or `--quota` that cannot be used; says where and what is wrong."""

    def __init__(self, reason: str, *, where: str | None = None) -> None:
        super().__init__(f"{where}: {reason}" if where else reason)
        self.reason = reason
        self.where = where


def load_queues(path: str | Path) -> tuple[QueueQuota, ...]:
    """The quotas of a queues file, in file order."""
    where = str(path)
    try:
        text = read_text(path)
    except OSError as error:
        raise QueueConfigError(f"cannot read: {error.strerror or error}", where=where) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        raise QueueConfigError(f"not valid YAML: {error}", where=where) from None
    if not isinstance(data, dict) or set(data) != {"queues"}:
        if isinstance(data, dict):
            found = f"keys {', '.join(map(str, data)) or 'none'}"
        else:
            found = "an empty file" if data is None else f"a {type(data).__name__}"
        raise QueueConfigError(
            f"expected a mapping with one key, `queues`, holding a list; found {found}. "
            f"For example:\n{EXAMPLE}",
            where=where,
        )
    entries = data["queues"]
    if not isinstance(entries, list):
        raise QueueConfigError(
            f"`queues` must be a list of queues, not {type(entries).__name__}", where=where
        )
    return checked(
        (_entry(entry, f"{where}: queues[{i}]") for i, entry in enumerate(entries)), where=where
    )


def _entry(entry: object, where: str) -> QueueQuota:
    if not isinstance(entry, dict):
        raise QueueConfigError(
            f"expected a mapping with {', '.join(KEYS)}; found {entry!r}", where=where
        )
    fields = cast(Mapping[object, object], entry)
    unknown = [str(k) for k in fields if k not in KEYS]
    if unknown:
        raise QueueConfigError(
            f"unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}", where=where
        )
    name = fields.get("name")
    if not isinstance(name, str):
        raise QueueConfigError("`name` is required and must be a string", where=where)
    where = f"{where} ({name})"
    if "guaranteed_gpus" not in fields:
        raise QueueConfigError("`guaranteed_gpus` is required", where=where)
    return quota(name, fields["guaranteed_gpus"], fields.get("class", "train"), where=where)


def quota(name: str, gpus: object, job_class: object, *, where: str) -> QueueQuota:
    """One queue's quota, validated."""
    try:
        check_name("queue", name)
    except InvalidName as error:
        raise QueueConfigError(str(error), where=where) from None
    # bool is an int in Python; `guaranteed_gpus: yes` is a mistake, not 1.
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise QueueConfigError(
            f"guaranteed_gpus must be a whole number >= 0, not {gpus!r}", where=where
        )
    if job_class not in JOB_CLASSES:
        raise QueueConfigError(
            f"class must be {' or '.join(JOB_CLASSES)}, not {job_class!r}", where=where
        )
    return QueueQuota(name=name, guaranteed_gpus=gpus, job_class=job_class)


def parse_quota(text: str) -> QueueQuota:
    """`NAME=GPUS[:build|train]`, as `alnair sim --quota` takes it."""
    where = f"--quota {text!r}"
    name, sep, rest = text.partition("=")
    gpus_text, _, job_class = rest.partition(":")
    if not sep or not gpus_text.strip().isdigit():
        raise QueueConfigError(
            "expected NAME=GPUS[:build|train], e.g. research=8:train", where=where
        )
    return quota(name.strip(), int(gpus_text), job_class.strip() or "train", where=where)


def checked(quotas: Iterable[QueueQuota], *, where: str | None = None) -> tuple[QueueQuota, ...]:
    """The quotas, refusing a queue configured twice."""
    seen: set[str] = set()
    result: list[QueueQuota] = []
    for q in quotas:
        if q.name in seen:
            raise QueueConfigError(f"queue {q.name!r} is configured twice", where=where)
        seen.add(q.name)
        result.append(q)
    return tuple(result)


def describe(quotas: Iterable[QueueQuota]) -> str:
    """`interactive=4:build research=8:train`, for logs and `alnair status`."""
    return " ".join(f"{q.name}={q.guaranteed_gpus}:{q.job_class}" for q in quotas) or "none"


def queue_status(
    queues: Iterable[QueueQuota], running: Iterable[JobRecord], pending: Iterable[JobRecord]
) -> list[QueueStatus]:
    """Every listed queue, and every other queue that has jobs, by name: its quota
    beside its running jobs' GPUs and its pending jobs' asks, a share of a GPU counted as
    its share (as the policy charges it: `brain.core.quota.charge`)."""
    listed = {q.name: q for q in queues}
    # Jobs, and thousandths of a GPU.
    counts: dict[str, list[int]] = {name: [0, 0, 0, 0] for name in listed}
    for job in running:
        count = counts.setdefault(job.spec.queue, [0, 0, 0, 0])
        count[0] += 1
        held = sum(len(g.gpus) for g in job.grants) * MILLI
        count[1] += held if job.spec.gpu_milli is None else job.spec.gpu_milli
    for job in pending:
        count = counts.setdefault(job.spec.queue, [0, 0, 0, 0])
        count[2] += 1
        milli = job.spec.gpu_milli
        count[3] += job.spec.gpus * MILLI if milli is None else milli
    statuses: list[QueueStatus] = []
    for name, (running_jobs, running_milli, pending_jobs, pending_milli) in sorted(counts.items()):
        quota = listed.get(name)
        statuses.append(
            QueueStatus(
                name=name,
                listed=quota is not None,
                job_class=quota.job_class if quota is not None else "train",
                guaranteed_gpus=quota.guaranteed_gpus if quota is not None else 0,
                running_jobs=running_jobs,
                running_gpus=running_milli / MILLI,
                pending_jobs=pending_jobs,
                pending_gpus=pending_milli / MILLI,
            )
        )
    return statuses


def unlisted(queues: Iterable[QueueQuota], queue: str) -> str | None:
    """Why a job for `queue` is refused by a brain that takes only listed queues
    (`--strict-queues`), or None."""
    names = [q.name for q in queues]
    if queue in names:
        return None
    return f"no queue {queue}; the queues are {', '.join(names)} (submit --queue NAME)"


def never_within(queues: Iterable[QueueQuota], queue: str, gpus: int) -> str | None:
    """Why a job asking `gpus` (an elastic job: its minimum) of `queue` could never run,
    or None: a build queue's jobs never borrow beyond its guarantee."""
    quota = next((q for q in queues if q.name == queue), None)
    if quota is None or quota.job_class != "build" or gpus <= quota.guaranteed_gpus:
        return None
    return (
        f"queue {queue} is a build queue guaranteed {gpus_said(quota.guaranteed_gpus)}, and "
        f"build jobs do not borrow: a job asking {gpus_said(gpus)} there could never run"
    )
