#!/usr/bin/env bash
# The build's one identity (core/util/build_info.h, generated at every build by cmake/build_info.cmake):
#   - `dflash --version` names the commit `git rev-parse HEAD` of the source tree ("-dirty" allowed);
#     skipped (exit 77) only when the source tree is not a git checkout;
#   - --version, the dflash_build_info metric and the export's provenance all read build_info, and
#     no other code or CMake file reads the git commit.
# Usage: build_identity.sh BIN_DIR SOURCE_DIR
set -euo pipefail
bin=$1 src=$2
fail() { echo "FAIL: $*"; exit 1; }

# One source: every surface calls build_info::identity(); nothing else runs git or defines a commit.
for f in services/coordinator/main.cc services/target/main.cc services/drafter/main.cc \
         core/metrics/process.cc core/train/export_card.cc; do
  grep -q 'build_info::identity()' "$src/$f" || fail "$f does not take the commit from build_info::identity()"
done
others=$(cd "$src" && grep -rlE 'execute_process\(COMMAND +git|git +(rev-parse|describe)' \
           --include=CMakeLists.txt --include='*.cmake' --include='*.in' core services cmake CMakeLists.txt |
         grep -v '^cmake/build_info\.cmake$' || true)
[ -z "$others" ] || fail "another build step reads the git commit: $others"
stale=$(cd "$src" && grep -rlE 'DFLASH_BUILD_COMMIT|DFLASH_GIT_COMMIT|build_commit\(' core services || true)
[ -z "$stale" ] || fail "an older build-identity mechanism is still referenced: $stale"

line=$("$bin/dflash" --version)
echo "dflash --version: $line"
[[ $line =~ ^dflash\ [0-9]+\.[0-9]+\.[0-9]+\ \(commit\ (.+)\)$ ]] || fail "no version line: $line"
shown=${BASH_REMATCH[1]}
if ! head=$(git -c safe.directory="$src" -C "$src" rev-parse --verify HEAD 2> /dev/null); then
  [ "$shown" = unknown ] || fail "the source tree has no git metadata, yet --version names commit $shown"
  echo "SKIP: $src is not a git checkout (no .git): no commit to compare --version with (it says '$shown')"
  exit 77
fi
[ "$shown" = "$head" ] || [ "$shown" = "$head-dirty" ] ||
  fail "--version names commit $shown, the source tree's HEAD is $head (rebuild dflash after committing)"
for b in dflash-target dflash-drafter; do
  other=$("$bin/$b" --version)
  [ "${other#"$b "}" = "${line#dflash }" ] || fail "$b --version '$other' differs from dflash's '$line'"
done
echo "PASS: --version of the 3 binaries names HEAD $shown; the metric and the export read the same build_info"
