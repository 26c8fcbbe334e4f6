#!/usr/bin/env bash
# `dflash bench pipeline` on CPU with the tiny qwen3 test model over shm: 1 target server + 1 drafter
# trainer as processes; checks the JSON fields and that every batch's checksum was verified.
# Usage: bench_pipeline.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
rm -rf "$work" && mkdir -p "$work"
"$bin/dflash" bench pipeline --transport shm --model "$data/qwen3" --device cpu --samples 24 --seq-len 64 \
  --work "$work" --timeout-s 600 --drafter-env BENCH_NOTE=drafter,BENCH_SECOND=2 \
  > "$work/bench.json" 2> "$work/bench.log" || { tail -40 "$work/bench.log"; exit 1; }
cat "$work/bench.json"
"$py" - "$work/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ["transport", "tokens", "batches", "tokens_per_s", "tokens_per_s_wall", "drafter_wait_fraction",
          "target_pack_send_over_forward", "target_credit_wait_fraction", "checksums_verified", "checksums_all_verified",
          "processes", "wall_s"]:
    assert k in r, f"missing field {k}"
assert r["transport"] == "shm"
assert r["batches"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0, r
assert r["checksums_all_verified"] is True and r["checksums_verified"] == r["batches"], r
assert 0 <= r["drafter_wait_fraction"] <= 1, r
# Rates are over the drafter's training: its loop without the checkpoint writes (the final step
# always saves one, so they are > 0), and the loop rate is the lower one.
d = r["processes"]["drafter"]["result"]
assert r["drafter_checkpoint_s"] > 0 and d["checkpoint_seconds"] == r["drafter_checkpoint_s"], r
assert abs(d["train_seconds"] + d["checkpoint_seconds"] - d["loop_seconds"]) < 1e-6, d
assert r["tokens_per_s_loop"] < r["tokens_per_s"], r
assert abs(r["tokens_per_s"] - r["tokens"] / d["train_seconds"]) < 1e-6 * r["tokens_per_s"], r
# The link's verifier thread checks batches as they land; those that waited for the drafter were
# checked before it asked (on CPU the drafter is the slow side, so batches do wait).
assert 0 < r["checksums_verified_ahead"] <= r["checksums_verified"], r
# The steady fraction leaves out the first micro-batch's wait (the target starting up): never above
# the whole-loop fraction, and the first wait is part of the total.
assert 0 <= r["drafter_first_wait_s"] <= d["wait_seconds"] + 1e-9, r
assert 0 <= r["drafter_wait_fraction_steady"] <= r["drafter_wait_fraction"] + 1e-9, r
assert r["target_pack_send_over_forward"] >= 0, r
for role in ["target", "drafter"]:
    p = r["processes"][role]
    assert p["peak_rss_bytes"] > 10 << 20, (role, p)
    assert "peak_gpu_allocated_bytes" in p and "peak_gpu_reserved_bytes" in p, (role, p)
# 24 documents of 64 tokens, 4 per batch: 6 batches, all trained by the single drafter.
assert r["batches"] == 6 and r["tokens"] == 24 * 64, r
assert r["config"]["drafter_env"] == ["BENCH_NOTE=drafter", "BENCH_SECOND=2"] and r["config"]["target_env"] == [], r["config"]
print("bench pipeline JSON OK:", r["batches"], "batches,", round(r["tokens_per_s"]), "tok/s")
PY
# --target-env reaches the target alone: a bad switch value there fails the target at start, and the
# bench says so (naming the target and the switch) instead of waiting out its timeout.
if "$bin/dflash" bench pipeline --transport shm --model "$data/qwen3" --device cpu --samples 8 --seq-len 64 \
  --work "$work/env" --timeout-s 300 --grace-s 2 --target-env DFLASH_C10D_SEND=bogus > "$work/env.json" 2> "$work/env.log"; then
  echo "FAIL: a bad switch value in --target-env did not fail the target"; exit 1
fi
grep -q 'target (pid' "$work/env.log" && grep -q 'DFLASH_C10D_SEND' "$work/env.log" || { tail -20 "$work/env.log"; echo FAIL; exit 1; }
# A malformed entry is refused before anything starts (exit 2, naming the flag).
rc=0
"$bin/dflash" bench pipeline --model "$data/qwen3" --drafter-env 1X=2 > /dev/null 2> "$work/bad.log" || rc=$?
[ "$rc" -eq 2 ] && grep -q -- '--drafter-env' "$work/bad.log" || { cat "$work/bad.log"; echo "FAIL: exit $rc"; exit 1; }
echo PASS
