"""``meshrun k8s render`` and the job secret: every pod of every kind reads
``MESHRUN_JOB_SECRET`` from one Kubernetes Secret (never a literal in the manifest); with
``--output`` the Secret is written next to the manifests (mode 600, a fresh key, kept when
rendered again) and passes the Kubernetes schema; its key is never printed."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from meshrun.cli.main import main
from meshrun.config import ConfigError
from meshrun.launch.k8s.render import KINDS, K8sJob, check_job, render
from meshrun.launch.trust.secret import resolve
from meshrun.runtime.secret import SECRET_ENV

pytestmark = pytest.mark.timeout(60)

Doc = dict[str, Any]
K8S_VERSION = "1.33.0"
RENDER = ["k8s", "render", "--image", "img:1", "--nodes", "2", "--name", "gpt"]


def job(**changes: Any) -> K8sJob:
    return K8sJob(
        **{
            "name": "gpt",
            "image": "img:1",
            "script": "train.py",
            "nodes": "2",
            "env": {"A": "1"},
            **changes,
        }
    )


def containers(doc: Any) -> list[Doc]:
    """Every container (or TrainJob trainer) in a rendered document, wherever it sits."""
    found: list[Doc] = []
    if isinstance(doc, dict):
        if "image" in doc and "command" in doc:
            found.append(doc)
        for value in doc.values():
            found += containers(value)
    elif isinstance(doc, list):
        for value in doc:
            found += containers(value)
    return found


def secret_env(box: Doc) -> Doc:
    (entry,) = [e for e in box["env"] if e["name"] == SECRET_ENV]
    return entry


@pytest.mark.parametrize("kind", KINDS)
def test_every_pod_reads_the_secret_from_one_kubernetes_secret(kind: str) -> None:
    for secret_name, expected in (("", "gpt-job-secret"), ("team-key", "team-key")):
        docs = render(
            job(secret_name=secret_name, nodes="2" if kind == "trainjob" else "2:3"), kind
        )
        boxes = [box for doc in docs for box in containers(doc)]
        assert boxes, kind
        for box in boxes:
            entry = secret_env(box)
            assert entry == {
                "name": SECRET_ENV,
                "valueFrom": {"secretKeyRef": {"name": expected, "key": "secret"}},
            }
            assert {"name": "A", "value": "1"} in box["env"]  # --env kept beside it
        assert "Secret" not in [d["kind"] for d in docs]  # the manifests hold no key


def test_output_writes_a_private_secret_that_passes_and_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k8s"
    assert main([*RENDER, "--kind", "jobset", "--output", str(out), "train.py"]) == 0
    printed = capsys.readouterr()
    path = out / "gpt-job-secret.yaml"
    assert f"wrote {path}, the job secret (mode 600)" in printed.out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (secret,) = yaml.safe_load_all(path.read_text())
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert secret["metadata"]["name"] == "gpt-job-secret"
    assert secret["metadata"]["namespace"] == "default"
    key = secret["stringData"]["secret"]
    assert len(key) == 64 and int(key, 16) >= 0
    # What a pod gets from it is a secret meshrun launch accepts.
    assert resolve(str(tmp_path), {SECRET_ENV: key}, create=False).key == key.encode()
    # The key is in that file only: not printed, not in the job's manifest.
    jobset = (out / "jobset.yaml").read_text()
    assert key not in printed.out + printed.err + jobset
    (pod,) = [b for d in yaml.safe_load_all(jobset) for b in containers(d)]
    ref = secret_env(pod)["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("gpt-job-secret", "secret")
    assert "Secret 'gpt-job-secret'" in jobset  # its header says so

    # Rendering again must not change the key under pods already running.
    assert main([*RENDER, "--kind", "jobset", "--output", str(out), "train.py"]) == 0
    assert "kept (from an earlier render)" in capsys.readouterr().out
    (again,) = yaml.safe_load_all(path.read_text())
    assert again["stringData"]["secret"] == key


def test_a_named_secret_is_the_users_and_stdout_never_holds_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k8s"
    argv = [*RENDER, "--kind", "pytorchjob", "--secret-name", "team-key"]
    assert main([*argv, "--output", str(out), "train.py"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["pytorchjob.yaml"]  # not overwritten
    assert "Secret 'team-key'" in capsys.readouterr().err
    assert main([*RENDER, "train.py"]) == 0
    printed = capsys.readouterr()
    kinds = [d["kind"] for d in yaml.safe_load_all(printed.out)]
    assert "Secret" not in kinds and "stringData" not in printed.out
    assert "Secret 'gpt-job-secret'" in printed.err and "--output DIR" in printed.err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"env": {SECRET_ENV: "x" * 64}}, f"--env {SECRET_ENV}: every pod reads it from"),
        ({"secret_name": "Team_Key"}, "--secret-name 'Team_Key' is not allowed"),
        ({"secret_name": "a" * 254}, "at most 253 characters"),
    ],
)
def test_bad_secret_inputs_are_errors_naming_the_flag(changes: Doc, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_job(job(**changes))
