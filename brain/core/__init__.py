"""The pure policy core shared by the live brain and the simulator. No I/O here."""

from brain.core.decide import DEFAULT_POLICY, Policy, UnknownPlugin, decide
from brain.core.model import (
    Action,
    ClusterSnapshot,
    Decisions,
    Grant,
    JobView,
    NodeView,
    Place,
    Wait,
)

__all__ = [
    "DEFAULT_POLICY",
    "Action",
    "ClusterSnapshot",
    "Decisions",
    "Grant",
    "JobView",
    "NodeView",
    "Place",
    "Policy",
    "UnknownPlugin",
    "Wait",
    "decide",
]
