"""YAML as Alnair's configuration files and job files read it: a key given twice is an
error naming it and both lines (PyYAML keeps the last without a word, so an entry, or
a whole list, was lost), and a file that is not UTF-8 says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

# The tag of a merge key (`<<: *anchor`): not a key of the mapping, so never a repeat.
_MERGE: Final = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader`, refusing a mapping that gives a key twice."""


def _mapping(loader: _StrictLoader, node: MappingNode) -> dict[Any, Any]:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE:
            continue  # `<<: *anchor`: merged by construct_mapping, the mapping's own win
        key = loader.construct_object(key_node, deep=True)
        try:
            line = first.get(key)
        except TypeError:
            continue  # an unhashable key: construct_mapping refuses it, naming it
        if line is not None:
            raise ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"key {key!r} is given twice (first on line {line + 1})",
                key_node.start_mark,
            )
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str) -> Any:
    """`text`'s document, as `yaml.safe_load` reads it, but a key given twice in a
    mapping raises `yaml.YAMLError` naming it and its lines."""
    return yaml.load(text, Loader=_StrictLoader)


def read_text(path: str | Path) -> str:
    """The file's text; `OSError` as `open` raises it, and a file that is not UTF-8 as
    an `OSError` that says so (so that a caller's one `except OSError` names the file)."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise OSError(
            f"not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x})"
        ) from None
