"""The message catalogue is generated from the schemas; it must match them, and it must
list every message: the API's every request and reply, and every model a listed one
holds."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from schemas import api
from schemas.catalogue import ENTRIES, NESTED, render

ROOT = Path(__file__).resolve().parent.parent


def test_message_catalogue_is_current() -> None:
    current = (ROOT / "docs" / "messages.md").read_text()
    assert current == render(), "run: .venv/bin/python -m schemas.catalogue > docs/messages.md"


def _models_in(annotation: object) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in typing.get_args(annotation):
        yield from _models_in(argument)


def test_every_model_a_listed_message_holds_is_listed() -> None:
    listed = {model for entry in ENTRIES for model in entry.models} | set(NESTED)
    unlisted = {
        f"{inner.__name__} (in {model.__name__}.{name})"
        for model in listed
        for name, field in model.model_fields.items()
        for inner in _models_in(field.annotation)
        if inner not in listed
    }
    assert not unlisted, "add to schemas/catalogue.py NESTED: " + ", ".join(sorted(unlisted))


def test_every_api_message_is_listed() -> None:
    listed = {model for entry in ENTRIES for model in entry.models} | set(NESTED)
    defined = {
        value
        for value in vars(api).values()
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == api.__name__
    }
    missing = sorted(model.__name__ for model in defined - listed)
    assert not missing, "add to schemas/catalogue.py: " + ", ".join(missing)
