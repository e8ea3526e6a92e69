"""Alnair's error hierarchy.

One root, `AlnairError`; subclasses carry the data an operator needs to act on them
(a subject, a job id, a node). Expected outcomes of a decision are values, never
these exceptions: these are for bad input, broken infrastructure and bugs.
"""

from __future__ import annotations


class AlnairError(Exception):
    """Root of every error Alnair raises on purpose."""


class InvalidMessage(AlnairError, ValueError):
    """A message failed validation at the edge; `reason` says which field and why."""

    def __init__(self, reason: str, *, subject: str | None = None) -> None:
        super().__init__(reason if subject is None else f"{subject}: {reason}")
        self.reason = reason
        self.subject = subject


class InvalidSubject(AlnairError, ValueError):
    def __init__(self, subject: str, reason: str) -> None:
        super().__init__(f"invalid subject {subject!r}: {reason}")
        self.subject = subject


class InvalidName(AlnairError, ValueError):
    """A node, tenant or queue name that cannot be a subject token."""

    def __init__(self, what: str, name: str) -> None:
        super().__init__(f"invalid {what} name {name!r}: use 1-64 letters, digits, '_' or '-'")
        self.name = name


class BusError(AlnairError):
    pass


class BusTimeout(BusError, TimeoutError):
    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(f"no answer on {subject} within {timeout_s:g}s")
        self.subject = subject


class BusClosed(BusError):
    """The connection to NATS is closed for good (it gave up reconnecting): nothing
    more can be asked on it."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"the connection to NATS is closed; no answer on {subject}")
        self.subject = subject


class MessageTooLarge(BusError):
    """A message over the server's payload limit, refused before it is sent: sent, the
    server would close the connection ("Maximum Payload Violation")."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(
            f"a message of {size} bytes for {subject} is over the server's limit of {limit}"
        )
        self.subject = subject
        self.size = size
        self.limit = limit


class SequenceConflict(BusError):
    """A fenced append found the log further along than expected: another writer.

    For the brain this means it is no longer the leader and must step down.
    """

    def __init__(self, stream: str, expected: int) -> None:
        super().__init__(f"{stream} has moved past sequence {expected}: another writer appended")
        self.stream = stream
        self.expected = expected


class BusDenied(BusError):
    """The server refused this connection's identity publishing to `subject`."""

    def __init__(self, subject: str) -> None:
        super().__init__(
            f"NATS refused this identity publishing to {subject} (its permissions); "
            "connect as an identity allowed to (--nkey)"
        )
        self.subject = subject


class BrainUnavailable(BusError):
    def __init__(self, subject: str, *, asked_for_s: float = 0.0) -> None:
        asked = f" (asked for {asked_for_s:g} s)" if asked_for_s > 0 else ""
        super().__init__(
            f"no brain is answering on {subject}{asked}: is the cluster up "
            "(`make up` / `alnair up`, or `alnair brain`)?"
        )
        self.subject = subject


class HandBack(AlnairError):
    """A consumer cannot take this message now for a reason that is not the
    message's fault (this brain stopped leading): the bus hands it back for
    redelivery, to whichever consumer leads next, without calling it a failure."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoDefiniteAnswer(AlnairError):
    """A submission was neither acknowledged nor refused in time (no brain answered
    through a failover): the job may exist. Its idempotency key finds out safely."""

    def __init__(self, key: str, waited_s: float, last: Exception) -> None:
        super().__init__(
            f"no definite answer within {waited_s:g}s ({last}); the job may have been "
            f"created: submit again with --idempotency-key {key} to find out without "
            "creating a second one"
        )
        self.key = key


class ApiError(AlnairError):
    """The brain refused a request; `code` tells callers what kind of refusal."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ClusterNotFound(AlnairError):
    pass


class SnapshotUnreadable(AlnairError):
    """A stored brain snapshot cannot be used (torn, corrupt, or of another schema);
    the brain replays the log instead."""

    def __init__(self, reason: str, *, last_seq: int | None = None) -> None:
        where = "snapshot" if last_seq is None else f"snapshot at seq {last_seq}"
        super().__init__(f"{where}: {reason}")
        self.reason = reason
        self.last_seq = last_seq
