"""``meshrun ckpt export CKPT OUT --hf`` into a directory that already holds a tokenizer (the
usual order: ``tokenizer.save_pretrained(out)``, then the export): the files the export does
not write stay, the model loads beside them; a directory holding weight files is refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_export_safetensors import commit_checkpoint

import byo_models
from meshrun.checkpoint.hf_files import hf_files
from meshrun.cli.main import main as cli_main

TOKENIZER = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "README.md": "mine"}


def _checkpoint(tmp_path: Path) -> Path:
    model = byo_models.tiny_llama()
    return commit_checkpoint(tmp_path / "ckpt", model.state_dict(), hf_files(model))


def test_export_keeps_the_tokenizer_files_already_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    for name, text in {**TOKENIZER, "config.json": "{}"}.items():
        (out / name).write_text(text)
    with caplog.at_level(logging.WARNING, logger="meshrun"):
        assert cli_main(["ckpt", "export", str(_checkpoint(tmp_path)), str(out), "--hf"]) == 0
    assert {n: (out / n).read_text() for n in TOKENIZER} == TOKENIZER
    assert (out / "model.safetensors").is_file()
    assert "replacing ['config.json']" in caplog.text  # said, not silent
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out) is not None


@pytest.mark.parametrize("old", ["pytorch_model.bin", "model.safetensors.index.json"])
def test_export_refuses_a_directory_holding_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / old).write_text("old")
    assert cli_main(["ckpt", "export", str(_checkpoint(tmp_path)), str(out), "--hf"]) == 2
    said = capsys.readouterr().out
    assert f"it holds weight files ['{old}']" in said and "tokenizer" in said
    assert sorted(p.name for p in out.iterdir()) == sorted([old, "tokenizer.json"])
