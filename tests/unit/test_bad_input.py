"""Bad input on every entry point gets one line and a non-zero exit: the command, the key or
flag, the value, what is allowed and the fix, with no traceback. Each row is a value that once
ended in a traceback, was accepted, or was answered vaguely; the CLI runs in-process (no
launch: every row is refused before a process would be spawned)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import meshrun
from meshrun.cli.main import main
from meshrun.config import Config, ConfigError, ConfigWarning, JobConfig, ParallelConfig

_MOE_PLAN = [
    *[
        "--layers",
        "4",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "128",
        "--seq",
        "32",
        "--ffn",
        "128",
    ],
    *["--experts", "8", "--top-k", "2", "--expert-ffn", "32", "--global-batch", "8"],
]

# Each row: the arguments (``{tmp}`` is the test's directory, holding the files made below)
# and the words the one error line must hold: the flag or key, and the value.
ROWS: list[tuple[str, list[str], list[str]]] = [
    ("non-UTF-8 TOML", ["config", "show", "{tmp}/latin1.toml"], ["latin1.toml", "UTF-8"]),
    ("--config DIR", ["config", "show", "{tmp}"], ["is a directory", "meshrun.toml"]),
    ("run_dir a file", ["config", "show", "--job.run_dir={tmp}/afile"], ["job.run_dir", "afile"]),
    ("run_dir under a file", ["config", "show", "--job.run_dir={tmp}/afile/x"], ["job.run_dir"]),
    ("job.name newline", ["config", "show", "--job.name=a\nb"], ["job.name", "'a\\nb'"]),
    ("job.name ../", ["config", "show", "--job.name=../x"], ["job.name", "'../x'"]),
    ("world size 0", ["config", "show", "--world-size", "0"], ["--world-size 0", ">= 1"]),
    (
        "a DDP hook under FSDP2",
        ["config", "show", "--parallel.zero=2", "--parallel.ddp_comm_hook=fp16"],
        ["parallel.ddp_comm_hook = 'fp16'", "parallel.zero = 2", "reduce_dtype"],
    ),
    ("plan --params nan", ["plan", "--params", "nan"], ["--params nan", "finite"]),
    ("plan --params inf", ["plan", "--params", "inf"], ["--params inf", "finite"]),
    ("plan --layers 0", ["plan", "--layers", "0"], ["--layers 0", ">= 1"]),
    *(
        (f"plan {name}", ["plan", *_MOE_PLAN, *flags], words)
        for name, flags, words in (
            ("--moe-routing typo", ["--moe-routing", "even"], ["--moe-routing 'even'", "dropless"]),
            ("dropless alone", ["--moe-routing", "dropless"], ["dropless", "--moe-imbalance F"]),
            (
                "--moe-imbalance 0.8",
                ["--moe-routing", "dropless", "--moe-imbalance", "0.8"],
                ["--moe-imbalance 0.8", ">= 1.0"],
            ),
            (
                "imbalance, balanced",
                ["--moe-imbalance", "1.2"],
                ["--moe-imbalance 1.2", "dropless"],
            ),
            (
                "--moe-capacity-factor 0",
                ["--moe-routing", "capacity", "--moe-capacity-factor", "0"],
                ["--moe-capacity-factor 0", "> 0"],
            ),
            ("capacity alone", ["--moe-routing", "capacity"], ["--moe-capacity-factor C"]),
            (
                "capacity, dropless",
                [
                    "--moe-routing",
                    "dropless",
                    "--moe-imbalance",
                    "1.2",
                    "--moe-capacity-factor",
                    "1",
                ],
                ["--moe-capacity-factor 1", "--moe-routing capacity"],
            ),
        )
    ),
    (
        "plan routing, dense model",
        ["plan", "--params", "7e9", "--moe-routing", "dropless", "--moe-imbalance", "1.2"],
        ["--moe-routing dropless", "needs an MoE model"],
    ),
    (
        "plan --emit-config DIR",
        ["plan", "--params", "7e9", "--emit-config", "{tmp}"],
        ["--emit-config", "is a directory"],
    ),
    ("data --out a file", ["data", "prepare", "--out", "{tmp}/afile", "{tmp}/corpus"], ["--out"]),
    (
        "data hf tokenizer missing",
        [
            "data",
            "prepare",
            "--out",
            "{tmp}/o",
            "--tokenizer",
            "hf:{tmp}/no/tokenizer.json",
            "{tmp}/corpus",
        ],
        ["--tokenizer hf:", "cannot be loaded"],
    ),
    (
        "data binary input",
        ["data", "prepare", "--out", "{tmp}/o", "{tmp}/bin"],
        ["binary", "random.bin"],
    ),
    ("ckpt list missing", ["ckpt", "list", "{tmp}/nosuchdir"], ["nosuchdir", "does not exist"]),
    (
        "slurm --cpus-per-task 0",
        ["slurm", "submit", "--dry-run", "--cpus-per-task", "0", "{tmp}/train.py"],
        ["--cpus-per-task 0", ">= 1"],
    ),
    (
        "slurm --gpus-per-node -1",
        ["slurm", "submit", "--dry-run", "--gpus-per-node", "-1", "{tmp}/train.py"],
        ["--gpus-per-node -1", ">= 0"],
    ),
    (
        "launch --replica-groups 0",
        ["launch", "--replica-groups", "0", "{tmp}/train.py"],
        ["--replica-groups 0"],
    ),
    (
        "non-UTF-8 hostfile",
        ["launch", "--hostfile", "{tmp}/hosts", "{tmp}/train.py"],
        ["--hostfile", "UTF-8"],
    ),
]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    (tmp_path / "latin1.toml").write_bytes(b'[job]\nname = "caf\xe9"\n')
    (tmp_path / "hosts").write_bytes(b"n\xe9ud1 slots=2\n")
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "train.py").write_text("print('never run')\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "random.bin").write_bytes(bytes(range(256)) * 64)
    return tmp_path


@pytest.mark.parametrize(("case", "argv", "words"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line(
    case: str,
    argv: list[str],
    words: list[str],
    inputs: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(inputs)
    code = main([a.replace("{tmp}", str(inputs)) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in (err + out).splitlines() if ": error:" in line]
    assert code != 0, f"{case}: accepted (exit 0)\n{out}{err}"
    assert len(lines) == 1 and lines[0].startswith("meshrun "), f"{case}: {err}{out}"
    assert "Traceback" not in err + out
    for word in words:
        assert word.replace("{tmp}", str(inputs)) in lines[0], f"{case}: {word!r} not in {lines[0]}"
    assert not (inputs / "o").exists() or (
        case == "data binary input" and not any((inputs / "o").glob("shard_*"))
    )


CODE_ROWS: list[tuple[str, Callable[[], object], str]] = [
    ("init(123)", lambda: meshrun.init(123, argv=[]), r"meshrun.init\(config=123\)"),  # type: ignore[arg-type]
    ("JobConfig name", lambda: JobConfig(name="a/b"), r"job.name = 'a/b'"),
    (
        "hook in code",
        lambda: Config(parallel=ParallelConfig(zero=3, ddp_comm_hook="powersgd")),
        r"parallel.ddp_comm_hook = 'powersgd'",
    ),
]


@pytest.mark.parametrize(("case", "make", "match"), CODE_ROWS, ids=[r[0] for r in CODE_ROWS])
def test_bad_values_in_code(case: str, make: Callable[[], object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_a_warmup_beyond_the_run_is_said(tmp_path: Path) -> None:
    """A warmup longer than the run is a printed warning (short runs of a longer config, the
    demo's --steps, keep their schedule), checked once the file and the overrides are in."""
    from meshrun.config import load_config

    path = tmp_path / "c.toml"
    path.write_text("[optim]\nwarmup_steps = 200\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(path, [("optim.steps", "1000")]).optim.warmup_steps == 200
    with pytest.warns(ConfigWarning, match=r"optim.warmup_steps = 200 exceeds optim.steps = 100"):
        load_config(path)


def test_the_meshrun_program_prints_a_config_warning_as_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not Python's file:line plus meshrun's own source line: one line naming the keys."""
    from meshrun.cli.main import _one_line_config_warning

    others: list[str] = []
    show = _one_line_config_warning(lambda message, *args: others.append(str(message)))
    show(ConfigWarning("optim.warmup_steps = 9 exceeds optim.steps = 3"), ConfigWarning, "f", 1)
    show(UserWarning("a library's"), UserWarning, "f", 1)
    err = capsys.readouterr().err
    assert err == "meshrun: warning: optim.warmup_steps = 9 exceeds optim.steps = 3\n"
    assert others == ["a library's"]
