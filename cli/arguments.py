"""Argument types the `alnair` commands share: each refuses what it is not, saying what
it must be (argparse then prints `argument --flag: ...`)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Final

# ASCII digits only (`str.isdigit` takes `²`, which `int` refuses), and few enough that
# `int` reads them.
_WHOLE: Final = re.compile(r"-?[0-9]{1,18}")


def whole_number(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """A type for whole numbers from `low` to `high` (None: no bound), refusing others
    as `'TEXT' is not WHAT`."""

    def parse(text: str) -> int:
        value = int(text) if _WHOLE.fullmatch(text.strip()) else None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def positive_number(text: str) -> float:
    """A finite number above 0 (not NaN, not inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def number_or_zero(text: str) -> float:
    """A finite number of 0 or more (0: the caller's "none" or "for good")."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 0 or more")
    return value
