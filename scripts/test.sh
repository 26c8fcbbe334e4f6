#!/usr/bin/env bash
# Installs what is missing, builds, runs every test (ctest). Exits non-zero on any failure.
# Env: DFLASH_BUILD_DIR (default ./build), DFLASH_JOBS, DFLASH_CUDA (AUTO|ON|OFF), CTEST_ARGS.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
start=$(date +%s)
dflash_install_debs "${dflash_apt_packages[@]}" "${dflash_apt_test_packages[@]}"
dflash_install_venv
build=${DFLASH_BUILD_DIR:-$DFLASH_ROOT/build}
dflash_configure_build "$build" -DDFLASH_CUDA="${DFLASH_CUDA:-AUTO}"
built=$(date +%s)
# Tests labelled `gpu` need a CUDA device, `multidev` two or more; they run only where those exist.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
exclude=()
if [ "${gpus:-0}" -eq 0 ]; then exclude=(-LE 'gpu|multidev'); elif [ "$gpus" -lt 2 ]; then exclude=(-LE multidev); fi
cd "$build"
# One intra-op thread per test process: ctest runs tests in parallel and several tests start
# multi-process pipelines; oversubscribed LibTorch thread pools made them ~10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ctest --output-on-failure -j "${DFLASH_JOBS:-$(nproc)}" "${exclude[@]}" ${CTEST_ARGS:-}
echo "[test] build $((built - start)) s, tests $(($(date +%s) - built)) s"
