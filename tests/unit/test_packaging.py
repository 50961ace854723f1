"""pyproject.toml in the form current setuptools reads without deprecation warnings."""

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # The table form ({ text = ... }) costs three SetuptoolsDeprecationWarnings per install.
    assert doc["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in doc["project"].get("classifiers", []))
    (setuptools,) = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+).*", setuptools)
    assert floor and int(floor.group(1)) >= 77, setuptools  # the first with SPDX strings
