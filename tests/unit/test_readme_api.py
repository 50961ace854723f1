"""The README's code teaches calls that exist: every ``run.NAME`` in its code blocks (the
adoption diff, the pipeline variant) is a public attribute of ``meshrun.Run``, and the Python
blocks parse. The demo runs the same calls under every layout (tests/dist/test_layouts_demo.py)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import meshrun

ROOT = Path(__file__).resolve().parents[2]


def code_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [
        textwrap.dedent(b) for b in re.findall(rf"^ *```{lang}\n(.*?)^ *```", text, re.M | re.S)
    ]


def test_every_run_call_in_the_readme_exists() -> None:
    code = "\n".join(code_blocks("diff") + code_blocks("python"))
    names = set(re.findall(r"\brun\.([a-z_]+)", code))
    assert {"optimizer", "pipeline", "pipeline_step", "parallelize", "backward"} <= names, names
    missing = sorted(n for n in names if not hasattr(meshrun.Run, n))
    assert not missing, f"README calls run.{missing} that meshrun.Run does not have"


def test_the_readme_teaches_the_optimizer_that_works_under_every_layout() -> None:
    diff = code_blocks("diff")[0]
    added = [line for line in diff.splitlines() if line.startswith("+")]
    assert any("run.optimizer(model, torch.optim.AdamW" in line for line in added), added
    assert not any("torch.optim.AdamW(model.parameters()" in line for line in added), added


def test_the_python_blocks_parse() -> None:
    blocks = code_blocks("python")
    assert any("run.pipeline_step(pipe" in b for b in blocks), "the pipeline variant is missing"
    for block in blocks:
        ast.parse(block)
