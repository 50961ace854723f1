"""The config: defaults, TOML files, ``--section.key=value`` overrides, errors that name the
key, the value and what is allowed, the world-size checks, and the TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.config import (
    Config,
    ConfigError,
    DataConfig,
    ParallelConfig,
    apply_overrides,
    grad_accumulation,
    load_config,
    resolve_mesh_dims,
    split_overrides,
    to_toml,
    validate_for_world,
)

pytestmark = pytest.mark.timeout(10)


def _write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(overrides: list[tuple[str, str]]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


# --- loading ---------------------------------------------------------------------------


def test_defaults_load_without_a_file() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.data.global_batch == 0  # unset: micro_batch x data-parallel size, derived
    assert cfg.data.micro_batch == 8
    assert cfg.parallel.dp_shard == -1
    assert cfg.optim.decay == "cosine"
    assert cfg.checkpoint.async_ is False
    assert cfg.resolved_run_dir() == Path("runs/meshrun")


def test_a_toml_file_loads(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[job]\nname = "exp1"\n\n[data]\nglobal_batch = 64\n\n'
        '[optim]\nlr = 1\ndecay = "linear"\n\n[checkpoint]\nasync = true\n',
    )
    cfg = load_config(path)
    assert cfg.job.name == "exp1"
    assert cfg.data.global_batch == 64
    assert cfg.optim.lr == 1.0
    assert isinstance(cfg.optim.lr, float)  # a TOML integer in a float field becomes a float
    assert cfg.optim.decay == "linear"
    assert cfg.checkpoint.async_ is True
    assert cfg.data.micro_batch == 8  # keys the file does not name keep their defaults
    assert cfg.resolved_run_dir() == Path("runs/exp1")


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[data]\nglobal_batch = 64\nmicro_batch = 4\n")
    cfg = load_config(path, [("data.global_batch", "128"), ("optim.lr", "0.5")])
    assert cfg.data.global_batch == 128
    assert cfg.data.micro_batch == 4  # from the file, not overridden
    assert cfg.optim.lr == 0.5


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="meshrun config init") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_invalid_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[data\nglobal_batch = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_a_top_level_value_instead_of_a_table_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "lr = 0.1\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table") as info:
        load_config(path)
    assert "'lr'" in str(info.value)


# --- split_overrides -------------------------------------------------------------------


def test_split_overrides_keeps_the_scripts_own_arguments() -> None:
    argv = ["--data.global_batch=64", "--lr", "3", "data.txt", "--optim.lr", "0.1", "--flag"]
    overrides, rest = split_overrides(argv)
    assert overrides == [("data.global_batch", "64"), ("optim.lr", "0.1")]
    assert rest == ["--lr", "3", "data.txt", "--flag"]


def test_split_overrides_takes_a_negative_value_in_the_space_form() -> None:
    overrides, rest = split_overrides(["--parallel.dp_shard", "-1", "x"])
    assert overrides == [("parallel.dp_shard", "-1")]
    assert rest == ["x"]


def test_split_overrides_keeps_an_equals_sign_inside_the_value() -> None:
    overrides, _ = split_overrides(["--job.name=a=b"])
    assert overrides == [("job.name", "a=b")]


def test_split_overrides_without_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"--optim\.lr=VALUE"):
        split_overrides(["x", "--optim.lr"])


# --- errors name the key, the value and what is allowed --------------------------------


def test_unknown_section_is_an_error_with_a_suggestion() -> None:
    message = _error([("optimm.lr", "0.1")])
    assert "'optimm'" in message
    assert "Did you mean 'optim'?" in message
    assert "job, parallel, data, optim, checkpoint, metrics, monitor, launch" in message


def test_unknown_key_is_an_error_with_a_suggestion() -> None:
    message = _error([("data.global_bach", "64")])
    assert "'data.global_bach'" in message
    assert "Did you mean 'global_batch'?" in message
    assert "global_batch, micro_batch, num_workers, shuffle" in message  # the allowed keys
    assert message.startswith("command line:")


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[data]\nbogus = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:")
    assert "'data.bogus'" in message


def test_a_key_without_a_section_is_an_error() -> None:
    message = _error([("a.b.c", "1")])
    assert "'a.b.c'" in message
    assert "section.key" in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("data.micro_batch", "abc", "an integer"),
        ("data.micro_batch", "4.0", "an integer"),
        ("optim.lr", "fast", "a number"),
        ("data.shuffle", "maybe", "true or false"),
    ],
)
def test_a_wrong_type_on_the_command_line_is_an_error(key: str, value: str, allowed: str) -> None:
    message = _error([(key, value)])
    assert key in message
    assert repr(value) in message
    assert "wrong type" in message
    assert f"expected {allowed}" in message


@pytest.mark.parametrize(
    ("line", "key", "shown", "allowed"),
    [
        ('micro_batch = "8"', "data.micro_batch", "'8'", "an integer"),
        ("micro_batch = true", "data.micro_batch", "True", "an integer"),  # bool is not an int
        ('shuffle = "yes"', "data.shuffle", "'yes'", "true or false"),
    ],
)
def test_a_wrong_type_in_a_file_is_an_error(
    tmp_path: Path, line: str, key: str, shown: str, allowed: str
) -> None:
    path = _write(tmp_path, f"[data]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert key in message
    assert shown in message
    assert f"expected {allowed}" in message


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("data.micro_batch", "0", ">= 1"),
        ("parallel.zero", "4", "<= 3"),
        ("parallel.dp_shard", "-2", ">= -1"),
        ("optim.min_lr_ratio", "1.5", "<= 1"),
        ("job.timeout_s", "0.5", ">= 1"),
    ],
)
def test_an_out_of_range_value_is_an_error(key: str, value: str, bound: str) -> None:
    message = _error([(key, value)])
    assert key in message
    assert value in message
    assert "out of range" in message
    assert f"must be {bound}" in message


def test_a_value_on_the_range_bound_is_allowed() -> None:
    cfg = load_config(None, [("data.micro_batch", "1"), ("optim.min_lr_ratio", "1")])
    assert cfg.data.micro_batch == 1
    assert cfg.optim.min_lr_ratio == 1.0


def test_a_bad_literal_choice_is_an_error_listing_the_choices() -> None:
    message = _error([("optim.decay", "step")])
    assert "optim.decay" in message
    assert "'step'" in message
    assert "one of 'cosine', 'linear', 'constant'" in message


def test_text_booleans_are_accepted() -> None:
    cfg = load_config(None, [("data.shuffle", "off"), ("metrics.jsonl", "No")])
    assert cfg.data.shuffle is False
    assert cfg.metrics.jsonl is False
    assert load_config(None, [("data.shuffle", "on")]).data.shuffle is True


# --- checkpoint.async ------------------------------------------------------------------


def test_checkpoint_async_key_maps_to_the_async_field() -> None:
    cfg = load_config(None, [("checkpoint.async", "true")])
    assert cfg.checkpoint.async_ is True
    assert "async = true" in to_toml(cfg).splitlines()


def test_the_python_field_name_is_not_a_config_key() -> None:
    message = _error([("checkpoint.async_", "true")])
    assert "Did you mean 'async'?" in message


# --- resolve_mesh_dims -------------------------------------------------------------------


def test_dp_shard_minus_one_takes_the_rest_of_the_world() -> None:
    assert resolve_mesh_dims(ParallelConfig(), 8) == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 8,
        "tp": 1,
    }
    dims = resolve_mesh_dims(ParallelConfig(dp_replicate=2, tp=2), 8)
    assert dims["dp_shard"] == 2


def test_an_explicit_dp_shard_that_fits_is_kept() -> None:
    assert resolve_mesh_dims(ParallelConfig(dp_shard=4, dp_replicate=2), 8)["dp_shard"] == 4


def test_a_mesh_product_other_than_the_world_is_an_error_naming_the_dims() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_mesh_dims(ParallelConfig(dp_shard=3), 2)
    message = str(info.value)
    assert "pp=1 x dp_replicate=1 x dp_shard=3 x tp=1 = 3" in message
    assert "world size is 2" in message
    assert "parallel.dp_shard=-1" in message


def test_fixed_degrees_that_do_not_divide_the_world_are_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_mesh_dims(ParallelConfig(tp=3), 8)
    message = str(info.value)
    assert "dp_replicate x tp x pp = 1 x 3 x 1 = 3" in message
    assert "world size 8" in message


def test_dp_shard_zero_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.dp_shard = 0"):
        resolve_mesh_dims(ParallelConfig(dp_shard=0), 2)


# --- grad_accumulation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_batch", "micro_batch", "dp", "expected"),
    [(32, 8, 4, 1), (32, 4, 2, 4), (64, 2, 1, 32), (48, 3, 4, 4)],
)
def test_grad_accumulation_is_global_over_micro_times_dp(
    global_batch: int, micro_batch: int, dp: int, expected: int
) -> None:
    data = DataConfig(global_batch=global_batch, micro_batch=micro_batch)
    assert grad_accumulation(data, dp) == expected


def test_grad_accumulation_that_does_not_divide_names_global_batch() -> None:
    with pytest.raises(ConfigError) as info:
        grad_accumulation(DataConfig(global_batch=30, micro_batch=4), 2)
    message = str(info.value)
    assert "data.global_batch = 30" in message
    assert "4 x 2 = 8" in message
    assert "micro_batch in [1, 3, 5, 15]" in message  # the micro batches that would work


def test_grad_accumulation_with_no_fitting_micro_batch_suggests_a_global_batch() -> None:
    with pytest.raises(ConfigError, match="a global_batch that is a multiple of 2"):
        grad_accumulation(DataConfig(global_batch=7, micro_batch=1), 2)


# --- validate_for_world ----------------------------------------------------------------


def test_validate_for_world_returns_the_dims() -> None:
    dims = validate_for_world(Config(), 4)
    assert dims == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}


def test_validate_for_world_accepts_pp_with_zero1() -> None:
    cfg = load_config(None, [("parallel.pp", "2"), ("parallel.zero", "1")])  # pp x ZeRO-1
    assert validate_for_world(cfg, 4) == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1}


def test_validate_for_world_checks_the_batch_arithmetic() -> None:
    cfg = load_config(None, [("data.global_batch", "30"), ("data.micro_batch", "4")])
    with pytest.raises(ConfigError, match=r"data\.global_batch = 30"):
        validate_for_world(cfg, 2)


def test_validate_for_world_checks_the_mesh() -> None:
    cfg = load_config(None, [("parallel.dp_shard", "3")])
    with pytest.raises(ConfigError, match="dp_shard=3"):
        validate_for_world(cfg, 2)


# --- to_toml and digest ------------------------------------------------------------------


def _changed_config() -> Config:
    cfg = Config()
    apply_overrides(
        cfg,
        [
            ("job.run_dir", 'naïve "quoted" \\ dir'),  # a path takes any text: quoted
            ("job.timeout_s", "90"),
            ("parallel.dp_shard", "4"),
            ("data.shuffle", "false"),
            ("optim.lr", "1e-5"),
            ("optim.decay", "linear"),
            ("optim.min_lr_ratio", "0"),
            ("checkpoint.async", "true"),
            ("launch.nnodes", "1:4"),
        ],
    )
    return cfg


def test_to_toml_round_trips_through_load_config(tmp_path: Path) -> None:
    cfg = _changed_config()
    assert cfg != Config()  # the round trip has something to lose
    path = _write(tmp_path, to_toml(cfg))
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    assert loaded.to_dict()["checkpoint"]["async"] is True


def test_to_toml_with_comments_also_loads(tmp_path: Path) -> None:
    cfg = _changed_config()
    text = to_toml(cfg, comments=True)
    assert "# Batch sizes and the loader." in text
    assert "# Samples per forward/backward on one rank." in text
    loaded = load_config(_write(tmp_path, text))
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()


def test_digest_changes_when_a_value_changes() -> None:
    base = Config().digest()
    assert len(base) == 16
    int(base, 16)  # hexadecimal
    assert Config().digest() == base  # stable for equal configs
    changed = load_config(None, [("optim.lr", "0.001")])
    assert changed.digest() != base
    other = load_config(None, [("checkpoint.async", "true")])
    assert other.digest() not in (base, changed.digest())
