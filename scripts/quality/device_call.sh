#!/usr/bin/env bash
# One device call of the quality run (docs/quality.md, "How to reproduce"), run on the GPU host from
# the repository root:
#   scripts/quality/device_call.sh [--gpu-tests REGEX] [--part DIR]... [--regen DIR]
#                                  [--out-archive FILE] [--gpu DEADLINE_S] [-- EXTRA_GPU_FLAGS...]
# In order:
#   1. builds the binaries into $DFLASH_GPU_BUILD (default /tmp/build-gpu; tests off) when its
#      bin/dflash is missing, with .gpu-deps/build.sh (carry .gpu-deps on that call); with
#      --gpu-tests "NAME|NAME..." (GPU test names = their targets, e.g.
#      "test_fused_ops_gpu|test_trainer_gpu") it then turns the tests on and builds those targets
#      only, and runs them (`ctest -L gpu`, their log in OUT's archive, logs/gpu_tests.log): a
#      failure stops the call (exit 1) before anything trains;
#   2. stores each --part DIR into /tmp/quality/bundle (/tmp/quality: $DFLASH_QUALITY_DIR if set) (run.py unpack; the bundle is rebuilt when the
#      last part is there);
#   2b. --regen DIR: restores the regenerated data that an earlier session's call left in $OUT
#      (DIR/regen.tgz.NN, carried back): the regenerate step is then done. Refused (exit 4) when it
#      was made from another bundle (the bundle's manifest.json differs);
#   2c. --out-archive FILE: an earlier session's $OUT/quality-out.tgz, carried back, restored into a
#      fresh /tmp/quality/out (refused, exit 2, when it already holds results.json): the steps it
#      records are done, except import and prompts, whose files (shards, prompt subsets) the
#      archive does not hold: they run again (seconds). A rerun with more --recipe flags (e.g. a
#      second seed) then trains and evaluates only those. Needs the regenerated data (--regen or
#      an earlier regenerate step) for the import;
#   3. with --gpu S: `run.py gpu /tmp/quality/bundle /tmp/quality/out --parallel 6 --deadline-s S`
#      plus EXTRA_GPU_FLAGS (it resumes where the last call stopped); stopped at S + 45 s (exit 3);
#   4. always, when $OUT is set and /tmp/quality/out exists: one archive $OUT/quality-out.tgz of its
#      results.json, host.json (the build and GPU that measured), steps, curves, evals and logs (a device call returns few files, and /tmp is lost
#      once the host goes back), so every call leaves what it measured here; once the regenerate
#      step is done, also $OUT/regen.tgz.NN (the regenerated data with its step record, gzip, cut
#      into files of 15 MiB), so that a run cut off by the end of a session can skip regeneration in
#      the next one (--regen).
# Exit: 0 done; 3 parts still missing or the gpu step stopped at its deadline (call again within
# 30 s, /tmp survives only then); 1 the build failed; else the failing step's exit (run.py: 1 a
# step failed, 2 bad usage, 4 a damaged part).
set -uo pipefail
build=${DFLASH_GPU_BUILD:-/tmp/build-gpu}
qdir=${DFLASH_QUALITY_DIR:-/tmp/quality}
dest=$qdir/bundle out_dir=$qdir/out
parts=() deadline="" extra=() regen="" gpu_tests="" out_archive=""
while [ $# -gt 0 ]; do
  case $1 in
    --part) parts+=("$2"); shift 2 ;;
    --gpu) deadline=$2; shift 2 ;;
    --regen) regen=$2; shift 2 ;;
    --out-archive) out_archive=$2; shift 2 ;;
    --gpu-tests) gpu_tests=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "ERROR: device_call.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

archive() {
  [ -n "${OUT:-}" ] && [ -d "$out_dir" ] || return 0
  local have=()
  for f in results.json host.json steps curves evals logs; do [ -e "$out_dir/$f" ] && have+=("$f"); done
  [ ${#have[@]} -gt 0 ] && tar czf "$OUT/quality-out.tgz" -C "$out_dir" "${have[@]}" && echo "archived ${have[*]} into \$OUT/quality-out.tgz"
  if [ -f "$out_dir/steps/regenerate.json" ] && [ -f "$dest/manifest.json" ]; then
    sha256sum "$dest/manifest.json" | cut -d' ' -f1 > "$out_dir/regen-bundle.sha256"
    tar cf - -C "$out_dir" regenerated.jsonl regenerated.jsonl.meta.json steps/regenerate.json regen-bundle.sha256 \
      | gzip -1 | split -b 15m -d -a 2 - "$OUT/regen.tgz." && echo "archived the regenerated data into \$OUT/regen.tgz.*"
  fi
}
trap archive EXIT

if [ ! -x "$build/bin/dflash" ]; then
  [ -f .gpu-deps/build.sh ] || { echo "ERROR: $build/bin/dflash missing and .gpu-deps not carried" >&2; exit 1; }
  t0=$SECONDS
  bash .gpu-deps/build.sh . "$build" -DDFLASH_CUDA=ON -DDFLASH_BUILD_TESTS=OFF > /tmp/quality-build.log 2>&1 \
    || { tail -40 /tmp/quality-build.log; exit 1; }
  echo "built $build in $((SECONDS - t0)) s"
fi
deps=/tmp/dflash-deps/usr  # where build.sh unpacked the bundled packages
export LD_LIBRARY_PATH=$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export DFLASH_SOURCE_DIR=$PWD DFLASH_PYTHON=${DFLASH_PYTHON:-python3}
py=$DFLASH_PYTHON

if [ -n "$gpu_tests" ]; then
  mkdir -p "$out_dir/logs"
  t0=$SECONDS
  PATH=$deps/bin:$PATH cmake -S . -B "$build" -DDFLASH_BUILD_TESTS=ON > /tmp/quality-build-tests.log 2>&1 \
    || { tail -40 /tmp/quality-build-tests.log; echo "ERROR: --gpu-tests: configuring the tests failed" >&2; exit 1; }
  # Each named test's executable (its target), from the add_test lines ctest reads
  # (the name bare, "quoted" or [=[bracketed]=]: CMake versions differ).
  test_targets=()
  IFS='|' read -r -a test_names <<< "$gpu_tests"
  for t in "${test_names[@]}"; do
    exe=$("$py" - "$build/tests" "$t" <<'PY'
import pathlib, re, sys
pat = re.compile(r'add_test\(\s*(?:\[=\[|")?' + re.escape(sys.argv[2]) + r'(?:\]=\]|")?\s+"([^"]+)"')
for f in sorted(pathlib.Path(sys.argv[1]).rglob("CTestTestfile.cmake")):
    m = pat.search(f.read_text())
    if m:
        print(m.group(1))
        break
PY
)
    [ -n "$exe" ] || { grep -rh --include=CTestTestfile.cmake -m2 "$t" "$build/tests" >&2; echo "ERROR: --gpu-tests: no test named '$t'" >&2; exit 1; }
    test_targets+=("$(basename "$exe")")
  done
  PATH=$deps/bin:$PATH LIBRARY_PATH=$deps/lib/x86_64-linux-gnu cmake --build "$build" -j "$(nproc)" --target "${test_targets[@]}" \
    >> /tmp/quality-build-tests.log 2>&1 || { tail -40 /tmp/quality-build-tests.log; echo "ERROR: --gpu-tests: building ${test_targets[*]} failed" >&2; exit 1; }
  echo "built ${test_targets[*]} in $((SECONDS - t0)) s"
  if ! ctest --test-dir "$build" -L gpu -R "^($gpu_tests)\$" --no-tests=error --output-on-failure > "$out_dir/logs/gpu_tests.log" 2>&1; then
    grep -E "tests passed|Failed|Passed" "$out_dir/logs/gpu_tests.log" | tail -20
    echo "ERROR: --gpu-tests: GPU tests failed or none matched '$gpu_tests' (logs/gpu_tests.log)" >&2
    exit 1
  fi
  grep -E "tests passed" "$out_dir/logs/gpu_tests.log"
fi

rc=0
for p in "${parts[@]}"; do
  "$py" scripts/quality/run.py unpack "$p" "$dest"; rc=$?
  [ $rc = 0 ] || [ $rc = 3 ] || exit $rc
done
if [ -n "$regen" ]; then
  if [ $rc != 0 ] || [ ! -f "$dest/manifest.json" ]; then
    echo "ERROR: --regen: the bundle is not complete yet" >&2
    exit 3
  fi
  ls "$regen"/regen.tgz.* > /dev/null 2>&1 || { echo "ERROR: --regen: no $regen/regen.tgz.* files" >&2; exit 2; }
  mkdir -p "$out_dir"
  tmp=$(mktemp -d "$qdir/regen.XXXXXX")
  cat "$regen"/regen.tgz.* | tar xzf - -C "$tmp" || { echo "ERROR: --regen: $regen/regen.tgz.* is not a whole archive" >&2; exit 4; }
  want=$(sha256sum "$dest/manifest.json" | cut -d' ' -f1)
  if [ "$(cat "$tmp/regen-bundle.sha256")" != "$want" ]; then
    rm -rf "$tmp"
    echo "ERROR: --regen: $regen was regenerated from another bundle (manifest sha256 differs); regenerate again" >&2
    exit 4
  fi
  mkdir -p "$out_dir/steps"
  for f in regenerated.jsonl regenerated.jsonl.meta.json steps/regenerate.json regen-bundle.sha256; do mv "$tmp/$f" "$out_dir/$f"; done
  rm -rf "$tmp"
  echo "restored the regenerated data from $regen"
fi
if [ -n "$out_archive" ]; then
  [ -f "$out_archive" ] || { echo "ERROR: --out-archive: $out_archive not found" >&2; exit 2; }
  [ ! -f "$out_dir/results.json" ] || { echo "ERROR: --out-archive: $out_dir already holds a run (results.json)" >&2; exit 2; }
  mkdir -p "$out_dir"
  tar xzf "$out_archive" -C "$out_dir" && [ -d "$out_dir/steps" ] \
    || { echo "ERROR: --out-archive: $out_archive is not a quality-out archive" >&2; exit 4; }
  rm -f "$out_dir/steps/import.json" "$out_dir/steps/prompts.json"
  if [ -z "$regen" ] && [ ! -f "$out_dir/regenerated.jsonl" ]; then
    rm -f "$out_dir/steps/regenerate.json"  # the data is not here: regenerate again
  fi
  echo "restored the steps of $out_archive (import and prompts run again)"
fi
[ -n "$deadline" ] || exit $rc
[ $rc = 0 ] || { echo "ERROR: --gpu: the bundle is not complete yet (parts missing)" >&2; exit 3; }
# A step already running at the deadline is not waited for past deadline + 45 s: it is stopped (a
# rerun resumes it) so that the call ends, and leaves its archive, within the device's 600 s
# (S + 45 + at most 40 s of graceful stops + the archive: keep S <= 490).
timeout -s TERM "$((deadline + 45))" \
  "$py" scripts/quality/run.py --bin "$build/bin" gpu "$dest" "$out_dir" --parallel 6 --deadline-s "$deadline" "${extra[@]}"
rc=$?
if [ $rc = 124 ]; then
  # timeout sent TERM to run.py's whole process group: a `dflash run` stops gracefully (checkpoint,
  # then exit), SpecForge's harness saves its resume state after its step in flight. Wait for them
  # (at most 40 s) so that the next call's resume finds their run dirs free.
  busy="$build/bin/dflash|scripts/quality/specforge_train.py"
  for _ in $(seq 40); do pgrep -f "$busy" > /dev/null || break; sleep 1; done
  pgrep -af "$busy" >&2 && echo "WARNING: steps' processes still running after 40 s" >&2
  echo "stopped at the deadline + 45 s; the next call resumes" >&2
  exit 3
fi
exit $rc
