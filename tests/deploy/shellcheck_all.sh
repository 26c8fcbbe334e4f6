#!/usr/bin/env bash
# Every shell script of the repository passes shellcheck (0.9, .shellcheckrc at the root follows
# `source`d files next to each script):
#   deploy/**, tests/deploy/** (incl. the fake pct/ssh/scp): every severity, style included;
#   scripts/*.sh and the other tests/**/*.sh: severity warning and up (their style/info notes,
#   mostly unquoted $vars in test scripts, are left as they are).
# Usage: shellcheck_all.sh SOURCE_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
cd "$src"
command -v shellcheck >/dev/null || { echo "FAIL: shellcheck not installed (scripts/test.sh installs it)"; exit 1; }
strict=()
while IFS= read -r -d '' f; do strict+=("$f"); done < <(find deploy tests/deploy -type f \( -name '*.sh' -o -path '*/fake-bin/*' \) -print0 | sort -z)
warn=()
while IFS= read -r -d '' f; do warn+=("$f"); done < <(find scripts tests -name '*.sh' ! -path 'tests/deploy/*' -print0 | sort -z)
rc=0
shellcheck "${strict[@]}" || rc=1
shellcheck -S warning "${warn[@]}" || rc=1
[ $rc = 0 ] || { echo "FAIL: shellcheck"; exit 1; }
echo "PASS: shellcheck clean: ${#strict[@]} deploy script(s) (all severities), ${#warn[@]} other script(s) (warnings)"
