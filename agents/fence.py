"""Self-fencing: an agent cut off from NATS stops its jobs before the brain reruns them.

The brain declares a node lost `node_timeout_s` after the last heartbeat it heard, and
runs the node's jobs elsewhere only `fence_margin_s` later (brain/liveness.py). This
module is the agent's half of that bargain: every heartbeat is followed by a PING, and
when its PONG comes back the heartbeat is known to have reached the server, so the brain
heard from this node no earlier than that heartbeat was sent. Counting from there, an
attempt whose node has had no such confirmation for its fence period is stopped (SIGTERM,
then SIGKILL after the fence grace). docs/operations.md ("Partitions") states the
inequality that makes the two halves add up to "never two attempts at once".

It owns the contact clock and which attempts it has fenced; the agent owns the processes
and asks this module which of them are due.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

# How often the agent compares the contact clock with each attempt's fence period.
CHECK_EVERY_S: Final = 0.2


@dataclass
class ContactClock:
    """When this agent last knew a heartbeat of its own had reached NATS (monotonic).

    Starts at construction: an agent that never reaches NATS fences what it runs (it
    runs nothing it was not told to, and the brain reruns nothing before that).
    """

    monotonic: Callable[[], float]
    last_contact: float = 0.0
    fenced: set[tuple[str, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.last_contact = self.monotonic()

    def confirmed(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` reached the server."""
        self.last_contact = max(self.last_contact, sent_at)

    def silent_s(self) -> float:
        return max(0.0, self.monotonic() - self.last_contact)

    def due(
        self,
        running: Iterable[tuple[str, int]],
        fence_after: Callable[[str, int], float | None],
    ) -> list[tuple[str, int, float]]:
        """The attempts to fence now, each with how long contact has been lost.

        `fence_after(job, attempt)` is the attempt's fence period, None for never.
        Each attempt is returned once; a later contact does not unfence it (its stop
        is under way).
        """
        silent = self.silent_s()
        due = []
        for key in running:
            if key in self.fenced:
                continue
            period = fence_after(*key)
            if period is not None and silent > period:
                self.fenced.add(key)
                due.append((key[0], key[1], silent))
        return due

    def forget(self, job_id: str, attempt: int) -> None:
        with contextlib.suppress(KeyError):
            self.fenced.remove((job_id, attempt))
