#!/usr/bin/env python3
"""`dflash bench target --fp8 --baseline` on CPU (tiny dense and hybrid shapes, bf16): the report's
fields, and what a host without FP8 GEMMs must give: fp8_gemm false, so the FP8 model computes on the
dequantized weights exactly like the bf16 baseline (identical per-layer errors against fp32), and
those errors are those of bf16 (above 0, below 5e-2 relative). Usage: bench_fp8_check.py DFLASH."""
import json
import subprocess
import sys

dflash = sys.argv[1]
for shape, layers in (("tiny", 6), ("tiny-hybrid", 8)):
    out = subprocess.run([dflash, "bench", "target", "--shape", shape, "--device", "cpu", "--dtype", "bfloat16",
                          "--fp8", "--baseline", "--batches", "1x48,2x16", "--warmup", "0", "--repeats", "1"],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)["fp8"]
    assert r["fp8_gemm"] is False, r["fp8_gemm"]
    assert [b["batch"] for b in r["ours"]] == ["1x48", "2x16"], r["ours"]
    assert [b["batch"] for b in r["bf16"]["ours"]] == ["1x48", "2x16"], r["bf16"]
    assert len(r["speedup_vs_bf16"]) == 2 and all(s > 0 for s in r["speedup_vs_bf16"]), r["speedup_vs_bf16"]
    err = r["error_vs_fp32"]
    assert err["tokens"] == 48, err["tokens"]
    assert len(err["fp8"]) == layers and err["fp8"] == err["bf16"], err
    assert all(0 < e["rel_fro"] < 5e-2 and e["max_abs"] > 0 for e in err["bf16"]), err["bf16"]
    assert r["hf_fp8"].startswith("not run"), r["hf_fp8"]
    print(f"{shape}: bf16 rel_fro per layer {[round(e['rel_fro'], 5) for e in err['bf16']]}")
