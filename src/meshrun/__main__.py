"""``python -m meshrun``: the command line."""

import gc
import sys

from meshrun.cli.main import main

code = main()
# With torch loaded, the interpreter's final garbage collection takes 4 s on a loaded 2-core
# machine (0.7 s with this, measured): time that `meshrun launch` adds after its job ended.
gc.freeze()
sys.exit(code)
