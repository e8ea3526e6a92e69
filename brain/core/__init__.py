"""The pure policy core shared by the live brain and the simulator. No I/O here."""

from brain.core.decide import DEFAULT_POLICY, InvalidPolicy, Policy, UnknownPlugin, decide
from brain.core.distribution import (
    DEFAULT_ERROR_PRIOR,
    DEFAULT_SERVICE_PRIOR,
    ServiceDistribution,
)
from brain.core.elastic import ELASTICITIES
from brain.core.model import (
    Action,
    ClusterSnapshot,
    Decisions,
    Grant,
    JobClass,
    JobView,
    Measured,
    MemoryPressure,
    NodeView,
    Outranked,
    Place,
    Placed,
    Preempt,
    PreemptCause,
    QueueQuota,
    QuotaReclaim,
    Resize,
    Service,
    SetServiceLevel,
    Wait,
)
from brain.core.ordering import (
    ORDER_READS,
    ORDERINGS,
    QUEUE_ORDERS,
    QueueOrder,
    reads,
)
from brain.core.placement import PLACEMENTS, KeptLedger
from brain.core.preemption import PREEMPTIONS
from brain.core.ranking import Ranking

__all__ = [
    "DEFAULT_ERROR_PRIOR",
    "DEFAULT_POLICY",
    "DEFAULT_SERVICE_PRIOR",
    "ELASTICITIES",
    "ORDERINGS",
    "ORDER_READS",
    "PLACEMENTS",
    "PREEMPTIONS",
    "QUEUE_ORDERS",
    "Action",
    "ClusterSnapshot",
    "Decisions",
    "Grant",
    "InvalidPolicy",
    "JobClass",
    "JobView",
    "KeptLedger",
    "Measured",
    "MemoryPressure",
    "NodeView",
    "Outranked",
    "Place",
    "Placed",
    "Policy",
    "Preempt",
    "PreemptCause",
    "QueueOrder",
    "QueueQuota",
    "QuotaReclaim",
    "Ranking",
    "Resize",
    "Service",
    "ServiceDistribution",
    "SetServiceLevel",
    "UnknownPlugin",
    "Wait",
    "decide",
    "reads",
]
