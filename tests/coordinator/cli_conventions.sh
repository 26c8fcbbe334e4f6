#!/usr/bin/env bash
# The CLI conventions (docs/cli.md) on EVERY command of every binary. The command lists come from
# the binaries' own registries (`BINARY --list-commands`), so a new command cannot be left out:
#   BINARY --help / -h / help, and BINARY COMMAND --help / -h: exit 0, usage on stdout;
#   BINARY --version and BINARY COMMAND --version: exit 0, "(commit C)" with this checkout's commit;
#   an unknown flag (a known one misspelt): exit 2 and "did you mean" the known one; a flag of a
#   command that takes none: exit 2 "unknown flag"; an unknown command: exit 2 with a did-you-mean;
#   BINARY help COMMAND: that command's usage alone; COMMAND --help: its usage once;
#   no output of any of these (warnings, errors, JSON) carries a source location "[file.cc:N]".
# Usage: cli_conventions.sh BIN_DIR WORK_DIR   (DFLASH_SOURCE_DIR: the checkout the binaries were built from)
set -euo pipefail
bin=$1 work=$2
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
# The commit the binaries must report (core/util/build_info.h: `git rev-parse HEAD`, "-dirty" with changes).
commit=""
if git -C "$src" rev-parse --git-dir > /dev/null 2>&1; then commit=$(git -C "$src" rev-parse HEAD); fi

# expect RC WHAT CMD...: runs CMD (stdout -> $work/out, stderr -> $work/err), checks its exit code.
expect() {
  local want=$1 what=$2 rc=0
  shift 2
  "$@" > "$work/out" 2> "$work/err" < /dev/null || rc=$?
  { echo "== $*"; cat "$work/out" "$work/err"; } >> "$work/all"  # every user-facing line, for the location grep
  [ "$rc" = "$want" ] || fail "$what: '$*' exited $rc, expected $want; stderr: $(tail -c 600 "$work/err")"
}
expect_version() {
  expect 0 "--version" "$@"
  grep -Eq "^$(basename "$1") [0-9]+\.[0-9]+\.[0-9]+ \(commit .+\)$" "$work/out" || fail "'$*': no version line: $(cat "$work/out")"
  [ -z "$commit" ] || grep -Eq "\(commit $commit(-dirty)?\)$" "$work/out" || fail "'$*': the commit is not $commit: $(cat "$work/out")"
}

n=0
for b in dflash dflash-target dflash-drafter; do
  exe=$bin/$b
  for h in --help -h help; do
    expect 0 "$b $h" "$exe" $h
    grep -q "^usage: $b " "$work/out" || fail "$b $h: no usage on stdout: $(head -3 "$work/out")"
  done
  expect 2 "no arguments" "$exe"
  grep -q "^usage: $b " "$work/err" || fail "$b without arguments: no usage on stderr"
  expect_version "$exe" --version
  expect 2 "misspelt --version" "$exe" --versoin
  grep -q "did you mean '--version'?" "$work/err" || fail "$b --versoin: no did-you-mean: $(cat "$work/err")"
  mapfile -t cmds < <("$exe" --list-commands)
  [ "${#cmds[@]}" -ge 1 ] || fail "$b --list-commands listed nothing"
  first=${cmds[0]}
  expect 2 "unknown command" "$exe" "${first}x"
  grep -q "did you mean '$first'?" "$work/err" || fail "$b ${first}x: no did-you-mean: $(cat "$work/err")"
  for c in "${cmds[@]}"; do
    read -r -a words <<< "$c"
    for h in --help -h; do
      expect 0 "$b $c $h" "$exe" "${words[@]}" $h
      [ -s "$work/out" ] || fail "$b $c $h: nothing on stdout"
      grep -qi "usage" "$work/out" || fail "$b $c $h: no usage on stdout: $(head -3 "$work/out")"
      [ "$(grep -cxF -- "$(head -1 "$work/out")" "$work/out")" = 1 ] || fail "$b $c $h: the usage printed twice: $(cat "$work/out")"
    done
    expect 0 "$b help $c" "$exe" help "${words[@]}"
    [ "$(grep -c '^usage: ' "$work/out")" = 1 ] && grep -q "^usage: $b $c" "$work/out" ||
      fail "$b help $c: not that command's usage alone: $(head -5 "$work/out")"
    expect_version "$exe" "${words[@]}" --version
    # The command's first flag in its usage, misspelt by one letter.
    flag=$(grep -o -- '--[a-z][a-z0-9-]*[a-z0-9]' "$work/out" | grep -v -- '^--help$' | head -1 || true)
    if [ -n "$flag" ]; then
      expect 2 "unknown flag" "$exe" "${words[@]}" "${flag}x"
      grep -q -- "did you mean '\?$flag'\??" "$work/err" || fail "$b $c ${flag}x: no 'did you mean $flag?': $(cat "$work/err")"
    else
      expect 2 "flag of a command without flags" "$exe" "${words[@]}" --bogus
      grep -q -- "unknown flag --bogus" "$work/err" || fail "$b $c --bogus: $(cat "$work/err")"
    fi
    n=$((n + 1))
  done
done
# section.field=VALUE overrides are validated like the YAML (positional or --set), before any work.
expect 2 "a bad override" "$bin/dflash" train "$src/configs/tiny-cpu.yaml" run.epochs=many
grep -q "run.epochs: .*(override run.epochs=many)" "$work/err" || fail "train override: $(cat "$work/err")"
expect 2 "an unknown override key" "$bin/dflash" run "$src/configs/tiny-cpu.yaml" --set train.lrr=1 --plan
grep -q "train.lrr: .*did you mean 'lr'.*(override train.lrr=1)" "$work/err" || fail "run --set: $(cat "$work/err")"
expect 2 "a stray argument after the config" "$bin/dflash" run "$src/configs/tiny-cpu.yaml" extra.yaml
grep -q "unexpected argument 'extra.yaml'" "$work/err" || fail "run extra.yaml: $(cat "$work/err")"
expect 2 "help for an unknown command" "$bin/dflash" help rnu
grep -q "did you mean 'run'?" "$work/err" || fail "dflash help rnu: $(cat "$work/err")"
# Warnings and JSON of a data error skipped with --skip-bad, and a data error itself.
python3 -c 'import json; d = {"input_ids": list(range(1, 41)), "loss_mask": [0] * 8 + [1] * 32}; print(json.dumps(d)); print(json.dumps({"input_id": [1]})); print(json.dumps(d))' > "$work/bad.jsonl"
expect 0 "import --skip-bad" "$bin/dflash" data import --input "$work/bad.jsonl" --out "$work/shards" --skip-bad
grep -q "bad.jsonl:2" "$work/all" || fail "data import --skip-bad named no FILE:LINE: $(cat "$work/err")"
expect 4 "import without --skip-bad" "$bin/dflash" data import --input "$work/bad.jsonl" --out "$work/shards2"
# User-facing output (usage errors, warnings, JSON, data errors) carries no source location unless
# DFLASH_LOG_LEVEL=debug.
! grep -Eq '\.(cc|h|cpp|cu|cuh):[0-9]+\]' "$work/all" ||
  fail "a source location in user-facing output: $(grep -E '^==|\.(cc|h|cpp|cu|cuh):[0-9]+\]' "$work/all" | grep -B1 -E '\.(cc|h|cpp|cu|cuh):[0-9]+\]' | head -6)"
expect 2 "a stray argument after the config" "$bin/dflash" run "$src/configs/tiny-cpu.yaml" extra.yaml
expect 2 "debug level" env DFLASH_LOG_LEVEL=debug "$bin/dflash" run "$src/configs/tiny-cpu.yaml" extra.yaml
grep -q '\.cc:[0-9]*\]' "$work/err" || fail "no source location at debug level: $(cat "$work/err")"
grep -Eq '^E [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z \[dflash\] ' "$work/err" ||
  fail "log line format: $(cat "$work/err")"
echo "PASS: $n commands of 3 binaries: --help/-h on stdout, --version with commit ${commit:-?}, unknown flags and commands"
