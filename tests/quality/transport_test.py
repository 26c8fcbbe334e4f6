#!/usr/bin/env python3
"""scripts/quality/transport.py without the GGUF conversion (usage: transport_test.py SOURCE_DIR WORK):
a fake bundle (a 3 MiB "GGUF", pylib, the model's small files and a safetensors, a data file over
1 MiB that travels gzip) packed into parts of at most 1.5 MiB. Checks:
  - every part is at most 1.5 MiB, carries index.json with the pack id, the number of parts and
    every file's sha256; the chunks of each file tile it;
  - parts stored over two batches (in reverse order): the first batch leaves exactly the other
    parts missing; after the second, assemble() rebuilds every file with the bundle's bytes;
  - a damaged chunk, and a part of another pack, are refused (TransportError naming them);
  - safetensors_tensor_digests() ignores the header order and sees a changed tensor;
  - the reference modules travel (SpecForge, speculators, pydantic, typing_extensions) and
    install_ref_wheels() extracts the binary wheel of the asked CPython version into refpy, and
    refuses a version with no wheel.
The round trip with the real conversion is in tests/quality/fetch_test.sh. Exit 0 when all hold."""
import hashlib
import io
import json
import os
import shutil
import sys
import zipfile

import torch
from safetensors.torch import save_file
from verdict import verdict


def fake_wheel(tag):
    """A wheel of a package 'pydantic_core' built for CPython `tag`, its module naming the tag."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pydantic_core/__init__.py", f"TAG = {tag!r}\n")
        z.writestr("pydantic_core-9.9.9.dist-info/WHEEL", f"Tag: {tag}-{tag}-manylinux_2_17_x86_64\n")
    return buf.getvalue()


def ref_checks(transport, dest):
    fails = []
    import importlib.metadata
    meta = f"speculators-{importlib.metadata.version('speculators')}.dist-info/METADATA"  # its version check reads it
    for name in ("specforge/__init__.py", "speculators/__init__.py", "pydantic/__init__.py", "typing_extensions.py",
                 "annotated_types/__init__.py", "typing_inspection/__init__.py", meta):
        if not os.path.isfile(os.path.join(dest, "refpy", name)):
            fails.append(f"refpy/{name} not shipped")
    done = transport.install_ref_wheels(dest, "cp312")
    got = open(os.path.join(dest, "refpy", "pydantic_core", "__init__.py")).read()
    if done != ["pydantic_core-9.9.9-cp312-cp312-manylinux_2_17_x86_64.whl"] or "cp312" not in got:
        fails.append(f"install_ref_wheels(cp312): {done}, module {got!r}")
    try:
        transport.install_ref_wheels(dest, "cp399")
        fails.append("a CPython version without a wheel was accepted")
    except transport.TransportError as e:
        if "cp399" not in str(e):
            fails.append(f"no wheel: message {e}")
    return fails


def main():
    src, work = sys.argv[1:3]
    sys.path.insert(0, os.path.join(src, "scripts", "quality"))
    import transport
    shutil.rmtree(work, ignore_errors=True)
    b = os.path.join(work, "bundle")
    rnd = torch.Generator().manual_seed(0)
    files = {"gguf/" + transport.GGUF_NAME: torch.randint(0, 256, (3 << 20,), generator=rnd, dtype=torch.uint8).numpy().tobytes(),
             "pylib/acc/__init__.py": b"X = 1\n", "model/config.json": b'{"a": 1}', "model/tokenizer.json": b"{}",
             "data/train.jsonl": b"".join(b'{"input_ids": [%d, 2, 3]}\n' % i for i in range(60000)),
             "data/heldout_prompts.jsonl": b'{"input_ids": [1]}\n'}
    for tag in ("cp311", "cp312"):
        files[f"{transport.REF_WHEELS}/pydantic_core-9.9.9-{tag}-{tag}-manylinux_2_17_x86_64.whl"] = fake_wheel(tag)
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(b, name)), exist_ok=True)
        open(os.path.join(b, name), "wb").write(data)
    st = os.path.join(b, "model", "model.safetensors")
    save_file({"w": torch.arange(6.0).reshape(2, 3), "e": torch.ones(4)}, st)
    manifest = {"files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items() if n.startswith(("model/", "data/"))}}
    manifest["files"]["model/model.safetensors"] = transport.sha256_file(st)
    json.dump(manifest, open(os.path.join(b, "manifest.json"), "w"))
    fails = []
    packdir = os.path.join(work, "pack")
    index = transport.pack(b, packdir, "1.5")
    sizes = transport.part_sizes(packdir, index)
    if index["parts"] < 3 or max(sizes) > 1.5 * transport.MIB:
        fails.append(f"parts {index['parts']} sizes {sizes}")
    for e in index["files"]:
        if sum(c["length"] for c in e["chunks"]) != e["payload_size"]:
            fails.append(f"{e['name']}: chunks do not tile the payload")
    if next(e for e in index["files"] if e["name"] == "data/train.jsonl")["encoding"] != "gzip":
        fails.append("data/train.jsonl did not travel gzip")
    parts = sorted(os.path.join(packdir, d) for d in os.listdir(packdir))
    if any(json.load(open(os.path.join(p, "index.json")))["pack_id"] != index["pack_id"] for p in parts):
        fails.append("a part's index.json names another pack")
    dest = os.path.join(work, "dest")
    incoming = os.path.join(dest, ".incoming")
    transport.store_parts(parts[:0:-1], incoming)  # all but the first, in reverse order
    if transport.missing_parts(index, incoming) != [1]:
        fails.append(f"missing after the first batch: {transport.missing_parts(index, incoming)}")
    transport.store_parts(parts[:1], incoming)
    if transport.missing_parts(index, incoming):
        fails.append("parts missing after all were stored")
    transport.assemble(index, incoming, dest)
    for name, data in files.items():
        if not name.startswith("model/") and open(os.path.join(dest, name), "rb").read() != data:
            fails.append(f"{name}: rebuilt bytes differ")
    fails += ref_checks(transport, dest)
    chunk = os.path.join(parts[0], sorted(f for f in os.listdir(parts[0]) if f.endswith(".bin"))[0])
    open(chunk, "r+b").write(b"\0\0\0\0")
    for bad, what in ((parts[:1], "damaged"), ([parts[1]], "pack")):
        if what == "pack":
            other = os.path.join(work, "other")
            idx = json.load(open(os.path.join(parts[1], "index.json")))
            shutil.copytree(parts[1], other)
            json.dump(dict(idx, pack_id="0" * 16), open(os.path.join(other, "index.json"), "w"))
            bad = [other]
        try:
            transport.store_parts(bad, os.path.join(work, "dest2", ".incoming") if what == "damaged" else incoming)
            fails.append(f"{what} part accepted")
        except transport.TransportError as e:
            if what not in str(e):
                fails.append(f"{what}: message {e}")
    d1 = transport.safetensors_tensor_digests(st)
    save_file({"e": torch.ones(4), "w": torch.arange(6.0).reshape(2, 3)}, st)
    d2 = transport.safetensors_tensor_digests(st)
    save_file({"e": torch.ones(4), "w": torch.arange(6.0).reshape(2, 3) + 1}, st)
    if d1 != d2 or transport.safetensors_tensor_digests(st)["w"] == d1["w"]:
        fails.append("tensor digests depend on the header order or miss a change")
    print(f"{index['parts']} parts, MiB {[round(s / transport.MIB, 2) for s in sizes]}, {len(index['files'])} files")
    return verdict(fails)


if __name__ == "__main__":
    sys.exit(main())
