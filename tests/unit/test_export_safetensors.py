"""Checkpoint export without processes: checkpoints are written here by DCP in one process and
committed as meshrun commits them, then exported by the CLI and read back with the
``safetensors`` library and transformers' ``from_pretrained``.

- the single-file export (``OUT.safetensors``, ``OUT.pt``) streams tensors in groups, converts
  floating-point ones with ``--dtype`` and keeps integer ones;
- ``--hf`` writes a directory from_pretrained loads, for a tied GPT-2 (the head written once, as
  ``save_pretrained`` writes it) and an untied Llama; names that torch's wrappers insert never
  reach the files; names that match neither way stop it with both lists; a checkpoint without
  ``config.json`` is refused naming the flag and the fixes;
- ``hf_files`` finds the transformers model under torch's wrappers;
- no hand-written safetensors format code is left in src/ or tests/.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

import byo_models
from meshrun.checkpoint import on_disk
from meshrun.checkpoint.export.hf import parse_size
from meshrun.checkpoint.hf_files import hf_files
from meshrun.cli.main import main as cli_main


def commit_checkpoint(root: Path, sd: dict[str, torch.Tensor], files: dict[str, str]) -> Path:
    """A committed checkpoint of ``sd`` under ``model.`` (as meshrun's saves name it)."""
    tmp, final = on_disk.tmp_dir(root, 1), on_disk.step_dir(root, 1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"model.{k}": v for k, v in sd.items()}, checkpoint_id=str(tmp))
    for name, text in files.items():
        (tmp / name).write_text(text)
    on_disk.commit_dir(tmp, final, on_disk.build_manifest(tmp, step=1, meta={}))
    assert on_disk.problems(final) == []
    return final


def probe() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, byo_models.VOCAB, (2, byo_models.SEQ), generator=g)


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("40KB") == 40_000
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    for bad in ("5XB", "-1GB", "0", "GB"):
        with pytest.raises(ValueError, match="--shard-size"):
            parse_size(bad)


def test_single_file_export_streams_and_converts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    sd = {f"w{i}": torch.randn(64, 64) for i in range(6)} | {"steps": torch.arange(5)}
    ckpt = commit_checkpoint(tmp_path / "ckpt", sd, {})
    out = tmp_path / "m.safetensors"
    # --max-mb 0: one tensor per group, the most groups the streaming can make
    assert cli_main(["ckpt", "export", str(ckpt), str(out), "--max-mb", "0"]) == 0
    got = load_file(out)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # not the library's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.safetensors"]  # no staging
    half = tmp_path / "half.safetensors"
    assert cli_main(["ckpt", "export", str(ckpt), str(half), "--dtype", "bf16"]) == 0
    got = load_file(half)
    assert got["w0"].dtype == torch.bfloat16 and torch.equal(got["w0"], sd["w0"].bfloat16())
    assert got["steps"].dtype == torch.int64  # integers keep their dtype
    pt = tmp_path / "m.pt"
    assert cli_main(["ckpt", "export", str(ckpt), str(pt), "--dtype", "fp16"]) == 0
    assert torch.load(pt, weights_only=True)["w1"].dtype == torch.float16
    assert "wrote" in capsys.readouterr().out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_hf_export_loads_with_from_pretrained(
    tmp_path: Path, build: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    model = {"gpt2": byo_models.tiny_gpt2, "llama": byo_models.tiny_llama}[build]().eval()
    # Names as torch.compile and activation checkpointing would give them: the export drops them.
    sd = {
        k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v
        for k, v in model.state_dict().items()
    }
    sd = {k.replace("h.0.", "h.0._orig_mod."): v for k, v in sd.items()}
    ckpt = commit_checkpoint(tmp_path / "ckpt", sd, hf_files(model))
    out = tmp_path / "hf"
    assert cli_main(["ckpt", "export", str(ckpt), str(out), "--hf", "--shard-size", "30KB"]) == 0
    said = capsys.readouterr().out
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) >= 2 and (out / "model.safetensors.index.json").is_file()
    written = {k for f in files for k in load_file(f)}
    # What save_pretrained writes: the tied head once (GPT-2), both matrices when untied.
    assert ("lm_head.weight" in written) == (build == "llama")
    assert ("tied, written once: lm_head.weight" in said) == (build == "gpt2")
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(
            byo_models.logits_of(loaded, probe()), byo_models.logits_of(model, probe())
        )


def test_hf_export_refuses_names_that_do_not_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = byo_models.tiny_llama()
    sd = {("blocks." + k if "norm" in k else k): v for k, v in model.state_dict().items()}
    ckpt = commit_checkpoint(tmp_path / "ckpt", sd, hf_files(model))
    assert cli_main(["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--hf"]) == 2
    said = capsys.readouterr().out
    assert "do not match LlamaForCausalLM's names: missing ['model.layers.0.input_layernorm" in said
    assert "unexpected ['blocks.model.layers.0.input_layernorm.weight'" in said
    assert not (tmp_path / "hf").exists()  # refused before writing anything


def test_hf_export_without_config_names_the_flag_and_the_fixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = commit_checkpoint(tmp_path / "ckpt", nn.Linear(4, 2).state_dict(), {})
    assert cli_main(["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--hf"]) == 2
    said = capsys.readouterr().out
    assert f"--hf: {ckpt} has no config.json" in said
    assert "Export without --hf" in said and "save the checkpoint from a transformers model" in said


def test_hf_export_wants_a_new_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = byo_models.tiny_llama()
    ckpt = commit_checkpoint(tmp_path / "ckpt", model.state_dict(), hf_files(model))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model-00001-of-00009.safetensors").write_text("old")
    assert cli_main(["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--hf"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().out


def test_hf_files_finds_the_model_under_wrappers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = byo_models.tiny_llama()
    for wrapped in (torch.compile(model), checkpoint_wrapper(model), nn.ModuleList([model])):
        files = hf_files(wrapped)
        config = json.loads(files["config.json"])
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        assert "generation_config.json" in files
    assert hf_files(nn.Linear(2, 2)) == {}


def test_no_hand_written_safetensors_code_remains() -> None:
    """Every safetensors read and write goes through the library: no 8-byte header length
    packed by hand, no header offsets parsed, anywhere in src/ or tests/."""
    root = Path(__file__).resolve().parents[2]
    header = re.compile(r"struct\.(un)?pack(_from|_into)?\(\s*['\"]<Q|" + "data_" + "offsets")
    found = [
        f"{p.relative_to(root)}:{n}"
        for top in ("src", "tests")
        for p in sorted((root / top).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if header.search(line)
    ]
    assert found == [], f"hand-written safetensors format code: {found}"
