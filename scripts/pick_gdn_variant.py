#!/usr/bin/env python3
"""Reads the GatedDeltaGpu.KernelSweep output (ctest -V log) and prints the environment settings of
the fastest scan variant at T=4096 whose fp32 error stays under 1e-4 (DFLASH_GDN_SCAN_VT=.. etc.).
Usage: pick_gdn_variant.py CTEST_LOG"""
import re, sys

best = None
pat = re.compile(r"GDN sweep T=(\d+) docs=\d+ vt=(\d+) warps=(\d+) prefetch=(\d+): prep ([\d.]+) ms, scan ([\d.]+) ms, "
                 r"call ([\d.]+) ms.*?rel_err fp32 ([\deE.+-]+)")
for line in open(sys.argv[1]):
    m = pat.search(line)
    if not m or m.group(1) != "4096" or float(m.group(8)) >= 1e-4:
        continue
    call = float(m.group(7))
    if best is None or call < best[0]:
        best = (call, m.group(2), m.group(3), m.group(4))
if best:
    print(f"DFLASH_GDN_SCAN_VT={best[1]} DFLASH_GDN_SCAN_WARPS={best[2]} DFLASH_GDN_SCAN_PREFETCH={best[3]}")
