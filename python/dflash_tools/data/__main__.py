"""python -m dflash_tools.data prepare|regenerate|benchmark|bench-regenerate ARGS (normally run by
`dflash data ...` and `dflash bench regenerate`). No subcommand ends in a traceback: errors.guard
turns any failure into one line on stderr and a documented exit code (docs/data.md)."""

import sys

from ..errors import guard

COMMANDS = ("prepare", "regenerate", "benchmark", "bench-regenerate")


def dispatch(argv):
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m dflash_tools.data {'|'.join(COMMANDS)} ARGS (see --help)", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name == "bench-regenerate":
        from .bench_regenerate import main as bench_main
        return bench_main(args)
    if name == "prepare":
        from .prepare import main as prepare_main
        return prepare_main(args)
    if name == "benchmark":
        from .benchmark import main as benchmark_main
        return benchmark_main(args)
    from .regenerate import main as regenerate_main
    return regenerate_main(args)


def main():
    return guard("data " + (sys.argv[1] if len(sys.argv) > 1 else ""), dispatch, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
