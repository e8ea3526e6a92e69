"""Base model for everything on the wire, and the codec.

Every message is a frozen pydantic model carrying the schema version `v`, with
unknown fields rejected, so a sender built against another schema is told so
instead of silently half-understood.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Final, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, TypeAdapter, ValidationError

from schemas.errors import InvalidMessage, InvalidName

SCHEMA_VERSION: Final = 1
# NATS' default max_payload is 1 MiB; refuse anything bigger before parsing it.
MAX_MESSAGE_BYTES: Final = 1024 * 1024

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(what: str, value: str) -> str:
    if not _NAME_RE.match(value):
        raise InvalidName(what, value)
    return value


def _node_name(value: str) -> str:
    return check_name("node", value)


def _tenant_name(value: str) -> str:
    return check_name("tenant", value)


def _queue_name(value: str) -> str:
    return check_name("queue", value)


NodeName = Annotated[str, AfterValidator(_node_name)]
TenantName = Annotated[str, AfterValidator(_tenant_name)]
QueueName = Annotated[str, AfterValidator(_queue_name)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = SCHEMA_VERSION


M = TypeVar("M")


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json(exclude_none=False).encode()


def encode_request(message: BaseModel) -> bytes:
    """An API request without the fields at their defaults (`alnair` asking a brain):
    one that uses nothing an older brain lacks is one that brain reads, though every
    message refuses fields it does not know. What is left out means the default, on
    either side; but the schema version `v` is always said: it is what a brain of
    another version refuses."""
    fields = message.model_dump(mode="json", exclude_defaults=True)
    if isinstance(message, Message):
        fields = {"v": message.v, **fields}
    return json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()


def describe_invalid(error: ValidationError, whole: str = "message") -> str:
    """What failed validation, field by field (the first five), for a person: `field:
    reason; ...`, `whole` naming a problem with no field."""
    parts = []
    errors = error.errors()
    # A list too short for want of the items that failed within it says nothing more.
    within = {item["loc"][:i] for item in errors for i in range(len(item["loc"]))}
    errors = [e for e in errors if not (e["type"] == "too_short" and e["loc"] in within)]
    for item in errors[:5]:
        where = ".".join(str(p) for p in item["loc"]) or whole
        # A validator's own words, without pydantic's "Value error, " before them.
        said = item["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {said}")
    more = len(errors) - 5
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def decode(
    data: bytes,
    kind: type[M] | TypeAdapter[M],
    *,
    strict: bool = False,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> M:
    """Parse and validate one message; raise InvalidMessage saying what is wrong.

    `strict` refuses coercions (`0` for a boolean, `"2"` for a number): the API's
    requests are decoded so, over NATS and HTTP alike, as its OpenAPI document promises.
    `max_bytes` stays at the bus's bound for anything that came over the bus; only a
    document assembled from many messages whose size was declared beforehand (a
    brain snapshot's body) passes its own.
    """
    if len(data) > max_bytes:
        raise InvalidMessage(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        if isinstance(kind, TypeAdapter):
            return kind.validate_json(data, strict=strict)
        if issubclass(kind, BaseModel):
            return kind.model_validate_json(data, strict=strict)
        return TypeAdapter(kind).validate_json(data, strict=strict)
    except ValidationError as error:
        raise InvalidMessage(describe_invalid(error)) from None
