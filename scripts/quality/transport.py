"""The quality run's transport to the GPU host (docs/quality.md, "How to reproduce"): `run.py pack`
cuts what the host needs out of a fetched bundle into parts of bounded size, `run.py unpack`
gathers the parts (over several device calls) and rebuilds the bundle there.

What travels (DEST is the rebuilt bundle):
  gguf/<GGUF_NAME>          the quantized model (98 MB; the float32 HF folder is 540 MB, it is
                            rebuilt on the host by scripts/quality/convert_gguf.py)
  pylib/                    the converter's pure-Python libraries the host lacks (gguf, accelerate,
                            psutil), put on sys.path by convert_gguf.py --pylib only
  refpy/specforge, refpy/dflash
                            SpecForge 0.2.0 and z-lab's `dflash` (both MIT, their LICENSE files
                            beside them), imported as modules by the reference steps of `run.py
                            gpu`; never part of our sources
  refpy/speculators, refpy/pydantic, refpy/typing_inspection, refpy/annotated_types,
  refpy/typing_extensions.py
                            vLLM speculators 0.9.0 (Apache-2.0; the successors' reference loop) and
                            the pure-Python part of what its models import that the host lacks
                            (pydantic 2 and its helpers; typing_extensions at the version pydantic
                            asks for), from the Python running `pack`
  refwheels/*.whl           pydantic_core (compiled) as binary wheels for several CPython versions
                            (`run.py fetch` downloads them); unpack extracts the one of the host's
                            Python into refpy (install_ref_wheels)
  model/<small files>       the bundle's config, generation config and tokenizer files, so the
                            rebuilt folder is the bundle's byte for byte
  data/*                    the prepared data (large files gzip-compressed in transit)
  manifest.json             the bundle's manifest (sha256 of every model and data file)

A part is a folder PACKDIR/part-NN holding chunk files and index.json: the pack id, the number of
parts, every file of the pack (name, size, sha256, how it travels, its chunks: part, offset,
length, sha256), so any single part tells what the whole pack is. Parts may arrive in any order
and over several calls; unpack stores their chunks in DEST/.incoming and finishes when all are there.
"""
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

MIB = 1 << 20
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SpecForge 0.2.0, z-lab dflash, speculators 0.9.0 and the pure-Python packages its models need.
REFERENCE_MODULES = ("specforge", "dflash", "speculators", "pydantic", "typing_inspection", "annotated_types")
REFERENCE_SINGLE_FILES = ("typing_extensions",)  # one-file modules
REF_WHEELS = "refwheels"  # binary wheels (pydantic_core), one per CPython version
COMPLETE = ".complete"
EXIT_INCOMPLETE = 3


class TransportError(Exception):
    """A part or a file that is missing, damaged or inconsistent (message names it)."""


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(b):
    return hashlib.sha256(b).hexdigest()


def parse_part_mib(text):
    """'36' or '36,58': the size limit of part k is the k-th value (MiB), the last one repeating."""
    try:
        sizes = [float(x) for x in text.split(",")]
    except ValueError:
        raise TransportError(f"--part-mib: expected N or N1,N2,... (MiB), got '{text}'")
    if not sizes or any(s <= 0 for s in sizes):
        raise TransportError(f"--part-mib: every size must be > 0, got '{text}'")
    return [int(s * MIB) for s in sizes]


def module_dir(name):
    """The installed package directory of module `name` and its dist-info licence files."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise TransportError(f"the Python running this has no package '{name}' to ship")
    pkg = list(spec.submodule_search_locations)[0]
    site = os.path.dirname(pkg)
    licences = []
    for d in sorted(os.listdir(site)):
        if d.startswith(name + "-") and d.endswith(".dist-info"):
            for dp, _, fs in os.walk(os.path.join(site, d)):
                licences += [os.path.join(dp, f) for f in fs if f.upper().startswith(("LICENSE", "LICENCE"))]
    return pkg, licences


def dist_metadata(name, site):
    """(path, dist-info folder name) of the METADATA of module `name`'s distribution in `site`, or
    None: shipped so that importlib.metadata answers for it on the host (speculators' own version
    check reads it)."""
    for d in sorted(os.listdir(site)):
        if d.lower().startswith(name.lower() + "-") and d.endswith(".dist-info") \
                and os.path.isfile(os.path.join(site, d, "METADATA")):
            return os.path.join(site, d, "METADATA"), d
    return None


def module_file(name):
    """The source file of a one-file module (e.g. typing_extensions.py)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise TransportError(f"the Python running this has no one-file module '{name}' to ship")
    return spec.origin


def tree_files(src, dest_prefix):
    """(source path, pack name) of every file under src except caches."""
    out = []
    for dp, dns, fs in os.walk(src):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        for f in sorted(fs):
            if not f.endswith(".pyc"):
                p = os.path.join(dp, f)
                out.append((p, dest_prefix + "/" + os.path.relpath(p, src)))
    return out


def pack_sources(bundle):
    """(source path, pack name, gzip?) of everything the host needs, in a fixed order."""
    need = [os.path.join(bundle, "manifest.json"), os.path.join(bundle, "gguf", GGUF_NAME),
            os.path.join(bundle, "pylib"), os.path.join(bundle, "model", "config.json")]
    for p in need:
        if not os.path.exists(p):
            raise TransportError(f"{p}: missing (run `run.py fetch` first)")
    files = [(os.path.join(bundle, "manifest.json"), "manifest.json", False),
             (os.path.join(bundle, "gguf", GGUF_NAME), "gguf/" + GGUF_NAME, False)]
    files += [(p, n, False) for p, n in tree_files(os.path.join(bundle, "pylib"), "pylib")]
    for name in REFERENCE_MODULES:
        pkg, licences = module_dir(name)
        files += [(p, n, False) for p, n in tree_files(pkg, "refpy/" + name)]
        files += [(p, f"refpy/{name}/{os.path.basename(p)}.dist", False) for p in licences]
        meta = dist_metadata(name, os.path.dirname(pkg))
        files += [(meta[0], f"refpy/{meta[1]}/METADATA", False)] if meta else []
    for name in REFERENCE_SINGLE_FILES:
        files.append((module_file(name), f"refpy/{name}.py", False))
        meta = dist_metadata(name, os.path.dirname(module_file(name)))
        files += [(meta[0], f"refpy/{meta[1]}/METADATA", False)] if meta else []
    wheels = os.path.join(bundle, REF_WHEELS)
    found = sorted(f for f in os.listdir(wheels) if f.endswith(".whl")) if os.path.isdir(wheels) else []
    if not found:
        raise TransportError(f"{wheels}: no binary wheels (pydantic_core; run `run.py fetch` first)")
    files += [(os.path.join(wheels, f), f"{REF_WHEELS}/{f}", False) for f in found]
    model = os.path.join(bundle, "model")
    files += [(os.path.join(model, f), "model/" + f, False) for f in sorted(os.listdir(model))
              if f != "model.safetensors" and os.path.isfile(os.path.join(model, f))]
    data = os.path.join(bundle, "data")
    files += [(os.path.join(data, f), "data/" + f, os.path.getsize(os.path.join(data, f)) > MIB)
              for f in sorted(os.listdir(data))]
    return files


def safetensors_tensor_digests(path):
    """sha256 of every tensor's raw bytes in a safetensors file (header order does not matter)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, meta in sorted(header.items()):
            if name == "__metadata__":
                continue
            a, b = meta["data_offsets"]
            f.seek(base + a)
            out[name] = {"dtype": meta["dtype"], "shape": meta["shape"], "sha256": sha256_bytes(f.read(b - a))}
    return out


def payload(src, compress):
    if not compress:
        return open(src, "rb").read()
    with open(src, "rb") as f:
        return gzip.compress(f.read(), compresslevel=6, mtime=0)


def cut(entries, blobs, limits):
    """Sets each entry's chunks: the payloads in order, cut into parts of at most limits[k] bytes
    (a file may span parts; the last limit repeats). Returns the number of parts."""
    if min(limits) <= 0:
        raise TransportError("--part-mib: a part is too small for its index.json")
    part, used, chunk_no = 0, 0, 0
    for e, data in zip(entries, blobs):
        e["chunks"], off = [], 0
        while True:
            limit = limits[min(part, len(limits) - 1)]
            if used >= limit and off < len(data):
                part, used = part + 1, 0
                continue
            n = min(len(data) - off, limit - used)
            e["chunks"].append({"part": part + 1, "file": f"{chunk_no:04d}.bin", "offset": off, "length": n,
                                "sha256": sha256_bytes(data[off:off + n])})
            chunk_no, off, used = chunk_no + 1, off + n, used + n
            if off >= len(data):
                break
    return part + 1


def pack(bundle, packdir, part_mib):
    """Writes PACKDIR/part-01 .. part-NN (see the module doc); returns the index (a dict)."""
    bundle, limits = os.path.abspath(bundle), parse_part_mib(part_mib)
    entries, blobs = [], []
    for src, name, compress in pack_sources(bundle):
        data = payload(src, compress)
        entries.append({"name": name, "size": os.path.getsize(src), "sha256": sha256_file(src),
                        "encoding": "gzip" if compress else "raw", "payload_size": len(data), "chunks": []})
        blobs.append(data)
    manifest = json.load(open(os.path.join(bundle, "manifest.json")))
    index = {"format": "dflash-quality-pack 1", "parts": 0, "files": entries,
             "model_files": {k[len("model/"):]: v for k, v in manifest["files"].items() if k.startswith("model/")},
             "model_tensors": safetensors_tensor_digests(os.path.join(bundle, "model", "model.safetensors")),
             "gguf": "gguf/" + GGUF_NAME}
    # Each part holds index.json beside its chunks: cut once, then again with room for the index.
    cut(entries, blobs, limits)
    reserve = 2 * len(json.dumps(index, indent=1))
    index["parts"] = cut(entries, blobs, [lim - reserve for lim in limits])
    n_parts = index["parts"]
    index["pack_id"] = sha256_bytes(json.dumps(index, sort_keys=True).encode())[:16]
    if os.path.exists(packdir):
        shutil.rmtree(packdir)
    for k in range(1, n_parts + 1):
        d = os.path.join(packdir, f"part-{k:02d}")
        os.makedirs(d)
        json.dump(dict(index, part=k), open(os.path.join(d, "index.json"), "w"), indent=1)
    for e, data in zip(entries, blobs):
        for c in e["chunks"]:
            with open(os.path.join(packdir, f"part-{c['part']:02d}", c["file"]), "wb") as f:
                f.write(data[c["offset"]:c["offset"] + c["length"]])
    return index


def part_sizes(packdir, index):
    return [sum(os.path.getsize(os.path.join(packdir, f"part-{k:02d}", f))
                for f in os.listdir(os.path.join(packdir, f"part-{k:02d}"))) for k in range(1, index["parts"] + 1)]


def part_dirs(paths):
    """Every part folder among `paths` (a part folder itself, or a folder holding part-NN folders)."""
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "index.json")):
            out.append(p)
        elif os.path.isdir(p):
            subs = sorted(os.path.join(p, d) for d in os.listdir(p) if os.path.isfile(os.path.join(p, d, "index.json")))
            if not subs:
                raise TransportError(f"{p}: neither a part (index.json) nor a folder of parts")
            out += subs
        else:
            raise TransportError(f"{p}: no such part folder")
    return out


def store_parts(parts, incoming):
    """Copies each part's chunks (sha256 checked) into DEST/.incoming; returns the pack index."""
    index = None
    os.makedirs(incoming, exist_ok=True)
    idx_path = os.path.join(incoming, "index.json")
    if os.path.isfile(idx_path):
        index = json.load(open(idx_path))
    for p in parts:
        pi = json.load(open(os.path.join(p, "index.json")))
        if index is not None and pi["pack_id"] != index["pack_id"]:
            raise TransportError(f"{p}: part of pack {pi['pack_id']}, but {incoming} holds pack {index['pack_id']} "
                                 "(clear DEST to switch packs)")
        index = index or {k: v for k, v in pi.items() if k != "part"}
        for e in pi["files"]:
            for c in e["chunks"]:
                if c["part"] != pi["part"]:
                    continue
                data = open(os.path.join(p, c["file"]), "rb").read()
                if len(data) != c["length"] or sha256_bytes(data) != c["sha256"]:
                    raise TransportError(f"{p}/{c['file']} ({e['name']}): damaged (length or sha256 differs from index.json)")
                tmp = os.path.join(incoming, c["file"] + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(incoming, c["file"]))
        json.dump(index, open(idx_path + ".tmp", "w"))
        os.replace(idx_path + ".tmp", idx_path)
    if index is None:
        raise TransportError("no part given")
    return index


def missing_parts(index, incoming):
    return sorted({c["part"] for e in index["files"] for c in e["chunks"]
                   if not os.path.isfile(os.path.join(incoming, c["file"]))})


def assemble(index, incoming, dest):
    """Every file of the pack into DEST (gunzipped when it travelled gzip), sha256 checked."""
    for e in index["files"]:
        data = b"".join(open(os.path.join(incoming, c["file"]), "rb").read() for c in e["chunks"])
        if e["encoding"] == "gzip":
            data = gzip.decompress(data)
        if len(data) != e["size"] or sha256_bytes(data) != e["sha256"]:
            raise TransportError(f"{e['name']}: reassembled file differs from the index (size or sha256)")
        out = os.path.join(dest, e["name"])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(data)


def rebuild_model(index, dest, python):
    """The HF folder from the GGUF (convert_gguf.py, float32, as `run.py fetch` makes it), then the
    bundle's small files over it; model.safetensors must hold the bundle's tensors bit for bit.
    Returns how model.safetensors compares ("identical file" or "same tensors, other header")."""
    model = os.path.join(dest, "model")
    small = {f: open(os.path.join(model, f), "rb").read() for f in os.listdir(model)}
    conv = tempfile.mkdtemp(prefix="convert-", dir=dest)
    out = os.path.join(conv, "model")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([python, os.path.join(here, "convert_gguf.py"), "--gguf", os.path.join(dest, index["gguf"]),
                        "--out", out, "--pylib", os.path.join(dest, "pylib")], capture_output=True, text=True)
    if r.returncode != 0:
        raise TransportError(f"convert_gguf.py exited {r.returncode}: {r.stderr[-3000:]}")
    st = os.path.join(out, "model.safetensors")
    want = index["model_files"]["model.safetensors"]
    if sha256_file(st) == want:
        how = "identical file"
    else:
        got, ref = safetensors_tensor_digests(st), index["model_tensors"]
        bad = sorted(k for k in set(got) | set(ref) if got.get(k) != ref.get(k))
        if bad:
            raise TransportError(f"converted model.safetensors differs from the bundle's in {len(bad)} tensors "
                                 f"(first: {bad[:3]}); this host's transformers/gguf convert differently")
        how = "same tensors, other header"
    for f, data in small.items():
        with open(os.path.join(out, f), "wb") as fh:
            fh.write(data)
    for f in os.listdir(out):
        if f != "model.safetensors" and f not in small:
            os.remove(os.path.join(out, f))
    for f, digest in index["model_files"].items():
        p = os.path.join(out, f)
        if f != "model.safetensors" and (not os.path.isfile(p) or sha256_file(p) != digest):
            raise TransportError(f"model/{f}: missing or differs from the bundle's manifest")
    shutil.rmtree(model)
    os.rename(out, model)
    shutil.rmtree(conv)
    return how


def install_ref_wheels(dest, tag=None):
    """Extracts each binary wheel of DEST/refwheels built for this Python (tag `cpXY`, default the
    running interpreter's) into DEST/refpy; returns the wheels extracted. A package with wheels but
    none for this Python is an error naming the versions there are."""
    import zipfile
    tag = tag or f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = os.path.join(dest, REF_WHEELS)
    by_package = {}
    for f in sorted(os.listdir(wheels)) if os.path.isdir(wheels) else []:
        if f.endswith(".whl"):
            by_package.setdefault(f.split("-")[0], []).append(f)
    done = []
    for package, names in sorted(by_package.items()):
        mine = [f for f in names if f.split("-")[2] == tag]
        if not mine:
            raise TransportError(f"{wheels}: no {package} wheel for this Python ({tag}); there are {names}")
        with zipfile.ZipFile(os.path.join(wheels, mine[0])) as z:
            z.extractall(os.path.join(dest, "refpy"))
        done.append(mine[0])
    return done


def unpack(paths, dest, python):
    """Stores the given parts in DEST; when every part is there, rebuilds the bundle in DEST.
    Returns a status dict: complete (bool), missing_parts, model (how the rebuilt model compares)."""
    dest = os.path.abspath(dest)
    parts = part_dirs(paths)
    done_path = os.path.join(dest, COMPLETE)
    if os.path.isfile(done_path):
        done = json.load(open(done_path))
        ids = {json.load(open(os.path.join(p, "index.json")))["pack_id"] for p in parts}
        if ids <= {done["pack_id"]}:
            return done  # rebuilt by an earlier call
        raise TransportError(f"{dest} holds pack {done['pack_id']}, the parts are of {sorted(ids)} (clear DEST)")
    incoming = os.path.join(dest, ".incoming")
    index = store_parts(parts, incoming)
    missing = missing_parts(index, incoming)
    status = {"pack_id": index["pack_id"], "parts": index["parts"], "missing_parts": missing, "complete": False}
    if missing:
        return status
    assemble(index, incoming, dest)
    status.update(complete=True, model=rebuild_model(index, dest, python), ref_wheels=install_ref_wheels(dest))
    json.dump(status, open(os.path.join(dest, COMPLETE), "w"))
    shutil.rmtree(incoming)
    return status
