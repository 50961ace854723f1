"""Building a Config from its sources: a TOML file, ``--section.key=value`` overrides and
``meshrun launch`` flags (as overrides) all go through ``apply_pairs``, which checks each value
where it names the key, then runs each changed section's own ``__post_init__``: the checks a
section built in code gets. And the way back: the resolved config as TOML.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshrun.config.fields import ConfigError, checked, field_map, key_of
from meshrun.config.sections import Config, recheck, section_types, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _suggest(name: str, options: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(options), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _script_flag_hint(dotted: str, from_text: bool) -> str:
    # Only a command-line key can be a script's own flag taken for meshrun's; every dotted
    # key before `--` is meshrun's, so that a typo of a real section stays an error.
    if not from_text:
        return ""
    return (
        f" If --{dotted} is your script's own flag, put it after `--`: "
        f"train.py [--section.key=value ...] -- --{dotted}=... (docs/porting.md)"
    )


def _set(cfg: Config, dotted: str, value: Any, from_text: bool) -> Any:
    """Set one key after its value's check; return the section it changed."""
    sections = section_types()
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(
            f"config key {dotted!r} must have the form section.key; sections: {', '.join(sections)}"
        )
    sec, key = parts
    if sec not in sections:
        raise ConfigError(
            f"unknown config section {sec!r} in {dotted!r}; allowed: {', '.join(sections)}."
            + _suggest(sec, sections)
            + _script_flag_hint(dotted, from_text)
        )
    fmap = field_map(sections[sec])
    if key not in fmap:
        raise ConfigError(
            f"unknown config key {dotted!r}; keys of [{sec}]: {', '.join(fmap)}."
            + _suggest(key, fmap)
            + _script_flag_hint(dotted, from_text)
        )
    f, tp = fmap[key]
    section = getattr(cfg, sec)
    setattr(section, f.name, checked(dotted, value, f, tp, from_text))
    return section


def apply_pairs(
    cfg: Config, pairs: Iterable[tuple[str, Any]], from_text: bool, source: str | None
) -> Config:
    """The one way keys reach a config: each ``(section.key, value)`` checked as it is set
    (text from the command line, Python values from TOML or code), then every section it
    changed checked whole by its own ``__post_init__``. Errors start with ``source``."""
    changed: dict[int, Any] = {}
    try:
        for dotted, value in pairs:
            section = _set(cfg, dotted, value, from_text)
            changed[id(section)] = section
        for section in changed.values():
            recheck(section)
    except ConfigError as e:
        if source is None:
            raise
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """``cfg.<section>.<key> = value`` for a Python value, checked as a TOML value is."""
    apply_pairs(cfg, [(dotted, value)], from_text=False, source=None)


def apply_mapping(cfg: Config, data: Mapping[str, Any], source: str = "config") -> Config:
    """Apply a ``{section: {key: value}}`` mapping (parsed TOML) to ``cfg`` in place."""
    for sec, body in data.items():
        if not isinstance(body, Mapping):
            raise ConfigError(
                f"{source}: top-level key {sec!r} must be a [section] table; "
                f"allowed sections: {', '.join(section_types())}"
            )
    pairs = [(f"{sec}.{key}", value) for sec, body in data.items() for key, value in body.items()]
    return apply_pairs(cfg, pairs, from_text=False, source=source)


def apply_overrides(
    cfg: Config, overrides: Sequence[tuple[str, str]], source: str = "command line"
) -> Config:
    """Apply ``(section.key, text)`` pairs from the command line to ``cfg`` in place;
    ``source`` starts the error (``meshrun launch`` names the flag there)."""
    return apply_pairs(cfg, overrides, from_text=True, source=source)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"config file {str(p)!r} is a directory; pass the TOML file itself (e.g. "
            f"{str(p / 'meshrun.toml')!r}), or create one with `meshrun config init`"
        )
    if not p.is_file():
        raise ConfigError(
            f"config file {str(p)!r} does not exist; create one with `meshrun config init`"
        )
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # tomllib decodes UTF-8 itself and lets this through
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
            f"offset {e.start}); TOML files are UTF-8: save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None


SEPARATOR = "--"  # ends the overrides: what follows goes to the script untouched


def split_overrides(argv: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Separate ``--section.key=value`` / ``--section.key value`` from the other arguments.

    Only dotted long options are taken, so a user script's own flags pass through untouched.
    The first ``--`` ends the overrides: it is dropped and every argument after it is the
    script's, as written, even ``--trainer.batch_size=4`` (a script whose own flags are dotted
    keeps them this way; docs/porting.md). Write ``-- --`` to give the script a ``--``.
    """
    overrides: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == SEPARATOR:
            return overrides, rest + list(argv[i + 1 :])
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." not in name:
            rest.append(arg)
        elif "=" in arg:
            overrides.append((name, arg.split("=", 1)[1]))
        elif i + 1 < len(argv) and argv[i + 1] != SEPARATOR:
            overrides.append((name, argv[i + 1]))
            i += 1
        else:
            raise ConfigError(f"override --{name} has no value; write --{name}=VALUE")
        i += 1
    return overrides, rest


def load_config(
    path: str | Path | None = None, overrides: Sequence[tuple[str, str]] = ()
) -> Config:
    """Defaults, then the TOML file (if any), then ``--section.key=value`` overrides."""
    cfg = Config()
    if path:
        apply_mapping(cfg, load_toml(path), source=str(path))
    # Keys only wrong together (warmup beyond the run) are checked once all layers are in.
    return validate(apply_overrides(cfg, overrides))


# --- files ---------------------------------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def to_toml(cfg: Config, comments: bool = False) -> str:
    """Render the config as TOML; with comments, each key carries its documentation."""
    lines: list[str] = []
    for sec in dataclasses.fields(cfg):
        section_obj = getattr(cfg, sec.name)
        if comments:
            lines.append(f"# {(type(section_obj).__doc__ or '').strip()}")
        lines.append(f"[{sec.name}]")
        for f in dataclasses.fields(section_obj):
            entry = f"{key_of(f)} = {toml_value(getattr(section_obj, f.name))}"
            doc = f.metadata.get("doc", "")
            lines.append(f"{entry:<32} # {doc}" if comments and doc else entry)
        lines.append("")
    return "\n".join(lines)


def write_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config atomically (workers read it while the launcher may rewrite).

    The temporary file's name is unique to this writer: on a multi-node job every node's
    launcher writes the same file in a shared run directory, and with one fixed temporary name
    one node's rename would take the file another node was about to rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(p)
    return p
