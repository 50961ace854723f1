"""``meshrun data prepare`` with a slowed byte tokenizer, so a test can kill it midway.

Usage: slow_prepare.py SOURCE OUT. Same tokenizer spec ("bytes") and settings as
tests/e2e/test_data_prepare.py's plain CLI runs, so a rerun through the CLI resumes its work.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from meshrun.data.prepare import prepare
from meshrun.data.tokenizers import ByteTokenizer


class SlowBytes(ByteTokenizer):
    def encode(self, text: bytes) -> np.ndarray:
        time.sleep(0.1)
        return super().encode(text)


if __name__ == "__main__":
    prepare(
        sys.argv[1], sys.argv[2], tokenizer=SlowBytes(), shard_tokens=5000, workers=2, unit_bytes=1
    )
