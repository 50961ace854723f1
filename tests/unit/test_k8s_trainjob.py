"""``meshrun k8s render --kind trainjob``: the TrainJob passes Kubeflow Trainer v2's own CRD
schema, its pods (the runtime's template with meshrun's patch applied) pass the Kubernetes
OpenAPI schema, and a broken TrainJob fails; ``--nnodes`` is ``--nodes``, and every error names
the spelling typed.

No cluster here: ``fixtures/trainer-v2.3.0-trainjob-schema.json`` is the ``openAPIV3Schema`` of
the TrainJob CRD of kubeflow/trainer v2.3.0 (the release of the ``kubeflow-trainer-api`` 2.3.0
models on PyPI), and ``fixtures/trainer-v2.3.0-torch-distributed.yaml`` its ``torch-distributed``
ClusterTrainingRuntime; ``fixtures/trainer-v2.3.0-README.md`` says where each came from. The
schema is read with jsonschema the way ``kubectl apply`` (strict field validation, kubectl's
default) has the API server read it: a field the schema does not name is an error.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from meshrun.cli.main import build_parser, launch_request, main
from meshrun.config import ConfigError
from meshrun.launch.front.command import env_defaults
from meshrun.launch.front.torchrun import rendezvous
from meshrun.launch.k8s.render import K8sJob, check_job, render
from meshrun.launch.k8s.trainjob import PET_VARIABLES, render_trainjob

pytestmark = pytest.mark.timeout(60)

FIXTURES = Path(__file__).parent / "fixtures"
K8S_VERSION = "1.33.0"
Doc = dict[str, Any]


# --- the validators --------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: every object that lists its properties and
    neither allows more (``additionalProperties``) nor keeps unknown ones
    (``x-kubernetes-preserve-unknown-fields``) takes no other field."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


CRD_SCHEMA = json.loads((FIXTURES / "trainer-v2.3.0-trainjob-schema.json").read_text())
TRAINJOB_SCHEMA = strict(CRD_SCHEMA)
# Built once: jsonschema.validate checks the 140 kB schema against its metaschema every call.
VALIDATOR = jsonschema.Draft202012Validator(TRAINJOB_SCHEMA)
RUNTIME = yaml.safe_load((FIXTURES / "trainer-v2.3.0-torch-distributed.yaml").read_text())
# The CRD's CEL rules on the whole object (x-kubernetes-validations at the root), which
# jsonschema does not run: checked by hand below, and pinned so a new fixture is noticed.
ROOT_RULES = [
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "size(self.metadata.name) <= 63",
]


def check_trainjob_schema(doc: Doc) -> None:
    VALIDATOR.validate(doc)
    name = doc["metadata"]["name"]
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
        raise jsonschema.ValidationError(f"metadata.name {name!r} fails the CRD's CEL rules")


def runtime_pod(trainjob: Doc, runtime: Doc = RUNTIME) -> Doc:
    """The trainer pod the controller makes: the runtime's ``node`` pod template, with the
    TrainJob's trainer fields and runtime patch applied and the torch plugin's PET_* env (a
    reduced copy of what the Trainer does, enough for the Kubernetes schema to check it)."""
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = copy.deepcopy(replicated["template"]["spec"]["template"])
    (box,) = pod["spec"]["containers"]
    trainer = trainjob["spec"]["trainer"]
    box |= {"image": trainer["image"], "command": trainer["command"]}
    box["env"] = trainer.get("env", []) + [{"name": n, "value": "1"} for n in PET_VARIABLES]
    if "resourcesPerNode" in trainer:
        box["resources"] = trainer["resourcesPerNode"]
    (patch,) = trainjob["spec"]["runtimePatches"]
    (patched,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert patched["name"] == replicated["name"]  # the patch targets a job the runtime has
    pod_patch = patched["template"]["spec"]["template"]
    pod["spec"]["volumes"] = pod_patch["spec"]["volumes"]
    (box_patch,) = pod_patch["spec"]["containers"]
    assert box_patch["name"] == box["name"]  # ... and a container it has
    box["volumeMounts"] = box_patch["volumeMounts"]
    pod["metadata"] = {"labels": {**replicated["template"]["metadata"]["labels"]}}
    pod["metadata"]["labels"] |= pod_patch["metadata"]["labels"]
    pod["spec"]["restartPolicy"] = "OnFailure"  # JobSet's default for its Jobs' pods
    return pod


def check_pod(pod: Doc) -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"}}
    kubernetes_validate.validate({**job, "spec": {"template": pod}}, K8S_VERSION, strict=True)


CONFIG = "[data]\nglobal_batch = 96\nmicro_batch = 2\n"


def gpu_job(**changes: Any) -> K8sJob:
    fields: Doc = {
        "name": "gpt",
        "image": "ghcr.io/acme/train:1.0",
        "script": "train.py",
        "script_args": ["--epochs", "3", "--optim.lr=1e-3"],
        "nodes": "3",
        "gpus_per_node": 8,
        "env": {"NCCL_DEBUG": "INFO"},
        "config_text": CONFIG,
    }
    return K8sJob(**{**fields, **changes})


# --- rendered TrainJobs pass -----------------------------------------------------------------


def test_the_fixture_is_the_crd_schema_it_says() -> None:
    jsonschema.Draft202012Validator.check_schema(TRAINJOB_SCHEMA)
    assert [r["rule"] for r in CRD_SCHEMA["x-kubernetes-validations"]] == ROOT_RULES
    trainer = CRD_SCHEMA["properties"]["spec"]["properties"]["trainer"]["properties"]
    assert trainer["numProcPerNode"] == {"format": "int32", "type": "integer"}
    assert RUNTIME["kind"] == "ClusterTrainingRuntime"
    assert RUNTIME["metadata"]["name"] == "torch-distributed"
    assert "torch" in RUNTIME["spec"]["mlPolicy"]  # the plugin that sets PET_*


def test_trainjob_passes_the_crd_schema_and_its_pod_the_kubernetes_schema() -> None:
    docs = render(gpu_job(), "trainjob")
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"]
    kubernetes_validate.validate(docs[0], K8S_VERSION, strict=True)
    job = docs[1]
    check_trainjob_schema(job)
    check_pod(runtime_pod(job))

    spec = job["spec"]
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert spec["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 8)  # int32 in v1alpha1
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    secret = {"secretKeyRef": {"name": "gpt-job-secret", "key": "secret"}}
    assert trainer["env"] == [
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "MESHRUN_JOB_SECRET", "valueFrom": secret},
    ]
    command = trainer["command"]
    assert command[:2] == ["meshrun", "launch"]
    assert _flag(command, "--rdzv-backend") == "c10d"
    assert _flag(command, "--rdzv-endpoint") == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    for topology in ("--nnodes", "--nproc-per-node", "--node-rank"):  # from PET_*
        assert topology not in command
    assert command[-4:] == ["train.py", "--epochs", "3", "--optim.lr=1e-3"]
    pod = runtime_pod(job)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes[mounts["/etc/meshrun"]]["configMap"] == {"name": "gpt-config"}


def test_cpu_trainjob_without_config_or_env() -> None:
    job = render_trainjob(gpu_job(gpus_per_node=0, nproc_per_node=2, config_text=None, env={}))
    check_trainjob_schema(job)
    check_pod(runtime_pod(job))
    trainer = job["spec"]["trainer"]
    assert "resourcesPerNode" not in trainer
    assert [e["name"] for e in trainer["env"]] == ["MESHRUN_JOB_SECRET"]  # only the secret
    assert trainer["numProcPerNode"] == 2
    (patch,) = job["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]
    assert [v["name"] for v in pod["spec"]["template"]["spec"]["volumes"]] == ["dshm"]


def test_the_trainjob_command_is_meshrun_launchs_with_the_pet_variables() -> None:
    """In the pod: the kubelet expands $(PET_...), meshrun launch reads the rest of PET_*."""
    job = render_trainjob(gpu_job())
    env = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2"}
    env |= {"PET_MASTER_ADDR": "gpt-node-0-0.gpt", "PET_MASTER_PORT": "29500"}
    argv = [kubelet_expand(arg, env) for arg in job["spec"]["trainer"]["command"]]
    a, notes = env_defaults(launch_request(build_parser().parse_args(argv[1:])).torchrun, env)
    assert (a.nnodes, a.nproc_per_node, a.node_rank) == ("3", 8, 2)
    assert a.rdzv_endpoint == "gpt-node-0-0.gpt:29500" and a.rdzv_id == "gpt"
    assert "--nnodes 3 from PET_NNODES (torchrun's environment default)" in notes
    backend, _ = rendezvous(a, [])
    assert backend == "c10d"  # the endpoint wins over torchrun's static reading of PET_MASTER_*


def kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of a container's command ($$ is a literal $)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        arg,
    )


# --- broken TrainJobs fail -------------------------------------------------------------------

PATCHED_POD = "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0.template"
PATCHED_POD += ".spec.template.spec"
BROKEN = {
    "misspelled spec field": ("spec.runtimeRef", None, "runtimeref"),
    "numNodes as a string": ("spec.trainer.numNodes", "3", None),
    "numProcPerNode as auto": ("spec.trainer.numProcPerNode", "auto", None),  # v1alpha1: int32
    "misspelled trainer field": ("spec.trainer.command", None, "commands"),
    "runtimeRef without a name": ("spec.runtimeRef.name", None, "nam"),
    "patch without a manager": ("spec.runtimePatches.0.manager", None, "owner"),
    "misspelled emptyDir field": (f"{PATCHED_POD}.volumes.0.emptyDir.sizeLimit", None, "limit"),
    "an image in a container patch": (f"{PATCHED_POD}.containers.0.image", "img", None),
    "env value not a string": ("spec.trainer.env.0.value", 1, None),
    "a name too long": ("metadata.name", "n" * 64, None),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_trainjob_fails_the_crd_schema(case: str) -> None:
    good = render_trainjob(gpu_job())
    check_trainjob_schema(good)  # so that the failure below is the breakage's
    with pytest.raises(jsonschema.ValidationError):
        check_trainjob_schema(_set(good, *BROKEN[case]))


def _set(doc: Doc, path: str, value: Any, rename: str | None = None) -> Doc:
    broken = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = broken
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if rename:
        node[rename] = node.pop(last)
    else:
        node[last] = value
    return broken


def test_a_patch_for_a_container_the_runtime_lacks_fails() -> None:
    job = render_trainjob(gpu_job())
    broken = _set(job, f"{PATCHED_POD}.containers.0.name", "pytorch")
    with pytest.raises(AssertionError):
        runtime_pod(broken)


# --- input errors ----------------------------------------------------------------------------

BAD_INPUTS = [
    ({"nodes": "2:4"}, "--nodes '2:4' is not allowed for a trainjob: a TrainJob has a fixed"),
    ({"nodes": "2:4", "nodes_flag": "--nnodes"}, "--nnodes '2:4' is not allowed for a trainjob"),
    ({"port": 29501}, "--port 29501 is not allowed for a trainjob"),
    ({"restart_policy": "Never"}, "--restart-policy 'Never' is not allowed for a trainjob"),
    ({"env": {"PET_NNODES": "2"}}, "--env PET_NNODES: the TrainJob's torch runtime sets"),
    ({"runtime": "Torch_Runtime"}, "--runtime 'Torch_Runtime' is not allowed"),
    ({"name": "n" * 56}, "the trainjob pod hostname"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_INPUTS)
def test_what_a_trainjob_cannot_express_is_an_error_naming_the_flag(
    changes: Doc, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_job(gpu_job(**changes), ("trainjob",))


def test_runtime_is_refused_for_the_other_kinds() -> None:
    with pytest.raises(ConfigError, match="--runtime 'mine' applies to a TrainJob only"):
        check_job(gpu_job(runtime="mine"), ("jobset",))


@pytest.mark.parametrize("flag", ["--nodes", "--nnodes"])
def test_node_count_errors_name_the_spelling_typed(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for value, message in [("0", "a job needs at least 1 node"), ("x", "expected N or MIN")]:
        argv = ["k8s", "render", flag, value, "--image", "img:1", "train.py"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {value!r} is not allowed: {message}" in err


def test_nnodes_is_nodes_and_an_unknown_flag_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k8s"
    argv = ["k8s", "render", "--nnodes", "2", "--image", "img:1", "--kind", "trainjob"]
    assert main([*argv, "--output", str(out), "train.py", "--steps", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    (trainjob,) = [d for d in yaml.safe_load_all((out / "trainjob.yaml").read_text())]
    check_trainjob_schema(trainjob)
    assert trainjob["spec"]["trainer"]["numNodes"] == 2
    assert trainjob["spec"]["trainer"]["command"][-3:] == ["train.py", "--steps", "3"]
    # A flag render does not know, before the script, is named as typed; it used to hide
    # behind "the following arguments are required: --image".
    with pytest.raises(SystemExit):
        main(["k8s", "render", "--nnodez", "2", "--image", "img:1", "train.py"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --nnodez" in err and "--image" not in err
    assert main(["k8s", "render", "train.py"]) == 2
    assert "needs --image IMAGE" in capsys.readouterr().err


def test_other_node_counts_take_nnodes_too(capsys: pytest.CaptureFixture[str]) -> None:
    slurm = build_parser().parse_args(["slurm", "submit", "--nnodes", "3", "x.py"])
    assert (slurm.nodes, slurm.nodes_flag) == (3, "--nnodes")
    plan = build_parser().parse_args(["plan", "--nnodes", "4"])
    assert plan.nodes == 4
    assert main(["slurm", "submit", "--nnodes", "0", "--dry-run", __file__]) == 2
    assert "error: --nnodes 0 is not allowed: must be >= 1" in capsys.readouterr().err


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]
