# shellcheck shell=bash
# Sourced by shell tests: deterministic, slow-to-make fixtures (a trained tiny target, data decoded
# by it) cached across runs and clones.
#
#   fixture_cached OUT_DIR RECIPE INPUT_FILE... -- CMD [ARG...]
#
# CMD must write the fixture into OUT_DIR and depend only on RECIPE (a string that names every
# parameter: the caller writes it, so paths that differ between clones do not enter the key), the
# INPUT_FILEs (the generator scripts; their contents are hashed) and the Python environment (the
# venv's directory name, which carries the hash of scripts/requirements.txt). A cached copy is
# reused when all of them are unchanged; otherwise CMD runs and its output is stored. The cache is
# ${DFLASH_FIXTURE_CACHE:-$HOME/.cache/dflash/fixtures} (DFLASH_FIXTURE_CACHE=off: never cache).
fixture_cached() {
  local out=$1 recipe=$2
  shift 2
  local inputs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do inputs+=("$1"); shift; done
  [ "${1:-}" = -- ] || { echo "fixture_cached: missing -- before the command" >&2; return 2; }
  shift
  local env_id; env_id=$(basename "$(dirname "$(dirname "${DFLASH_PYTHON:-python3}")")")
  local key; key=$({ printf '%s\n%s\n' "$recipe" "$env_id"; cat "${inputs[@]}"; } | sha256sum | cut -c1-16)
  local base=${DFLASH_FIXTURE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash/fixtures}
  local cache=$base/$key
  rm -rf "$out" && mkdir -p "$out"
  if [ "$base" != off ] && [ -f "$cache/.complete" ]; then
    cp -a "$cache/." "$out/" && rm -f "$out/.complete"
    echo "fixture: reused $cache ($recipe)"
    return 0
  fi
  "$@"
  [ "$base" = off ] && return 0
  mkdir -p "$base"
  local tmp; tmp=$(mktemp -d "$base/.tmp.XXXXXX")
  cp -a "$out/." "$tmp/" && touch "$tmp/.complete" && rm -rf "$cache" && mv "$tmp" "$cache"
  echo "fixture: stored $cache ($recipe)"
}
