"""The syntax of the ``[launch]`` values that are text with a shape: ``nnodes`` (N or
MIN:MAX), ``rdzv_endpoint`` (HOST:PORT), ``rdzv_conf`` (KEY=VALUE,...) and ``rdzv_id``.

``LaunchConfig.__post_init__`` runs :func:`check_launch_values`, so a bad value is refused
where it is made (a file, ``--launch.nnodes=x``, ``meshrun launch --nnodes x``, code), with
a message naming the flag and the key. What needs more than one key and the environment
(``--nnodes 2`` needs an endpoint, which SLURM may supply) is ``launch.multinode.validate``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshrun.config.fields import ConfigError


def nnodes_range(text: str) -> tuple[int, int]:
    """``"2"`` or ``"2:4"`` (elastic MIN:MAX) as (min, max); errors name the flag and key."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) < 1 or values[0] > values[-1]:
        raise ConfigError(
            f"--nnodes / launch.nnodes = {text!r} is not allowed: expected N or MIN:MAX with "
            "1 <= MIN <= MAX, e.g. 2 or 2:4"
        )
    return values[0], values[-1]


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv4 address or name) as (host, port); errors name the flag."""
    host, sep, port_text = text.rpartition(":")
    port = int(port_text) if port_text.isdigit() else -1
    if not sep or not host or not 1 <= port <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint / launch.rdzv_endpoint = {text!r} is not allowed: expected "
            "HOST:PORT with PORT in 1..65535, the address of one of the nodes, e.g. 10.0.0.1:29500"
        )
    return host, port


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` (torchrun's --rdzv-conf syntax) as a dict; errors name the flag."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--rdzv-conf / launch.rdzv_conf = {text!r} is not allowed: expected "
                "KEY=VALUE[,KEY=VALUE...], e.g. last_call_timeout=5"
            )
        conf[key.strip()] = value.strip()
    return conf


def check_rdzv_id(rdzv_id: str) -> None:
    # torchrun puts the id in store keys and log folder names.
    if not rdzv_id or any(c in rdzv_id for c in " /:,="):
        raise ConfigError(
            f"--rdzv-id / launch.rdzv_id = {rdzv_id!r} is not allowed: expected a non-empty "
            "name without spaces, '/', ':', ',' or '='"
        )


def check_launch_values(launch: Any) -> None:
    """Every shaped ``[launch]`` value of ``launch`` (a LaunchConfig), as one error."""
    errors = []
    checks: list[tuple[Callable[[str], object], str]] = [
        (nnodes_range, launch.nnodes),
        (parse_rdzv_conf, launch.rdzv_conf),
        (check_rdzv_id, launch.rdzv_id),
    ]
    if launch.rdzv_endpoint:  # empty: one node on a free loopback port
        checks.append((parse_endpoint, launch.rdzv_endpoint))
    for check, value in checks:
        try:
            check(value)
        except ConfigError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("; ".join(errors))
