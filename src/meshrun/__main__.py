"""``python -m meshrun``: the command line."""

import sys

from meshrun.cli import main

sys.exit(main())
