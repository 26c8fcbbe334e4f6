#!/usr/bin/env bash
# The command reference of docs/cli.md, generated from the commands' option tables
# (core/util/options.h): every binary's `--markdown-reference`, in the order dflash, dflash-target,
# dflash-drafter.
#   scripts/cli_reference.sh BIN_DIR            print it
#   scripts/cli_reference.sh --write BIN_DIR    replace the text between the markers of docs/cli.md
# The markers (each on a line of its own): <!-- BEGIN command reference --> ... <!-- END command reference -->
set -euo pipefail
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
[ $# -eq 1 ] || { echo "usage: scripts/cli_reference.sh [--write] BIN_DIR" >&2; exit 2; }
bin=$1
src=$(cd "$(dirname "$0")/.." && pwd)

reference() {
  local first=1 b
  for b in dflash dflash-target dflash-drafter; do
    [ -x "$bin/$b" ] || { echo "scripts/cli_reference.sh: $bin/$b: not an executable" >&2; exit 2; }
    [ $first = 1 ] || echo
    first=0
    echo "Commands of \`$b\`:"
    echo
    "$bin/$b" --markdown-reference
  done
}

if [ $write = 0 ]; then
  reference
  exit 0
fi
doc=$src/docs/cli.md
grep -qx '<!-- BEGIN command reference -->' "$doc" && grep -qx '<!-- END command reference -->' "$doc" ||
  { echo "$doc: no <!-- BEGIN command reference --> / <!-- END command reference --> lines" >&2; exit 2; }
generated=$(mktemp)
trap 'rm -f "$generated" "$generated.doc"' EXIT
reference > "$generated"
awk -v gen="$generated" '
  $0 == "<!-- END command reference -->" { skipping = 0 }
  !skipping { print }
  $0 == "<!-- BEGIN command reference -->" { while ((getline line < gen) > 0) print line; skipping = 1 }
' "$doc" > "$generated.doc"
mv "$generated.doc" "$doc"
echo "docs/cli.md: command reference rewritten"
