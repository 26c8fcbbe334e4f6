#!/usr/bin/env python3
"""One line per `dflash bench drafter` JSON given: our median step, the baseline's, the ratio, MFU,
peak memory, the timed steps, for a successor method (--method) our DFlash step beside it, and for an
A/B (--ab), each value's median and ratio."""
import json
import sys

for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: unreadable ({e})")
        continue
    line = {k: d.get(k) for k in ("method", "context", "anchors", "soft_labels", "median_step_ms", "mfu", "peak_gib",
                                  "dflash_step_ms", "dflash_peak_gib", "step_ratio_vs_dflash",
                                  "baseline_kind", "baseline_median_step_ms", "baseline_peak_gib",
                                  "speedup_vs_baseline", "memory_ratio_vs_baseline")}
    line["step_ms"] = [round(x, 1) for x in d.get("step_ms", [])]
    if "ab" in d:
        line["ab"] = {k: d["ab"][k] for k in ("median_step_ms", "ratio_vs_first")}
    print(path.rsplit("/", 1)[-1], json.dumps(line))
