"""A script whose own flags are dotted like meshrun's overrides (minGPT's configurator takes
``--trainer.batch_size=4``), parsed by a strict ``parse_args()`` after ``meshrun.init()``.
Its flags follow a ``--``; it prints what it saw as one JSON line per rank."""

import argparse
import json
import sys

import meshrun

run = meshrun.init()
argv_after_init = list(sys.argv[1:])
parser = argparse.ArgumentParser()
parser.add_argument("--trainer.batch_size", dest="batch_size", type=int, required=True)
parser.add_argument("--model.n_layer", dest="n_layer", type=int, default=0)
args = parser.parse_args()  # strict: a `--` left in argv would make the flags positional
seen = {"argv": argv_after_init, "batch_size": args.batch_size, "n_layer": args.n_layer}
seen |= {"lr": run.config.optim.lr, "steps": run.config.optim.steps, "rank": run.rank}
# One write of the whole line: both ranks share the launcher's stdout pipe, and print() under
# PYTHONUNBUFFERED writes the text and its newline separately (two lines could fuse).
sys.stdout.write(json.dumps(seen) + "\n")
sys.stdout.flush()
run.close()
