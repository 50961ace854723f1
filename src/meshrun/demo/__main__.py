"""``python -m meshrun.demo``: the demo's training script (see train.py)."""

from meshrun.demo.train import main

main()
