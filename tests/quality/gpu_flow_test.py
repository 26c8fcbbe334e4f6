#!/usr/bin/env python3
"""`scripts/quality/run.py gpu` end to end on CPU with the tiny Qwen3 target of the golden_models
fixture (usage: gpu_flow_test.py SOURCE_DIR BIN_DIR TESTDATA_DIR WORK). A bundle is made from the
fixture (tokenized documents, two prompt groups); then:
  (a) through scripts/quality/device_call.sh --gpu 1 (as on the GPU host) with a long estimate:
      exit 3 before any process step, results.json written and archived into $OUT/quality-out.tgz;
  (b) the whole flow (plain + specforge + the successors dspark and dflash2 + a --recipe variant, 2 steps
      at once): exit 0; SpecForge's
      steps, drafter shape and batches from plain's `--plan` (equal to plain's steps, export config
      and documents per step); the
      recipe's overrides in its config and results, no speed step for it (a recipe name taken is
      refused); results.json has both drafters
      with tau per group, the same step count, the z-lab cross-check on the same prompts (z-lab and
      our batch-1 eval both in float32, the default --zlab-dtype: the same ids and tau), a speedup against the greedy baseline, one loss
      value per step in both curves, and the table on stdout; the successors trained with their
      reference recipes' per-method settings (block 7 / 8, gamma, lr, DSpark with the target's last
      hidden state), their differences from plain in results.json, a speedup each, and the
      cross-check: `dflash export --format speculators` loaded by speculators' own loader, its
      reference drafting loop and our batch-1 eval identical on every prompt;
  (b3) the methods table, seed spread and default-recipe decision of report.py on made-up results:
      a successor above 1.03x DFlash on both groups with both seeds becomes the default, one ratio at
      or below it keeps DFlash, a missing second seed leaves the decision pending;
  (b2) the step estimates of the batch-1 kinds scale with their prompt counts, --estimate wins;
  (c) a rerun starts no process (every step's record is there) and rewrites the same results.json;
  (d) with eval:plain's record removed, a rerun runs only that step; the cross-check can fail: with
      one acceptance length of the reference changed, xcheck:dspark (rerun alone) reports 1 of 2
      prompts identical and the check not passed;
  (e) `run.py report` into a copy of docs/quality.md: the results block replaced, prose kept, the
      PNGs written (the methods' loss panels too), SpecForge's loss and that of every DFlash-loss
      variant of ours (plain, the recipe) compared over windows covering every step, a D-PACE
      variant and the successors left out; the methods table and a decision in the block, the
      results copy with the decision beside the doc;
  (f) device_call.sh archives the regenerated data into $OUT/regen.tgz.*; in a fresh quality dir
      --regen restores it (the regenerate step done, the same bytes, nothing started before the
      deadline); from a bundle whose manifest differs it is refused (exit 4);
  (g) --out-archive with --regen in a fresh quality dir and one more --recipe (a second seed of
      plain): only import, that training and its eval start, the earlier results stay.
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
            f.writelines(json.dumps({"id": f"{name[:2]}{i}", "input_ids": d[:6]}) + "\n" for i, d in enumerate(rows))


def successor_checks(out, v):
    """(b) the successors: their configs, results and the cross-check with the reference loop."""
    import yaml
    fails = []
    cfg = {n: yaml.safe_load(open(os.path.join(out, "configs", n + ".yaml"))) for n in ("plain", "dspark", "dflash2")}
    want = {"dspark": ("dspark", 7, 4, 6e-4, True), "dflash2": ("dflash2", 8, 7, 5e-4, False),
            "plain": (None, 16, 7, 6e-4, False)}
    for n, (method, block, gamma, lr, h_last) in want.items():
        c = cfg[n]
        got = (c["drafter"].get("method"), c["drafter"]["block_size"], c["train"]["gamma"], c["train"]["lr"],
               c["target"]["ship_h_last"])
        if got != (method, block, gamma, lr, h_last):
            fails.append(f"(b) {n} config: method, block, gamma, lr, ship_h_last {got}, expected "
                         f"{(method, block, gamma, lr, h_last)}")
    for n in ("dspark", "dflash2"):
        r = v.get(n) or {}
        g = r.get("groups") or {}
        if set(g) != {"sharegpt_heldout", "humaneval"} or not all(x["tau"] >= 1 for x in g.values()) \
                or r.get("steps") != v["plain"]["steps"] or r.get("method") != n:
            fails.append(f"(b) {n}: groups {g}, steps {r.get('steps')} (plain {v['plain']['steps']}), "
                         f"method {r.get('method')}")
        diff = r.get("differs_from_plain") or {}
        if "drafter.block_size" not in diff or diff.get("drafter.method", {}).get(n) != n \
                or not r.get("reference_not_applied"):
            fails.append(f"(b) {n}: differences from plain {sorted(diff)}, not applied {r.get('reference_not_applied')}")
        if not (r.get("speed") or {}).get("speedup_vs_greedy", 0) > 0:
            fails.append(f"(b) {n} speed {r.get('speed')}")
        x = r.get("xcheck") or {}
        spec = os.path.join(out, "runs", n, "export-speculators", "config.json")
        if x.get("prompts") != 2 or x.get("identical") is not True or x.get("same_output_prompts") != 2 \
                or abs(x.get("tau_reference", 0) - x.get("tau_ours", -1)) > 1e-9 or not os.path.isfile(spec) \
                or json.load(open(spec)).get("speculators_model_type") != n:
            fails.append(f"(b) {n} cross-check {x}")
    if "train.gamma" not in v["dspark"]["differs_from_plain"] or "train.lr" not in v["dflash2"]["differs_from_plain"]:
        fails.append("(b) the reference recipes' gamma (dspark) / lr (dflash2) not recorded as differences")
    return fails


def xcheck_must_fail(gpu, out):
    """(d) one changed acceptance length of the reference: xcheck:dspark, rerun alone, is not identical;
    restored, it is again."""
    fails = []
    path = os.path.join(out, "evals", "xcheck_ref_dspark.json")
    good = open(path).read()
    ref = json.loads(good)
    ref["results"][0]["acceptance_lengths"][0] += 1
    json.dump(ref, open(path, "w"))
    os.remove(os.path.join(out, "steps", "xcheck_dspark.json"))
    r = run(gpu, 0)
    x = json.load(open(os.path.join(out, "results.json")))["variants"]["dspark"]["xcheck"]
    if "+ " in r.stderr or x["identical"] or x["same_acceptance_prompts"] != 1:
        fails.append(f"(d) a changed reference acceptance length: {x}")
    open(path, "w").write(good)
    os.remove(os.path.join(out, "steps", "xcheck_dspark.json"))
    run(gpu, 0)
    if not json.load(open(os.path.join(out, "results.json")))["variants"]["dspark"]["xcheck"]["identical"]:
        fails.append("(d) the restored reference is not identical again")
    return fails


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
    base[base.index("plain,specforge")] = "plain,specforge,dspark"
    base += ["--xcheck-prompts", "4"]
    for extra, kind, want in (([], "zlab", d["zlab"] * 3 / 32), ([], "zlab-ours", d["zlab-ours"] * 3 / 32),
                              ([], "speed", d["speed"] * 2 / 32), ([], "eval", d["eval"]),
                              ([], "xcheck-ref", d["xcheck-ref"] * 4 / 32), ([], "xexport", d["xexport"]),
                              (["--estimate", "zlab=77"], "zlab", 77)):
        flow = gpu_flow.GpuFlow(ap.parse_args(base + extra))
        got = flow.estimate(next(s for s in flow.steps if s.kind == kind))
        if abs(got - want) > 1e-9:
            fails.append(f"estimate of {kind} {extra}: {got}, expected {want}")
    return fails


def made_up_results(taus):
    """results.json's variants for report.decision: taus {variant: (method, seed, tau ShareGPT, tau
    HumanEval)}; a variant named like its method is that method's base run, others a run.seed recipe."""
    v = {}
    for name, (m, seed, a, b) in taus.items():
        v[name] = {"base": m, "method": m if m in ("dspark", "dflash2") else "dflash", "seed": seed, "steps": 10,
                   "train_wall_s": 5.0, "block_size": 16,
                   "groups": {"sharegpt_heldout": {"tau": a}, "humaneval": {"tau": b}}}
        if name != m:
            v[name]["recipe"] = {"base": m, "set": [f"run.seed={seed}"]}
    return {"variants": v, "host": {"dflash_version": "dflash test", "gpu": None, "device": "cpu"}}


def decision_checks(src):
    """(b3) report.decision and methods_block on made-up numbers."""
    sys.path.insert(0, os.path.join(src, "scripts", "quality"))
    import report
    fails = []
    both = {"plain": ("plain", 1, 1.50, 1.20), "plain_s2": ("plain", 2, 1.52, 1.22),
            "dspark": ("dspark", 1, 1.60, 1.25), "dspark_s2": ("dspark", 2, 1.58, 1.27),
            "dflash2": ("dflash2", 1, 1.70, 1.30), "dpace": ("dpace", 1, 1.70, 1.30)}
    d = report.decision(made_up_results(both))
    if d["default"] != "dspark" or d["successors"]["dspark"]["status"] != "passes" \
            or d["successors"]["dflash2"]["status"] != "pending" or "DSpark becomes the default" not in d["text"]:
        fails.append(f"(b3) both seeds above 1.03x: {d}")
    low = dict(both, dspark_s2=("dspark", 2, 1.58, 1.256))  # 1.0295x on HumanEval, seed 2: not above 1.03x
    d = report.decision(made_up_results(low))
    if d["default"] is not None or d["successors"]["dspark"]["status"] != "fails" or d["status"] != "pending":
        fails.append(f"(b3) one ratio below 1.03x: {d}")
    d = report.decision(made_up_results({k: x for k, x in low.items() if k != "dflash2"}))
    if d["default"] != "plain" or "DFlash stays the default" not in d["text"]:
        fails.append(f"(b3) no successor left passing: {d}")
    one = {k: x for k, x in both.items() if not k.endswith("_s2")}
    d = report.decision(made_up_results(one))
    if d["default"] is not None or d["status"] != "pending" or "pending" not in d["text"]:
        fails.append(f"(b3) seed 2 missing: {d}")
    block = "\n".join(report.methods_block(made_up_results(both)))
    rows = [line for line in block.splitlines() if line.startswith("| D")]
    if "| DSpark | 2 | `dspark_s2` |" not in block or "| DFlash | 1 | `plain` |" not in block or \
            "| 1.067 |" not in block or "Seed spread" not in block or "| DSpark | 1.3% | 1.6% |" not in block:
        fails.append(f"(b3) methods table / spread: {rows}")
    return fails


def report_checks(src, runpy, out, work, v):
    """(e) `run.py report` into a copy of docs/quality.md."""
    fails = []
    doc, images = os.path.join(work, "quality.md"), os.path.join(work, "images")
    shutil.copy(os.path.join(src, "docs", "quality.md"), doc)
    before = open(doc).read()
    run(runpy + ["report", out, "--doc", doc, "--images", images], 0)
    after = open(doc).read()
    head, tail = before.split("<!-- quality-results:begin")[0], before.split("<!-- quality-results:end -->")[1]
    block = after.split("<!-- quality-results:begin")[1].split("<!-- quality-results:end -->")[0]
    if not after.startswith(head) or not after.endswith(tail) or "| ours, `plain` |" not in block:
        fails.append("(e) report: prose changed or table not written")
    if "| DSpark | 1234 | `dspark` | 7 |" not in block or "| DFlash2 | 1234 | `dflash2` | 8 |" not in block or \
            "**Decision" not in block or "Cross-check of `dspark`" not in block:
        fails.append(f"(e) report: no methods table, cross-check or decision: {block[-1500:]}")
    copy = json.load(open(os.path.join(work, "quality-results.json")))
    if copy.get("decision", {}).get("status") not in ("pending", "final") or set(copy["variants"]) != set(v):
        fails.append(f"(e) results copy beside the doc: {copy.get('decision')}")
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
    for png in ("quality_loss.png", "quality_tau.png", "quality_methods_loss.png"):
        if not os.path.getsize(os.path.join(images, png)) > 1000:
            fails.append(f"(e) {png} missing")
    return fails


def regen_checks(src, gpu_flags, env, bundle, out, work, dev_out):
    """(f) the regenerated data across sessions (device_call.sh --regen)."""
    fails = []
    call = os.path.join(src, "scripts", "quality", "device_call.sh")
    flags = gpu_flags + ["--estimate", "import=60", "--estimate", "prompts=60"]
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
    # (g) a later session: the finished run's archive and regenerated data restored into a fresh
    # quality dir, a second seed added: only import, its training and its eval start.
    q4 = os.path.join(work, "q4")
    os.makedirs(q4)
    os.symlink(bundle, os.path.join(q4, "bundle"))
    r = run([call, "--regen", kept, "--out-archive", os.path.join(kept, "quality-out.tgz"), "--gpu", "600", "--",
             *gpu_flags, "--recipe", "plain_s2=plain:run.seed=4321"], 0, cwd=src, env=dict(env, DFLASH_QUALITY_DIR=q4))
    started = [line for line in r.stderr.splitlines() if line.startswith("+ ")]
    res4 = json.load(open(os.path.join(q4, "out", "results.json")))["variants"]
    if len(started) != 3 or " data import " not in started[0] or "plain_s2.yaml" not in started[1] \
            or "runs/plain_s2/export" not in started[2] or res4.get("plain_s2", {}).get("seed") != 4321 \
            or not (res4["plain_s2"].get("groups") or {}).get("humaneval") or not res4["dspark"].get("xcheck"):
        fails.append(f"(g) --out-archive with a second seed: started {started}, plain_s2 {res4.get('plain_s2')}")
    json.dump({"bundle": "another"}, open(os.path.join(bundle, "manifest.json"), "w"))
    q3 = os.path.join(work, "q3")
    os.makedirs(q3)
    os.symlink(bundle, os.path.join(q3, "bundle"))
    r = run([call, "--regen", kept], 4, cwd=src, env=dict(env, DFLASH_QUALITY_DIR=q3, OUT=dev_out))
    if "another bundle" not in r.stderr or os.path.exists(os.path.join(q3, "out", "regenerated.jsonl")):
        fails.append(f"(f) --regen from another bundle: {r.stderr[-300:]}")
    return fails


def main():
    src, bindir, testdata, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    bundle, out = os.path.join(work, "bundle"), os.path.join(work, "out")
    make_bundle(testdata, bundle)
    runpy = [sys.executable, os.path.join(src, "scripts", "quality", "run.py"), "--bin", bindir]
    gpu = runpy + ["gpu", bundle, out, "--device", "cpu", "--dtype", "float32", "--variants",
                   "plain,specforge,dspark,dflash2", "--max-new-tokens", "40", "--eval-prompts", "4", "--eval-batch",
                   "2", "--speed-prompts", "2", "--zlab-prompts", "3", "--xcheck-prompts", "2", "--parallel", "2",
                   "--set", "data.token_budget=256",
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
    fails += successor_checks(out, v)
    fails += estimate_checks(src, bindir, bundle, work)
    fails += decision_checks(src)
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
    fails += xcheck_must_fail(gpu, out)
    fails += report_checks(src, runpy, out, work, v)
    fails += regen_checks(src, gpu[len(runpy) + 3:], env, bundle, out, work, dev_out)
    print(f"plain tau {v['plain']['groups']['sharegpt_heldout']['tau']:.3f}, specforge "
          f"{v['specforge']['groups']['sharegpt_heldout']['tau']:.3f}, steps {v['plain']['steps']}")
    return verdict(fails)


if __name__ == "__main__":
    sys.exit(main())
