#!/usr/bin/env bash
# On a GPU host: build with CUDA, run the GPU tests, run the benches; results go to $OUT (or
# ./out/gpu). The checks are declared in scripts/gpu-host/checks.json and run by
# scripts/gpu-host/run_checks.py in the manifest's order.
# Usage: scripts/gpu_host_check.sh [--list] [--dry-run] [CHECK|all]...   (default: all)
#   --list     every check, whether it is part of `all`, what it does and the files it writes
#   --dry-run  the bash each selected check would run
exec python3 "$(dirname "$0")/gpu-host/run_checks.py" "$@"
