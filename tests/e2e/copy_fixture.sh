# shellcheck shell=bash disable=SC2154  # $py and $src are the sourcing script's
# Sourced by the e2e tests that need a target a tiny drafter can learn from:
#   copy_target_fixture OUT_DIR
# writes OUT_DIR/target (make_copy_target.py, 500 steps), OUT_DIR/train.jsonl (256 phrase prompts of
# 12 tokens with 60 tokens of that target's greedy continuation, seed 1), OUT_DIR/heldout.jsonl and
# OUT_DIR/prompts.jsonl (6 held-out ones, seed 999, and their prompts alone). Deterministic and most
# of a minute of CPU to make: cached (tests/common/fixture_cache.sh). Needs $py and $src.
# shellcheck source=../common/fixture_cache.sh
source "$src/tests/common/fixture_cache.sh"

make_copy_fixture() {
  local out=$1
  "$py" "$src/scripts/reference/make_copy_target.py" --out "$out/target" --steps 500
  local gen=("$py" "$src/scripts/reference/make_target_data.py" --target "$out/target" --phrase-prompts
             --prompt-len 12 --new-tokens 60)
  "${gen[@]}" --out "$out/train.jsonl" --n 256 --seed 1
  "${gen[@]}" --out "$out/heldout.jsonl" --prompts-out "$out/prompts.jsonl" --n 6 --seed 999
}

copy_target_fixture() {
  fixture_cached "$1" "copy target: 500 steps; data: phrase prompts of 12, 60 new tokens, 256 with seed 1, 6 held out with seed 999" \
    "$src/scripts/reference/make_copy_target.py" "$src/scripts/reference/make_target_data.py" -- make_copy_fixture "$1"
}
