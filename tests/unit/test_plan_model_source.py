"""``meshrun plan --model`` on models meshrun did not write: a file with a factory taking
arguments, Hugging Face Llama and GPT-2 config.json files, and every way of getting it wrong
(in-process: the command's own ``main``, its printed lines and exit code)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from meshrun.cli.main import main
from meshrun.plan.user_model import format_count

pytestmark = pytest.mark.timeout(300)

# A nanoGPT-shaped model in two files: model.py imports its neighbour, as user code does; the
# config is a dataclass (which needs its module registered while the file loads).
BLOCKS_PY = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd)
"""
MODEL_PY = """
from dataclasses import dataclass
from torch import nn
from nano_blocks import Block

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config.n_embd, config.n_head) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does

def build(n_layer, n_embd=64, n_head=4):
    return GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head))

def broken(n_layer=2):
    raise ValueError("n_embd must be divisible by n_head")

def not_a_module():
    return {"n_layer": 2}
"""
# No config object: heads on the attention module, hidden and vocab from the embedding.
BARE_PY = """
from torch import nn

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = Attention(dim, heads)
        self.up, self.gate = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

class Net(nn.Module):
    def __init__(self, layers=3, dim=32, heads=2):
        super().__init__()
        self.embed = nn.Embedding(100, dim)
        self.layers = nn.ModuleList([Layer(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, 100)
"""


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    # --no-trace: these check what is read from the model (tests/unit/test_plan_trace.py traces)
    argv = ["plan", "--no-trace", "--gpus-per-node", "2", "--global-batch", "8", "--top", "1"]
    code = main([*argv, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    (tmp_path / "nano_blocks.py").write_text(BLOCKS_PY)
    (tmp_path / "model.py").write_text(MODEL_PY)
    yield tmp_path / "model.py"
    sys.modules.pop("nano_blocks", None)


def counted(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def line(out: str, key: str) -> str:
    return next(x for x in out.splitlines() if x.split()[:1] == [key])


def test_a_factory_in_a_file_with_kwargs_is_inferred_with_its_sources(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    path_before = list(sys.path)
    code, out, err = plan(
        capsys,
        "--model",
        f"{model_file}:build",
        "--model-kwargs",
        '{"n_layer": 3, "n_embd": 96, "n_head": 6}',
        "--json",
    )
    assert code == 0, err
    assert sys.path == path_before and "model" not in sys.modules  # nothing left behind
    doc = json.loads(out)
    sys.path.insert(0, str(model_file.parent))
    try:
        import model as user_model  # the same file, built for real on the CPU

        exact = counted(user_model.build(n_layer=3, n_embd=96, n_head=6))
    finally:
        sys.path.remove(str(model_file.parent))
        sys.modules.pop("model", None)
    assert doc["params"] == doc["model"]["params"] == exact
    shape = doc["model"]["shape"]
    assert shape == {
        "layers": 3,
        "hidden": 96,
        "heads": 6,
        "kv_heads": 6,
        "ffn": 384,
        "vocab": 512,
        "seq": 64,
        "tied": True,
        "mlp": "plain",
        "separate_qkv": False,
    }
    sources = doc["model"]["sources"]
    assert sources["layers"] == "transformer.h (3 x Block)"
    assert (sources["hidden"], sources["heads"], sources["seq"]) == (
        "config.n_embd",
        "config.n_head",
        "config.block_size",
    )
    assert sources["tied"] == "transformer.wte.weight = lm_head.weight"
    assert sources["ffn"].startswith("transformer.h.0.mlp.c_proj")
    # The human-readable lines go to stderr under --json, stdout otherwise.
    assert f"GPT, {format_count(exact)} parameters ({exact:,};" in err
    assert "tied     yes      transformer.wte.weight = lm_head.weight" in err


def test_a_module_without_config_reads_its_blocks_and_names_the_missing_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "bare.py").write_text(BARE_PY)
    spec = f"{tmp_path / 'bare.py'}:Net"
    code, _, err = plan(capsys, "--model", spec)
    assert code == 2
    # 100 x 32 embedding + 3 x (4 x 32 x 33 + 2 x 32 x 96 + 2 x 96 + 96 x 32 + 32) + 32 x 100 + 100
    assert err.strip().endswith("give --seq N, or --params 47492 alone (model-state memory only)")
    code, out, err = plan(capsys, "--model", spec, "--seq", "16")
    assert code == 0, err
    assert "layers   3        layers (3 x Layer)" in out
    assert "heads    2        layers.0.attn.num_heads" in out
    assert line(out, "hidden").split()[1:3] == ["32", "embed"]  # from nn.Embedding 100 x 32
    assert "ffn      96       layers.0.down" in out
    assert line(out, "mlp").split()[1] == "gated"  # up and gate: two projections hidden->ffn
    assert line(out, "q/k/v").split()[1] == "separate"
    assert line(out, "seq").split()[1:] == ["16", "--seq"]
    assert "47K parameters on 2 GPUs" in out


def test_a_shape_flag_that_changes_the_model_drops_the_exact_counts(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    args = ["--model", f"{model_file}:build", "--model-kwargs", '{"n_layer": 2}', "--json"]
    code, out, err = plan(capsys, *args, "--layers", "8", "--seq", "32")
    assert code == 0, err
    doc = json.loads(out)
    assert not doc["model"]["exact_counts"]
    assert doc["model"]["sources"]["layers"] == "--layers (the model says 2)"
    assert "counts   from the shape formulas" in err
    code, out, err = plan(capsys, *args, "--seq", "32")  # the training length changes no weight
    assert json.loads(out)["model"]["exact_counts"]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (950, "950"),
        (106_816, "107K"),
        (220_544, "221K"),
        (999_600, "1.0M"),
        (9_960_000, "10M"),
        (3_311_872, "3.3M"),
        (6_738_415_616, "6.7B"),
        (70_553_706_496, "71B"),
        (1.2e12, "1.2T"),
    ],
)
def test_parameter_counts_are_formatted_for_people(n: float, text: str) -> None:
    assert format_count(n) == text


# --- Hugging Face configs, built by transformers on the meta device --------------------------


def tiny_llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=512,
    )


def tiny_gpt2(**extra: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )


def test_a_llama_config_directory_gives_its_gqa_shape_and_exact_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    config = tiny_llama()
    (tmp_path / "llama").mkdir()
    config.to_json_file(tmp_path / "llama" / "config.json")
    code, out, err = plan(capsys, "--model", str(tmp_path / "llama"))
    assert code == 0, err
    exact = counted(LlamaForCausalLM(config))
    assert exact == 106_816
    assert "LlamaForCausalLM, 107K parameters (106,816; built on the meta device" in out
    assert "107K parameters on 2 GPUs" in out  # the table's title
    assert "layers   2        model.layers (2 x LlamaDecoderLayer)" in out
    assert "heads    4        config.num_attention_heads" in out
    assert "kv-heads 2        config.num_key_value_heads" in out
    assert "ffn      128      config.intermediate_size" in out
    assert "vocab    256      config.vocab_size" in out
    assert line(out, "seq").split()[1:3] == ["512", "config.max_position_embeddings"]
    assert "--seq N for the length you train at" in line(out, "seq")
    assert line(out, "tied").split()[1] == "no"
    assert line(out, "mlp").split()[1] == "gated"
    assert line(out, "q/k/v").split()[1] == "separate"


def test_a_gpt2_config_file_reads_gpt2_names_and_the_tied_head(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from transformers import GPT2LMHeadModel

    tiny_gpt2(n_inner=192).to_json_file(tmp_path / "gpt2.json")
    code, out, err = plan(capsys, "--model", str(tmp_path / "gpt2.json"), "--json")
    assert code == 0, err
    model = json.loads(out)["model"]
    assert model["params"] == counted(GPT2LMHeadModel(tiny_gpt2(n_inner=192)))
    assert model["shape"] == {
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "kv_heads": 4,
        "ffn": 192,
        "vocab": 256,
        "seq": 128,
        "tied": True,
        "mlp": "plain",
        "separate_qkv": False,
    }
    src = model["sources"]
    assert (src["hidden"], src["heads"], src["ffn"], src["seq"]) == (
        "config.n_embd",
        "config.n_head",
        "config.n_inner",
        "config.n_positions",
    )
    assert src["tied"] == "transformer.wte.weight = lm_head.weight"
    assert src["separate_qkv"] == "transformer.h.0: attn.c_attn"  # Conv1D, fused


def test_model_kwargs_override_config_json_fields(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tiny_llama().to_json_file(tmp_path / "config.json")
    code, out, err = plan(
        capsys,
        "--model",
        str(tmp_path / "config.json"),
        "--model-kwargs",
        '{"num_hidden_layers": 5}',
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["model"]["shape"]["layers"] == 5
    code, _, err = plan(
        capsys, "--model", str(tmp_path / "config.json"), "--model-kwargs", '{"num_layers": 5}'
    )
    assert code == 2
    assert "num_layers is not a field of a 'llama' config" in err
    assert "did you mean" in err and "num_hidden_layers" in err


# --- every mistake: exit 2, one line naming the flag, the value and the fix -------------------


def write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


ERRORS: dict[str, tuple[Any, list[str]]] = {
    "no such file": (
        lambda d: ["--model", f"{d}/nope.py:build"],
        ["nope.py:build", "does not exist", "path/to/model.py:factory"],
    ),
    "no factory name": (lambda d: ["--model", f"{d}/model.py"], ["model.py:FACTORY"]),
    "misspelt factory": (
        lambda d: ["--model", f"{d}/model.py:biuld"],
        [
            "no callable 'biuld'",
            "callables defined there: GPT, GPTConfig, broken, build, not_a_module",
        ],
    ),
    "bad JSON": (
        lambda d: ["--model", f"{d}/model.py:build", "--model-kwargs", "{n_layer: 2}"],
        ["--model-kwargs '{n_layer: 2}' is not valid JSON", '{"n_layer": 4'],
    ),
    "JSON not an object": (
        lambda d: ["--model", f"{d}/model.py:build", "--model-kwargs", "[2]"],
        ["--model-kwargs '[2]' is a JSON list", "object"],
    ),
    "missing argument": (
        lambda d: ["--model", f"{d}/model.py:build"],
        [
            "build(n_layer, n_embd=64, n_head=4) cannot be called without --model-kwargs",
            """--model-kwargs '{"n_layer": ...}'""",
        ],
    ),
    "unknown argument": (
        lambda d: [
            "--model",
            f"{d}/model.py:build",
            "--model-kwargs",
            '{"n_layer": 2, "layers": 2}',
        ],
        ["got an unexpected keyword argument 'layers'"],
    ),
    "factory raises": (
        lambda d: ["--model", f"{d}/model.py:broken"],
        ["broken() raised ValueError: n_embd must be divisible by n_head", "fix the factory"],
    ),
    "not a module": (
        lambda d: ["--model", f"{d}/model.py:not_a_module"],
        ["returned a dict, not a torch.nn.Module"],
    ),
    "import fails": (
        lambda d: ["--model", write(d, "bad.py", "import no_such_pkg_xyz\n") + ":build"],
        ["cannot import", "No module named 'no_such_pkg_xyz'"],
    ),
    "script at import": (
        lambda d: [
            "--model",
            write(d, "train.py", "import sys\nsys.exit(2)  # as argparse does on bad arguments\n")
            + ":build",
        ],
        ["exited (SystemExit 2)", "if __name__ == '__main__':"],
    ),
    "kwargs alone": (
        lambda d: ["--layers", "2", "--model-kwargs", "{}"],
        ["--model-kwargs '{}'", "add --model"],
    ),
    "not a model form": (
        lambda d: ["--model", "just_a_name"],
        ["expected path/to/model.py:factory, pkg.module:factory, a config.json"],
    ),
    "no such module": (
        lambda d: ["--model", "no_such_pkg_xyz.models:build"],
        ["cannot import no_such_pkg_xyz.models", "give its path"],
    ),
    "config without model_type": (
        lambda d: ["--model", write(d, "c.json", '{"n_layer": 2}')],
        ['has no "model_type"', "save_pretrained"],
    ),
    "config not JSON": (lambda d: ["--model", write(d, "d.json", "{")], ["cannot read", "as JSON"]),
    "directory without config": (
        lambda d: ["--model", str(d)],
        ["the directory has no config.json"],
    ),
    "unknown architecture": (
        lambda d: ["--model", write(d, "e.json", '{"model_type": "zzz"}')],
        ["model_type 'zzz' is unknown to transformers", "--model path/to/modeling.py:factory"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_every_mistake_is_one_line_and_exit_2(
    case: str, capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    args, wanted = ERRORS[case]
    code, out, err = plan(capsys, *args(model_file.parent))
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("meshrun plan: error: --model"), err
    assert "Traceback" not in err
    for text in wanted:
        assert text in err, err


def test_a_config_of_an_architecture_with_no_causal_lm_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from transformers import ViTConfig

    ViTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128
    ).to_json_file(tmp_path / "vit.json")
    code, _, err = plan(capsys, "--model", str(tmp_path / "vit.json"))
    assert code == 2 and err.count("\n") == 1
    assert "model_type 'vit' has no causal language model in transformers" in err
    assert "give the shape (--layers --hidden --heads --vocab --seq) or --params N" in err


# --- the planner reads the same structure as the layouts -------------------------------------


def test_the_planner_finds_the_blocks_heads_and_ties_the_layouts_find() -> None:
    # meshrun.parallel.structure is what every layout reads; the planner keeps its own small
    # finder so that `meshrun plan` imports no torch.distributed code. They must agree.
    from byo_models import NanoGPT, tiny_gpt2, tiny_llama, tiny_qwen2
    from meshrun.demo.model import GPT, demo_config
    from meshrun.parallel.structure import find_structure
    from meshrun.plan.inspect_model import inspect_module

    models = [
        NanoGPT(),
        tiny_llama(),
        tiny_llama(num_key_value_heads=1),
        tiny_qwen2(),
        tiny_gpt2(),
        GPT(demo_config("tiny")),
    ]
    for model in models:
        planner, layouts = (
            inspect_module(model, getattr(model, "config", None)),
            find_structure(model),
        )
        name = type(model).__name__
        assert planner.sources["layers"] == (
            f"{layouts.blocks_fqn} ({layouts.n_blocks} x {layouts.block_class})"
        ), name
        assert planner.layers == layouts.n_blocks, name
        heads = planner.shape["heads"]
        assert (heads, planner.shape.get("kv_heads", heads)) == (
            layouts.num_heads,
            layouts.num_kv_heads,
        ), name
        assert tuple(planner.tied) == layouts.tied, name
        assert (planner.separate_qkv is False) == bool(layouts.fused_qkv), name
