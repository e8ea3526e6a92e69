"""Quota standings (brain/core/quota.py): one walk in rank order, which stops reading
guarantees once none has a GPU left, stands every job as the rule says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import Grant, JobView, QueueQuota
from brain.core.quota import Standing, quota_of, standings_in_order


def _by_the_rule(jobs: list[JobView], queues: dict[str, QueueQuota]) -> list[Standing]:
    """The rule as the module states it, job by job, with no shortcut."""
    used: dict[str, int] = {}
    for job in jobs:
        quota = queues.get(job.queue)
        if quota is not None and quota.job_class == "build" and job.grants:
            used[job.queue] = used.get(job.queue, 0) + job.gpus
    result = []
    for job in jobs:
        quota = queues.get(job.queue)
        if quota is None:
            result.append(Standing.OVER_QUOTA)
        elif job.grants and quota.job_class == "build":
            result.append(Standing.PINNED)
        elif used.get(job.queue, 0) + job.gpus <= quota.guaranteed_gpus:
            used[job.queue] = used.get(job.queue, 0) + job.gpus
            result.append(Standing.IN_QUOTA)
        elif quota.job_class == "build":
            result.append(Standing.HELD)
        else:
            result.append(Standing.OVER_QUOTA)
    return result


_jobs = st.lists(
    st.tuples(
        st.sampled_from(("a", "b", "c", "default")),
        st.sampled_from((1, 1, 1, 2, 4, 8)),
        st.booleans(),
    ),
    max_size=60,
)
_queues = st.lists(
    st.tuples(
        st.sampled_from(("a", "b", "c")), st.integers(0, 12), st.sampled_from(("train", "build"))
    ),
    max_size=3,
    unique_by=lambda q: q[0],
)


@settings(max_examples=500, deadline=None)
@given(_jobs, _queues)
def test_standings_follow_the_rule_whatever_the_queues_and_ranks(
    jobs: list[tuple[str, int, bool]], queues: list[tuple[str, int, str]]
) -> None:
    views = [
        JobView(
            f"j{i}",
            gpus,
            float(i),
            queue=queue,
            grants=(Grant("n", tuple(range(gpus))),) if running else (),
        )
        for i, (queue, gpus, running) in enumerate(jobs)
    ]
    quotas = quota_of(QueueQuota(name, guaranteed, kind) for name, guaranteed, kind in queues)
    assert standings_in_order(views, quotas) == _by_the_rule(views, quotas)
