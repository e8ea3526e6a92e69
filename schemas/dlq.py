"""Dead letters: messages a component refused, with the reason, on `alnair.dlq.<origin>`."""

from __future__ import annotations

from typing import Final

from pydantic import Field

from schemas.base import Message

DLQ_PAYLOAD_PREVIEW_BYTES: Final = 4096


class DeadLetter(Message):
    subject: str
    reason: str
    received_at: float
    by: str = Field(description="the component that refused it, e.g. brain or agent:n1")
    payload_bytes: int = Field(ge=0)
    # The first bytes of the payload, decoded leniently, for a person to read.
    payload_preview: str
