"""Heartbeats and telemetry, kept apart from decisions.

Every node sends a heartbeat and a telemetry batch each interval; at thousands of nodes
that is tens of thousands of messages a second, almost all saying what the previous one
said. `NodeIngest` keeps the latest of each per node and their arrival times (liveness),
and tells the decision loop only what changes what it decides on: a node heard for the
first time (or again after falling silent), or a heartbeat whose inventory, GPU health,
agent instance or running processes differ from the node's previous one. A heartbeat
that changes nothing only moves the node's last-seen time.

It owns no I/O and reads no clock: arrival times (monotonic seconds) are passed in, and
the brain's shell subscribes, validates at the edge and dead-letters what fails before
anything reaches it. It never touches the brain's state or the log.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

from brain.telemetry import LatestTelemetry
from schemas.telemetry import GpuInfo, Heartbeat, TelemetryBatch

# Why a heartbeat is handed to the decision loop.
NewsKind = Literal["first", "returned", "changed"]

# Telemetry waiting for the brain's handler past these limits is dropped by the
# client (shed, and counted): it is the only traffic the brain may lose under load.
# 20,000 batches is an interval's worth at 20,000 nodes.
TELEMETRY_PENDING_MSGS: Final = 20_000
TELEMETRY_PENDING_BYTES: Final = 64 * 1024 * 1024
# The brain also drops telemetry unread, before decoding it, while its loop runs this
# late or its inbox holds this many items: heartbeats, events and the API go first.
SHED_TELEMETRY_LAG_S: Final = 0.25
SHED_TELEMETRY_INBOX: Final = 1_000


@dataclass(frozen=True, slots=True)
class NodeNews:
    """A heartbeat the decision loop must look at, and why."""

    kind: NewsKind
    beat: Heartbeat


@dataclass(frozen=True, slots=True)
class _Reported:
    """What a heartbeat says that decisions depend on (not its time or sequence)."""

    instance: str
    hostname: str
    backend: str
    gpus: tuple[GpuInfo, ...]
    running: frozenset[tuple[str, int]]
    cpu_milli: int | None = None
    memory_mib: int | None = None

    @classmethod
    def of(cls, beat: Heartbeat) -> _Reported:
        return cls(
            instance=beat.instance,
            hostname=beat.hostname,
            backend=beat.backend,
            gpus=beat.gpus,
            running=frozenset((r.job_id, r.attempt) for r in beat.running),
            cpu_milli=beat.cpu_milli,
            memory_mib=beat.memory_mib,
        )


# A heartbeat's arrival less the time its node wrote in it is the clocks' offset plus
# its time in transit and in the brain's queues, which is never negative and is at
# times seconds (a brain behind on heartbeats): the least of a window's says the offset.
# Two windows, so an offset that grew (a node's clock set back) is seen within two.
OFFSET_WINDOW_S: Final = 30.0


@dataclass(slots=True)
class _Offset:
    least: float = math.inf  # this window's least
    before: float = math.inf  # the last window's
    since: float = -math.inf  # when this window began (monotonic)

    def add(self, sample: float, now: float) -> bool:
        """Take a sample at `now`; whether `value` may have moved (a new window began, or
        the sample is its least so far): most samples move nothing."""
        if now - self.since >= OFFSET_WINDOW_S:
            self.before, self.least, self.since = self.least, sample, now
            return True
        if sample < self.least:
            self.least = sample
            return True
        return False

    @property
    def value(self) -> float:
        least = min(self.least, self.before)
        return 0.0 if least == math.inf else least


@dataclass(slots=True)
class _Node:
    last_seen: float
    instance: str
    # None until a heartbeat arrives (a node known from the log gets a grace period).
    reported: _Reported | None = None
    beat: Heartbeat | None = None
    # The last heartbeat's bytes without its time and sequence (`_without_clock`).
    raw: bytes | None = None
    # How far this brain's clock is ahead of the node's (seconds; negative: behind):
    # the least of its heartbeats' arrival, by this brain's wall clock, less the time
    # the node wrote in it, over this window of OFFSET_WINDOW_S and the last
    # (`_Offset`).
    offset: _Offset = field(default_factory=_Offset)


@dataclass
class IngestCounts:
    """What ingest has seen since it started (exported in /metrics)."""

    heartbeats: int = 0
    # Heartbeats handed to the decision loop (the rest only moved a last-seen time).
    heartbeats_forwarded: int = 0
    telemetry: int = 0


# What `_without_clock` cuts out, as JSON writes it: two numbers, the second an integer
# of zero or more; anything else (which pydantic may or may not accept) is not a repeat.
_CLOCK: Final = re.compile(
    rb',"ts":-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?,"seq":(?:0|[1-9][0-9]*)'
)


def _clock_span(raw: bytes) -> tuple[int, int] | None:
    """Where a heartbeat's `"ts"` and `"seq"` sit together before `"instance"` (as
    pydantic writes a Heartbeat), from the comma before `"ts"` to the one before
    `"instance"`; None for any other layout."""
    start = raw.find(b',"ts":')
    end = raw.find(b',"instance":', start + 1)
    return None if start < 0 or end < 0 else (start, end)


def _without_clock(raw: bytes) -> bytes | None:
    """A heartbeat's bytes without its `"ts"` and `"seq"` (`_clock_span`); None for any
    other layout.

    Only for a message already validated: its schema allows no other `"ts"` key, and
    exactly two keys between the cut's ends means nothing else is cut out, so equal
    results mean equal heartbeats but for their time and sequence."""
    span = _clock_span(raw)
    if span is None or raw.count(b'":', *span) != 2:
        return None
    return raw[: span[0]] + raw[span[1] :]


class NodeIngest:
    """Latest heartbeat and telemetry per node, liveness, and the news in them."""

    def __init__(self, *, node_timeout_s: float) -> None:
        if node_timeout_s <= 0:
            raise ValueError(f"node_timeout_s must be positive, not {node_timeout_s!r}")
        self.node_timeout_s = node_timeout_s
        self.counts = IngestCounts()
        self._nodes: dict[str, _Node] = {}
        self._telemetry = LatestTelemetry()
        # Nodes whose clock offset may have moved since the brain last looked (it takes
        # them, a tick at a time, to say which clocks differ: not at every heartbeat).
        self.clocks_moved: set[str] = set()

    def reset(self) -> None:
        """Forget every node's liveness (a new tenure starts from the log); keep the
        latest telemetry, which is only ever shown."""
        self._nodes.clear()

    def expect(self, node: str, instance: str, now: float) -> None:
        """A node the log knows: it has `node_timeout_s` from `now` to be heard from.
        Its first heartbeat is news, so the loop compares it with the log's record."""
        self._nodes[node] = _Node(last_seen=now, instance=instance)

    def heartbeat(
        self, beat: Heartbeat, now: float, raw: bytes | None = None, *, wall: float | None = None
    ) -> NodeNews | None:
        """Note a (validated) heartbeat that arrived at `now`; the news in it, if any.

        `raw`, the bytes it was decoded from, makes the common case cheap: bytes equal to
        the previous heartbeat's but for time and sequence say nothing new. `wall`, the
        arrival by the wall clock, gives the node's clock offset (`clock_offset`)."""
        self.counts.heartbeats += 1
        stripped = _without_clock(raw) if raw is not None else None
        known = self._nodes.get(beat.node)
        first = known is None
        if known is None:
            known = self._nodes[beat.node] = _Node(
                last_seen=now,
                instance=beat.instance,
                reported=_Reported.of(beat),
                beat=beat,
                raw=stripped,
            )
        if wall is not None:
            self._clock_sample(beat.node, known, wall - beat.ts, now)
        if first:
            return self._forward(NodeNews("first", beat))
        silent_s = now - known.last_seen
        previous = known.reported
        known.last_seen = max(known.last_seen, now)
        same = stripped is not None and stripped == known.raw
        if (
            previous is not None
            and beat.gpus is not previous.gpus
            and (same or beat.gpus == previous.gpus)
        ):
            # One copy of an inventory that did not change, shared with the node's record
            # (a heartbeat decoded again, after a silence, would otherwise keep a second).
            beat = beat.model_copy(update={"gpus": previous.gpus})
        known.beat = beat
        if same and previous is not None and silent_s <= self.node_timeout_s:
            return None
        reported = _Reported.of(beat)
        known.instance = beat.instance
        known.reported = reported
        known.raw = stripped
        if previous is None:
            return self._forward(NodeNews("first", beat))
        if silent_s > self.node_timeout_s:
            return self._forward(NodeNews("returned", beat))
        if reported != previous:
            return self._forward(NodeNews("changed", beat))
        return None

    def repeat(self, node: str, raw: bytes, now: float, *, wall: float | None = None) -> bool:
        """Whether `raw`, arrived at `now` (`wall` by the wall clock) on `node`'s heartbeat
        subject, is that node's last heartbeat again but for a well-formed time and
        sequence; if so it is noted (the node's last-seen time moves, its time gives
        the clock offset) and needs no decoding: the bytes it repeats
        were validated when they first came, on the same subject. At thousands of nodes
        this is nearly every heartbeat, and decoding one costs ten times the comparison.
        A heartbeat after silence, or after news the loop could not act on, is never a
        repeat."""
        known = self._nodes.get(node)
        if known is None or known.raw is None or known.reported is None:
            return False
        if now - known.last_seen > self.node_timeout_s:
            return False
        span = _clock_span(raw)
        if span is None:
            return False
        # `raw` without its clock equals the last one's (`_without_clock`), compared
        # in place, and what was cut is a well-formed clock.
        start, end = span
        if raw[:start] != known.raw[:start]:
            return False
        if raw[end:] != known.raw[start:] or not _CLOCK.fullmatch(raw, start, end):
            return False
        self.counts.heartbeats += 1
        known.last_seen = max(known.last_seen, now)
        if wall is not None:
            # `,"ts":<number>,"seq":`, matched above: the number is a float's.
            sent = float(raw[start + 6 : raw.index(b",", start + 6)])
            self._clock_sample(node, known, wall - sent, now)
        return True

    def _clock_sample(self, node: str, known: _Node, sample: float, now: float) -> None:
        if known.offset.add(sample, now):
            self.clocks_moved.add(node)

    def unsettle(self, node: str) -> None:
        """The loop could not act on the node's news (a failed append): its next
        heartbeat is news again, whatever it says."""
        known = self._nodes.get(node)
        if known is not None:
            known.reported = None
            known.raw = None

    def _forward(self, news: NodeNews) -> NodeNews:
        self.counts.heartbeats_forwarded += 1
        return news

    def telemetry(self, batch: TelemetryBatch) -> None:
        self.counts.telemetry += 1
        self._telemetry.put(batch)

    # -- views -----------------------------------------------------------------------

    @property
    def latest_telemetry(self) -> LatestTelemetry:
        """Each node's latest telemetry batch."""
        return self._telemetry

    def clock_offset(self, node: str) -> float:
        """How far this brain's wall clock is ahead of `node`'s (negative: behind): the
        least difference between a heartbeat's arrival and the time in it over the last
        one to two OFFSET_WINDOW_S (a heartbeat's time in transit and queued only adds
        to it); 0 for a node not heard from."""
        known = self._nodes.get(node)
        return known.offset.value if known is not None else 0.0

    def known(self, node: str) -> bool:
        return node in self._nodes

    def silent(self, now: float) -> Iterator[tuple[str, float]]:
        """Every node not heard from for more than `node_timeout_s`, with how long."""
        limit = self.node_timeout_s
        for name, node in self._nodes.items():
            silent_s = now - node.last_seen
            if silent_s > limit:
                yield name, silent_s

    def last_seen_ago(self, node: str, now: float) -> float | None:
        """Seconds since the node's last heartbeat; None if this brain has not heard it
        (a node known from the log is only given a grace period: `expect`)."""
        known = self._nodes.get(node)
        if known is None or known.reported is None:
            return None
        return max(0.0, now - known.last_seen)

    def running(self, node: str) -> frozenset[tuple[str, int]]:
        """The (job, attempt) processes the node's latest heartbeat reported."""
        known = self._nodes.get(node)
        if known is None or known.reported is None:
            return frozenset()
        return known.reported.running

    def latest_beat(self, node: str) -> Heartbeat | None:
        known = self._nodes.get(node)
        return None if known is None else known.beat

    def instance(self, node: str) -> str | None:
        known = self._nodes.get(node)
        return None if known is None else known.instance

    def reporting(self, now: float, names: Iterable[str] | None = None) -> Iterator[Heartbeat]:
        """The latest heartbeat of every live node (of those `names`) that reports
        running processes (a silent node's last word is stale: its jobs are requeued,
        not stopped again)."""
        nodes = self._nodes
        for node in nodes.values() if names is None else map(nodes.get, names):
            if (
                node is not None
                and node.beat is not None
                and node.beat.running
                and now - node.last_seen <= self.node_timeout_s
            ):
                yield node.beat
