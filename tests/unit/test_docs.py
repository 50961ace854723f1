"""The generated references in docs/ must match the code, and the README's set-up commands
must exist in the Makefile."""

from pathlib import Path

from meshrun.cli.main import reference_markdown as cli_reference
from meshrun.config import reference_markdown as config_reference

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = (
    'regenerate: .venv/bin/python -c "from meshrun.{m} import reference_markdown as r; '
    "open('docs/{f}', 'w').write(r())\""
)


def test_config_reference_is_current() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == config_reference(), REGENERATE.format(m="config", f="config.md")


def test_cli_reference_is_current() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    assert text == cli_reference(), REGENERATE.format(m="cli.main", f="cli.md")


def test_readme_starts_with_the_two_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "torch==2.13.0" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()
