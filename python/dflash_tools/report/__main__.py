"""python -m dflash_tools.report RUN_DIR [--out DIR] (normally run by `dflash report`). Never ends in
a traceback (errors.guard), not even when matplotlib is missing."""

import sys

from ..errors import guard


def run(argv):
    from .report import main
    return main(argv)


if __name__ == "__main__":
    sys.exit(guard("report", run, sys.argv[1:]))
