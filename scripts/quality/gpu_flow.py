"""`run.py gpu BUNDLE OUT`: the quality run's device side as resumable steps (docs/quality.md).

Steps (a step runs when the steps it needs are done, in this order of preference; up to
--parallel at once):
  regenerate            `dflash data regenerate` of data/train.jsonl by the target (greedy)
  import                `dflash data import` into OUT/shards (block 16)
  prompts               the fixed prompt subsets: OUT/prompts/eval.jsonl (the first --eval-prompts
                        of each group), speed.jsonl (the first --speed-prompts held-out ShareGPT
                        prompts), zlab.jsonl (the first --zlab-prompts of them)
  train:<v>             `dflash run` of variant v (one target server + one drafter trainer sharing
                        GPU 0, topology.colocate), export in OUT/runs/<v>/export
  plan:specforge        `dflash run` of train:plain's config with --plan: its optimizer steps, the
                        config.json its export will carry (the drafter's shape), OUT/runs/specforge-shape,
                        and every step's samples (--plan-batches OUT/runs/specforge-batches.jsonl)
  train:specforge       scripts/quality/specforge_train.py with train:plain's steps, shape,
                        hyperparameters and batches (the same samples in every step, read from
                        OUT/shards; from plan:specforge: it runs beside train:plain, the critical
                        path); train:plain fails if its steps differ from the plan's
  eval:<v>              `dflash eval` of v's drafter on eval.jsonl (--eval-batch, no baseline)
  zlab-ours:<v>         `dflash eval --batch-size 1` on zlab.jsonl in --zlab-dtype (default float32)
  zlab-generate:<v>     z-lab's dflash_generate (scripts/reference/zlab_generate.py) on zlab.jsonl
                        in --zlab-dtype, for plain and specforge (beside zlab-ours:<v>)
  zlab:<v>              the two side by side: tau by z-lab next to zlab-ours:<v>'s on the
                        same prompts, one prompt at a time, same dtype (in bfloat16 the two
                        implementations' different kernels split near-tied greedy paths, which
                        moves tau by more than the 1% the comparison is about)
  xexport:<v>           for a successor drafter (drafter.method dspark | dflash2), with --xcheck-prompts:
                        `dflash export --format speculators` of v's last checkpoint (the dtype of its
                        run's export, the target folder as the verifier)
  xcheck-ours:<v>       `dflash eval --batch-size 1` of v's export on xcheck.jsonl in --xcheck-dtype
  xcheck-ref:<v>        the reference drafting loop (scripts/reference/successor_generate.py
                        --format speculators: speculators 0.9.0's own model, loaded by its own
                        SpeculatorModel.from_pretrained from the xexport folder, verified by
                        transformers' target) on the same prompts, same dtype, batch 1
  xcheck:<v>            the two side by side: prompts with identical output ids and identical
                        acceptance lengths per round, tau by each (the check passes when all agree)
  speed:<v>             `dflash eval --batch-size 1` on speed.jsonl; speed:plain also runs the
                        target's own greedy decoding (the baseline of every speedup). These steps
                        run alone on the device (nothing else at the same time), after the others;
                        none for --recipe variants (recipe measurements compare tau).
--recipe NAME=BASE:SECTION.FIELD=VALUE[;...] adds a variant trained like BASE with its own overrides
(train:NAME, eval:NAME); a rerun with more --recipe flags trains only the new ones. A recipe whose
only override is run.seed is a second seed of BASE (the report groups it with BASE).

Each finished step writes OUT/steps/<step>.json (its wall time and results); a step whose record
exists is skipped, so a rerun resumes where the last one stopped (a killed `dflash run` continues
from its checkpoint, a killed regenerate from its output). OUT/results.json is rewritten after
every step. --deadline-s S: a step is not started when its estimated wall time (the longest measured
step of its kind in OUT/steps, else the --estimate value, else DEFAULT_ESTIMATE_S) would end past S
seconds after the start; when nothing else can run the command exits EXIT_DEADLINE (3) and a rerun
continues. Exit: 0 all done, 1 a step failed (its command and output tail printed, the other running
steps stopped), 2 bad usage, 3 stopped for the deadline.
"""
import json
import os
import subprocess
import sys
import time

import transport

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXIT_DEADLINE = 3
MAX_SEQ_LEN = 2048
BLOCK_SIZE = 16
GROUPS = {"sharegpt_heldout": "heldout_prompts.jsonl", "humaneval": "humaneval_prompts.jsonl"}
# Recipe variants: overrides of quality.yaml by section (the plain DFlash loss is the baseline).
_OFF = {"soft_labels": {"enabled": False}, "noise": {"type": "none"}}
VARIANTS = {
    "plain": {"train": dict(_OFF)},
    "soft": {"train": {"soft_labels": {"enabled": True}, "noise": {"type": "none"}}},
    "noise": {"train": {"soft_labels": {"enabled": False}, "noise": {"type": "uniform", "start": 0.05, "end": 0.01}}},
    "dpace": {"train": dict(_OFF, loss="dpace")},
    # The successors with their reference recipes' per-method settings (docs/quality.md,
    # "Successor variants"): DSpark as DeepSpec's DSpark recipe (7 drafts per round from the anchor
    # row, gamma 4, CE 0.1 + TV 0.9 + confidence BCE 1.0, a vanilla Markov head of rank 256, the
    # confidence head on the Markov feature, lr 6e-4, no weight decay); DFlash2 as its reference
    # recipe (block 8: 7 drafts, gamma 7, lr 5e-4, hard-label CE + selector CE at weight 1, two
    # taps of groups of 16 channels, a selector of rank 256 over the top 16).
    "dspark": {"drafter": {"method": "dspark", "block_size": 7,
                           "dspark": {"markov_rank": 256, "markov_head": "vanilla", "confidence_head": True,
                                      "confidence_with_markov": True}},
               "train": dict(_OFF, loss="dflash", gamma=4, lr=6.0e-4, weight_decay=0.0,
                             dspark={"ce_weight": 0.1, "tv_weight": 0.9, "confidence_weight": 1.0})},
    "dflash2": {"drafter": {"method": "dflash2", "block_size": 8,
                            "dflash2": {"conv_taps": 2, "conv_group": 16, "selector_rank": 256, "selector_top_k": 16}},
                "train": dict(_OFF, loss="dflash", gamma=7, lr=5.0e-4, dflash2={"selector_weight": 1.0})},
}
SUCCESSORS = ("dspark", "dflash2")  # drafter.method values the reference loop cross-checks
# What each successor's reference recipe does that this run does not (our config has no such knob,
# or the setting is held equal for every method on purpose); results.json carries it beside the
# settings that differ from `plain` (computed from the configs).
REFERENCE_NOT_APPLIED = {
    "dspark": ["5 draft layers in the reference recipe; here 3 for every method (the drafter shape is held equal)",
               "10 epochs at 512 sequences per step in the reference; here the same data, epochs and steps as "
               "every method"],
    "dflash2": ["a constant learning rate in the reference; here 4% warmup then cosine decay, as every method "
                "(the config has no constant schedule)",
                "5 draft layers with sliding-window attention of 2048 in the reference; here 3 full-attention "
                "layers, as every method (documents are at most 2048 tokens, so a 2048 window sees them whole)"],
}
ZLAB_VARIANTS = ("plain", "specforge")
# Wall seconds per step kind on one H200 at the full setting (docs/quality.md, "Time budget"); only
# the --deadline-s check reads them, and a measured step of the same kind replaces them.
# Measured 2026-12-02 with 4 trainings, then 4 evals and the z-lab pairs side by
# side, at the default prompt counts except the batch-1 kinds (zlab-ours, zlab, speed), which were
# measured on 16 prompts and scale with their prompt count (PER_PROMPT_KINDS; the values are per 32).
# The cross-check kinds (xcheck-ours like zlab-ours; xcheck-ref, an uncached reference loop, guessed at
# 1.5x z-lab's generate) are not measured yet.
DEFAULT_ESTIMATE_S = {"regenerate": 340, "import": 10, "prompts": 1, "plan": 10, "train": 300, "specforge": 300,
                      "eval": 240, "zlab-ours": 320, "zlab": 370, "compare": 1, "speed": 100, "xexport": 20,
                      "xcheck-ours": 320, "xcheck-ref": 560}
PER_PROMPT_KINDS = {"zlab-ours": "zlab_prompts", "zlab": "zlab_prompts", "speed": "speed_prompts",
                    "xcheck-ours": "xcheck_prompts", "xcheck-ref": "xcheck_prompts"}


class StepError(Exception):
    pass


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def stop_ids(model):
    """The target's eos ids (generation_config.json, else config.json) as a --stop-token-ids value."""
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(model, name)
        eos = json.load(open(p)).get("eos_token_id") if os.path.isfile(p) else None
        if eos is not None:
            return ",".join(str(e) for e in (eos if isinstance(eos, list) else [eos]))
    raise StepError(f"{model}: no eos_token_id in generation_config.json or config.json")


def group_stats(results):
    """tau, rounds and per-position acceptance (P(length >= k+1), k = 1..) of per-prompt results."""
    lens = [L for r in results for L in r["acceptance_lengths"]]
    if not lens:
        return {"prompts": len(results), "tau": 0.0, "rounds": 0, "per_position_acceptance": []}
    return {"prompts": len(results), "tau": sum(lens) / len(lens), "rounds": len(lens),
            "per_position_acceptance": [sum(1 for L in lens if L >= k + 1) / len(lens) for k in range(1, BLOCK_SIZE)]}


class Step:
    """One step: `command()` (argv, run as a process; None for an in-process `command` that does
    its work itself) and `collect()` (its results once it exited 0)."""

    def __init__(self, name, kind, deps, command, collect, exclusive=False, env=None, stdout=None):
        self.name, self.kind, self.deps, self.command, self.collect = name, kind, deps, command, collect
        self.exclusive, self.env, self.stdout = exclusive, env, stdout


class GpuFlow:
    def __init__(self, a):
        self.a = a
        self.bundle, self.out = os.path.abspath(a.bundle), os.path.abspath(a.out)
        self.model = os.path.join(self.bundle, "model")
        self.dflash = os.path.join(a.bin, "dflash")
        self.recipes = parse_recipes(a.recipe or [])
        self.variants = a.variants.split(",") + [r for r in self.recipes if r not in a.variants.split(",")]
        for v in self.variants:
            if v not in VARIANTS and v not in self.recipes and v != "specforge":
                raise StepError(f"--variants: unknown variant '{v}' (known: {', '.join(VARIANTS)}, specforge, "
                                "and the --recipe names)")
        if "specforge" in self.variants and "plain" not in self.variants:
            raise StepError("--variants: 'specforge' needs 'plain' (its steps and drafter shape)")
        if a.parallel < 1:
            raise StepError(f"--parallel: expected >= 1, got {a.parallel}")
        if max(a.zlab_prompts, a.speed_prompts, a.xcheck_prompts) > a.eval_prompts:
            raise StepError("--zlab-prompts, --speed-prompts and --xcheck-prompts must not exceed --eval-prompts "
                            "(same prompts)")
        self.estimates = dict(DEFAULT_ESTIMATE_S)
        for k, count in PER_PROMPT_KINDS.items():  # the defaults are for 32 prompts
            self.estimates[k] *= getattr(a, count) / 32
        for kv in a.estimate or []:
            k, _, v = kv.partition("=")
            if k not in self.estimates:
                raise StepError(f"--estimate: unknown step kind '{k}' (known: {', '.join(self.estimates)})")
            try:
                self.estimates[k] = float(v)
            except ValueError:
                raise StepError(f"--estimate {kv}: expected KIND=SECONDS")
        for d in ("steps", "logs", "prompts", "configs", "evals", "curves", "runs"):
            os.makedirs(os.path.join(self.out, d), exist_ok=True)
        self.regen = os.path.join(self.out, "regenerated.jsonl")
        self.shards = os.path.join(self.out, "shards")
        self.specforge_batches = os.path.join(self.out, "runs", "specforge-batches.jsonl")  # plain's, from plan:specforge
        refpy = os.path.join(self.bundle, "refpy")  # SpecForge and z-lab dflash (run.py unpack)
        self.ref_env = dict(os.environ)
        if os.path.isdir(refpy):
            self.ref_env["PYTHONPATH"] = os.pathsep.join(p for p in (refpy, os.environ.get("PYTHONPATH")) if p)
        self.steps = self.plan()

    # ---- records ----
    def record_path(self, name):
        return os.path.join(self.out, "steps", name.replace(":", "_") + ".json")

    def record(self, name):
        p = self.record_path(name)
        return json.load(open(p)) if os.path.isfile(p) else None

    def dev(self):
        return ["--device", self.a.device, "--dtype", self.a.dtype]

    # ---- the steps ----
    def plan(self):
        a, ours = self.a, [v for v in self.variants if v != "specforge"]
        steps = [
            Step("regenerate", "regenerate", [], lambda: [
                self.dflash, "data", "regenerate", "--target", self.model, "--input",
                os.path.join(self.bundle, "data", "train.jsonl"), "--out", self.regen, *self.dev(),
                "--max-new-tokens", str(a.max_new_tokens), "--temperature", "0", "--batch-size", str(a.regen_batch),
                "--python", sys.executable], self.collect_regenerate),
            Step("import", "import", ["regenerate"], lambda: [
                self.dflash, "data", "import", "--input", self.regen, "--out", self.shards, "--max-seq-len",
                str(MAX_SEQ_LEN), "--block-size", str(BLOCK_SIZE)], lambda: {"shard_dir": self.shards}),
            Step("prompts", "prompts", [], None, self.write_prompts),
        ]
        for v in ours:
            steps.append(Step(f"train:{v}", "train", ["import"], lambda v=v: self.train_command(v),
                              lambda v=v: self.collect_train(v)))
            if v == "plain" and "specforge" in self.variants:  # next in line, beside plain
                steps.append(Step("plan:specforge", "plan", ["import"], self.plan_command, self.collect_plan,
                                  stdout=os.path.join(self.out, "runs", "specforge-plan.json")))
                steps.append(Step("train:specforge", "specforge", ["plan:specforge"], self.specforge_command,
                                  self.collect_specforge, env=self.ref_env))
        for v in self.variants:
            steps.append(Step(f"eval:{v}", "eval", [f"train:{v}", "prompts"], lambda v=v: self.eval_command(v),
                              lambda v=v: self.collect_eval(v)))
        for v in (v for v in ZLAB_VARIANTS if v in self.variants and a.zlab_prompts > 0):
            steps.append(Step(f"zlab-ours:{v}", "zlab-ours", [f"train:{v}", "prompts"], lambda v=v: self.zlab_ours_command(v),
                              lambda v=v: {}))
            steps.append(Step(f"zlab-generate:{v}", "zlab", [f"train:{v}", "prompts"], lambda v=v: self.zlab_command(v),
                              lambda v=v: {}, env=self.ref_env, stdout=os.path.join(self.out, "evals", f"zlab_{v}.json")))
            steps.append(Step(f"zlab:{v}", "compare", [f"zlab-ours:{v}", f"zlab-generate:{v}"], None,
                              lambda v=v: self.collect_zlab(v)))
        steps += self.xcheck_steps()
        if a.speed_prompts > 0:  # not for --recipe variants: their tau decides, and speed steps run alone
            for v in (v for v in self.variants if v not in self.recipes):
                deps = [f"train:{v}", "prompts"] + ([] if v == "plain" else ["speed:plain"])
                steps.append(Step(f"speed:{v}", "speed", deps, lambda v=v: self.speed_command(v),
                                  lambda v=v: self.collect_speed(v), exclusive=True))
        return steps

    def xcheck_steps(self):
        """The reference cross-check of every successor variant (not the --recipe ones)."""
        if self.a.xcheck_prompts <= 0:
            return []
        steps = []
        for v in (v for v in self.variants if v in VARIANTS and self.method_of(v) in SUCCESSORS):
            steps += [Step(f"xexport:{v}", "xexport", [f"train:{v}"], lambda v=v: self.xexport_command(v),
                           lambda v=v: {"export": self.xexport_dir(v)}),
                      Step(f"xcheck-ours:{v}", "xcheck-ours", [f"train:{v}", "prompts"],
                           lambda v=v: self.eval_argv(v, "xcheck", f"xcheck_ours_{v}", 1, self.a.xcheck_dtype),
                           lambda v=v: {}),
                      Step(f"xcheck-ref:{v}", "xcheck-ref", [f"xexport:{v}", "prompts"],
                           lambda v=v: self.xcheck_ref_command(v), lambda v=v: {}, env=self.ref_env,
                           stdout=os.path.join(self.out, "evals", f"xcheck_ref_{v}.json")),
                      Step(f"xcheck:{v}", "compare", [f"xcheck-ours:{v}", f"xcheck-ref:{v}"], None,
                           lambda v=v: self.collect_xcheck(v))]
        return steps

    def collect_regenerate(self):
        """The regeneration's stats; the drafter's mask token must not occur in the data it trains on."""
        import yaml
        mask = yaml.safe_load(open(os.path.join(HERE, "quality.yaml")))["drafter"]["mask_token_id"]
        for kv in self.a.set or []:
            if kv.startswith("drafter.mask_token_id="):
                mask = int(kv.partition("=")[2])
        hits = sum(r["input_ids"].count(mask) for r in read_jsonl(self.regen))
        if hits:
            raise StepError(f"{self.regen}: the drafter's mask token {mask} occurs {hits} times (pick another id)")
        return {"stats": json.load(open(self.regen + ".meta.json"))["stats"], "mask_token_id": mask}

    def write_prompts(self):
        """The fixed subsets: the first N prompts of each group, in file order."""
        a, rows = self.a, []
        for g, f in GROUPS.items():
            for r in read_jsonl(os.path.join(self.bundle, "data", f))[:a.eval_prompts]:
                rows.append({"id": r.get("id"), "input_ids": r["input_ids"], "group": g})
        first = [r for r in rows if r["group"] == "sharegpt_heldout"]
        for name, subset in (("eval", rows), ("speed", first[:a.speed_prompts]), ("zlab", first[:a.zlab_prompts]),
                             ("xcheck", first[:a.xcheck_prompts])):
            with open(os.path.join(self.out, "prompts", name + ".jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in subset)
        counts = {g: sum(1 for r in rows if r["group"] == g) for g in GROUPS}
        return {"eval": counts, "speed": min(a.speed_prompts, len(first)), "zlab": min(a.zlab_prompts, len(first)),
                "xcheck": min(a.xcheck_prompts, len(first))}

    def config_dict(self, v):
        """quality.yaml with the bundle's paths, epochs, dtype, this variant's overrides and a
        control plane of its own (ephemeral port, no /metrics) so variants can run side by side."""
        import yaml
        cfg = yaml.safe_load(open(os.path.join(HERE, "quality.yaml")))
        cfg["run"].update(name=f"quality-{v}", output_dir=os.path.join(self.out, "runs", v), epochs=self.a.epochs)
        cfg["target"].update(model_dir=self.model, dtype=self.a.dtype)
        cfg["data"]["shard_dir"] = self.shards
        base, own = self.base_of(v), self.recipes[v][1] if v in self.recipes else []
        for section, fields in VARIANTS[base].items():
            merge(cfg.setdefault(section, {}), fields)
        slot = self.variants.index(v) if v in self.variants else len(self.variants)  # plain as a baseline only
        cfg["topology"]["c10d_port_base"] = 29700 + 16 * slot
        for kv in (self.a.set or []) + own:  # a recipe's own overrides last: they win
            apply_set(cfg, kv)
        # The target ships its last hidden state when the objective reads it: soft labels, or
        # DSpark's distribution terms.
        cfg["target"]["ship_h_last"] = bool(cfg["train"]["soft_labels"]["enabled"]) or \
            cfg["drafter"].get("method", "dflash") == "dspark"
        return cfg

    def train_config(self, v):
        """config_dict(v) written to OUT/configs/<v>.yaml (what `dflash run` reads)."""
        import yaml
        path = os.path.join(self.out, "configs", v + ".yaml")
        yaml.safe_dump(self.config_dict(v), open(path, "w"), sort_keys=False)
        return path

    def base_of(self, v):
        return self.recipes[v][0] if v in self.recipes else v

    def method_of(self, v):
        """drafter.method of v's config (dflash for SpecForge's drafter)."""
        return "dflash" if v == "specforge" else self.config_dict(v)["drafter"].get("method", "dflash")

    def recipe_differences(self, v):
        """The settings of v's config that differ from `plain`'s (paths, names and ports aside):
        {SECTION.FIELD: {"plain": value, v: value}}."""
        skip = {"run.name", "run.output_dir", "topology.c10d_port_base"}
        mine, ref = flatten(self.config_dict(v)), flatten(self.config_dict("plain"))
        return {k: {"plain": ref.get(k), v: mine.get(k)} for k in sorted(set(mine) | set(ref))
                if k not in skip and mine.get(k) != ref.get(k)}

    def train_command(self, v):
        return [self.dflash, "run", self.train_config(v), "--device", self.a.device, "--quiet"]

    def collect_train(self, v):
        run = os.path.join(self.out, "runs", v)
        curve = [{"step": r["step"], "loss": r["loss"]} for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
                 if "event" not in r and "loss" in r]
        if not curve or not os.path.isfile(os.path.join(run, "export", "config.json")):
            raise StepError(f"{run}: no metrics or no export after `dflash run`")
        write_json(os.path.join(self.out, "curves", v + ".json"), curve)
        steps = max(p["step"] for p in curve)
        planned = self.record("plan:specforge") if v == "plain" else None
        if planned and planned["steps"] != steps:
            raise StepError(f"{run}: trained {steps} steps, its plan (SpecForge's step count) said {planned['steps']}")
        return {"steps": steps, "export": os.path.join(run, "export"),
                "config": os.path.join(self.out, "configs", v + ".yaml")}

    def plan_command(self):
        return [self.dflash, "run", self.train_config("plain"), "--plan", "--device", self.a.device,
                "--plan-batches", self.specforge_batches]

    def collect_plan(self):
        """train:plain's plan: its step count and its export's config.json (the shape SpecForge builds)."""
        plan = json.load(open(os.path.join(self.out, "runs", "specforge-plan.json")))
        shape = os.path.join(self.out, "runs", "specforge-shape")
        os.makedirs(shape, exist_ok=True)
        write_json(os.path.join(shape, "config.json"), plan["drafter_config"])
        return {"steps": plan["total_steps"], "shape": shape, "config": os.path.join(self.out, "configs", "plain.yaml"),
                "batches": self.specforge_batches}

    def specforge_command(self):
        import yaml
        plan = self.record("plan:specforge")
        tr = yaml.safe_load(open(plan["config"]))
        t = tr["train"]
        return [sys.executable, os.path.join(HERE, "specforge_train.py"), "--target", self.model,
                "--batches", plan["batches"], "--shards", self.shards,
                "--shape", plan["shape"], "--out", os.path.join(self.out, "runs", "specforge"),
                "--steps", str(plan["steps"]), "--lr", str(t["lr"]), "--warmup-ratio", str(t["warmup_ratio"]),
                "--weight-decay", str(t["weight_decay"]), "--grad-clip", str(t["grad_clip"]),
                "--anchors", str(t["max_anchors"]), "--gamma", str(t["gamma"]), "--seed", str(tr["run"]["seed"]),
                *self.dev()]

    def collect_specforge(self):
        dest = os.path.join(self.out, "runs", "specforge")
        curve = [{"step": r["step"], "loss": r["loss"]} for r in read_jsonl(os.path.join(dest, "loss.jsonl"))]
        write_json(os.path.join(self.out, "curves", "specforge.json"), curve)
        summary = json.load(open(os.path.join(dest, "summary.json")))
        return {"steps": summary["steps"], "export": os.path.join(dest, "drafter"), "loop_wall_s": summary["wall_s"]}

    def loss_of(self, v):
        """The training objective of v (train.loss: dflash | dpace); SpecForge's harness trains dflash."""
        if v == "specforge":
            return "dflash"
        base, own = self.recipes[v] if v in self.recipes else (v, [])
        loss = VARIANTS[base]["train"].get("loss", "dflash")
        for kv in (self.a.set or []) + own:  # the order train_config applies them in
            if kv.startswith("train.loss="):
                loss = kv.partition("=")[2]
        return loss

    def export_of(self, v):
        return self.record(f"train:{v}")["export"]

    def eval_argv(self, v, prompts, out, batch, dtype, baseline=False):
        """`dflash eval` of v's drafter on OUT/prompts/<prompts>.jsonl into OUT/evals/<out>.json."""
        return [self.dflash, "eval", "--target", self.model, "--drafter", self.export_of(v), "--input",
                os.path.join(self.out, "prompts", prompts + ".jsonl"), "--max-new-tokens", str(self.a.max_new_tokens),
                "--batch-size", str(batch), "--stop-token-ids", stop_ids(self.model),
                "--out", os.path.join(self.out, "evals", out + ".json"), "--device", self.a.device,
                "--dtype", dtype] + ([] if baseline else ["--no-baseline"])

    def eval_command(self, v):
        return self.eval_argv(v, "eval", v, self.a.eval_batch, self.a.dtype)

    def collect_eval(self, v):
        ev = json.load(open(os.path.join(self.out, "evals", v + ".json")))
        return {"groups": {g: group_stats([r for r in ev["results"] if r["group"] == g]) for g in GROUPS},
                "tokens_per_second": ev["tokens_per_second"], "batch_size": self.a.eval_batch}

    def zlab_command(self, v):
        return [sys.executable, os.path.join(ROOT, "scripts", "reference", "zlab_generate.py"), "--target", self.model,
                "--drafter", self.export_of(v), "--input", os.path.join(self.out, "prompts", "zlab.jsonl"),
                "--max-new-tokens", str(self.a.max_new_tokens), "--stop-token-ids", stop_ids(self.model),
                "--device", self.a.device, "--dtype", self.a.zlab_dtype]

    def zlab_ours_command(self, v):
        return self.eval_argv(v, "zlab", f"zlab_ours_{v}", 1, self.a.zlab_dtype)

    def collect_zlab(self, v):
        z = json.load(open(os.path.join(self.out, "evals", f"zlab_{v}.json")))["results"]
        ours = json.load(open(os.path.join(self.out, "evals", f"zlab_ours_{v}.json")))["results"]
        if len(ours) != len(z):  # both in zlab.jsonl's order
            raise StepError(f"zlab:{v}: z-lab has {len(z)} results, ours {len(ours)} (the same prompts expected)")
        zs, os_ = group_stats(z), group_stats(ours)
        same = sum(1 for a, b in zip(z, ours) if a["output_ids"] == b["output_ids"])
        return {"prompts": len(z), "dtype": self.a.zlab_dtype, "tau_zlab": zs["tau"], "tau_ours": os_["tau"],
                "ratio": zs["tau"] / os_["tau"] if os_["tau"] else None, "same_output_prompts": same}

    def xexport_dir(self, v):
        return os.path.join(self.out, "runs", v, "export-speculators")

    def last_checkpoint(self, v):
        """v's checkpoint of its last step (runs/<v>/checkpoints/step-NNNNNNNN)."""
        steps = self.record(f"train:{v}")["steps"]
        path = os.path.join(self.out, "runs", v, "checkpoints", f"step-{steps:08d}")
        if not os.path.isfile(os.path.join(path, "state.json")):
            raise StepError(f"{path}: no checkpoint of train:{v}'s last step {steps}")
        return path

    def xexport_command(self, v):
        """`dflash export --format speculators` in the dtype of the run's own export (its weights are
        then the ones our eval reads), the target folder as the verifier."""
        dtype = json.load(open(os.path.join(self.export_of(v), "config.json")))["dtype"]
        return [self.dflash, "export", "--checkpoint", self.last_checkpoint(v), "--out", self.xexport_dir(v),
                "--format", "speculators", "--dtype", dtype, "--verifier", self.model]

    def xcheck_ref_command(self, v):
        return [sys.executable, os.path.join(ROOT, "scripts", "reference", "successor_generate.py"), "--target",
                self.model, "--drafter", self.xexport_dir(v), "--format", "speculators", "--input",
                os.path.join(self.out, "prompts", "xcheck.jsonl"), "--max-new-tokens", str(self.a.max_new_tokens),
                "--stop-token-ids", stop_ids(self.model), "--device", self.a.device, "--dtype", self.a.xcheck_dtype]

    def collect_xcheck(self, v):
        """Ours and the reference loop on the same prompts: identical output ids and acceptance
        lengths per round on every prompt, tau by each."""
        ref = json.load(open(os.path.join(self.out, "evals", f"xcheck_ref_{v}.json")))["results"]
        ours = json.load(open(os.path.join(self.out, "evals", f"xcheck_ours_{v}.json")))["results"]
        if len(ours) != len(ref):  # both in xcheck.jsonl's order
            raise StepError(f"xcheck:{v}: the reference has {len(ref)} results, ours {len(ours)} (the same prompts "
                            "expected)")
        rs, os_ = group_stats(ref), group_stats(ours)
        ids = sum(1 for a, b in zip(ref, ours) if a["output_ids"] == b["output_ids"])
        lens = sum(1 for a, b in zip(ref, ours) if a["acceptance_lengths"] == b["acceptance_lengths"])
        return {"prompts": len(ref), "dtype": self.a.xcheck_dtype, "method": self.method_of(v),
                "reference": "speculators 0.9.0 model (SpeculatorModel.from_pretrained of `dflash export --format "
                             "speculators`), scripts/reference/successor_generate.py loop",
                "tau_reference": rs["tau"], "tau_ours": os_["tau"], "same_output_prompts": ids,
                "same_acceptance_prompts": lens, "identical": ids == lens == len(ref)}

    def speed_command(self, v):  # plain's also runs the target's own greedy decoding (the baseline)
        return self.eval_argv(v, "speed", f"speed_{v}", 1, self.a.dtype, baseline=v == "plain")

    def collect_speed(self, v):
        ev = json.load(open(os.path.join(self.out, "evals", f"speed_{v}.json")))
        r = {"prompts": ev["prompts"], "tau": ev["tau"], "tokens_per_second": ev["tokens_per_second"]}
        if v == "plain":
            r.update(greedy_tokens_per_second=ev["baseline_tokens_per_second"], greedy_seconds=ev["baseline_seconds"])
        greedy = r.get("greedy_tokens_per_second") or self.record("speed:plain")["greedy_tokens_per_second"]
        r["speedup_vs_greedy"] = ev["tokens_per_second"] / greedy
        return r

    # ---- scheduling ----
    def estimate(self, step):
        """The longest measured step of its kind in this run, else the kind's estimate."""
        walls = [r["wall_s"] for r in (self.record(s.name) for s in self.steps if s.kind == step.kind) if r]
        return max(walls) if walls else self.estimates[step.kind]

    def finish(self, step, wall, result=None):
        rec = {"step": step.name, "kind": step.kind, "wall_s": wall, **(result if result is not None else step.collect())}
        write_json(self.record_path(step.name), rec)
        write_json(os.path.join(self.out, "results.json"), self.results())
        print(f"[quality] {step.name} done in {wall:.1f} s", file=sys.stderr, flush=True)

    def start(self, step):
        argv = step.command()
        log = os.path.join(self.out, "logs", step.name.replace(":", "_"))
        print("+ " + " ".join(argv), file=sys.stderr, flush=True)
        out = open(step.stdout or log + ".out", "w")
        return subprocess.Popen(argv, stdout=out, stderr=open(log + ".err", "w"), env=step.env), log

    def host_info(self):
        """OUT/host.json, once per output folder: the build (`dflash --version`) and the device that
        measured (the GPU's name through torch, in a child process: the flow itself holds no CUDA
        context). The report names both beside the speedups."""
        path = os.path.join(self.out, "host.json")
        if os.path.isfile(path):
            return json.load(open(path))
        version = subprocess.run([self.dflash, "--version"], capture_output=True, text=True)
        if version.returncode != 0:
            raise StepError(f"{self.dflash} --version exited {version.returncode}: {version.stderr[-500:]}")
        gpu = None
        if self.a.device.startswith("cuda"):
            probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                                   capture_output=True, text=True)
            if probe.returncode != 0:
                raise StepError(f"the GPU's name: torch exited {probe.returncode}: {probe.stderr[-500:]}")
            gpu = probe.stdout.strip()
        info = {"dflash_version": version.stdout.strip(), "gpu": gpu, "device": self.a.device}
        write_json(path, info)
        return info

    def run(self):
        self.host_info()
        t0 = time.time()
        deadline = t0 + self.a.deadline_s if self.a.deadline_s else None
        done = {s.name for s in self.steps if self.record(s.name)}
        running = {}  # name -> (step, process, log, start time)
        while True:
            pending = [s for s in self.steps if s.name not in done and s.name not in running]
            if not pending and not running:
                write_json(os.path.join(self.out, "results.json"), self.results())
                return 0
            blocked = False
            for s in pending:
                if len(running) >= self.a.parallel or any(r[0].exclusive for r in running.values()):
                    break
                if not all(d in done for d in s.deps) or (s.exclusive and running):
                    continue
                if deadline is not None and time.time() + self.estimate(s) > deadline:
                    blocked = True
                    continue
                if s.command is None:  # in-process: collect() does the work
                    t = time.time()
                    result = s.collect()
                    self.finish(s, time.time() - t, result)
                    done.add(s.name)
                    continue
                running[s.name] = (s, *self.start(s), time.time())
            if not running:
                if blocked:
                    left = [s.name for s in self.steps if s.name not in done]
                    print(f"[quality] deadline: stopped before {', '.join(left)} (rerun to continue)",
                          file=sys.stderr, flush=True)
                    write_json(os.path.join(self.out, "results.json"), self.results())
                    return EXIT_DEADLINE
                continue  # in-process steps finished: look again
            self.wait_one(running, done)

    def wait_one(self, running, done):
        while True:
            for name, (s, p, log, t) in list(running.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del running[name]
                try:
                    if rc != 0:
                        tail = open(log + ".err", errors="replace").read()[-4000:]
                        raise StepError(f"step {name} exited {rc}; log {log}.err:\n{tail}")
                    self.finish(s, time.time() - t)
                except StepError:
                    for _, q, _, _ in running.values():
                        q.terminate()
                    for _, q, _, _ in running.values():
                        q.wait()
                    raise
                done.add(name)
                return
            time.sleep(0.2)

    # ---- results ----
    def results(self):
        """OUT/results.json from the step records (the same whether the run went in one go or not)."""
        a = self.a
        rec = {s.name: self.record(s.name) for s in self.steps}
        prompts = rec.get("prompts") or {}
        res = {"setting": {"bundle": self.bundle, "device": a.device, "dtype": a.dtype, "epochs": a.epochs,
                           "max_new_tokens": a.max_new_tokens, "regen_batch": a.regen_batch,
                           "eval_batch": a.eval_batch, "parallel": a.parallel, "set": a.set or []},
               "subsets": {"tau": f"first {a.eval_prompts} prompts of each group (counts: {prompts.get('eval')}), "
                                  f"batch {a.eval_batch}",
                           "speed": f"first {prompts.get('speed')} held-out ShareGPT prompts, batch 1, "
                                    "greedy baseline on the same prompts",
                           "zlab": f"first {prompts.get('zlab')} held-out ShareGPT prompts, batch 1, {a.zlab_dtype}, "
                                   "z-lab's dflash_generate and our eval",
                           "xcheck": f"first {prompts.get('xcheck')} held-out ShareGPT prompts, batch 1, "
                                     f"{a.xcheck_dtype}, the reference loop with speculators' model and our eval"},
               "host": json.load(open(os.path.join(self.out, "host.json")))
               if os.path.isfile(os.path.join(self.out, "host.json")) else None,
               "steps": {n: r["wall_s"] for n, r in rec.items() if r},
               "regenerate": (rec.get("regenerate") or {}).get("stats"), "variants": {}}
        for v in self.variants:
            tr, ev = rec.get(f"train:{v}"), rec.get(f"eval:{v}")
            r = {"steps": tr["steps"] if tr else None, "train_wall_s": tr["wall_s"] if tr else None,
                 "export": tr["export"] if tr else None, "groups": ev["groups"] if ev else None,
                 "loss_curve": os.path.join(self.out, "curves", v + ".json") if tr else None}
            for k in ("zlab", "speed", "xcheck"):
                if rec.get(f"{k}:{v}"):
                    r[k] = {x: y for x, y in rec[f"{k}:{v}"].items() if x not in ("step", "kind")}
            if v in self.recipes:
                r["recipe"] = {"base": self.recipes[v][0], "set": self.recipes[v][1]}
            r["loss"] = self.loss_of(v)
            if v != "specforge":
                cfg = self.config_dict(v)
                r.update(base=self.base_of(v), method=self.method_of(v), seed=cfg["run"]["seed"],
                         block_size=cfg["drafter"]["block_size"], differs_from_plain=self.recipe_differences(v))
                if self.method_of(v) in REFERENCE_NOT_APPLIED:
                    r["reference_not_applied"] = REFERENCE_NOT_APPLIED[self.method_of(v)]
            res["variants"][v] = r
        sp = rec.get("speed:plain")
        res["target_greedy"] = ({"tokens_per_second": sp["greedy_tokens_per_second"], "seconds": sp["greedy_seconds"],
                                 "prompts": sp["prompts"], "batch_size": 1} if sp else None)
        return res


def merge(node, fields):
    """fields (nested dicts) into node, section by section."""
    for k, val in fields.items():
        if isinstance(val, dict):
            merge(node.setdefault(k, {}), val)
        else:
            node[k] = val


def flatten(cfg, prefix=""):
    """{"a.b.c": value} of a nested config dict (lists are values)."""
    out = {}
    for k, val in cfg.items():
        if isinstance(val, dict):
            out.update(flatten(val, f"{prefix}{k}."))
        else:
            out[prefix + k] = val
    return out


def apply_set(cfg, kv):
    """One SECTION.FIELD=VALUE override (VALUE read as YAML) into the config dict."""
    import yaml
    key, _, val = kv.partition("=")
    *path, field = key.split(".")
    node = cfg
    for k in path:
        node = node.setdefault(k, {}) if isinstance(node, dict) else None
    if not path or path[0] not in cfg or not field or not isinstance(node, dict) or not _:
        raise StepError(f"--set / --recipe: expected section.field=VALUE with a section of quality.yaml, got '{kv}'")
    value = yaml.safe_load(val)
    if isinstance(value, str):  # YAML 1.1 reads 2e-3 (no dot) as text
        try:
            value = float(value)
        except ValueError:
            pass
    node[field] = value


def parse_recipes(specs):
    """--recipe NAME=BASE:SECTION.FIELD=VALUE[;SECTION.FIELD=VALUE...] -> {NAME: (BASE, [overrides])}:
    a variant trained like BASE (one of VARIANTS) with its own overrides, for the recipe
    measurements (e.g. layers5=plain:drafter.num_layers=5) and second seeds (dspark_s2=dspark:run.seed=4321)."""
    out = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        base, colon, sets = rest.partition(":")
        if not eq or not colon or not name or base not in VARIANTS or not sets:
            raise StepError(f"--recipe: expected NAME=BASE:SECTION.FIELD=VALUE[;...] with BASE one of "
                            f"{', '.join(VARIANTS)}, got '{spec}'")
        if name in VARIANTS or name == "specforge" or name in out or not name.replace("_", "").replace("-", "").isalnum():
            raise StepError(f"--recipe: the name '{name}' is taken or not a plain word")
        out[name] = (base, sets.split(";"))
    return out


def table(results):
    """The Markdown table of results.json (stdout of `run.py gpu`, and docs/quality.md's)."""
    lines = ["| variant | group | tau | steps | train wall s | speedup vs greedy | tau z-lab / ours |",
             "|---|---|---|---|---|---|---|"]
    for v, r in results["variants"].items():
        for g, s in (r["groups"] or {}).items():
            sp = r.get("speed", {}).get("speedup_vs_greedy") if g == "sharegpt_heldout" else None
            z = r.get("zlab") if g == "sharegpt_heldout" else None
            lines.append(f"| {v} | {g} | {s['tau']:.3f} | {r['steps']} | {r['train_wall_s']:.0f} | "
                         f"{'%.2f' % sp if sp else '-'} | {'%.3f / %.3f' % (z['tau_zlab'], z['tau_ours']) if z else '-'} |")
    return "\n".join(lines)


def cmd_gpu(a):
    flow = GpuFlow(a)
    rc = flow.run()
    if rc == 0:
        print(table(flow.results()))
    return rc


def add_arguments(g):
    g.add_argument("bundle")
    g.add_argument("out")
    g.add_argument("--variants", default="plain,specforge,soft,noise,dpace",
                   help="our recipe variants (plain, soft, noise, dpace, dspark, dflash2) and specforge (needs plain)")
    g.add_argument("--epochs", type=int, default=1, help="epochs over the regenerated data (the lr schedule's length)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--regen-batch", type=int, default=512, help="requests decoded at once by regenerate (512: 322 s on the H200, 256: ~725 s)")
    g.add_argument("--eval-prompts", type=int, default=600, help="first N prompts of each group for tau")
    g.add_argument("--eval-batch", type=int, default=64, help="batch size of the tau evals")
    g.add_argument("--speed-prompts", type=int, default=32, help="first N held-out prompts for the speedup (batch 1)")
    g.add_argument("--zlab-prompts", type=int, default=32, help="first N held-out prompts for the z-lab cross-check")
    g.add_argument("--zlab-dtype", default="float32", help="dtype of the z-lab cross-check, both sides")
    g.add_argument("--xcheck-prompts", type=int, default=0,
                   help="first N held-out prompts for the successors' cross-check with the reference loop (0: none)")
    g.add_argument("--xcheck-dtype", default="float32", help="dtype of the successors' cross-check, both sides")
    g.add_argument("--parallel", type=int, default=1, help="steps run at once (trainings and evals as processes)")
    g.add_argument("--deadline-s", type=float, default=0, help="start no step that would end later (0: none); exit 3")
    g.add_argument("--estimate", action="append", metavar="KIND=S", help="wall estimate of a step kind (seconds)")
    g.add_argument("--recipe", action="append", metavar="NAME=BASE:SECTION.FIELD=VALUE[;...]",
                   help="one more variant: BASE's recipe with these overrides (recipe measurements), "
                        "e.g. layers5=plain:drafter.num_layers=5")
    g.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="override of quality.yaml for every variant (e.g. data.token_budget=4096)")
