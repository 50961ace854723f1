"""``meshrun plan --model``: build the user's model on the meta device, from wherever it lives.

Three sources, told apart by their form:

- ``path/to/model.py:factory``: a file, imported as a script would be (its folder first on
  ``sys.path`` while it loads, so its own sibling imports work; no ``PYTHONPATH`` needed);
- ``pkg.module:factory``: an importable module;
- a Hugging Face ``config.json``, or a directory holding one: the causal LM it describes, built
  with transformers' ``AutoModelForCausalLM.from_config`` (nothing downloaded).

``--model-kwargs JSON`` gives the factory its keyword arguments, or overrides fields of a
``config.json``. Everything is built under ``torch.device("meta")``: no weights are allocated
however large the model. Every failure is a :class:`PlanError` naming the flag, the value and
the fix (``meshrun plan`` prints it on one line and exits 2), never a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from meshrun.plan.errors import PlanError

FORMS = "path/to/model.py:factory, pkg.module:factory, a config.json or a directory holding one"


@dataclass
class Built:
    """A model built on the meta device, and what it was built from."""

    model: Any  # torch.nn.Module (torch is imported lazily)
    config: Any  # the Hugging Face config for a config.json, else None
    origin: str  # "factory" or "config.json"


def parse_kwargs(text: str | None) -> dict[str, Any]:
    """``--model-kwargs``: a JSON object of keyword arguments."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(
            f"--model-kwargs {text!r} is not valid JSON ({e}); expected an object "
            """such as '{"n_layer": 4, "n_embd": 256}'"""
        ) from None
    if not isinstance(value, dict):
        raise PlanError(
            f"--model-kwargs {text!r} is a JSON {type(value).__name__}; expected an "
            """object of keyword arguments such as '{"n_layer": 4}'"""
        )
    return value


def build_model(spec: str, kwargs: dict[str, Any]) -> Built:
    """Build ``spec`` (any of :data:`FORMS`) on the meta device."""
    path = Path(spec)
    if spec.endswith(".json") or path.is_dir():
        return _from_hf_config(spec, _config_file(spec), kwargs)
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        hint = (
            f"{spec}:FACTORY (the function or class that builds it)"
            if spec.endswith(".py")
            else FORMS
        )
        raise PlanError(f"--model {spec!r}: expected {hint}")
    module = _load_module(spec, source)
    factory = _factory(spec, module, source, attr)
    return Built(_call(spec, factory, attr, kwargs), None, "factory")


# --- a factory in a file or a module ---------------------------------------------------------


def _is_file_source(source: str) -> bool:
    return source.endswith(".py") or "/" in source or Path(source).is_file()


def _load_module(spec: str, source: str) -> ModuleType:
    if not _is_file_source(source):
        return _import(spec, source, lambda: importlib.import_module(source))
    path = Path(source)
    if not path.is_file():
        raise PlanError(
            f"--model {spec!r}: {source} does not exist (looked in {Path.cwd()}); "
            f"give an existing file as {FORMS.split(', ')[0]}"
        )
    return _import(spec, source, lambda: _exec_file(path.resolve()))


def _exec_file(path: Path) -> ModuleType:
    name = path.stem if path.stem.isidentifier() else "user_model"
    if name in sys.modules:  # another module has the name: load beside it, not over it
        name = f"_meshrun_plan_{name}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    # Registered while it runs: dataclasses (nanoGPT's GPTConfig) look their module up there.
    sys.modules[name] = module
    try:
        with _on_sys_path(path.parent):
            loader_spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


@contextlib.contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    """The file's folder first on sys.path while it loads, as ``python model.py`` would have
    it: a model file that imports its neighbours (``from layers import Block``) loads."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def _import(spec: str, source: str, load: Callable[[], ModuleType]) -> ModuleType:
    try:
        return load()
    except SystemExit as e:  # a training script that parses sys.argv when imported
        raise PlanError(
            f"--model {spec!r}: importing {source} exited (SystemExit {e.code}): it "
            "runs as a script when imported; put the model in a module of its own "
            "or guard the script with `if __name__ == '__main__':`"
        ) from None
    except ModuleNotFoundError as e:
        hint = "" if _is_file_source(source) else " (a file? give its path: path/to/model.py)"
        raise PlanError(
            f"--model {spec!r}: cannot import {source}: {_first_line(e)}{hint}"
        ) from None
    except Exception as e:
        raise PlanError(
            f"--model {spec!r}: importing {source} raised {type(e).__name__}: "
            f"{_first_line(e)}; fix that file"
        ) from None


def _factory(spec: str, module: ModuleType, source: str, attr: str) -> Callable[..., Any]:
    factory = getattr(module, attr, None)
    if callable(factory):
        return factory
    own = sorted(
        k
        for k, v in vars(module).items()
        if callable(v)
        and not k.startswith("_")
        and getattr(v, "__module__", None) == module.__name__
    )
    there = f"callables defined there: {', '.join(own)}" if own else "it defines no callable"
    raise PlanError(
        f"--model {spec!r}: {source} has no callable {attr!r} ({there}); give {source}:NAME"
    )


def _call(spec: str, factory: Callable[..., Any], attr: str, kwargs: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    _check_signature(spec, factory, attr, kwargs)
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as e:
        given = f" with --model-kwargs {json.dumps(kwargs)}" if kwargs else ""
        raise PlanError(
            f"--model {spec!r}: {attr}(){given} raised {type(e).__name__}: "
            f"{_first_line(e)}; fix the factory or its arguments (it runs on the "
            "meta device: it must not read or copy weights)"
        ) from None
    if not isinstance(model, nn.Module):
        raise PlanError(
            f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a "
            "torch.nn.Module; give the function or class that builds the model"
        )
    return model


def _check_signature(spec: str, factory: Callable[..., Any], attr: str, kw: dict[str, Any]) -> None:
    """Arguments checked before the call, so that the error shows the signature."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    try:
        signature.bind(**kw)
    except TypeError as e:
        needed = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        example = ", ".join(f'"{n}": ...' for n in needed) or '"name": value'
        given = f"with --model-kwargs {json.dumps(kw)}" if kw else "without --model-kwargs"
        raise PlanError(
            f"--model {spec!r}: {attr}{signature} cannot be called {given}: {e}; "
            f"pass its arguments as a JSON object: --model-kwargs '{{{example}}}'"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


# --- a Hugging Face config.json -------------------------------------------------------------


def _config_file(spec: str) -> Path:
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(
                f"--model {spec!r}: the directory has no config.json; give a "
                "Hugging Face model directory, or one of: " + FORMS
            )
    elif not path.is_file():
        raise PlanError(
            f"--model {spec!r} does not exist (looked in {Path.cwd()}); give "
            "the path of a Hugging Face config.json or of its directory"
        )
    return path


def _read_config(spec: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"--model {spec!r}: cannot read {path} as JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise PlanError(
            f'--model {spec!r}: {path} has no "model_type", so it is not a Hugging '
            "Face model config; give the config.json that comes with the "
            "model (save it with config.save_pretrained(DIR))"
        )
    return data


def _from_hf_config(spec: str, path: Path, kwargs: dict[str, Any]) -> Built:
    data = _read_config(spec, path)
    torch, transformers = _import_transformers(spec)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = data.pop("model_type")
    version = transformers.__version__
    if kind not in CONFIG_MAPPING_NAMES:
        raise PlanError(
            f"--model {spec!r}: model_type {kind!r} is unknown to transformers "
            f"{version} (its code is not part of transformers; meshrun does not "
            "run code from a model repository): give --model "
            "path/to/modeling.py:factory that builds it"
        )
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise PlanError(
            f"--model {spec!r}: model_type {kind!r} has no causal language model in "
            f"transformers {version} (AutoModelForCausalLM: llama, qwen2, mistral, "
            "gpt2, ...); meshrun plan models decoder LMs: give the shape "
            "(--layers --hidden --heads --vocab --seq) or --params N"
        )
    config = _hf_config(spec, transformers, kind, data, kwargs)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise PlanError(
            f"--model {spec!r}: transformers could not build the {kind!r} model "
            f"from it: {type(e).__name__}: {_first_line(e)}; check its fields "
            "(and --model-kwargs)"
        ) from None
    return Built(model, config, "config.json")


def _import_transformers(spec: str) -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise PlanError(
            f"--model {spec!r}: a Hugging Face config.json is read with transformers, "
            f"which is not importable here ({e}); pip install transformers"
        ) from None
    return torch, transformers


def _hf_config(
    spec: str, transformers: Any, kind: str, data: dict[str, Any], kwargs: dict[str, Any]
) -> Any:
    known = set(data)
    if kwargs:  # the fields of the architecture's default config, for the names a user may set
        with contextlib.suppress(Exception):
            known |= set(transformers.AutoConfig.for_model(kind).to_dict())
    unknown = sorted(set(kwargs) - known)
    if unknown:
        close = {m for k in unknown for m in difflib.get_close_matches(k, known, n=2)}
        hint = f"did you mean {', '.join(sorted(close))}?" if close else "see its config.json"
        raise PlanError(
            f"--model-kwargs: {', '.join(unknown)} is not a field of a {kind!r} "
            f"config (--model {spec}); {hint}"
        )
    try:
        return transformers.AutoConfig.for_model(kind, **{**data, **kwargs})
    except Exception as e:
        raise PlanError(
            f"--model {spec!r}: transformers refuses the {kind!r} config: "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from None


__all__ = ["FORMS", "Built", "build_model", "parse_kwargs"]
