"""The message catalogue is generated from the schemas; it must match them."""

from __future__ import annotations

from pathlib import Path

from schemas.catalogue import render

ROOT = Path(__file__).resolve().parent.parent


def test_message_catalogue_is_current() -> None:
    current = (ROOT / "docs" / "messages.md").read_text()
    assert current == render(), "run: .venv/bin/python -m schemas.catalogue > docs/messages.md"
