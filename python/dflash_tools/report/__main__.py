"""python -m dflash_tools.report RUN_DIR [--out DIR] (normally run by `dflash report`)."""

import sys

from .report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
