"""What users type reaches the generated files as values, never as code: an sbatch script's
#SBATCH lines refuse what sbatch cannot quote and its shell lines quote the rest (run here with
bash, ``srun`` a stand-in that records its argv); Kubernetes manifests escape ``$`` for the
kubelet in every kind; a hostfile host cannot be an ssh option."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshrun.cli.main import main
from meshrun.launch.hostfile.hosts import HostfileError, parse_hostfile_text
from meshrun.launch.k8s.render import KINDS, K8sJob, render
from meshrun.launch.k8s.yamlout import dump_documents
from meshrun.launch.slurm.job import SlurmError
from meshrun.launch.slurm.submit import SubmitSpec, render_sbatch

NASTY = [
    "$(touch PWNED)",
    "pay $$5 to $(HOME)",
    "`touch PWNED2`",
    "a\nb; touch PWNED3",
    'it\'s "q" $HOME \\ #x',
]


# --- sbatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "char"),
    [
        ("--partition", "gpu\n#!/bin/sh", "'\\n'"),
        ("--account", "a;b", "';'"),
        ("--job-name", "x y", "' '"),
        ("--output", "/tmp/o\necho hi", "'\\n'"),
        ("--output", "/tmp/a #b", "' '"),
    ],
)
def test_sbatch_header_values_are_refused_naming_the_flag_and_character(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, char: str
) -> None:
    argv = ["slurm", "submit", "--dry-run", flag, value, "-m", "meshrun.demo"]
    assert main([*argv, f"--job.run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value!r}: {char} cannot go into an #SBATCH line" in err, err
    assert not (tmp_path / "run").exists()


def test_sbatch_working_directory_with_a_newline_is_refused() -> None:
    with pytest.raises(SlurmError, match=r"the working directory '/w\\nx': '\\n'"):
        render_sbatch(SubmitSpec(target="t.py", workdir="/w\nx"))


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", ["meshrun", "srun"])
def test_sbatch_script_passes_arguments_and_config_through_as_typed(
    tmp_path: Path, launcher: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    _fake(
        bin_dir,
        "srun",
        f'exec python3 -c \'import json,sys; json.dump(sys.argv[1:], open("{record}", "w"))\' "$@"',
    )
    spec = SubmitSpec(
        target="/opt/t.py",
        script_args=NASTY,
        sets=["job.name=x'; touch PWNED4; '"],
        output_dir=str(tmp_path / "out"),
        workdir=str(tmp_path),
        python="/venv/py",
        launcher=launcher,
        config_toml='[job]\nname = "$(touch PWNED5)"\n',
        config_path=str(tmp_path / "cfg" / "config.toml"),
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    r = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())
    assert argv[-len(NASTY) :] == NASTY
    assert list(tmp_path.glob("PWNED*")) == []
    if launcher == "meshrun":
        assert argv[argv.index("--set") + 1] == "job.name=x'; touch PWNED4; '"
    else:
        assert (tmp_path / "cfg" / "config.toml").read_text() == spec.config_toml


# --- Kubernetes -------------------------------------------------------------------------------


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command, arg or env value (Kubernetes'
    third_party/forked/golang/expansion): ``$(VAR)`` becomes VAR's value (an unknown one stays
    as written), ``$$`` becomes ``$``, any other ``$`` stays."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


def _containers(tree: Any) -> list[dict[str, Any]]:
    if isinstance(tree, dict):
        found = [tree] if "command" in tree and "image" in tree else []
        return found + [c for v in tree.values() for c in _containers(v)]
    if isinstance(tree, list):
        return [c for v in tree for c in _containers(v)]
    return []


@pytest.mark.parametrize("kind", KINDS)
def test_k8s_manifests_escape_dollar_in_args_and_env_for_every_kind(kind: str) -> None:
    job = K8sJob(
        name="demo",
        image="img:1",
        script="/app/train.py",
        script_args=NASTY,
        nodes="2",
        env={"NOTE": "$(HOME) and $$ and $"},
    )
    docs = list(yaml.safe_load_all(dump_documents(render(job, kind))))
    containers = _containers(docs)
    assert containers, docs
    env = {"HOME": "/root", "PET_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "1", "RANK": "1"}
    for c in containers:
        pod_env = {**env, **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
        argv = [kubelet_expand(a, pod_env) for a in c["command"]]
        assert argv[-len(NASTY) :] == NASTY  # what the user typed, as typed
        assert "/app/train.py" in argv
        rank = argv[argv.index("--node-rank") + 1] if "--node-rank" in argv else "1"
        assert rank == "1"  # meshrun's own $(VAR) is still the kubelet's to expand
        note = [e["value"] for e in c.get("env", []) if e["name"] == "NOTE"]
        assert [kubelet_expand(v, env) for v in note] == ["$(HOME) and $$ and $"]


def test_kubelet_expand_follows_kubernetes() -> None:
    env = {"A": "x"}
    cases = {"$(A)": "x", "$$(A)": "$(A)", "$$$(A)": "$x", "$(B)": "$(B)", "a$": "a$", "$b": "$b"}
    assert {k: kubelet_expand(k, env) for k in cases} == cases


# --- hostfile ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("-V", "'-V' is not a host (a host or user starting with '-' would be an option to ssh)"),
        ("-oProxyCommand=sh", "would be an option to ssh"),
        ("me@-oProxyCommand=sh", "would be an option to ssh"),
        ("node1\x1b[2J slots=2", "holds control characters"),
        ("node\x00x", "holds control characters"),
    ],
)
def test_hostfile_hosts_that_ssh_would_read_as_options_are_refused(
    line: str, expected: str
) -> None:
    text = f"good\n{line}\n"
    with pytest.raises(HostfileError, match=re.escape("hosts:2: ") + ".*" + re.escape(expected)):
        parse_hostfile_text(text, "hosts")


def test_hostfile_ordinary_hosts_still_parse() -> None:
    hosts = parse_hostfile_text("a-1.example\tslots=2\nuser_x@10.0.0.2:2222\nn-3")
    assert [(h.host, h.user, h.port, h.slots) for h in hosts] == [
        ("a-1.example", None, None, 2),
        ("10.0.0.2", "user_x", 2222, None),
        ("n-3", None, None, None),
    ]
