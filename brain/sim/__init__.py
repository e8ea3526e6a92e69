"""The trace simulator: replays a job trace in simulated time through `brain.core.decide`.

It owns its own event loop and cluster state; the core never knows it is simulated.
"""

from brain.sim.engine import JobOutcome, SimConfig, SimResult, SimulationError, simulate
from brain.sim.report import Metrics, summarize
from brain.sim.trace import ClusterSpec, TraceError, TraceJob, load_trace, parse_cluster

__all__ = [
    "ClusterSpec",
    "JobOutcome",
    "Metrics",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "TraceError",
    "TraceJob",
    "load_trace",
    "parse_cluster",
    "simulate",
    "summarize",
]
