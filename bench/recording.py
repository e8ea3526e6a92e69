"""Where every bench leaves its results, for a person to compare run to run.

`record` writes `bench/results/<name>-<stamp>.json` (the run's settings and notes, and
its rows under "results"), the same as `<name>-latest.json`, and the rows alone as
`<name>-<stamp>.csv` for a spreadsheet.
"""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

RESULTS: Final = Path(__file__).resolve().parent / "results"


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def record(name: str, payload: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    """Write one run's results; returns the JSON and CSV paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    at = stamp()
    text = json.dumps({"generated_at": at, **payload, "results": rows}, indent=2) + "\n"
    json_path = RESULTS / f"{name}-{at}.json"
    json_path.write_text(text)
    (RESULTS / f"{name}-latest.json").write_text(text)
    csv_path = RESULTS / f"{name}-{at}.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path
