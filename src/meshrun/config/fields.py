"""The checks every config value goes through, whatever made it: a TOML file, a
``--section.key=value`` override, a ``meshrun launch`` flag, or a section built in code.

A section's fields carry their documentation and range in ``field(metadata=...)``; the
type comes from the annotation (a Literal lists the allowed values). ``check_section`` runs
from each section's ``__post_init__``; ``checked`` is the same check for one value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

CONFIG_ENV = "MESHRUN_CONFIG"  # the resolved config's path, from the launcher to the workers


class ConfigError(ValueError):
    """A bad config key or value; the message names the key, the value and what is allowed."""


class ConfigWarning(UserWarning):
    """A config that runs but likely not as meant (the message names the keys and the fix);
    the ``meshrun`` program prints it as one line."""


def setting(default: Any, doc: str, **checks: Any) -> Any:
    """A dataclass field carrying its documentation and range checks (``min``, ``max``)."""
    return field(default=default, metadata={"doc": doc, **checks})


# --- field introspection -------------------------------------------------------------------


def key_of(f: dataclasses.Field[Any]) -> str:
    # `async` is a Python keyword: the field is `async_`, the TOML/CLI key is `async`.
    return f.name.rstrip("_")


# Cached: every section's __post_init__ reads it, and get_type_hints evaluates annotations.
@functools.cache
def field_map(section_type: type) -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    hints = get_type_hints(section_type)
    return {key_of(f): (f, hints[f.name]) for f in dataclasses.fields(section_type)}


def describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


# --- value coercion ------------------------------------------------------------------------


def coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """Convert ``value`` to ``tp`` or raise a ConfigError naming the key and what is allowed."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return value
        raise ConfigError(f"{key} = {value!r} is not allowed: expected {describe(tp)}")
    if origin in (Union, types.UnionType):  # Optional[X]
        inner = next(a for a in get_args(tp) if a is not type(None))
        if value is None or (from_text and str(value).lower() in ("none", "null", "")):
            return None
        return coerce(key, value, inner, from_text)
    converted = _convert_text(value, tp) if from_text else _convert_native(value, tp)
    if converted is _BAD:
        raise ConfigError(
            f"{key} = {value!r} has the wrong type: expected {describe(tp)} "
            f"(e.g. --{key}={_example(tp)})"
        )
    return converted


_BAD = object()


def _example(tp: Any) -> str:
    return {bool: "true", int: "4", float: "0.5", str: "text"}.get(tp, "...")


def _convert_native(value: Any, tp: Any) -> Any:
    if tp is bool:
        return value if isinstance(value, bool) else _BAD
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _BAD
    if tp is str:
        return value if isinstance(value, str) else _BAD
    return _BAD


def _convert_text(text: Any, tp: Any) -> Any:
    text = str(text)
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        return _BAD
    try:
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        return _BAD
    return text if tp is str else _BAD


def _check_range(key: str, value: Any, f: dataclasses.Field[Any]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} is not allowed: expected a finite number")
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {value!r} is out of range: must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r} is out of range: must be <= {hi}")


def checked(dotted: str, value: Any, f: dataclasses.Field[Any], tp: Any, from_text: bool) -> Any:
    """The one check of a value, whatever made it (TOML, command line, launch flag, code)."""
    value = coerce(dotted, value, tp, from_text)
    _check_range(dotted, value, f)
    return value


def check_section(section: Any) -> None:
    """Check (and normalise: an int for a float key becomes a float) every field of one
    section against its type, its Literal choices and its min/max. Each section's
    ``__post_init__`` runs it, so ``DataConfig(micro_batch=0)`` fails where it is written,
    with the message a TOML file would get."""
    section_type: type = type(section)
    name = getattr(section_type, "SECTION", section_type.__name__)
    errors = []  # every bad value of the section at once: ParallelConfig(zero=7, param_dtype=..)
    for key, (f, tp) in field_map(section_type).items():
        value = getattr(section, f.name)
        try:
            coerced = checked(f"{name}.{key}", value, f, tp, from_text=False)
        except ConfigError as e:
            errors.append(str(e))
            continue
        if coerced is not value:
            setattr(section, f.name, coerced)
    if errors:
        raise ConfigError("; ".join(errors))
