"""``meshrun k8s render``: the manifests pass the validators users' clusters trust, and a broken
manifest fails them.

No cluster here, so the checks are offline validators from PyPI (requirements-dev.txt):
``kubernetes-validate`` (the Kubernetes OpenAPI schemas, strict: unknown fields are errors) for
the core objects and every pod template, wrapped in a ``batch/v1`` Job; and the Kubeflow
training SDK's generated models for the PyTorchJob, read through the SDK's own ``ApiClient``
deserialisation and written back: a field the model does not know, or a value of the wrong
type, does not survive the round trip (or raises). The JobSet CRD has no PyPI validator: its
envelope is checked against a small schema written here from the CRD's field names, and its
Job template by ``kubernetes-validate``. The Trainer v2 TrainJob, whose CRD schema is checked in,
is tested in test_k8s_trainjob.py.
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
from kubeflow.training import ApiClient

from meshrun.cli.main import build_parser, main
from meshrun.config import ConfigError
from meshrun.launch.k8s.render import K8sJob, check_job, render, render_jobset, render_pytorchjob
from meshrun.launch.k8s.yamlout import dump_documents

pytestmark = pytest.mark.timeout(60)

K8S_VERSION = "1.33.0"
Doc = dict[str, Any]


# --- the validators --------------------------------------------------------------------------


class SdkRejected(Exception):
    """The Kubeflow SDK's models do not read the manifest back as written."""


def check_core(doc: Doc) -> None:
    """A core Kubernetes object against the OpenAPI schema, unknown fields rejected."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def as_batch_job(pod_template: Doc, **job_spec: Any) -> Doc:
    """A pod template inside a ``batch/v1`` Job, the nearest core object that holds one."""
    spec = {**job_spec, "template": pod_template}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "t"}, "spec": spec}


class _Response:
    """What ``ApiClient.deserialize`` reads: a response whose ``data`` is the JSON body."""

    def __init__(self, doc: Doc) -> None:
        self.data = json.dumps(doc)


def check_pytorchjob(doc: Doc) -> None:
    """The PyTorchJob through the Kubeflow SDK's models (strictly), its pods through k8s."""
    client = ApiClient()
    try:
        model = client.deserialize(_Response(doc), "KubeflowOrgV1PyTorchJob")
    except (ValueError, TypeError) as err:  # a wrong type or a missing required field
        raise SdkRejected(f"KubeflowOrgV1PyTorchJob: {err}") from err
    where = first_difference(doc, client.sanitize_for_serialization(model))
    if where is not None:
        raise SdkRejected(f"KubeflowOrgV1PyTorchJob does not keep {where} as written")
    for replica in doc["spec"]["pytorchReplicaSpecs"].values():
        check_core(as_batch_job(replica["template"]))


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}"
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        diffs = (
            first_difference(x, y, f"{path}[{i}]")
            for i, (x, y) in enumerate(zip(a, b, strict=True))
        )
        return next((d for d in diffs if d), None)
    same = a == b and type(a) is type(b)
    return None if same else f"{path} ({a!r} read back as {b!r})"


# The JobSet fields meshrun writes, from the jobset.x-k8s.io/v1alpha2 CRD; any other field at
# these levels is an error, as the API server's structural schema would drop or reject it.
def _obj(props: Doc, required: tuple[str, ...] = ()) -> Doc:
    return {
        "type": "object",
        "properties": props,
        "required": list(required),
        "additionalProperties": False,
    }


_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
JOBSET_ENVELOPE = _obj(
    {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},
        "spec": _obj(
            {
                "network": _obj(
                    {
                        "enableDNSHostnames": _BOOL,
                        "publishNotReadyAddresses": _BOOL,
                        "subdomain": _STR,
                    }
                ),
                "failurePolicy": _obj({"maxRestarts": _INT}),
                "replicatedJobs": {
                    "type": "array",
                    "items": _obj(
                        {
                            "name": _STR,
                            "replicas": _INT,
                            "template": _obj({"spec": {"type": "object"}}),
                        },
                        ("name", "template"),
                    ),
                },
            }
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)


def check_jobset(doc: Doc) -> None:
    jsonschema.validate(doc, JOBSET_ENVELOPE)
    for replicated in doc["spec"]["replicatedJobs"]:
        check_core({**as_batch_job({}), "spec": replicated["template"]["spec"]})


# --- fixtures --------------------------------------------------------------------------------

CONFIG = '[data]\nglobal_batch = 96\nmicro_batch = 2\n\n[job]\nrun_dir = "runs/k8s"  # "quoted"\n'


def gpu_job(**changes: Any) -> K8sJob:
    fields: Doc = {
        "name": "gpt",
        "image": "ghcr.io/acme/train:1.0",
        "script": "train.py",
        "script_args": ["--epochs", "3", "--optim.lr=1e-3"],
        "nodes": "3",
        "gpus_per_node": 8,
        "env": {"NCCL_DEBUG": "INFO", "FLAG": "yes"},
        "config_text": CONFIG,
    }
    return K8sJob(**{**fields, **changes})


def by_kind(docs: list[Doc]) -> dict[str, Doc]:
    return {doc["kind"]: doc for doc in docs}


def container(pod: Doc) -> Doc:
    (only,) = pod["spec"]["containers"]
    return only


def shm_volume(pod: Doc) -> Doc:
    mounts = {m["mountPath"]: m["name"] for m in container(pod)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return volumes[mounts["/dev/shm"]]


# --- rendered manifests pass -----------------------------------------------------------------


def test_pytorchjob_passes_kubeflow_sdk_and_kubernetes_validate() -> None:
    docs = by_kind(render(gpu_job(), "pytorchjob"))
    assert list(docs) == ["ConfigMap", "PyTorchJob"]
    check_core(docs["ConfigMap"])
    job = docs["PyTorchJob"]
    check_pytorchjob(job)

    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"  # a string in kubeflow.org/v1 ("auto", "gpu" or a count)
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 2}
    pod = replicas["Worker"]["template"]
    box = container(pod)
    assert box["image"] == "ghcr.io/acme/train:1.0"
    assert box["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert {"name": "FLAG", "value": "yes"} in box["env"]
    assert shm_volume(pod)["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert pod["spec"]["restartPolicy"] == replicas["Worker"]["restartPolicy"] == "OnFailure"
    command = box["command"]
    assert command[:2] == ["meshrun", "launch"]
    assert _flag(command, "--node-rank") == "$(RANK)"
    assert _flag(command, "--rdzv-endpoint") == "$(MASTER_ADDR):$(MASTER_PORT)"
    assert _flag(command, "--config") == "/etc/meshrun/config.toml"
    assert command[-4:] == ["train.py", "--epochs", "3", "--optim.lr=1e-3"]


def test_elastic_pytorchjob_has_an_elastic_policy_and_workers_only() -> None:
    job = render_pytorchjob(gpu_job(nodes="2:4", config_text=None, restart_policy="ExitCode"))
    check_pytorchjob(job)
    spec = job["spec"]
    assert spec["elasticPolicy"] == {
        "minReplicas": 2,
        "maxReplicas": 4,
        "rdzvBackend": "c10d",
        "rdzvId": "gpt",
        "rdzvPort": 29500,
        "maxRestarts": 3,
    }
    (worker,) = spec["pytorchReplicaSpecs"].values()
    assert list(spec["pytorchReplicaSpecs"]) == ["Worker"] and worker["replicas"] == 4
    # ExitCode is the operator's policy; the pods themselves run with Never.
    assert worker["restartPolicy"] == "ExitCode"
    assert worker["template"]["spec"]["restartPolicy"] == "Never"
    box = container(worker["template"])
    assert _flag(box["command"], "--nnodes") == "2:4"
    assert _flag(box["command"], "--rdzv-endpoint") == "$(PET_RDZV_ENDPOINT)"
    rank = next(e for e in box["env"] if e["name"] == "MESHRUN_NODE_RANK")
    path = rank["valueFrom"]["fieldRef"]["fieldPath"]
    assert path == "metadata.labels['training.kubeflow.org/replica-index']"


def test_jobset_and_headless_service_pass() -> None:
    docs = by_kind(render(gpu_job(nodes="2", gpus_per_node=0, nproc_per_node=2), "jobset"))
    assert list(docs) == ["ConfigMap", "Service", "JobSet"]
    service, jobset = docs["Service"], docs["JobSet"]
    check_core(docs["ConfigMap"])
    check_core(service)
    check_jobset(jobset)

    # The Service is the JobSet's subdomain and selects its pods: pod 0's DNS name resolves.
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["name"] == jobset["spec"]["network"]["subdomain"] == "gpt"
    assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "gpt"}
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job_spec = replicated["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"]) == (2, 2)
    assert job_spec["completionMode"] == "Indexed"
    box = container(job_spec["template"])
    assert "resources" not in box  # no GPUs asked for, no nvidia.com/gpu limit
    assert _flag(box["command"], "--node-rank") == "$(JOB_COMPLETION_INDEX)"
    pod0 = f"gpt-{replicated['name']}-0-0"  # <jobset>-<replicatedJob>-<job index>-<pod index>
    assert _flag(box["command"], "--rdzv-endpoint") == f"{pod0}.gpt:29500"
    assert shm_volume(job_spec["template"])["emptyDir"]["medium"] == "Memory"


def test_rendered_commands_are_accepted_by_meshrun_launch() -> None:
    """The pods' command line parses with this version's `meshrun launch` flags."""
    values = {"$(RANK)": "1", "$(JOB_COMPLETION_INDEX)": "1", "$(MESHRUN_NODE_RANK)": "1"}
    values |= {"$(MASTER_ADDR):$(MASTER_PORT)": "gpt-master-0:29500"}
    values |= {"$(PET_RDZV_ENDPOINT)": "gpt-worker-0:29500"}
    pods = [
        render_pytorchjob(gpu_job())["spec"]["pytorchReplicaSpecs"]["Master"]["template"],
        render_pytorchjob(gpu_job(nodes="2:3"))["spec"]["pytorchReplicaSpecs"]["Worker"][
            "template"
        ],
        render_jobset(gpu_job())["spec"]["replicatedJobs"][0]["template"]["spec"]["template"],
    ]
    for pod in pods:
        argv = [values.get(arg, arg) for arg in container(pod)["command"]]
        assert not any("$(" in arg for arg in argv), argv
        a = build_parser().parse_args(argv[1:])
        assert a.command == "launch" and a.node_rank == 1 and a.nproc_per_node == 8
        assert a.rdzv_id == "gpt" and a.max_restarts == 3 and a.config == "/etc/meshrun/config.toml"
        assert (a.target, a.args) == ("train.py", ["--epochs", "3", "--optim.lr=1e-3"])


def test_module_target_and_no_config() -> None:
    job = render_pytorchjob(
        gpu_job(script=None, module="meshrun.demo", config_text=None, nodes="1")
    )
    check_pytorchjob(job)
    (only,) = job["spec"]["pytorchReplicaSpecs"].values()
    command = container(only["template"])["command"]
    assert "--config" not in command
    assert command[-5:-3] == ["-m", "meshrun.demo"]


# --- broken manifests fail -------------------------------------------------------------------


def _set(doc: Doc, path: str, value: Any, rename: str | None = None) -> Doc:
    """A deep copy of ``doc`` with ``a.b.0.c`` set to ``value`` (or its key renamed)."""
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


POD = "spec.pytorchReplicaSpecs.Worker.template.spec"
BROKEN_PYTORCHJOB = {
    "misspelled spec field": ("spec.pytorchReplicaSpecs", None, "pytorchReplicaSpec"),
    "replicas not a number": ("spec.pytorchReplicaSpecs.Worker.replicas", "two", None),
    "replicas as a string": ("spec.pytorchReplicaSpecs.Worker.replicas", "2", None),
    "nprocPerNode as an int": ("spec.nprocPerNode", 8, None),
    "misspelled container field": (f"{POD}.containers.0.image", None, "imagee"),
    "wrong type in the pod": (f"{POD}.containers.0.ports.0.containerPort", "http", None),
    "misspelled emptyDir field": (f"{POD}.volumes.0.emptyDir.sizeLimit", None, "sizelimit"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_PYTORCHJOB))
def test_broken_pytorchjob_fails(case: str) -> None:
    good = render_pytorchjob(gpu_job())
    check_pytorchjob(good)  # so that the failure below is the breakage's
    # The SDK's models catch each of them themselves (they run before kubernetes-validate).
    with pytest.raises(SdkRejected):
        check_pytorchjob(_set(good, *BROKEN_PYTORCHJOB[case]))


def test_kubeflow_sdk_rejects_a_misspelled_elastic_policy_field() -> None:
    good = render_pytorchjob(gpu_job(nodes="2:4"))
    broken = _set(good, "spec.elasticPolicy.minReplicas", None, "minReplica")
    with pytest.raises(SdkRejected, match="minReplica"):
        check_pytorchjob(broken)


def test_broken_core_objects_fail_kubernetes_validate() -> None:
    docs = by_kind(render(gpu_job(), "jobset"))
    service, jobset = docs["Service"], docs["JobSet"]
    pod_job = {**as_batch_job({}), "spec": jobset["spec"]["replicatedJobs"][0]["template"]["spec"]}
    check_core(service)
    check_core(pod_job)
    breakages = [
        _set(service, "spec.clusterIP", None, "clusterIp"),
        _set(service, "spec.ports.0.port", "rdzv"),
        _set(pod_job, "spec.parallelism", "two"),
        _set(pod_job, "spec.template.spec.containers.0.volumeMounts", None, "volumeMount"),
        _set(docs["ConfigMap"], "data", None, "dat"),
    ]
    for broken in breakages:
        with pytest.raises(kubernetes_validate.ValidationError):
            check_core(broken)


def test_broken_jobset_envelope_fails() -> None:
    jobset = render_jobset(gpu_job())
    check_jobset(jobset)
    for broken in [
        _set(jobset, "spec.replicatedJobs", None, "replicatedJob"),
        _set(jobset, "spec.failurePolicy.maxRestarts", "3"),
        _set(jobset, "spec.network.subdomain", None, "subDomain"),
    ]:
        with pytest.raises(jsonschema.ValidationError):
            check_jobset(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        check_jobset(_set(jobset, "spec.replicatedJobs.0.template.spec.completions", "two"))


# --- the YAML text ---------------------------------------------------------------------------


def test_written_yaml_reads_back_as_rendered() -> None:
    for kind, nodes in [("pytorchjob", "3"), ("pytorchjob", "2:4"), ("jobset", "2:3")]:
        docs = render(gpu_job(nodes=nodes), kind)
        text = dump_documents(docs, "a header\nwith two lines")
        assert text.startswith("# a header\n# with two lines\n")
        assert list(yaml.safe_load_all(text)) == docs


AMBIGUOUS = ["yes", "No", "on", "1", "0x10", "1.5", "1e3", "null", "~", "", "a: b", "#x", "- x"]
AMBIGUOUS += ["@x", "*x", "&x", "!x", "'q'", '"q"', "  lead", "tab\tx", "ünï", "$(RANK)", "a,b"]
TEXTS = ["one\ntwo\n", "one\ntwo", "trailing  \nspace\n", "x\n\n", "\nfirst empty", "a\n\nb\n"]


@pytest.mark.parametrize("value", AMBIGUOUS + TEXTS)
def test_yaml_writer_keeps_every_string_a_string(value: str) -> None:
    doc = {"k": value, "list": [value, {"x": value, "y": [1, True]}], value or "e": 1}
    assert yaml.safe_load(dump_documents([doc])) == doc


# --- input errors ----------------------------------------------------------------------------

BAD_INPUTS = [
    ({"name": "My_Job"}, "--name 'My_Job'"),
    ({"name": "9lives"}, "--name '9lives'"),
    ({"name": "n" * 60}, "--name"),
    ({"namespace": "Prod"}, "--namespace 'Prod'"),
    ({"nodes": "0"}, "--nodes '0'"),
    ({"nodes": "4:2"}, "MIN 4 is larger than MAX 2"),
    ({"nodes": "two"}, "--nodes 'two'"),
    ({"nodes": "1:2:3"}, "--nodes '1:2:3'"),
    ({"env": {"MESHRUN_NODE_RANK": "0"}}, "meshrun sets this variable itself"),
    ({"image": ""}, "--image"),
    ({"shm_size": "16GB"}, "--shm-size '16GB'"),
    ({"shm_size": "0"}, "--shm-size"),
    ({"env": {"1BAD": "x"}}, "--env '1BAD'"),
    ({"nproc_per_node": 16}, "--nproc-per-node 16 is larger than --gpus-per-node 8"),
    ({"gpus_per_node": -1}, "--gpus-per-node -1"),
    ({"max_restarts": -1}, "--max-restarts -1"),
    ({"port": 70000}, "--port 70000"),
    ({"restart_policy": "Sometimes"}, "--restart-policy 'Sometimes'"),
    ({"restart_policy": "Always"}, "not allowed for a jobset: choose one of OnFailure, Never"),
    ({"script": None}, "needs a script"),
]


@pytest.mark.parametrize(("changes", "message"), BAD_INPUTS)
def test_bad_inputs_are_errors_naming_the_flag(changes: Doc, message: str) -> None:
    with pytest.raises(ConfigError, match=_escaped(message)):
        check_job(gpu_job(**changes))


def _escaped(text: str) -> str:
    return re.escape(text)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- the command line ------------------------------------------------------------------------


def test_cli_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "train.toml"
    config.write_text(CONFIG)
    out = tmp_path / "k8s"
    argv = ["k8s", "render", "--image", "img:1", "--nodes", "2:4", "--gpus-per-node", "4"]
    argv += ["--name", "llm", "--env", "A=1", "--config", str(config), "--output", str(out)]
    assert main([*argv, "train.py", "--steps", "10"]) == 0
    captured = capsys.readouterr()
    assert "JobSet has no elastic scaling" in captured.err  # said aloud, not silently
    names = ["jobset.yaml", "llm-job-secret.yaml", "pytorchjob.yaml"]  # the secret's: see
    assert sorted(p.name for p in out.iterdir()) == names  # tests/unit/test_k8s_secret.py
    pytorchjob = by_kind(list(yaml.safe_load_all((out / "pytorchjob.yaml").read_text())))
    check_pytorchjob(pytorchjob["PyTorchJob"])
    assert pytorchjob["ConfigMap"]["data"]["config.toml"] == CONFIG
    text = (out / "jobset.yaml").read_text()
    assert "64 MB default breaks NCCL and DataLoader workers" in text
    check_jobset(by_kind(list(yaml.safe_load_all(text)))["JobSet"])


def test_cli_rejects_a_bad_config_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "train.toml"
    config.write_text("[data]\nglobal_batch = 64\nmicro_batch = 3\n")
    out = tmp_path / "k8s"
    argv = ["k8s", "render", "--image", "img:1", "--nodes", "2", "--nproc-per-node", "4"]
    assert main([*argv, "--config", str(config), "--output", str(out), "train.py"]) == 2
    err = capsys.readouterr().err
    assert "data.global_batch = 64" in err and "with 2 nodes x 4 = 8 processes" in err
    assert not out.exists()
    # An override among the script's arguments is checked the same way.
    assert main([*argv, "train.py", "--optim.lrr=1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err


def test_cli_prints_to_stdout_and_rejects_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["k8s", "render", "--image", "img:1", "--kind", "jobset", "-m", "meshrun.demo"]
    assert main(argv) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["Service", "JobSet"]
    assert main([*argv[:-2], "--restart-policy", "Always", "train.py"]) == 2
    assert "--restart-policy 'Always' is not allowed for a jobset" in capsys.readouterr().err
