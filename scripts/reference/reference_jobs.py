"""--jobs for the reference scripts (hf_generate.py, zlab_generate.py): many invocations in one
Python process, so a test pays for one interpreter start and one torch/transformers import.

    SCRIPT.py --jobs JOBS.jsonl    one JSON array of SCRIPT's own arguments per line

Each line runs as main(argv) in turn; the exit code is the worst of the jobs'."""
import json
import sys


def main_or_jobs(main):
    if sys.argv[1:2] != ["--jobs"]:
        return main()
    if len(sys.argv) != 3:
        print("usage: --jobs JOBS.jsonl", file=sys.stderr)
        return 2
    worst = 0
    with open(sys.argv[2]) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                argv = json.loads(line)
                print(f"job {n}: {' '.join(argv)}", file=sys.stderr)
                worst = max(worst, main(argv))
    return worst
