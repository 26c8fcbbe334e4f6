"""python -m dflash_tools.data prepare|regenerate|bench-regenerate ARGS (normally run by `dflash data ...` and
`dflash bench regenerate`)."""

import sys


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("prepare", "regenerate", "bench-regenerate"):
        print("usage: python -m dflash_tools.data prepare|regenerate|bench-regenerate ARGS (see --help)", file=sys.stderr)
        return 2
    if sys.argv[1] == "bench-regenerate":
        from .bench_regenerate import main as bench_main
        return bench_main(sys.argv[2:])
    if sys.argv[1] == "prepare":
        from .prepare import main as prepare_main
        return prepare_main(sys.argv[2:])
    from .regenerate import main as regenerate_main
    return regenerate_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
