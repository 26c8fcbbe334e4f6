#!/bin/sh
# `dflash data import` end to end: exit codes 0 / 4 (bad line, nothing written) / 2 (existing DIR).
# usage: cli_import_test.sh PATH/TO/dflash WORKDIR
set -u
DFLASH=$1
W=$2
rm -rf "$W" && mkdir -p "$W" || exit 1
fail() { echo "FAIL: $*"; exit 1; }

printf '%s\n' '{"input_ids": [1,2,3,4,5,6,7,8,9,10], "loss_mask": [0,0,1,1,1,1,1,1,1,1]}' \
  '{"input_ids": [5,6,7,8,9,10,11,12], "labels": [-100,6,7,8,9,10,11,12]}' > "$W/good.jsonl"
printf '%s\n' '{"input_ids": [1,2,3,4,5,6,7,8,9]}' '{"input_ids": [1, "x"]}' > "$W/bad.jsonl"

"$DFLASH" data import --input "$W/good.jsonl" --out "$W/ds" --block-size 2 > "$W/summary.json"
[ $? -eq 0 ] || fail "good import did not exit 0"
grep -q '"documents": 2' "$W/summary.json" || fail "summary lacks documents=2: $(cat "$W/summary.json")"
[ -f "$W/ds/manifest.json" ] && [ -f "$W/ds/index.bin" ] && [ -f "$W/ds/shard-00000.bin" ] || fail "dataset files missing"

"$DFLASH" data import --input "$W/good.jsonl" --out "$W/ds" --block-size 2 2> "$W/err2.txt"
rc=$?; [ $rc -eq 2 ] || fail "import into a non-empty DIR exited $rc, expected 2"

"$DFLASH" data import --input "$W/good.jsonl,$W/bad.jsonl" --out "$W/ds_bad" --block-size 2 2> "$W/err4.txt"
rc=$?; [ $rc -eq 4 ] || fail "bad line exited $rc, expected 4"
grep -q "bad.jsonl:2" "$W/err4.txt" || fail "error does not name bad.jsonl:2: $(cat "$W/err4.txt")"
[ ! -e "$W/ds_bad" ] || fail "a partial dataset was left behind"
for f in "$W"/ds_bad.tmp-*; do if [ -e "$f" ]; then fail "temporary directory left behind"; fi; done

"$DFLASH" data import --input "$W/good.jsonl,$W/bad.jsonl" --out "$W/ds_skip" --block-size 2 --skip-bad > "$W/skip.json"
[ $? -eq 0 ] || fail "--skip-bad import did not exit 0"
grep -q '"skipped_bad": 1' "$W/skip.json" || fail "summary lacks skipped_bad=1: $(cat "$W/skip.json")"

# A line that is not UTF-8: named as FILE:LINE (exit 4), or counted and skipped with --skip-bad.
printf '{"input_ids": [1,2,3,4,5,6,7,8,9], "note": "\377"}\n' > "$W/latin1.jsonl"
"$DFLASH" data import --input "$W/good.jsonl,$W/latin1.jsonl" --out "$W/ds_u8" --block-size 2 2> "$W/err_u8.txt"
rc=$?; [ $rc -eq 4 ] || fail "a non-UTF-8 line exited $rc, expected 4"
grep -q "latin1.jsonl:1: not UTF-8 text" "$W/err_u8.txt" || fail "error does not name latin1.jsonl:1: $(cat "$W/err_u8.txt")"
"$DFLASH" data import --input "$W/good.jsonl,$W/latin1.jsonl" --out "$W/ds_u8" --block-size 2 --skip-bad > "$W/skip_u8.json"
rc=$?; [ $rc -eq 0 ] || fail "--skip-bad with a non-UTF-8 line exited $rc, expected 0"
grep -q '"skipped_bad": 1' "$W/skip_u8.json" || fail "summary lacks skipped_bad=1: $(cat "$W/skip_u8.json")"
echo "ok"
