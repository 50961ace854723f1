"""The README's adoption diff resumes: a user who copies only it gets restarts that continue
from the newest checkpoint, not from step 0 (``run.resume`` between the loader and the loop)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_adoption_diff_calls_resume_before_the_loop() -> None:
    diff = re.search(r"^```diff\n(.*?)^```", README, re.M | re.S)
    assert diff is not None
    added = [line[1:].strip() for line in diff[1].splitlines() if line.startswith("+")]
    code = [line.split("#")[0].strip() for line in added]
    resume = code.index("run.resume(model, opt, loader)")
    assert code.index("loader = run.dataloader(dataset)") < resume
    assert resume < code.index("for batch in run.steps(loader):")


def test_the_first_two_commands_stay_at_the_top() -> None:
    first = re.search(r"^```bash\n(.*?)^```", README, re.M | re.S)
    assert first is not None
    assert [line.split()[:2] for line in first[1].splitlines()] == [
        ["make", "demo"],
        ["make", "test"],
    ]
