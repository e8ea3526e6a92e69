"""Commands (brain -> agent / supervisor, JetStream COMMANDS).

Every command carries an id, used as `Nats-Msg-Id` and de-duplicated by the receiver,
and the brain's leader epoch: receivers refuse a command from an older epoch than the
newest they have obeyed (fencing a deposed brain).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter

from schemas.base import Message, NodeName


class _Command(Message):
    command_id: str = Field(min_length=1, max_length=128)
    epoch: int = Field(ge=1)
    issued_at: float


class Launch(_Command):
    kind: Literal["launch"] = "launch"
    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    gpus: tuple[int, ...] = Field(min_length=1)
    command: tuple[str, ...] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    # A launch that reaches an agent after this (brain clock) is refused: the node was
    # away, and the brain has since given the job elsewhere.
    expires_at: float
    node_rank: int = Field(default=0, ge=0)
    nodes: tuple[NodeName, ...] = ()


class Stop(_Command):
    kind: Literal["stop"] = "stop"
    job_id: str = Field(min_length=1, max_length=64)
    # None stops every attempt of the job the node runs.
    attempt: int | None = Field(default=None, ge=1)
    reason: str
    grace_s: float = Field(default=10.0, ge=0, le=3600)


NodeCommand = Annotated[Launch | Stop, Field(discriminator="kind")]
NODE_COMMAND: Final[TypeAdapter[NodeCommand]] = TypeAdapter(NodeCommand)
