#!/usr/bin/env python3
"""`scripts/quality/run.py gpu` end to end on CPU with the tiny Qwen3 target of the golden_models
fixture (usage: gpu_flow_test.py SOURCE_DIR BIN_DIR TESTDATA_DIR WORK). A bundle is made from the
fixture (tokenized documents, two prompt groups); then:
  (a) through scripts/quality/device_call.sh --gpu 1 (as on the GPU host) with a long estimate:
      exit 3 before any process step, results.json written and archived into $OUT/quality-out.tgz;
  (b) the whole flow (plain + specforge + a --recipe variant, 2 steps at once): exit 0; SpecForge's
      steps, drafter shape and batches from plain's `--plan` (equal to plain's steps, export config
      and documents per step); the
      recipe's overrides in its config and results, no speed step for it (a recipe name taken is
      refused); results.json has both drafters
      with tau per group, the same step count, the z-lab cross-check on the same prompts (z-lab and
      our batch-1 eval both in float32, the default --zlab-dtype: the same ids and tau), a speedup against the greedy baseline, one loss
      value per step in both curves, and the table on stdout;
  (b2) the step estimates of the batch-1 kinds scale with their prompt counts, --estimate wins;
  (c) a rerun starts no process (every step's record is there) and rewrites the same results.json;
  (d) with eval:plain's record removed, a rerun runs only that step;
  (e) `run.py report` into a copy of docs/quality.md: the results block replaced, prose kept, both
      PNGs written, SpecForge's loss and that of every DFlash-loss variant of ours (plain, the
      recipe) compared over windows covering every step, a D-PACE variant left out;
  (f) device_call.sh archives the regenerated data into $OUT/regen.tgz.*; in a fresh quality dir
      --regen restores it (the regenerate step done, the same bytes, nothing started before the
      deadline); from a bundle whose manifest differs it is refused (exit 4).
Exit 0 when all hold."""
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile

from verdict import verdict


def run(cmd, want, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != want:
        print(f"FAIL: exit {r.returncode}, expected {want}: {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        sys.exit(1)
    return r


def make_bundle(testdata, bundle):
    """model: the tiny Qwen3 with an eos id; data: random tokenized documents (loss on the second
    half, regenerated with 40 new tokens: enough for import's 32 trainable tokens) and prompts."""
    shutil.copytree(os.path.join(testdata, "qwen3"), os.path.join(bundle, "model"))
    cfg_path = os.path.join(bundle, "model", "config.json")
    cfg = json.load(open(cfg_path))
    cfg["eos_token_id"] = 3
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    json.dump({"bundle": "gpu_flow_test"}, open(os.path.join(bundle, "manifest.json"), "w"))
    rnd = random.Random(0)
    docs = [[rnd.randrange(4, cfg["vocab_size"] - 1) for _ in range(rnd.randrange(12, 40))] for _ in range(30)]
    os.makedirs(os.path.join(bundle, "data"))
    with open(os.path.join(bundle, "data", "train.jsonl"), "w") as f:
        for i, d in enumerate(docs[8:]):
            cut = len(d) // 2
            f.write(json.dumps({"id": f"t{i}", "input_ids": d, "loss_mask": [0] * cut + [1] * (len(d) - cut)}) + "\n")
    for name, rows in (("heldout_prompts.jsonl", docs[:5]), ("humaneval_prompts.jsonl", docs[5:8])):
        with open(os.path.join(bundle, "data", name), "w") as f:
            f.writelines(json.dumps({"id": f"{name[0]}{i}", "input_ids": d[:6]}) + "\n" for i, d in enumerate(rows))


def estimate_checks(src, bindir, bundle, work):
    """Before a step of a kind has run, the batch-1 kinds' estimates scale with their prompt count
    (zlab 3 of 32 prompts -> 3/32 of the default), the others do not, and --estimate wins."""
    import argparse
    sys.path.insert(0, os.path.join(src, "scripts", "quality"))
    import gpu_flow
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=bindir)
    gpu_flow.add_arguments(ap)
    base = [bundle, os.path.join(work, "estimates"), "--variants", "plain,specforge", "--zlab-prompts", "3",
            "--speed-prompts", "2", "--eval-prompts", "4"]
    fails = []
    d = gpu_flow.DEFAULT_ESTIMATE_S
    for extra, kind, want in (([], "zlab", d["zlab"] * 3 / 32), ([], "zlab-ours", d["zlab-ours"] * 3 / 32),
                              ([], "speed", d["speed"] * 2 / 32), ([], "eval", d["eval"]),
                              (["--estimate", "zlab=77"], "zlab", 77)):
        flow = gpu_flow.GpuFlow(ap.parse_args(base + extra))
        got = flow.estimate(next(s for s in flow.steps if s.kind == kind))
        if abs(got - want) > 1e-9:
            fails.append(f"estimate of {kind} {extra}: {got}, expected {want}")
    return fails


def main():
    src, bindir, testdata, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    bundle, out = os.path.join(work, "bundle"), os.path.join(work, "out")
    make_bundle(testdata, bundle)
    runpy = [sys.executable, os.path.join(src, "scripts", "quality", "run.py"), "--bin", bindir]
    gpu = runpy + ["gpu", bundle, out, "--device", "cpu", "--dtype", "float32", "--variants", "plain,specforge",
                   "--max-new-tokens", "40", "--eval-prompts", "4", "--eval-batch", "2", "--speed-prompts", "2",
                   "--zlab-prompts", "3", "--parallel", "2", "--set", "data.token_budget=256",
                   "--set", "data.max_seq_len=128", "--set", "train.max_anchors=16",
                   "--set", "resilience.oom.token_budget_floor=128", "--set", "drafter.num_layers=1",
                   "--set", "target.target_layer_ids=[0,2]", "--set", "drafter.mask_token_id=255",
                   "--recipe", "l2=plain:drafter.num_layers=2;train.lr=2e-3"]
    fails = []
    # (a) through the device-call wrapper as on the GPU host (build found in place, flags after --)
    dev_out = os.path.join(work, "dev_out")
    os.makedirs(dev_out)
    env = dict(os.environ, DFLASH_GPU_BUILD=os.path.dirname(bindir), DFLASH_QUALITY_DIR=work, OUT=dev_out,
               DFLASH_PYTHON=sys.executable)
    r = run([os.path.join(src, "scripts", "quality", "device_call.sh"), "--gpu", "1", "--", *gpu[len(runpy) + 3:],
             "--estimate", "regenerate=60", "--estimate", "prompts=60"], 3, cwd=src, env=env)
    if "+ " in r.stderr or not os.path.isfile(os.path.join(out, "results.json")) or "deadline" not in r.stderr:
        fails.append(f"(a) a step started or no results.json / deadline message: {r.stderr[-500:]}")
    with tarfile.open(os.path.join(dev_out, "quality-out.tgz")) as tar:
        if "results.json" not in tar.getnames():
            fails.append(f"(a) the call's archive holds {tar.getnames()}")
    # (b)
    r = run(gpu, 0)
    res = json.load(open(os.path.join(out, "results.json")))
    v = res["variants"]
    for name in ("plain", "specforge"):
        g = v[name]["groups"]
        if set(g) != {"sharegpt_heldout", "humaneval"} or not all(x["tau"] >= 1 for x in g.values()):
            fails.append(f"(b) {name} groups {g}")
        if g["sharegpt_heldout"]["prompts"] != 4 or g["humaneval"]["prompts"] != 3:
            fails.append(f"(b) {name}: prompts per group {g['sharegpt_heldout']['prompts']}, {g['humaneval']['prompts']}")
        z = v[name].get("zlab") or {}
        if z.get("prompts") != 3 or z.get("dtype") != "float32" or z.get("same_output_prompts") != 3 \
                or abs(z["tau_zlab"] - z["tau_ours"]) > 1e-9 \
                or not os.path.isfile(os.path.join(out, "evals", f"zlab_ours_{name}.json")):
            fails.append(f"(b) {name} z-lab cross-check {z}")
        s = v[name].get("speed") or {}
        if s.get("prompts") != 2 or not s.get("speedup_vs_greedy", 0) > 0:
            fails.append(f"(b) {name} speed {s}")
        curve = json.load(open(os.path.join(out, "curves", name + ".json")))
        if [p["step"] for p in curve] != list(range(1, v["plain"]["steps"] + 1)):
            fails.append(f"(b) {name} loss curve steps {[p['step'] for p in curve]}")
    # The recipe variant: trained, evaluated, its overrides on top of plain's in its config and results.
    import yaml
    l2 = yaml.safe_load(open(os.path.join(out, "configs", "l2.yaml")))
    if (l2["drafter"]["num_layers"], l2["train"]["lr"], l2["train"]["loss"]) != (2, 2e-3, "dflash") \
            or v.get("l2", {}).get("recipe") != {"base": "plain", "set": ["drafter.num_layers=2", "train.lr=2e-3"]} \
            or not (v["l2"].get("groups") or {}).get("sharegpt_heldout", {}).get("tau", 0) >= 1 or "speed" in v["l2"]:
        fails.append(f"(b) recipe l2: config {l2['drafter']['num_layers']}, {l2['train']['lr']}; results {v.get('l2')}")
    bad = subprocess.run(gpu + ["--recipe", "plain=plain:train.lr=1"], capture_output=True, text=True)
    if bad.returncode != 1 or "--recipe: the name 'plain'" not in bad.stderr:
        fails.append(f"(b) a recipe named like a variant: exit {bad.returncode}, {bad.stderr[-300:]}")
    if v["plain"]["steps"] != v["specforge"]["steps"] or v["plain"]["steps"] < 1:
        fails.append(f"(b) steps plain {v['plain']['steps']} specforge {v['specforge']['steps']}")
    # SpecForge's steps and shape came from plain's plan, before plain ended: the shape is plain's
    # export config.json, provenance aside.
    plan = json.load(open(os.path.join(out, "steps", "plan_specforge.json")))
    shape = json.load(open(os.path.join(plan["shape"], "config.json")))
    export = json.load(open(os.path.join(out, "runs", "plain", "export", "config.json")))
    export["dflash_config"].pop("provenance", None)
    if plan["steps"] != v["plain"]["steps"] or shape != export:
        fails.append(f"(b) plan:specforge steps {plan['steps']} (plain {v['plain']['steps']}), shape == export: {shape == export}")
    # ... and its batches: SpecForge trained the documents plain trained, step by step (rows per
    # step = the samples in plain's ledger record of that step).
    ledger = [json.loads(line) for line in open(os.path.join(out, "runs", "plain", "ledger.jsonl"))]
    ours = [len(r["samples"]) for r in sorted((r for r in ledger if r.get("type") == "step"), key=lambda r: r["step"])]
    theirs = [json.loads(line)["rows"] for line in open(os.path.join(out, "runs", "specforge", "loss.jsonl"))]
    if ours != theirs:
        fails.append(f"(b) documents per step: plain {ours}, SpecForge {theirs}")
    if not res["target_greedy"] or res["target_greedy"]["prompts"] != 2:
        fails.append(f"(b) greedy baseline {res['target_greedy']}")
    if "| plain | sharegpt_heldout |" not in r.stdout:
        fails.append(f"(b) no table on stdout: {r.stdout[-500:]}")
    fails += estimate_checks(src, bindir, bundle, work)
    # (c)
    r = run(gpu, 0)
    if "+ " in r.stderr or json.load(open(os.path.join(out, "results.json"))) != res:
        fails.append(f"(c) rerun started a step or changed results.json: {r.stderr[-500:]}")
    # (d)
    os.remove(os.path.join(out, "steps", "eval_plain.json"))
    r = run(gpu, 0)
    started = [line for line in r.stderr.splitlines() if line.startswith("+ ")]
    if len(started) != 1 or " eval " not in started[0] or "runs/plain/export" not in started[0]:
        fails.append(f"(d) expected only eval:plain to run, started {started}")
    # (e)
    doc, images = os.path.join(work, "quality.md"), os.path.join(work, "images")
    shutil.copy(os.path.join(src, "docs", "quality.md"), doc)
    before = open(doc).read()
    run(runpy + ["report", out, "--doc", doc, "--images", images], 0)
    after = open(doc).read()
    head, tail = before.split("<!-- quality-results:begin")[0], before.split("<!-- quality-results:end -->")[1]
    block = after.split("<!-- quality-results:begin")[1].split("<!-- quality-results:end -->")[0]
    if not after.startswith(head) or not after.endswith(tail) or "| ours, `plain` |" not in block or "pending" in block:
        fails.append("(e) report: prose changed or table not written")
    # the loss windows: SpecForge's and each DFlash-loss variant's mean loss over the same steps
    # (plain and the recipe l2), every step in one window, each ratio = ours / SpecForge's
    table = [line.split("|")[1:-1] for line in block.splitlines() if line.startswith("| steps | SpecForge |")
             or (line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit() and "-" in line.split("|")[1])]
    head_row, rows = (table[0], table[1:]) if table else ([], [])
    names = [c.strip().strip("`") for c in head_row[2::2]]
    covered = sum(int(b) - int(a) + 1 for a, b in (r[0].strip().split("-") for r in rows))
    if names != ["plain", "l2"] or not rows or covered != v["plain"]["steps"] or \
            any(abs(float(r[k]) / float(r[1]) - float(r[k + 1])) > 2e-3 for r in rows for k in (2, 4)):
        fails.append(f"(e) loss windows {head_row} {rows} (steps covered {covered}, plain {v['plain']['steps']})")
    # ... and a D-PACE variant (its loss on another scale) is left out of them
    sys.path.insert(0, os.path.join(src, "scripts", "quality"))
    import report
    dp = {"variants": {"specforge": {}, "plain": {"loss": "dflash"}, "l2": {"loss": "dpace"}}}
    w = report.loss_windows(out, dp)
    if not w or "`l2`" in "".join(w) or "`plain`" not in "".join(w) or v["l2"].get("loss") != "dflash":
        fails.append(f"(e) a D-PACE variant in the loss windows, or l2's loss not dflash: {w[:5]}, {v['l2'].get('loss')}")
    for png in ("quality_loss.png", "quality_tau.png"):
        if not os.path.getsize(os.path.join(images, png)) > 1000:
            fails.append(f"(e) {png} missing")
    # (f) the regenerated data across sessions
    call = os.path.join(src, "scripts", "quality", "device_call.sh")
    flags = gpu[len(runpy) + 3:] + ["--estimate", "import=60", "--estimate", "prompts=60"]
    kept = os.path.join(work, "dev_regen")
    os.makedirs(kept)
    run([call], 0, cwd=src, env=dict(env, OUT=kept))  # a call with nothing to do still archives
    if not any(f.startswith("regen.tgz.") for f in os.listdir(kept)):
        fails.append(f"(f) no regen.tgz.* in the call's OUT: {os.listdir(kept)}")
    q2 = os.path.join(work, "q2")
    os.makedirs(q2)
    os.symlink(bundle, os.path.join(q2, "bundle"))
    env2 = dict(env, DFLASH_QUALITY_DIR=q2, OUT=dev_out)
    r = run([call, "--regen", kept, "--gpu", "1", "--", *flags], 3, cwd=src, env=env2)
    regen2 = os.path.join(q2, "out", "regenerated.jsonl")
    if "+ " in r.stderr or not os.path.isfile(regen2) or open(regen2, "rb").read() != open(
            os.path.join(out, "regenerated.jsonl"), "rb").read() or not os.path.isfile(
            os.path.join(q2, "out", "steps", "regenerate.json")):
        fails.append(f"(f) --regen: a step started or the data/record not restored: {r.stderr[-500:]}")
    json.dump({"bundle": "another"}, open(os.path.join(bundle, "manifest.json"), "w"))
    q3 = os.path.join(work, "q3")
    os.makedirs(q3)
    os.symlink(bundle, os.path.join(q3, "bundle"))
    r = run([call, "--regen", kept], 4, cwd=src, env=dict(env, DFLASH_QUALITY_DIR=q3, OUT=dev_out))
    if "another bundle" not in r.stderr or os.path.exists(os.path.join(q3, "out", "regenerated.jsonl")):
        fails.append(f"(f) --regen from another bundle: {r.stderr[-300:]}")
    print(f"plain tau {v['plain']['groups']['sharegpt_heldout']['tau']:.3f}, specforge "
          f"{v['specforge']['groups']['sharegpt_heldout']['tau']:.3f}, steps {v['plain']['steps']}")
    return verdict(fails)


if __name__ == "__main__":
    sys.exit(main())
