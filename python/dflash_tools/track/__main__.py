"""python -m dflash_tools.track --run-dir DIR --to wandb|mlflow (started by `dflash run` for run.report_to)."""

import sys

from .track import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
