"""The docs speak of the project, its users and its machines: not of who wrote them or in
which sitting (such words were found in docs/ and went stale at once)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORDS = re.compile(r"\bother engineers\b|\bengineers'|\bsessions?\b(?! start)|\bthe lead\b", re.I)


def test_docs_do_not_speak_of_their_writers() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WORDS.search(line) and "ssh session" not in line.lower()
    ]
    assert found == [], "\n".join(found)
