#!/usr/bin/env bash
# The command reference and the --help texts follow the option tables (core/util/options.h):
#   1. docs/cli.md's generated section (between <!-- BEGIN command reference --> and
#      <!-- END command reference -->) equals what scripts/cli_reference.sh prints for these binaries;
#   2. for every command of every binary, every flag its table accepts (`BINARY --list-options`,
#      modes included) appears in `BINARY COMMAND --help`.
# Usage: cli_reference.sh BIN_DIR   (DFLASH_SOURCE_DIR: the checkout the binaries were built from)
set -euo pipefail
bin=$1
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
fail() { echo "FAIL: $*"; exit 1; }

expected=$(mktemp)
actual=$(mktemp)
trap 'rm -f "$expected" "$actual"' EXIT
bash "$src/scripts/cli_reference.sh" "$bin" > "$expected"
awk '$0 == "<!-- END command reference -->" { on = 0 } on { print } $0 == "<!-- BEGIN command reference -->" { on = 1 }' \
  "$src/docs/cli.md" > "$actual"
if ! diff -u "$actual" "$expected" > "$actual.diff"; then
  head -40 "$actual.diff"
  rm -f "$actual.diff"
  fail "docs/cli.md's command reference is stale; refresh it with: scripts/cli_reference.sh --write build/bin"
fi
rm -f "$actual.diff"

n=0
for b in dflash dflash-target dflash-drafter; do
  last="" help=""
  while IFS=$'\t' read -r cmd flag; do
    if [ "$cmd" != "$last" ]; then  # one --help per command
      read -r -a words <<< "$cmd"
      help=$("$bin/$b" "${words[@]}" --help) || fail "$b $cmd --help exited $?"
      last=$cmd
    fi
    grep -Eq -- "${flag}([^a-z0-9-]|\$)" <<< "$help" || fail "$b $cmd --help does not show $flag: $help"
    n=$((n + 1))
  done < <("$bin/$b" --list-options)
done
[ "$n" -gt 0 ] || fail "no options listed"
echo "PASS: docs/cli.md's command reference is current; $n flags, each in its command's --help"
