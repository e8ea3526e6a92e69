"""When the next scheduling pass may start: passes owe the loop the time they take.

However fast state changes, passes must leave the brain's loop time for the API,
ingest, commits and the lease. A pass of T seconds owes the loop T x `rest_ratio`
(at most `rest_max_s`), paid back by the time no pass runs: the next pass starts once
nothing is owed, so passes take at most about half the loop. A pass for a new
submission starts while at most `prompt_owed_s` is owed: a submission that arrives
just after a pass began waits for that pass, not for its rest too. What is owed only
grows by what passes take, so under a flood of requests passes still take about half
the loop; they may run `prompt_owed_s` ahead of it in a burst.

Pure: the shell (brain/service.py, `Brain._schedule_forever`) gives it the times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

PASS_REST_RATIO: Final = 1.0
PASS_REST_MAX_S: Final = 1.0
PROMPT_OWED_S: Final = 0.25


@dataclass
class PassPacer:
    rest_ratio: float = PASS_REST_RATIO
    rest_max_s: float = PASS_REST_MAX_S
    prompt_owed_s: float = PROMPT_OWED_S
    # Seconds owed as of `since` (monotonic), when the last pass ended.
    owed_s: float = 0.0
    since: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rest_ratio", "rest_max_s", "prompt_owed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")

    def owed_at(self, now: float) -> float:
        return max(0.0, self.owed_s - (now - self.since))

    def wait_s(self, now: float, *, prompt: bool) -> float:
        """How long from `now` the next pass waits; `prompt`: a submission waits."""
        allowed = self.prompt_owed_s if prompt else 0.0
        return max(0.0, self.owed_at(now) - allowed)

    def ran(self, began: float, ended: float) -> None:
        """A pass ran from `began` to `ended`: it owes its time."""
        owed = self.owed_at(began) + (ended - began) * self.rest_ratio
        self.owed_s = min(owed, self.rest_max_s)
        self.since = ended
