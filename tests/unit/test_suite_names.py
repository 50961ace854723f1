"""Every test module has its own file name: pytest imports them by basename (tests/ has no
packages), so a second ``test_x.py`` in another folder is a collection error in the whole run,
and a distributed test's children unpickle their function from whichever module won."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_folders() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    twice = sorted(n for n, c in names.items() if c > 1)
    assert not twice, f"test modules named twice (rename one of each): {twice}"
