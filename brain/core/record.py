"""`record`: the policy core's immutable values, cheap to build.

A frozen dataclass sets each field through `object.__setattr__`: a `JobView` (31
fields) took about 4 µs to build, and the live brain and the simulator build one per
running job per cycle, the core a `Wait`, `Place` or `Grant` per job it decides on.
A `record` is a slotted dataclass, equal and hashed by its fields as a frozen one is,
whose `__init__` assigns plainly (a `JobView` in about 0.4 µs), and which the type
checker treats as frozen (PEP 681): assigning to a field of one is a mypy error, not a
run-time one. Nothing in Alnair assigns to a record after building it;
`dataclasses.replace` makes a changed copy.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from typing_extensions import dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[T]) -> type[T]:
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
