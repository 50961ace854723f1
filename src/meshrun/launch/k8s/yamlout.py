"""A small block-style YAML writer for rendered manifests (standard library only).

Kubernetes manifests are maps, lists, strings, integers and booleans, so a full YAML library
is not needed at run time; this keeps ``meshrun k8s render`` free of a PyYAML dependency and
lets a document carry comments. Any string that a YAML 1.1 reader (PyYAML, kubectl) could read
as something else (``yes``, ``1``, ``null``, ``a: b``) is written double-quoted with JSON
escapes, which YAML accepts as they are. ``tests/unit/test_k8s.py`` reads the output back with
PyYAML and compares.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Plain (unquoted) scalars: a conservative set that no YAML 1.1 reader takes for a number,
# bool, null, anchor, tag, comment or mapping.
_PLAIN = re.compile(r"^[A-Za-z_/$][A-Za-z0-9_./$()@+-]*$")
_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"}


def dump_documents(docs: Sequence[Mapping[str, Any]], header: str = "") -> str:
    """Documents separated by ``---``; ``header`` lines become ``#`` comments at the top."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for i, doc in enumerate(docs):
        if i:
            lines.append("---")
        lines += _mapping(doc, 0)
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = _PLAIN.match(value) and value.lower() not in _SPECIAL
        return value if plain else json.dumps(value)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _block_text(value: str) -> bool:
    """Multi-line text that a literal block (``|`` / ``|-``) keeps exactly."""
    if "\n" not in value or value.endswith("\n\n") or value.startswith((" ", "\n")):
        return False
    lines = value.rstrip("\n").split("\n")
    return all(line == line.rstrip() and line.isprintable() for line in lines)


def _value(key: str, value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        return (
            [f"{pad}{key}: {{}}"] if not value else [f"{pad}{key}:", *_mapping(value, indent + 2)]
        )
    if isinstance(value, list):
        return [f"{pad}{key}: []"] if not value else [f"{pad}{key}:", *_sequence(value, indent)]
    if isinstance(value, str) and _block_text(value):
        chomp = "" if value.endswith("\n") else "-"
        body = [f"{pad}  {line}" if line else "" for line in value.rstrip("\n").split("\n")]
        return [f"{pad}{key}: |{chomp}", *body]
    return [f"{pad}{key}: {_scalar(value)}"]


def _mapping(data: Mapping[str, Any], indent: int) -> list[str]:
    lines: list[str] = []
    for key, value in data.items():
        lines += _value(_scalar(str(key)), value, indent)
    return lines


def _sequence(items: list[Any], indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for item in items:
        if isinstance(item, Mapping) and item:
            # "- " then the first key on the same line; the rest aligned under it.
            body = _mapping(item, indent + 2)
            lines += [f"{pad}- {body[0].lstrip()}", *body[1:]]
        elif isinstance(item, Mapping):
            lines.append(f"{pad}- {{}}")
        elif isinstance(item, list):
            raise TypeError("lists inside lists are not used by manifests and not written")
        else:
            lines.append(f"{pad}- {_scalar(item)}")
    return lines
