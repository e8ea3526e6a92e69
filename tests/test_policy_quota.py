"""Quota standings (brain/core/quota.py): one walk in rank order, which stops reading
guarantees once none has a GPU left (the smallest share, where GPUs are shared), stands
every job as the rule says; a share of a GPU is charged its share."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from brain.core import Grant, JobView, QueueQuota
from brain.core.model import Demand
from brain.core.quota import Standing, quota_of, standings_in_order


def _gpus(job: JobView) -> float:
    return job.demand.gpu_milli / 1000 if job.demand is not None else job.gpus


def _by_the_rule(jobs: list[JobView], queues: dict[str, QueueQuota]) -> list[Standing]:
    """The rule as the module states it, job by job, with no shortcut (in GPUs, a share
    its fraction; the fractions here add up exactly in binary)."""
    used: dict[str, float] = {}
    for job in jobs:
        quota = queues.get(job.queue)
        if quota is not None and quota.job_class == "build" and job.grants:
            used[job.queue] = used.get(job.queue, 0) + _gpus(job)
    result = []
    for job in jobs:
        quota = queues.get(job.queue)
        if quota is None:
            result.append(Standing.OVER_QUOTA)
        elif job.grants and quota.job_class == "build":
            result.append(Standing.PINNED)
        elif used.get(job.queue, 0) + _gpus(job) <= quota.guaranteed_gpus:
            used[job.queue] = used.get(job.queue, 0) + _gpus(job)
            result.append(Standing.IN_QUOTA)
        elif quota.job_class == "build":
            result.append(Standing.HELD)
        else:
            result.append(Standing.OVER_QUOTA)
    return result


_jobs = st.lists(
    st.tuples(
        st.sampled_from(("a", "b", "c", "default")),
        # A float: a share of one GPU.
        st.sampled_from((1, 1, 1, 2, 4, 8, 0.25, 0.5, 0.75)),
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
    jobs: list[tuple[str, float, bool]], queues: list[tuple[str, int, str]]
) -> None:
    views = [
        JobView(
            f"j{i}",
            max(1, int(gpus)),
            float(i),
            queue=queue,
            grants=(Grant("n", tuple(range(max(1, int(gpus))))),) if running else (),
            demand=None if gpus >= 1 else Demand(gpu_milli=int(gpus * 1000)),
        )
        for i, (queue, gpus, running) in enumerate(jobs)
    ]
    quotas = quota_of(QueueQuota(name, guaranteed, kind) for name, guaranteed, kind in queues)
    assert standings_in_order(views, quotas) == _by_the_rule(views, quotas)


def test_shares_are_charged_their_share_of_the_guarantee() -> None:
    """Four quarter-GPU shares fit a 1-GPU guarantee; a fifth borrows."""
    quarters = [
        JobView(f"s{i}", 1, float(i), queue="team", demand=Demand(gpu_milli=250)) for i in range(5)
    ]
    quotas = quota_of([QueueQuota("team", 1, "train")])
    assert standings_in_order(quarters, quotas) == [Standing.IN_QUOTA] * 4 + [Standing.OVER_QUOTA]
