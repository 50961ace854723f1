"""SLURM without SLURM: the topology derived from environment dicts, the checks against the
allocation, and the sbatch script ``meshrun slurm submit`` renders (tests/e2e/test_slurm.py
runs both under a real SLURM)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.config import LaunchConfig
from meshrun.launch.slurm.job import (
    SlurmError,
    apply_to_launch,
    derive,
    given_from,
    in_allocation,
    tasks_per_node,
)
from meshrun.launch.slurm.submit import (
    SubmitSpec,
    check_direct_config,
    render_sbatch,
    time_limit_seconds,
)
from meshrun.launch.spec import LaunchKeys
from meshrun.runtime.launcher_env import slurm_port

pytestmark = pytest.mark.timeout(30)

# One task of `srun --ntasks-per-node=1` on the second node of a 2-node job with 4 GPUs each.
STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_GPUS_ON_NODE": "4",
}


def _hosts(nodelist: str) -> list[str]:
    assert nodelist == "gpu[07-08]"
    return ["gpu07", "gpu08"]


def test_two_node_step_derives_everything_from_slurm() -> None:
    t = derive(STEP, LaunchKeys(), hostnames=_hosts)
    assert (t.nnodes, t.node_rank, t.nproc_per_node) == ("2", 1, 4)
    assert t.master_addr == "gpu07"
    assert t.rdzv_endpoint == f"gpu07:{slurm_port('4242')}"
    assert t.rdzv_id == "slurm-4242"
    assert t.notes == []
    line = t.line()
    assert "nnodes 2 (SLURM_STEP_NUM_NODES=2)" in line
    assert "node_rank 1 (SLURM_NODEID=1)" in line
    assert "nproc_per_node 4 (SLURM_GPUS_ON_NODE=4)" in line
    assert "master gpu07 (first of SLURM_STEP_NODELIST=gpu[07-08] by scontrol" in line


def test_processes_from_cuda_visible_devices_then_the_cpu_default() -> None:
    env = {k: v for k, v in STEP.items() if k != "SLURM_GPUS_ON_NODE"}
    t = derive({**env, "CUDA_VISIBLE_DEVICES": "0,1"}, LaunchKeys(), hostnames=_hosts)
    assert t.nproc_per_node == 2 and "CUDA_VISIBLE_DEVICES=0,1" in t.line()
    t = derive(env, LaunchKeys(), cpu_default=3, hostnames=_hosts)
    assert t.nproc_per_node == 3 and "no GPUs: CPU default" in t.line()


def test_explicit_flags_win_and_disagreements_are_said() -> None:
    given = LaunchKeys(nnodes="3", nproc_per_node=2, rdzv_endpoint="login:1234", rdzv_id="mine")
    t = derive(STEP, given, hostnames=_hosts)
    assert (t.nnodes, t.nproc_per_node, t.rdzv_endpoint, t.rdzv_id) == (
        "3",
        2,
        "login:1234",
        "mine",
    )
    notes = "\n".join(t.notes)
    assert "--nnodes 3 given; SLURM says 2: using --nnodes" in notes
    assert "--nproc-per-node 2 given; SLURM gives 4 GPUs" in notes
    assert "--rdzv-endpoint login:1234 given" in notes


def test_nnodes_is_compared_with_slurm_as_a_node_range() -> None:
    t = derive(STEP, LaunchKeys(nnodes="2:2"), hostnames=_hosts)  # SLURM's 2, spelled MIN:MAX
    assert t.nnodes == "2:2" and not any("--nnodes" in n for n in t.notes), t.notes
    assert given_from(LaunchKeys(), LaunchConfig(nnodes="1:1")).nnodes is None  # the default
    assert given_from(LaunchKeys(), LaunchConfig(nnodes="1:2")).nnodes == "1:2"


def test_one_node_keeps_the_loopback_rendezvous() -> None:
    env = {**STEP, "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "a1"}
    t = derive(env, LaunchKeys(), hostnames=lambda spec: [spec])
    assert (t.nnodes, t.node_rank, t.master_addr, t.rdzv_endpoint) == ("1", 0, "a1", "")


def test_without_scontrol_meshrun_expands_the_hostlist_and_says_so() -> None:
    def missing(spec: str) -> list[str]:
        raise FileNotFoundError("scontrol")

    t = derive(STEP, LaunchKeys(), hostnames=missing)
    assert t.master_addr == "gpu07"
    assert "meshrun's hostlist parser (FileNotFoundError)" in t.line()


@pytest.mark.parametrize(
    ("change", "given", "expected"),
    [
        # Several tasks per node: each would run its own meshrun launch.
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, LaunchKeys(), "SLURM_STEP_TASKS_PER_NODE=2(x2)"),
        ({"SLURM_STEP_TASKS_PER_NODE": "1,4"}, LaunchKeys(), "srun --ntasks-per-node=1"),
        # The batch script of a multi-node job: only the first node would start.
        ({"SLURM_STEP_ID": None}, LaunchKeys(), "SLURM_STEP_ID is not set"),
        # More processes than GPUs, or than CPUs.
        ({}, LaunchKeys(nproc_per_node=8), "SLURM_GPUS_ON_NODE=4"),
        ({"SLURM_CPUS_ON_NODE": "2"}, LaunchKeys(), "--cpus-per-task=4"),
        ({"SLURM_NODEID": "x"}, LaunchKeys(), "SLURM_NODEID"),
        (
            {"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
            LaunchKeys(),
            "--rdzv-endpoint",
        ),
    ],
)
def test_allocation_mismatches_are_errors_naming_the_variable(
    change: dict[str, str | None], given: LaunchKeys, expected: str
) -> None:
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(SlurmError, match=re.escape(expected)):
        derive(env, given, hostnames=_hosts)


def test_batch_script_of_a_one_node_job_is_fine() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"}
    env["SLURM_TASKS_PER_NODE"] = "4"  # the job's tasks: irrelevant to the batch shell
    t = derive(env, LaunchKeys(), cpu_default=2, hostnames=lambda spec: [spec])
    assert (t.nnodes, t.node_rank, t.nproc_per_node, t.master_addr) == ("1", 0, 2, "n1")


def test_in_allocation() -> None:
    assert in_allocation({"SLURM_JOB_ID": "1"})
    assert not in_allocation({})
    assert not in_allocation({"SLURM_JOB_ID": "1", "TORCHELASTIC_RUN_ID": "x"})  # a worker
    assert not in_allocation({"SLURM_JOB_ID": "1", "MESHRUN_SLURM": "0"})


def test_tasks_per_node_format() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("1") == [1]
    with pytest.raises(SlurmError, match="cannot read"):
        tasks_per_node("two")


def test_apply_to_launch_fills_only_what_nothing_set(capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    saved = signal.getsignal(signal.SIGUSR1)
    env = {k: v for k, v in STEP.items() if k not in ("SLURM_GPUS_ON_NODE",)}
    cfg = LaunchConfig(rdzv_id="from-config")  # a non-default config value counts as explicit
    try:
        given = given_from(LaunchKeys(), cfg)  # no flag given
        filled = apply_to_launch(given, {**env, "SLURM_STEP_NODELIST": "gpu07,gpu08"})
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # the launcher survives
    finally:
        signal.signal(signal.SIGUSR1, saved)
    assert (filled.nnodes, filled.node_rank, filled.rdzv_id) == ("2", 1, None)
    assert filled.rdzv_endpoint is not None and filled.rdzv_endpoint.startswith("gpu07:")
    assert filled.nproc_per_node is not None and filled.nproc_per_node >= 1
    assert "meshrun launch: SLURM job 4242: nnodes 2" in capsys.readouterr().err
    untouched = apply_to_launch(
        given_from(LaunchKeys(), LaunchConfig()), {}
    )  # outside SLURM: nothing
    assert untouched == LaunchKeys()


# --- sbatch rendering -------------------------------------------------------------------


def _spec(**kw: object) -> SubmitSpec:
    base: dict[str, object] = dict(
        target="train.py",
        script_args=["--lr", "3e-4", "--note=a b"],
        output_dir="/runs/x/slurm",
        workdir="/work",
        python="/venv/bin/python",
    )
    return SubmitSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_sbatch_script_runs_one_launch_per_node() -> None:
    text = render_sbatch(
        _spec(
            nodes=4,
            nproc_per_node=8,
            gpus_per_node=8,
            cpus_per_task=64,
            partition="gpu",
            time="1-00:00:00",
            account="proj",
            requeue=True,
            signal_before_s=300,
        )
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --output=/runs/x/slurm/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --chdir=/work",
    ):
        assert line in text.splitlines(), line
    assert "--output=/runs/x/slurm/%x-%j-node%n.out" in text  # one file per node
    launch = "/venv/bin/python -m meshrun launch --nproc-per-node 8 train.py --lr 3e-4 '--note=a b'"
    assert launch in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert 'kill -USR1 "$WORKERS_PID"' in text


def test_sbatch_defaults_and_module_target() -> None:
    text = render_sbatch(_spec(target="meshrun.demo", module=True, script_args=[]))
    assert "#SBATCH --no-requeue" in text and "scontrol requeue" not in text
    assert "#SBATCH --cpus-per-task=2" in text and "--gpus-per-node" not in text
    assert "--partition" not in text and "--time" not in text
    assert "launch --nproc-per-node 2 -m meshrun.demo &" in text


def test_sbatch_script_is_valid_bash(tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(render_sbatch(_spec(requeue=True)))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr


TOML = '[job]\nname = "x"\n'


def _direct(launcher: str, **kw: object) -> SubmitSpec:
    return _spec(launcher=launcher, config_toml=TOML, config_path="/runs/x/slurm/config.toml", **kw)


def test_sbatch_under_mpirun_starts_every_worker_itself() -> None:
    text = render_sbatch(_direct("mpirun", nodes=2, nproc_per_node=4, cpus_per_task=8))
    lines = text.splitlines()
    assert "#SBATCH --ntasks-per-node=4" in lines and "#SBATCH --cpus-per-task=2" in lines
    assert "mpirun -np 8 --map-by ppr:4:node --bind-to none \\" in lines
    assert "    /venv/bin/python train.py --lr 3e-4 '--note=a b' &" in lines
    assert "meshrun launch" not in text and "srun" not in text
    # The resolved config reaches every rank as one file, as under meshrun launch.
    assert (
        f"cat > /runs/x/slurm/config.toml <<'MESHRUN_CONFIG_TOML'\n{TOML}MESHRUN_CONFIG_TOML"
        in text
    )
    assert "export MESHRUN_CONFIG=/runs/x/slurm/config.toml" in lines
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"' in lines
    assert 'kill -USR1 "$WORKERS_PID"' in text  # mpirun passes USR1 on to its processes


def test_sbatch_under_srun_runs_one_task_per_process() -> None:
    text = render_sbatch(_direct("srun", target="meshrun.demo", module=True, script_args=[]))
    assert "srun --mpi=pmix --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=1" in text
    assert "--output=/runs/x/slurm/%x-%j-node%n.out" in text
    assert "    /venv/bin/python -m meshrun.demo &" in text.splitlines()
    assert "#SBATCH --ntasks-per-node=2" in text and "meshrun launch" not in text


@pytest.mark.parametrize("launcher", ["meshrun", "mpirun", "srun"])
def test_every_launchers_script_is_valid_bash(tmp_path: Path, launcher: str) -> None:
    path = tmp_path / "job.sbatch"
    spec = _spec(requeue=True) if launcher == "meshrun" else _direct(launcher, requeue=True)
    path.write_text(render_sbatch(spec))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr


def test_direct_launchers_refuse_what_only_torchruns_agent_does() -> None:
    with pytest.raises(SlurmError, match=r"--cpus-per-task 3 with --launcher mpirun: .* multiple"):
        render_sbatch(_direct("mpirun", cpus_per_task=3))
    with pytest.raises(SlurmError, match=r"--launcher 'ompi' is not one of meshrun, mpirun, srun"):
        render_sbatch(_spec(launcher="ompi"))
    with pytest.raises(SlurmError, match=r"launch.max_restarts = 2 with --launcher srun"):
        check_direct_config("srun", max_restarts=2, replica_groups=1)
    with pytest.raises(SlurmError, match=r"replica_groups = 2 with --launcher mpirun: .*meshrun"):
        check_direct_config("mpirun", max_restarts=0, replica_groups=2)
    check_direct_config("meshrun", max_restarts=2, replica_groups=2)  # torchrun's agent does both


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("5:30", 330),
        ("2:00:00", 7200),
        ("1-12", 129600),
        ("1-00:30", 88200),
        ("0-00:00:45", 45),
        ("UNLIMITED", None),
    ],
)
def test_time_formats(text: str, seconds: int | None) -> None:
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"nodes": 0}, "--nodes 0 is not allowed: must be >= 1"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0"),
        ({"time": "2h"}, "--time '2h' is not a SLURM time"),
        ({"time": "1:00", "signal_before_s": 120}, "--signal-before 120 s is not before"),
        ({"signal_before_s": 70000}, "0 (off) to 65535"),
        ({"gpus_per_node": 4, "nproc_per_node": 8}, "exceeds --gpus-per-node 4"),
        ({"job_name": "a b"}, "--job-name"),
    ],
)
def test_bad_submit_flags_are_errors(kw: dict[str, object], expected: str) -> None:
    with pytest.raises(SlurmError, match=re.escape(expected)):
        render_sbatch(_spec(**kw))


# --- the CLI (no sbatch needed: --dry-run, and errors before anything is written) ---------


def test_cli_dry_run_prints_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "slurm",
            "submit",
            "--dry-run",
            "--nodes",
            "2",
            "--time",
            "30",
            "-m",
            "meshrun.demo",
            "--steps",
            "5",
            f"--job.run_dir={tmp_path}/run",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out.out
    assert f"--output={tmp_path}/run/slurm/meshrun-run-%j-node%n.out" not in out.out
    assert f"--output={tmp_path}/run/slurm/%x-%j-node%n.out" in out.out
    assert "#SBATCH --job-name=meshrun-run" in out.out
    assert f"{sys.executable} -m meshrun launch --nproc-per-node 2 -m meshrun.demo" in out.out
    assert "warning" not in out.err  # interval = 0: the signal still saves (on_signal)
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_cli_dry_run_under_mpirun_carries_the_resolved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["slurm", "submit", "--dry-run", "--launcher", "mpirun", "--set", "optim.steps=7"]
    argv += ["--set", "optim.warmup_steps=3"]  # the demo's 10-step warmup would outlast 7 steps
    assert main([*argv, "-m", "meshrun.demo", f"--job.run_dir={tmp_path}/run"]) == 0
    out = capsys.readouterr().out
    assert f"export MESHRUN_CONFIG={tmp_path}/run/slurm/config.toml" in out
    assert re.search(r"\[optim\][^[]*\nsteps = 7\n", out)  # --set, resolved at submit
    assert "mpirun -np 2 " in out and "--set optim" not in out
    assert not (tmp_path / "run").exists()  # the script writes the config when it runs
    run = f"--job.run_dir={tmp_path}/run"
    refused = [*argv[:5], "--set", "launch.max_restarts=1", "-m", "meshrun.demo", run]
    assert main(refused) == 2
    assert "launch.max_restarts = 1 with --launcher mpirun" in capsys.readouterr().err


def test_cli_rejects_bad_flags_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = f"--job.run_dir={tmp_path}/run"
    assert main(["slurm", "submit", "--time", "90 min", "-m", "meshrun.demo", run]) == 2
    assert "--time '90 min' is not a SLURM time" in capsys.readouterr().err
    assert main(["slurm", "submit", "--nodes", "0", "-m", "meshrun.demo", run]) == 2
    assert "--nodes 0 is not allowed" in capsys.readouterr().err
    assert main(["slurm", "submit", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # The job's config is validated for its world size (2 nodes x 3 processes) here.
    bad = ["slurm", "submit", "--nodes", "2", "--nproc-per-node", "3", "-m", "meshrun.demo", run]
    assert main(bad) == 2
    assert "global_batch" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
