"""What a command starts: a script that exists here or a module, and the config it uses when
no --config is given. Shared by every command that starts a job from this machine (launch,
scale-test, slurm submit, ray launch), so each refuses a missing script the same way."""

from __future__ import annotations

from pathlib import Path

DEMO_MODULE = "meshrun.demo"
# A file, not an import: the demo sits above the launch layer.
DEMO_CONFIG = Path(__file__).parents[1] / "demo" / "demo.toml"


def require_script(command: str, target: str | None, module: bool) -> None:
    """The target of a command that starts it from this machine: given, and a script that
    exists here unless it is a module (``-m``); the same errors from every such command."""
    from meshrun.config.fields import ConfigError

    if not target:
        raise ConfigError(f"meshrun {command} needs a script (train.py) or -m MODULE")
    if not module and not Path(target).is_file():
        raise ConfigError(f"script {target!r} does not exist")


def default_config(module: str | None) -> Path | None:
    """The config a target uses when no --config is given: the demo's own for ``-m
    meshrun.demo`` (so its settings hold under launch, scale-test and slurm), else none."""
    return DEMO_CONFIG if module == DEMO_MODULE else None


def check_target(target: str, module: str | None, no_python: bool | None) -> None:
    """``meshrun launch``'s target: a module, a script that exists here, or with --no-python a
    program found on PATH as torchrun would find it, before anything runs."""
    import shutil

    from meshrun.config.fields import ConfigError

    if module is not None or Path(target).is_file():
        return
    if no_python and shutil.which(target):  # --no-python: a program, found as torchrun would
        return
    what = "program" if no_python else "script"
    raise ConfigError(f"{what} {target!r} does not exist")
