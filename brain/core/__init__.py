"""The pure policy core shared by the live brain and the simulator. No I/O here."""

from brain.core.decide import DEFAULT_POLICY, InvalidPolicy, Policy, UnknownPlugin, decide
from brain.core.distribution import DEFAULT_SERVICE_PRIOR, ServiceDistribution
from brain.core.elastic import ELASTICITIES
from brain.core.model import (
    Action,
    ClusterSnapshot,
    Decisions,
    Grant,
    JobClass,
    JobView,
    Measured,
    NodeView,
    Outranked,
    Place,
    Placed,
    Preempt,
    PreemptCause,
    QueueQuota,
    QuotaReclaim,
    Resize,
    SetServiceLevel,
    Wait,
)
from brain.core.ordering import (
    DISTRIBUTION_AWARE,
    DURATION_AWARE,
    ORDER_READS,
    ORDERINGS,
    PROGRESS_AWARE,
    reads,
)
from brain.core.placement import PLACEMENTS
from brain.core.preemption import PREEMPTIONS

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_SERVICE_PRIOR",
    "DISTRIBUTION_AWARE",
    "DURATION_AWARE",
    "ELASTICITIES",
    "ORDERINGS",
    "ORDER_READS",
    "PLACEMENTS",
    "PREEMPTIONS",
    "PROGRESS_AWARE",
    "Action",
    "ClusterSnapshot",
    "Decisions",
    "Grant",
    "InvalidPolicy",
    "JobClass",
    "JobView",
    "Measured",
    "NodeView",
    "Outranked",
    "Place",
    "Placed",
    "Policy",
    "Preempt",
    "PreemptCause",
    "QueueQuota",
    "QuotaReclaim",
    "Resize",
    "ServiceDistribution",
    "SetServiceLevel",
    "UnknownPlugin",
    "Wait",
    "decide",
    "reads",
]
