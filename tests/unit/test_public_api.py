"""The public surface, frozen: ``meshrun.__all__``, the names a ``Run`` answers to (methods,
properties, the fields ``Run.__init__`` sets) and the signatures users call most. A change
here is a change to every user's script: this test fails until it is made on purpose (and
the CHANGELOG says so). Every public member also carries a docstring."""

from __future__ import annotations

import inspect
import typing

import meshrun

ALL = [
    "Config",
    "ConfigError",
    "ParallelDims",
    "ResumableSampler",
    "Run",
    "__version__",
    "build_dataloader",
    "init",
    "load_config",
    "lr_factor",
    "main",
    "scale_lr",
]

METHODS = [
    "all_reduce_sum",
    "backward",
    "close",
    "dataloader",
    "evaluate",
    "load_pretrained",
    "log_event",
    "loss_parallel",
    "lr_scheduler",
    "optimizer",
    "optimizer_step",
    "parallelize",
    "phase",
    "pipeline",
    "pipeline_eval",
    "pipeline_step",
    "resume",
    "sampler",
    "save_checkpoint",
    "scaled_lr",
    "set_flops_per_token",
    "set_model_flops",
    "steps",
    "summary",
    "timed_comm_hook",
    "unwrap",
]

PROPERTIES = ["data_wait", "grad_norm", "grad_scaler", "is_step_end", "step"]

# Set once by Run.__init__ and declared on the class. The machinery (train/machinery.py: the
# train state, the checkpointer, the metrics logger, ...) and the step loop built from it are
# private: `_parts`, `_loop`; what scripts read of them is a property above (`grad_norm`,
# `data_wait`) or a method (`timed_comm_hook`, `log_event`, `summary`).
FIELDS = [
    "accum",
    "backend",
    "cluster",
    "config",
    "device",
    "dims",
    "dp_rank",
    "dp_size",
    "is_main",
    "local_rank",
    "log",
    "mesh",
    "rank",
    "run_dir",
    "world_size",
]

SIGNATURES = {
    "init": "(config: 'Config | str | Path | None' = None, argv: 'Sequence[str] | None' = None, "
    "*, keep_argv: 'bool' = False) -> 'Run'",
    "Run.resume": "(self, model: 'nn.Module | Pipeline', optimizer: 'torch.optim.Optimizer', "
    "loader: 'Any' = None, per_rank: 'Mapping[str, Stateful] | None' = None, "
    "**named: 'Stateful') -> 'int'",
}


def _public(names: typing.Iterable[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("_"))


def test_the_package_exports_exactly_these_names() -> None:
    assert sorted(meshrun.__all__) == ALL


def test_a_run_answers_to_exactly_these_names() -> None:
    members = dict(inspect.getmembers(meshrun.Run))
    public = _public(members)
    properties = [n for n in public if isinstance(members[n], property)]
    assert properties == PROPERTIES
    assert [n for n in public if n not in properties] == METHODS
    assert _public(typing.get_type_hints(meshrun.Run)) == FIELDS


def test_the_machinery_is_private() -> None:
    hints = typing.get_type_hints(meshrun.Run)
    assert {"_parts", "_loop"} <= set(hints)
    assert not {"loop", "state", "checkpointer", "metrics"} & set(dir(meshrun.Run))


def test_every_public_member_is_documented() -> None:
    undocumented = [n for n in [*METHODS, *PROPERTIES] if not getattr(meshrun.Run, n).__doc__]
    assert undocumented == []
    assert [n for n in ALL if n != "__version__" and not getattr(meshrun, n).__doc__] == []


def test_the_calls_every_script_makes_keep_their_signatures() -> None:
    got = {
        "init": str(inspect.signature(meshrun.init)),
        "Run.resume": str(inspect.signature(meshrun.Run.resume)),
    }
    assert got == SIGNATURES
