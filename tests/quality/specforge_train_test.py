#!/usr/bin/env python3
"""scripts/quality/specforge_train.py on CPU with the tiny Qwen3 target of the golden_models fixture
(usage: specforge_train_test.py SOURCE_DIR TESTDATA_DIR WORK BIN_DIR). Checks:
- 3 steps run; loss.jsonl has one finite loss per step and the lr of our schedule (warmup then cosine);
- the saved drafter is in the z-lab format: z-lab's DFlashDraftModel loads it with no missing /
  unexpected keys, with the block size, mask token and target layers of the shape it was given, and
  its forward runs;
- resume: a run stopped after step 1 (--stop-after, as on SIGTERM: exit 3, resume.pt written) and
  rerun gives the uninterrupted run's losses, lrs and drafter weights exactly, and removes resume.pt;
- --batches/--shards (our run's batches, `dflash run --plan --plan-batches`): each step trains
  exactly the listed samples of our shards, cut to the listed lengths (rows and tokens per step); a
  run stopped after step 1 and rerun gives the uninterrupted losses; a file with two micro-batches
  in a step is refused (exit 2 naming the line);
- scripts/quality/anchor_mix.py on that file: anchors per step and shares per spreading rule;
- the harness refuses --steps 0 (exit 2).
Exit 0 when all hold."""
import json
import math
import os
import shutil
import subprocess
import sys

import torch
from verdict import verdict


def planned_batches_checks(base, data, bin_dir, work):  # base[1]: the harness script
    """--batches F --shards DIR trains exactly F's samples, cut to F's lengths."""
    fails, shards = [], os.path.join(work, "shards")
    shutil.rmtree(shards, ignore_errors=True)  # a rerun's import needs a fresh directory
    r = subprocess.run([os.path.join(bin_dir, "dflash"), "data", "import", "--input", data, "--out", shards,
                        "--block-size", "4", "--skip-bad"], capture_output=True, text=True)  # one 1-token doc has a 2-entry mask
    if r.returncode != 0:
        return [f"dflash data import: exit {r.returncode}: {r.stderr[-500:]}"]
    sys.path.insert(0, os.path.dirname(base[1]))
    from token_shards import TokenShards
    full = [len(TokenShards(shards).sample(i)[0]) for i in range(4)]  # the import keeps 4 of the 6 documents
    steps = [[(1, full[1]), (0, 9)], [(3, full[3])], [(2, full[2]), (0, 11), (1, 10)]]
    plan = os.path.join(work, "batches.jsonl")
    with open(plan, "w") as f:
        for k, b in enumerate(steps):
            f.write(json.dumps({"step": k, "micro_batches": [{"drafter": 0, "micro": 0, "epoch": 0,
                                "samples": [i for i, _ in b], "lengths": [n for _, n in b]}]}) + "\n")
    out = os.path.join(work, "out-batches")
    argv = [a for a in base if a not in ("--data", data)]
    argv[argv.index(os.path.join(work, "out"))] = out
    r = subprocess.run(argv + ["--batches", plan, "--shards", shards, "--steps", "3"], capture_output=True, text=True)
    if r.returncode != 0:
        return [f"--batches: exit {r.returncode}: {r.stderr[-2000:]}"]
    log = [json.loads(line) for line in open(os.path.join(out, "loss.jsonl"))]
    got = [(e["rows"], e["tokens"]) for e in log]
    want = [(len(b), sum(n for _, n in b)) for b in steps]
    if got != want:
        fails.append(f"--batches: (rows, tokens) per step {got}, the file lists {want}")
    # Resumed after step 1 in this mode (the trained steps' documents are not read again): the
    # uninterrupted run's losses.
    out2 = out + "-resumed"
    argv2 = [x if x != out else out2 for x in argv] + ["--batches", plan, "--shards", shards, "--steps", "3"]
    r1 = subprocess.run(argv2 + ["--stop-after", "1"], capture_output=True, text=True)
    r2 = subprocess.run(argv2, capture_output=True, text=True)
    log2 = [json.loads(line) for line in open(os.path.join(out2, "loss.jsonl"))] if r2.returncode == 0 else []
    if r1.returncode != 3 or [(e["step"], e["loss"], e["tokens"]) for e in log2] != [(e["step"], e["loss"], e["tokens"]) for e in log]:
        fails.append(f"--batches resumed after step 1: exits {r1.returncode}, {r2.returncode}; losses "
                     f"{[(e['step'], e['loss']) for e in log2]} vs {[(e['step'], e['loss']) for e in log]}")
    with open(plan, "a") as f:  # a 4th step with two micro-batches (two drafters): not this harness's
        m = {"drafter": 0, "micro": 0, "epoch": 0, "samples": [0], "lengths": [8]}
        f.write(json.dumps({"step": 3, "micro_batches": [m, dict(m, drafter=1)]}) + "\n")
    r = subprocess.run(argv + ["--batches", plan, "--shards", shards, "--steps", "4"], capture_output=True, text=True)
    if r.returncode != 2 or "line 4" not in r.stderr:
        fails.append(f"--batches with two micro-batches in a step: exit {r.returncode} (want 2), {r.stderr[-300:]}")
    print(f"--batches: (rows, tokens) per step {got}")
    fails += anchor_mix_checks(os.path.dirname(base[1]), shards, plan, steps)
    return fails


def anchor_mix_checks(here, shards, plan, steps):
    """scripts/quality/anchor_mix.py on the same file (its 4th line, two micro-batches, cut off):
    the batch and document rules draw min(M, valid) per step, SpecForge's per-row rule at least that;
    every share is a fraction; the first step's valid anchors are counted as the shards hold them."""
    from token_shards import TokenShards
    good = os.path.join(os.path.dirname(plan), "batches3.jsonl")
    with open(good, "w") as f:
        f.writelines(open(plan).readlines()[:3])
    r = subprocess.run([sys.executable, os.path.join(here, "anchor_mix.py"), "--shards", shards, "--batches", good,
                        "--anchors", "8", "--early", "16"], capture_output=True, text=True)
    if r.returncode != 0:
        return [f"anchor_mix.py: exit {r.returncode}: {r.stderr[-500:]}"]
    res, fails = json.loads(r.stdout)["ours"], []
    ts = TokenShards(shards)
    valid = []
    for b in steps:
        n = 0
        for i, length in b:
            m = ts.sample(i, length)[1]
            n += sum(1 for p in range(length - 1) if m[p] and m[p + 1])
        valid.append(min(8, n))
    want = sum(valid) / len(valid)
    if abs(res["batch"]["anchors_per_step"] - want) > 0.05 or abs(res["document"]["anchors_per_step"] - want) > 0.05 \
            or res["row"]["anchors_per_step"] < want - 0.05:
        fails.append(f"anchor_mix anchors per step {[res[k]['anchors_per_step'] for k in ('batch', 'document', 'row')]}, "
                     f"expected {want:.2f} (row: at least)")
    shares = [res[k][q] for k in ("batch", "document", "row") for q in ("first_reply", "position_below_16")]
    if not all(0.0 <= x <= 1.0 for x in shares) or res["steps"] != 3:
        fails.append(f"anchor_mix shares {shares}, steps {res['steps']}")
    print(f"anchor_mix: {want:.2f} anchors per step, first-reply shares {shares[0::2]}")
    return fails


def main():
    src, testdata, work, bin_dir = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    target = os.path.join(testdata, "qwen3")
    t = json.load(open(os.path.join(target, "config.json")))
    shape_dir = os.path.join(work, "shape")
    os.makedirs(shape_dir, exist_ok=True)
    shape = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": t["hidden_size"],
             "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
             "head_dim": t["head_dim"], "intermediate_size": 96, "num_hidden_layers": 2,
             "rms_norm_eps": t["rms_norm_eps"], "rope_parameters": t["rope_parameters"],
             "vocab_size": t["vocab_size"], "max_position_embeddings": 512, "tie_word_embeddings": False,
             "block_size": 4, "num_target_layers": t["num_hidden_layers"],
             "dflash_config": {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": [0, 2]}}
    json.dump(shape, open(os.path.join(shape_dir, "config.json"), "w"))
    data = os.path.join(work, "docs.jsonl")
    with open(data, "w") as f:
        for line in open(os.path.join(testdata, "docs.jsonl")):
            if line.strip():
                ids = json.loads(line)["input_ids"]
                f.write(json.dumps({"input_ids": ids, "loss_mask": [0, 0] + [1] * (len(ids) - 2)}) + "\n")
    out = os.path.join(work, "out")
    script = os.path.join(src, "scripts", "quality", "specforge_train.py")
    base = [sys.executable, script, "--target", target, "--data", data, "--shape", shape_dir, "--out", out,
            "--device", "cpu", "--dtype", "float32", "--token-budget", "64", "--anchors", "8", "--gamma", "4",
            "--lr", "1e-3", "--warmup-ratio", "0.34"]
    fails = []
    r = subprocess.run(base + ["--steps", "3"], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL harness exited {r.returncode}: {r.stderr[-3000:]}")
        return 1
    log = [json.loads(line) for line in open(os.path.join(out, "loss.jsonl"))]
    want_lr = [1e-3 * (s + 1) / 2 if s < 2 else 1e-3 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 1)) for s in range(3)]
    if [e["step"] for e in log] != [1, 2, 3] or not all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in log):
        fails.append(f"loss.jsonl: {log}")
    # --anchors is per micro-batch as ours: spread over the rows, not 8 per row (with per-row
    # anchors a batch of several rows would draw up to 8 x rows).
    if not any(e["rows"] > 1 for e in log) or any(not 0 < e["anchors"] <= 8 + e["rows"] - 1 for e in log):
        fails.append(f"anchors per step {[(e['rows'], e['anchors']) for e in log]}: expected <= 8 + rows - 1")
    if any(abs(e["lr"] - w) > 1e-12 for e, w in zip(log, want_lr)):
        fails.append(f"lr {[e['lr'] for e in log]} != {want_lr}")

    from dflash.model import DFlashDraftModel
    m, info = DFlashDraftModel.from_pretrained(os.path.join(out, "drafter"), dtype=torch.float32,
                                               output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            fails.append(f"z-lab load {k}: {info[k]}")
    if (m.block_size, m.mask_token_id, list(m.target_layer_ids)) != (4, t["vocab_size"] - 1, [0, 2]):
        fails.append(f"z-lab sees block {m.block_size}, mask {m.mask_token_id}, layers {m.target_layer_ids}")
    S, B, H = 7, 4, t["hidden_size"]
    with torch.no_grad():
        h = m(position_ids=torch.arange(S + B).unsqueeze(0), noise_embedding=torch.randn(1, B, H),
              target_hidden=torch.randn(1, S, 2 * H), attention_mask=None, use_cache=False)
    if tuple(h.shape) != (1, B, H) or not torch.isfinite(h).all():
        fails.append(f"z-lab forward: shape {tuple(h.shape)}")
    # Resume: stopped after step 1, then rerun to the end.
    out2 = os.path.join(work, "out2")
    resumed = [a if a != out else out2 for a in base] + ["--steps", "3"]
    r = subprocess.run(resumed + ["--stop-after", "1"], capture_output=True, text=True)
    if r.returncode != 3 or not os.path.isfile(os.path.join(out2, "resume.pt")):
        fails.append(f"--stop-after 1: exit {r.returncode} (want 3), resume.pt there: "
                     f"{os.path.isfile(os.path.join(out2, 'resume.pt'))}; {r.stderr[-500:]}")
    r = subprocess.run(resumed, capture_output=True, text=True)
    if r.returncode != 0 or "resumed at step 1" not in r.stdout:
        fails.append(f"rerun after the stop: exit {r.returncode}, stdout {r.stdout[-300:]}, stderr {r.stderr[-500:]}")
    else:
        log2 = [json.loads(line) for line in open(os.path.join(out2, "loss.jsonl"))]
        if [(e["step"], e["loss"], e["lr"]) for e in log2] != [(e["step"], e["loss"], e["lr"]) for e in log]:
            fails.append(f"resumed losses {[(e['step'], e['loss']) for e in log2]} != {[(e['step'], e['loss']) for e in log]}")
        from safetensors.torch import load_file
        w1 = load_file(os.path.join(out, "drafter", "model.safetensors"))
        w2 = load_file(os.path.join(out2, "drafter", "model.safetensors"))
        if w1.keys() != w2.keys() or any(not torch.equal(w1[k], w2[k]) for k in w1):
            fails.append("the resumed run's drafter weights differ from the uninterrupted run's")
        if os.path.exists(os.path.join(out2, "resume.pt")):
            fails.append("resume.pt left after the drafter was saved")
    fails += planned_batches_checks(base, data, bin_dir, work)
    r = subprocess.run(base + ["--steps", "0"], capture_output=True, text=True)
    if r.returncode != 2 or "--steps" not in r.stderr:
        fails.append(f"--steps 0: exit {r.returncode}, stderr {r.stderr[-300:]}")
    print(f"losses {[round(e['loss'], 4) for e in log]}")
    return verdict(fails)


if __name__ == "__main__":
    sys.exit(main())
