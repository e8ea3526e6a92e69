"""Argument types the `alnair` commands share: each refuses what it is not, saying what
it must be (argparse then prints `argument --flag: ...`)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
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


_DURATION: Final = re.compile(r"(?P<n>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[smhd])", re.I)
_CLOCK: Final = re.compile(r"(?:(?P<d>[0-9]+)-)?(?:(?P<h>[0-9]+):)?(?P<m>[0-9]+):(?P<s>[0-9]+)")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def unit_seconds(text: str) -> float | None:
    """`45s`, `90m`, `2h`, `1.5d` as seconds; None for anything else."""
    unit = _DURATION.fullmatch(text.strip())
    return None if unit is None else float(unit["n"]) * _UNIT_S[unit["unit"].lower()]


def duration_seconds(text: str) -> float:
    """`90m`, `2h`, `1.5d`, `45s`, or Slurm's clock forms `1:30:00`, `2-00:00:00`, `30:00`
    (minutes and seconds), as seconds above 0. A bare number is refused: Slurm reads
    minutes there, other tools seconds. ValueError says what it takes."""
    text = text.strip()
    if (in_units := unit_seconds(text)) is not None:
        seconds = in_units
    elif (clock := _CLOCK.fullmatch(text)) is not None:
        days, hours = int(clock["d"] or 0), int(clock["h"] or 0)
        seconds = float(((days * 24 + hours) * 60 + int(clock["m"])) * 60 + int(clock["s"]))
    else:
        raise ValueError(
            f"{text!r} is not a duration: give a unit (45s, 90m, 2h, 1d) or a clock "
            "(1:30:00, 2-00:00:00)"
        )
    if not 0 < seconds < math.inf:
        raise ValueError(f"{text!r} is not a duration above 0")
    return seconds


def duration(text: str) -> float:
    """`duration_seconds` as an argparse type."""
    try:
        return duration_seconds(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# Jobs one `alnair submit --array` makes at most (Slurm's MaxArraySize is 1,001 by
# default): each is a submission, answered once stored.
MAX_ARRAY_JOBS: Final = 10_000
_ARRAY_PART: Final = re.compile(r"(?P<first>[0-9]+)(?:-(?P<last>[0-9]+)(?::(?P<step>[0-9]+))?)?")


@dataclass(frozen=True)
class ArraySpec:
    """`--array 0-9`, `1,3,5`, `0-99:10`, with `%4` after: the indices, and how many of
    the array may run at once (None: as many as are placed)."""

    indices: tuple[int, ...]
    at_once: int | None = None


def array_spec(text: str) -> ArraySpec:
    """`--array` as Slurm's sbatch takes it: ranges (`0-9`), steps (`0-99:10`), lists
    (`1,3,5`) and a limit on how many run at once (`0-31%4`). ValueError says why not."""
    from schemas.jobs import MAX_ARRAY_INDEX

    ranges, _, limit = text.strip().partition("%")
    indices: list[int] = []
    for part in ranges.split(","):
        found = _ARRAY_PART.fullmatch(part.strip())
        if found is None:
            raise ValueError(
                f"takes indices such as 0-9, 0-99:10 or 1,3,5, with %N to run at "
                f"most N at once; not {text!r}"
            )
        first = int(found["first"])
        last = int(found["last"]) if found["last"] is not None else first
        step = int(found["step"] or 1)
        if last < first or step < 1:
            raise ValueError(f"{part.strip()!r} is an empty range")
        if last > MAX_ARRAY_INDEX:
            raise ValueError(f"an index is at most {MAX_ARRAY_INDEX:,}, not {last}")
        if (last - first) // step + 1 + len(indices) > MAX_ARRAY_JOBS:
            raise ValueError(f"an array is at most {MAX_ARRAY_JOBS:,} jobs")
        indices.extend(range(first, last + 1, step))
    if len(set(indices)) != len(indices):
        raise ValueError(f"{text!r} names an index twice")
    at_once = None
    if limit:
        if not limit.isdigit() or int(limit) < 1:
            raise ValueError(f"%N runs at most N at once, N 1 or more; not %{limit}")
        at_once = int(limit)
    return ArraySpec(tuple(indices), at_once)


def array_argument(text: str) -> ArraySpec:
    """`array_spec` as an argparse type."""
    try:
        return array_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
