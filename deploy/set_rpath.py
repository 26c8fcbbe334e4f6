#!/usr/bin/env python3
"""Rewrites an ELF executable's DT_RUNPATH/DT_RPATH in place to NEW (default "$ORIGIN/../lib")
and makes it a DT_RPATH, so the bundled lib/ is searched first for the executable AND for every
library it loads (a DT_RUNPATH applies to the executable's direct dependencies only, and the
bundled gRPC/abseil/... libraries carry no search path of their own). Environment-independent:
workers started through `pct exec` or `ssh` (no LD_LIBRARY_PATH) find their libraries too.

The new string is written over the old one in .dynstr (NUL-padded), so NEW must not be longer
than the existing path string; our binaries always carry the torch wheel's long lib path.
No patchelf/chrpath needed. 64-bit little-endian ELF only.
Usage: set_rpath.py FILE [NEW]   (prints the old and new value)"""
import struct
import sys

DT_NULL, DT_STRTAB, DT_RPATH, DT_RUNPATH = 0, 5, 15, 29
PT_LOAD, PT_DYNAMIC = 1, 2


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    path = sys.argv[1]
    new = (sys.argv[2] if len(sys.argv) == 3 else "$ORIGIN/../lib").encode()
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            sys.exit(f"{path}: not a 64-bit little-endian ELF file")
        e_phoff, = struct.unpack_from("<Q", data, 0x20)
        e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
        loads, dyn = [], None
        for i in range(e_phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, e_phoff + i * e_phentsize)
            if p_type == PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == PT_DYNAMIC:
                dyn = (p_offset, p_filesz)
        if dyn is None:
            sys.exit(f"{path}: no PT_DYNAMIC (statically linked?)")

        def file_offset(vaddr):
            for v, o, s in loads:
                if v <= vaddr < v + s:
                    return o + vaddr - v
            sys.exit(f"{path}: address {vaddr:#x} is in no PT_LOAD segment")

        strtab, path_entry = None, None
        for off in range(dyn[0], dyn[0] + dyn[1], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == DT_NULL:
                break
            if tag == DT_STRTAB:
                strtab = val
            elif tag in (DT_RPATH, DT_RUNPATH):
                if path_entry is not None:
                    sys.exit(f"{path}: both DT_RPATH and DT_RUNPATH present")
                path_entry = (off, tag, val)
        if strtab is None or path_entry is None:
            sys.exit(f"{path}: no DT_RUNPATH/DT_RPATH to rewrite (link with an rpath)")
        off, tag, val = path_entry
        start = file_offset(strtab) + val
        end = data.index(b"\0", start)
        old = bytes(data[start:end])
        if len(new) > len(old):
            sys.exit(f"{path}: new path '{new.decode()}' is longer than the old one '{old.decode()}'")
        data[start:end] = new + b"\0" * (len(old) - len(new))
        struct.pack_into("<q", data, off, DT_RPATH)
        f.seek(0)
        f.write(data)
    kind = "RUNPATH" if tag == DT_RUNPATH else "RPATH"
    print(f"{path}: {kind} {old.decode()} -> RPATH {new.decode()}")


if __name__ == "__main__":
    main()
