"""One validation on every path a config value takes: ``Config(...)`` and its sections built in
code, attributes set after construction, TOML files, ``--section.key=value`` overrides and
``meshrun launch`` flags, each with the message that names the key, the value and what is
allowed. And the unset global batch: derived as micro_batch x data-parallel size for the world
that runs it (1, 3, 8, 1024 processes), only a value the user set held to divisibility."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import meshrun
from meshrun.cli.main import main
from meshrun.config import (
    Config,
    ConfigError,
    DataConfig,
    JobConfig,
    LaunchConfig,
    ParallelConfig,
    grad_accumulation,
    load_config,
    resolve_global_batch,
    validate,
    validate_for_world,
)
from meshrun.demo.batch import fit_micro_batch as _fit_micro_batch
from meshrun.launch.prepare import prepare
from meshrun.launch.spec import parse_nnodes
from meshrun.launch.target import DEMO_CONFIG

pytestmark = pytest.mark.timeout(30)


def _prepare(cfg: Config, nproc: int, nnodes: str) -> Path:
    """launch/prepare.py's prepare, for a --nnodes text."""
    return prepare(cfg, nproc, parse_nnodes(nnodes))


def _message(make: Any) -> str:
    with pytest.raises(ConfigError) as info:
        make()
    return str(info.value)


# --- Config(...) in code ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: DataConfig(micro_batch=0), ["data.micro_batch = 0", ">= 1"]),
        (lambda: ParallelConfig(zero=7), ["parallel.zero = 7", "<= 3"]),
        (
            lambda: ParallelConfig(param_dtype="fp8"),
            ["parallel.param_dtype = 'fp8'", "'float32', 'bfloat16', 'float16'"],
        ),
        (lambda: DataConfig(micro_batch="8"), ["data.micro_batch = '8'", "an integer"]),
        (lambda: JobConfig(timeout_s=0.5), ["job.timeout_s = 0.5", ">= 1"]),
        (lambda: LaunchConfig(max_restarts=-1), ["launch.max_restarts = -1", ">= 0"]),
        (lambda: Config(data=ParallelConfig()), ["'data'", "DataConfig"]),  # type: ignore[arg-type]
    ],
)
def test_a_section_built_in_code_is_checked_where_it_is_made(
    make: Any, expected: list[str]
) -> None:
    message = _message(make)
    for part in expected:
        assert part in message, message


def test_every_bad_value_of_a_section_is_named_at_once() -> None:
    message = _message(lambda: ParallelConfig(zero=7, param_dtype="fp8"))  # type: ignore[arg-type]
    assert "parallel.zero = 7 is out of range: must be <= 3" in message
    assert "parallel.param_dtype = 'fp8' is not allowed" in message


def test_code_file_and_command_line_give_the_same_message(tmp_path: Path) -> None:
    in_code = _message(lambda: ParallelConfig(zero=7))
    path = tmp_path / "c.toml"
    path.write_text("[parallel]\nzero = 7\n")
    assert _message(lambda: load_config(path)) == f"{path}: {in_code}"
    assert _message(lambda: load_config(None, [("parallel.zero", "7")])) == (
        f"command line: {in_code}"
    )


def test_an_int_for_a_float_key_is_a_float() -> None:
    assert JobConfig(timeout_s=60).timeout_s == 60.0
    assert isinstance(JobConfig(timeout_s=60).timeout_s, float)


@pytest.mark.timeout(180)  # the first init() imports torch: slow on a loaded machine
def test_init_names_micro_batch_zero_instead_of_dividing_by_zero() -> None:
    with pytest.raises(ConfigError, match=r"data\.micro_batch = 0 .*>= 1"):
        meshrun.init(Config(data=DataConfig(micro_batch=0)), argv=[])


# --- set after construction: caught where init() and the launcher take the config ------------


def test_a_value_set_after_construction_is_caught_by_validate() -> None:
    cfg = Config()
    cfg.data.micro_batch = 0
    assert "data.micro_batch = 0" in _message(lambda: validate(cfg))
    assert "data.micro_batch = 0" in _message(lambda: validate_for_world(cfg, 2))
    cfg = Config()
    cfg.parallel.param_dtype = "fp8"  # type: ignore[assignment]
    assert "'fp8' is not allowed" in _message(lambda: validate_for_world(cfg, 2))


@pytest.mark.timeout(180)  # the first init() imports torch: slow on a loaded machine
def test_init_checks_a_config_changed_after_construction() -> None:
    cfg = Config()
    cfg.data.micro_batch = 0
    with pytest.raises(ConfigError, match=r"data\.micro_batch = 0"):
        meshrun.init(cfg, argv=[])
    cfg = Config()
    cfg.job.device = "gpu"  # type: ignore[assignment]  # must not fall back to the CPU quietly
    with pytest.raises(ConfigError, match=r"job\.device = 'gpu' is not allowed"):
        meshrun.init(cfg, argv=[])


def test_grad_accumulation_never_divides_by_zero() -> None:
    data = DataConfig()
    data.micro_batch = 0
    with pytest.raises(ConfigError, match=r"data\.micro_batch = 0"):
        grad_accumulation(data, 2)


# --- meshrun launch flags ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--max-restarts", "-1"], ["--max-restarts -1", "launch.max_restarts = -1", ">= 0"]),
        (["--join-timeout", "0"], ["--join-timeout 0", "launch.join_timeout_s = 0.0", ">= 1"]),
        (["--node-rank", "-2"], ["--node-rank -2", "launch.node_rank = -2", ">= 0"]),
    ],
)
def test_a_launch_flag_gets_the_config_check_naming_the_flag(
    flags: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_PROCID"):  # not inside an allocation
        monkeypatch.delenv(var, raising=False)
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["launch", "--nproc-per-node", "2", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshrun launch: error: "), err
    for part in expected:
        assert part in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("nnodes", "two", "--nnodes / launch.nnodes = 'two' is not allowed: expected N or MIN:MAX"),
        ("rdzv_endpoint", "h:0", "--rdzv-endpoint / launch.rdzv_endpoint = 'h:0'"),
        ("rdzv_conf", "oops", "--rdzv-conf / launch.rdzv_conf = 'oops' is not allowed"),
        ("rdzv_id", "a/b", "--rdzv-id / launch.rdzv_id = 'a/b' is not allowed"),
    ],
)
def test_a_launch_value_gets_one_check_from_code_file_override_and_flag(
    key: str,
    text: str,
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_code = _message(lambda: LaunchConfig(**{key: text}))
    assert expected in in_code, in_code
    path = tmp_path / "c.toml"
    path.write_text(f'[launch]\n{key} = "{text}"\n')
    assert _message(lambda: load_config(path)) == f"{path}: {in_code}"
    assert _message(lambda: load_config(None, [(f"launch.{key}", text)])) == (
        f"command line: {in_code}"
    )
    monkeypatch.chdir(tmp_path)
    for var in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_PROCID"):  # not inside an allocation
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "train.py").write_text("print('never runs')\n")
    flag = f"--{key.replace('_', '-')}"
    assert main(["launch", "--nproc-per-node", "2", flag, text, "train.py"]) == 2
    assert capsys.readouterr().err == f"meshrun launch: error: {flag} {text}: {in_code}\n"


def test_a_hostfile_launch_checks_its_flags_here_before_any_ssh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.txt").write_text("node-a\nnode-b\n")  # never reached: no such hosts
    (tmp_path / "train.py").write_text("print('never runs')\n")
    argv = ["launch", "--hostfile", "hosts.txt", "--max-restarts", "-1", "train.py"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "meshrun launch: error: --max-restarts -1: launch.max_restarts = -1 is out of range: "
        "must be >= 0\n"
    )


def test_launch_flags_are_launch_keys_in_the_resolved_config() -> None:
    from meshrun.launch.front.torchrun import apply_launch_flags, launch_flag_overrides
    from meshrun.launch.spec import LaunchKeys

    a = LaunchKeys(
        nproc_per_node=3,
        nnodes="2",
        rdzv_endpoint="10.0.0.1:29500",
        node_rank=1,
        join_timeout=60.0,
        max_restarts=None,
    )
    assert ("--join-timeout", "launch.join_timeout_s", "60.0") in launch_flag_overrides(a)
    cfg = load_config(None, [("launch.max_restarts", "2")])
    apply_launch_flags(cfg, a)
    assert cfg.launch == LaunchConfig(
        nproc_per_node=3,
        nnodes="2",
        max_restarts=2,
        node_rank=1,
        rdzv_endpoint="10.0.0.1:29500",
        join_timeout_s=60.0,
    )


def test_a_launch_spec_is_made_from_the_configs_launch_section_plus_what_to_run() -> None:
    from meshrun.launch.spec import LaunchSpec

    launch = load_config(None, [("launch.max_restarts", "2"), ("launch.rdzv_id", "job7")]).launch
    spec = LaunchSpec.of(launch, procs_per_node=4, script="t.py")
    assert not isinstance(spec, LaunchConfig)  # composed: its fields are not config keys
    assert (spec.max_restarts, spec.rendezvous.rdzv_id, spec.procs_per_node) == (2, "job7", 4)
    assert (launch.nproc_per_node, spec.script) == (0, "t.py")  # the config is left as it was
    assert LaunchSpec.of(dataclasses.replace(launch, nproc_per_node=3)).procs_per_node == 3
    # A bad key is the config's to refuse, with the message a file would get.
    message = _message(lambda: dataclasses.replace(launch, max_restarts=-1))
    assert "launch.max_restarts = -1" in message


def test_scale_test_runs_each_size_on_this_node_with_the_configs_launch_keys() -> None:
    from meshrun.diagnose.scale import _one_node

    launch = LaunchConfig(nnodes="2", rdzv_endpoint="10.0.0.1:29500", max_restarts=1)
    one = _one_node(launch, 3)
    assert (one.nnodes, one.rdzv_endpoint, one.nproc_per_node, one.max_restarts) == ("1", "", 3, 1)


# --- the unset global batch ------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3, 8, 1024])
def test_an_unset_global_batch_is_micro_times_dp_at_any_world(world: int) -> None:
    cfg = Config()
    assert cfg.data.global_batch == 0
    dims = validate_for_world(cfg, world)  # no divisibility to fail
    assert dims["dp_shard"] == world
    note = resolve_global_batch(cfg, [world])
    assert cfg.data.global_batch == 8 * world
    assert note is not None
    assert f"data.global_batch unset: 8 x {world} = {8 * world}" in note
    assert "(micro_batch x data-parallel size" in note
    assert grad_accumulation(cfg.data, world) == 1


def test_the_derived_global_batch_uses_the_data_parallel_size() -> None:
    cfg = load_config(None, [("parallel.tp", "2"), ("parallel.zero", "3")])
    resolve_global_batch(cfg, [16])
    assert cfg.data.global_batch == 8 * 8  # dp = 16 / tp


def test_several_worlds_get_one_global_batch_that_divides_at_each() -> None:
    cfg = Config()
    resolve_global_batch(cfg, [16, 24])  # an elastic 2:3 job of 8 per node
    assert cfg.data.global_batch == 8 * 48
    for world in (16, 24):
        validate_for_world(cfg, world)


def test_a_global_batch_the_user_set_is_kept_and_held_to_divisibility() -> None:
    cfg = load_config(None, [("data.global_batch", "32")])
    assert resolve_global_batch(cfg, [3]) is None
    assert cfg.data.global_batch == 32
    assert "data.global_batch = 32 is not divisible" in _message(lambda: validate_for_world(cfg, 3))


@pytest.mark.parametrize(
    ("nproc", "nnodes", "expected"), [(8, "1", 64), (3, "1", 24), (8, "1:2", 128)]
)
def test_the_launcher_writes_the_derived_number_and_says_so(
    nproc: int,
    nnodes: str,
    expected: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    path = _prepare(Config(), nproc, nnodes)
    written = load_config(path)
    assert written.data.global_batch == expected
    assert written.job.run_dir == "runs/meshrun"  # the workers get the path it became
    assert path == Path("runs/meshrun/config.toml")
    err = capsys.readouterr().err
    assert f"meshrun launch: data.global_batch unset: 8 x {expected // 8} = {expected}" in err
    assert "meshrun launch: job.run_dir unset:" in err
    assert "runs/meshrun" in err and "--job.run_dir=DIR" in err


def test_a_set_run_dir_is_not_announced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(None, [("job.run_dir", str(tmp_path / "r")), ("data.global_batch", "16")])
    _prepare(cfg, 2, "1")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("world", [3, 6, 8])
def test_config_show_prints_what_launch_would_write(
    world: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "--world-size", str(world)]) == 0
    out, err = capsys.readouterr()
    assert f"global_batch = {8 * world}\n" in out
    assert f"data.global_batch unset: 8 x {world} = {8 * world}" in err


# --- the demo: 32 samples per step where that divides, said aloud where it does not ---------


@pytest.mark.parametrize(
    ("nproc", "global_batch", "micro_batch", "said"),
    [
        (2, 32, 8, ""),
        (3, 30, 5, "data.global_batch 32 -> 30, data.micro_batch 8 -> 5 (accumulation 2)"),
        (6, 30, 5, "data.global_batch 32 -> 30, data.micro_batch 8 -> 5 (accumulation 1)"),
        (8, 32, 4, "data.micro_batch 8 -> 4 so that the global batch 32 divides"),
    ],
)
def test_the_demo_fits_its_batch_to_any_process_count(
    nproc: int, global_batch: int, micro_batch: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(DEMO_CONFIG)
    _fit_micro_batch(cfg, nproc)
    assert (cfg.data.global_batch, cfg.data.micro_batch) == (global_batch, micro_batch)
    validate_for_world(cfg, nproc)
    err = capsys.readouterr().err
    assert (said in err) if said else err == ""


def test_the_demo_keeps_a_global_batch_the_user_passed() -> None:
    cfg = load_config(DEMO_CONFIG)
    _fit_micro_batch(cfg, 3, keep_global=True)
    assert cfg.data.global_batch == 32  # and validation says what does not divide
    assert "data.global_batch = 32 is not divisible" in _message(lambda: validate_for_world(cfg, 3))


# --- other paths that validate a whole job before it starts ----------------------------------


def test_k8s_renders_eight_per_node_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["k8s", "render", "--image", "img:1", "--nodes", "2", "--nproc-per-node", "8"]
    assert main([*argv, "--kind", "jobset", "train.py"]) == 0
    out, err = capsys.readouterr()
    assert "kind: JobSet" in out
    assert "data.global_batch unset: 8 x 16 = 128" in err


# --- a resumed run keeps the saved run's global batch on any world size ----------------------


def _checkpoint(root: Path, step: int, global_batch: int) -> Path:
    from meshrun.checkpoint import on_disk

    tmp = on_disk.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text("{}")
    manifest = on_disk.build_manifest(tmp, step=step, meta={"global_batch": global_batch})
    final = on_disk.step_dir(root, step)
    on_disk.commit_dir(tmp, final, manifest)
    return final


def test_an_unset_global_batch_is_the_resumed_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    saved = _checkpoint(run_dir / "checkpoints", 10, 64)  # trained on 8 ranks: 8 x 8
    cfg = load_config(None, [("job.run_dir", str(run_dir))])
    written = load_config(_prepare(cfg, 4, "1"))  # resumed on 4: accumulation 2, not 32
    assert written.data.global_batch == 64
    assert grad_accumulation(written.data, 4) == 2
    err = capsys.readouterr().err
    assert f"data.global_batch unset: 64 from the checkpoint it resumes ({saved})" in err
    # On a world it does not divide the launcher says so before anything starts.
    cfg = load_config(None, [("job.run_dir", str(run_dir))])
    assert "data.global_batch = 64 is not divisible" in _message(lambda: _prepare(cfg, 3, "1"))
    # checkpoint.resume = never: a fresh run, derived for its own world.
    cfg = load_config(None, [("job.run_dir", str(run_dir)), ("checkpoint.resume", "never")])
    assert load_config(_prepare(cfg, 4, "1")).data.global_batch == 32


@pytest.mark.timeout(180)  # imports torch: slow on a loaded machine
def test_init_without_a_launcher_takes_the_resumed_batch_too(tmp_path: Path) -> None:
    from meshrun.train.startup import resolve_batch as _resolve_batch

    cfg = load_config(None, [("job.run_dir", str(tmp_path))])
    assert _resolve_batch(cfg, 2) == "micro_batch x dp"  # nothing to resume: derived
    assert cfg.data.global_batch == 16
    _checkpoint(tmp_path / "checkpoints", 4, 48)
    cfg = load_config(None, [("job.run_dir", str(tmp_path))])
    assert _resolve_batch(cfg, 2) == "from the checkpoint it resumes"
    assert cfg.data.global_batch == 48
    cfg = load_config(None, [("job.run_dir", str(tmp_path)), ("data.global_batch", "16")])
    assert _resolve_batch(cfg, 2) == ""  # set by the user: kept, the resume checks it
    assert cfg.data.global_batch == 16


def test_scale_test_keeps_one_derived_global_batch_for_every_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.diagnose.scale import ScaleRequest, scale_configs

    configs = scale_configs(ScaleRequest(sizes=[1, 2, 3], out=tmp_path))
    assert {n: c.data.global_batch for n, c in configs.items()} == {1: 48, 2: 48, 3: 48}
    assert "8 x 6 = 48 (micro_batch x data-parallel size; 6 = lcm of the sizes [1, 2, 3])" in (
        capsys.readouterr().err
    )
