"""`run.py report OUT`: the quality run's results (OUT/results.json and OUT/curves, as `run.py gpu`
wrote them) into docs/quality.md, its PNGs and a copy of results.json beside the doc.

docs/quality.md keeps its prose; only the text between BEGIN and END is replaced (both markers must
be there once, in that order). Images (--images, default docs/images): quality_loss.png (loss per
step of every trainer on one plot: ours per variant and SpecForge's), quality_tau.png (tau per
variant and prompt group), and with the successors quality_methods_loss.png (one panel per method,
its seeds' loss curves). The methods table (DFlash, D-PACE, DSpark, DFlash2 x seeds), the seed
spread and the default-recipe decision are computed from results.json (`decision`), never written
by hand. The copy (--results-copy, default quality-results.json beside the doc) adds the decision.
Exit 0 written, 2 missing results.json / markers.
"""
import json
import os
import sys

BEGIN = "<!-- quality-results:begin (written by scripts/quality/run.py report; do not edit by hand) -->"
END = "<!-- quality-results:end -->"
SMOOTH = 25  # steps in the loss plot's moving average
GROUP_TITLES = {"sharegpt_heldout": "held-out ShareGPT", "humaneval": "HumanEval"}
METHOD_ORDER = ("plain", "dpace", "dspark", "dflash2")  # the methods table's rows (VARIANTS names)
METHOD_TITLES = {"plain": "DFlash", "dpace": "D-PACE", "dspark": "DSpark", "dflash2": "DFlash2"}
SUCCESSORS = ("dspark", "dflash2")
MARGIN = 1.03  # a successor replaces DFlash only above this tau ratio, on both groups with both seeds


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def curves(out):
    d = os.path.join(out, "curves")
    return {f[:-5]: json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d)) if f.endswith(".json")}


def loss_windows(out, res, windows=8):
    """Markdown: the mean training loss of SpecForge and of each of our variants trained on the
    DFlash loss (results.json's `loss`; D-PACE's is on another scale) over windows of equal steps,
    with each ratio ours / SpecForge's (below 1: ours lower). Empty without SpecForge's curve."""
    c = curves(out)
    ours = [n for n, r in res["variants"].items() if n != "specforge" and n in c
            and r.get("loss", "dflash") == "dflash" and r.get("method", "dflash") == "dflash"]
    if "specforge" not in c or not ours:
        return []
    ref = {p["step"]: p["loss"] for p in c["specforge"]}
    by = {n: {p["step"]: p["loss"] for p in c[n]} for n in ours}
    steps = sorted(set(ref).intersection(*by.values()))
    if not steps:
        return []
    size = max(1, -(-len(steps) // windows))
    lines = ["", "Training loss, SpecForge and ours (DFlash loss), mean over windows of equal steps (the same steps "
                 "on every side; a ratio below 1: ours lower):", "",
             "| steps | SpecForge | " + " | ".join(f"`{n}` | `{n}` / SpecForge" for n in ours) + " |",
             "|---|---|" + "---|---|" * len(ours)]
    mean = lambda d, w: sum(d[k] for k in w) / len(w)
    for i in range(0, len(steps), size):
        w = steps[i:i + size]
        b = mean(ref, w)
        lines.append(f"| {w[0]}-{w[-1]} | {b:.3f} | " + " | ".join(f"{mean(by[n], w):.3f} | {mean(by[n], w) / b:.3f}"
                                                               for n in ours) + " |")
    return lines


def seed_runs(res):
    """{method: [(seed, variant name), ...] in seed order}: each VARIANTS base among METHOD_ORDER and
    the --recipe variants whose only override is run.seed (a second seed of that base)."""
    out = {}
    for name, r in res["variants"].items():
        base = r.get("base")
        recipe = r.get("recipe")
        if base not in METHOD_ORDER or (recipe and any(not kv.startswith("run.seed=") for kv in recipe["set"])):
            continue
        out.setdefault(base, []).append((r["seed"], name))
    return {m: sorted(out[m]) for m in METHOD_ORDER if m in out}


def tau_of(res, name, group):
    g = res["variants"][name].get("groups") or {}
    return (g.get(group) or {}).get("tau")


def decision(res):
    """The default-recipe rule on the measured numbers: a successor becomes the default when its tau
    is above MARGIN x DFlash's (`plain`, the same seed) on both groups with both of DFlash's first two
    seeds. A successor fails as soon as one measured ratio is not above it; it is pending while a
    seed's pair is not measured. Returns {"default": method, "status": final | pending,
    "successors": {m: {"ratios": {seed: {group: ratio}}, "status": passes | fails | pending}},
    "text": the sentence for the report}."""
    runs = seed_runs(res)
    base_seeds = [s for s, _ in runs.get("plain", [])][:2]
    out = {}
    for m in (m for m in SUCCESSORS if m in runs):
        mine = dict(runs[m])
        ratios, status = {}, "pending"
        for seed, plain_name in runs.get("plain", [])[:2]:
            if seed not in mine:
                continue
            for g in GROUP_TITLES:
                t, b = tau_of(res, mine[seed], g), tau_of(res, plain_name, g)
                if t is not None and b:
                    ratios.setdefault(str(seed), {})[g] = t / b
        flat = [x for d in ratios.values() for x in d.values()]
        if any(x <= MARGIN for x in flat):
            status = "fails"
        elif len(base_seeds) == 2 and len(flat) == 2 * len(GROUP_TITLES):
            status = "passes"
        out[m] = {"ratios": ratios, "status": status}
    passing = [m for m in out if out[m]["status"] == "passes"]
    pending = [m for m in out if out[m]["status"] == "pending"]
    fmt_r = lambda m: "; ".join(f"seed {s}: " + ", ".join(f"{GROUP_TITLES[g]} {x:.3f}x" for g, x in d.items())
                                for s, d in out[m]["ratios"].items()) or "no tau measured"
    detail = " ".join(f"{METHOD_TITLES[m]} / DFlash: {fmt_r(m)} ({out[m]['status']})." for m in out)
    if passing:
        best = max(passing, key=lambda m: min(x for d in out[m]["ratios"].values() for x in d.values()))
        return {"default": best, "status": "final", "successors": out,
                "text": f"**Decision: {METHOD_TITLES[best]} becomes the default recipe**: above {MARGIN:.2f}x "
                        f"DFlash's tau on both groups with both seeds. {detail}"}
    if pending or not out:
        return {"default": None, "status": "pending", "successors": out,
                "text": f"**Decision pending**: not every seed needed is measured yet (the rule: above {MARGIN:.2f}x "
                        f"DFlash's tau on both groups with both seeds). {detail}".rstrip()}
    return {"default": "plain", "status": "final", "successors": out,
            "text": f"**Decision: DFlash stays the default recipe**: no successor is above {MARGIN:.2f}x DFlash's "
                    f"tau on both groups with every seed. {detail}"}


def spread(values):
    """(max - min) / mean of the measured values, None with fewer than two."""
    vals = [x for x in values if x is not None]
    return (max(vals) - min(vals)) / (sum(vals) / len(vals)) if len(vals) >= 2 else None


def methods_block(res):
    """Markdown: the methods x seeds table, the seed spread, the cross-checks and the decision."""
    runs = seed_runs(res)
    if not any(m in runs for m in SUCCESSORS):
        return []
    v, host = res["variants"], res.get("host") or {}
    plain_by_seed = dict((s, n) for s, n in runs.get("plain", []))
    lines = ["", f"Methods x seeds (the same regenerated data, steps and prompts; each method with its reference "
                 f"recipe's per-method settings, `differs_from_plain` in results.json). Speedup: `dflash eval` "
                 f"at batch 1 against the target's greedy decoding, measured by `{host.get('dflash_version', '-')}` "
                 f"on {host.get('gpu') or host.get('device', '-')}; step time: train wall / steps, the "
                 "trainings side by side on one device.", "",
             "| method | seed | variant | block | tau held-out ShareGPT | / DFlash | tau HumanEval | / DFlash | "
             "steps | step time s | speedup vs greedy (batch 1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, seeds in runs.items():
        for seed, name in seeds:
            r, base = v[name], plain_by_seed.get(seed)
            cells = []
            for g in GROUP_TITLES:
                t, b = tau_of(res, name, g), tau_of(res, base, g) if base else None
                cells.append(f"{fmt(t)} | {fmt(t / b if t is not None and b else None)}")
            st = r["train_wall_s"] / r["steps"] if r.get("train_wall_s") and r.get("steps") else None
            lines.append(f"| {METHOD_TITLES[m]} | {seed} | `{name}` | {fmt(r.get('block_size'), 'd')} | "
                         f"{' | '.join(cells)} | {fmt(r.get('steps'), 'd')} | {fmt(st, '.3f')} | "
                         f"{fmt((r.get('speed') or {}).get('speedup_vs_greedy'), '.2f')} |")
    lines += ["", "Seed spread ((max - min) / mean of tau over the seeds; '-' until two seeds are measured):", "",
              "| method | " + " | ".join(GROUP_TITLES.values()) + " |", "|---|" + "---|" * len(GROUP_TITLES)]
    for m, seeds in runs.items():
        lines.append(f"| {METHOD_TITLES[m]} | " + " | ".join(
            fmt(spread([tau_of(res, n, g) for _, n in seeds]), ".1%") for g in GROUP_TITLES) + " |")
    for m in (m for m in SUCCESSORS if m in v and v[m].get("xcheck")):
        x = v[m]["xcheck"]
        lines += ["", f"Cross-check of `{m}` ({x['prompts']} held-out prompts, batch 1, {x['dtype']}): the reference "
                      f"loop with speculators' own model from our `dflash export --format speculators` gives tau "
                      f"{x['tau_reference']:.3f}, ours {x['tau_ours']:.3f}; identical output ids on "
                      f"{x['same_output_prompts']} of {x['prompts']} prompts, identical acceptance lengths on "
                      f"{x['same_acceptance_prompts']}: **{'identical' if x['identical'] else 'NOT identical'}**."]
    lines += ["", decision(res)["text"]]
    return lines


def block(res, image_rel, out):
    """The Markdown between the markers."""
    s, v = res["setting"], res["variants"]
    lines = [f"Measured by `run.py gpu` ({s['device']}, {s['dtype']}, {s['epochs']} epoch(s), at most "
             f"{s['max_new_tokens']} new tokens, T = 0). Prompt subsets: tau: {res['subsets']['tau']}; "
             f"speedup: {res['subsets']['speed']}; z-lab: {res['subsets']['zlab']}.", "",
             "| drafter | tau held-out ShareGPT | / SpecForge's | tau HumanEval | / SpecForge's | "
             "speedup vs target greedy (batch 1) | steps | train wall s | "
             "tau by z-lab `dflash_generate` / ours (same prompts) |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref = (v.get("specforge") or {}).get("groups") or {}

    def tau_and_ratio(g, group):
        t, r = g.get(group, {}).get("tau"), ref.get(group, {}).get("tau")
        return f"{fmt(t)} | {fmt(t / r if t is not None and r else None)}"

    for name, r in v.items():
        g = r.get("groups") or {}
        z = r.get("zlab")
        lines.append(f"| {'SpecForge (plain DFlash loss)' if name == 'specforge' else 'ours, `' + name + '`'} | "
                     f"{tau_and_ratio(g, 'sharegpt_heldout')} | {tau_and_ratio(g, 'humaneval')} | "
                     f"{fmt((r.get('speed') or {}).get('speedup_vs_greedy'), '.2f')} | {fmt(r.get('steps'), 'd')} | "
                     f"{fmt(r.get('train_wall_s'), '.0f')} | "
                     f"{'%.3f / %.3f' % (z['tau_zlab'], z['tau_ours']) if z else '-'} |")
    tg = res.get("target_greedy")
    if tg:
        lines += ["", f"Target greedy baseline: {tg['tokens_per_second']:.1f} tokens/s at batch 1 over "
                      f"{tg['prompts']} prompts."]
    for gname, title in GROUP_TITLES.items():
        rows = [(n, r["groups"][gname]["per_position_acceptance"]) for n, r in v.items()
                if r.get("groups") and gname in r["groups"]]
        if rows:
            k = max(len(p) for _, p in rows)
            lines += ["", f"Per-position acceptance, {title} (share of rounds whose k-th draft token was accepted):", "",
                      "| drafter | " + " | ".join(f"k={i + 1}" for i in range(k)) + " |",
                      "|---|" + "---|" * k]
            lines += [f"| {n} | " + " | ".join(f"{x:.2f}" for x in p) + " |" for n, p in rows]
    lines += methods_block(res)
    lines += loss_windows(out, res)
    lines += ["", "Wall time per step (s): " + ", ".join(f"{n} {w:.0f}" for n, w in res["steps"].items()) + ".",
              "", f"![loss per step, both trainers]({image_rel}/quality_loss.png)",
              f"![tau per variant]({image_rel}/quality_tau.png)"]
    if any(m in seed_runs(res) for m in SUCCESSORS):
        lines.append(f"![loss per method and seed]({image_rel}/quality_methods_loss.png)")
    return "\n".join(lines)


def plots(res, out, images):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(images, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in curves(out).items():  # each step's loss faint, its moving average over SMOOTH steps drawn
        steps, loss = [p["step"] for p in pts], [p["loss"] for p in pts]
        avg = [sum(loss[max(0, i - SMOOTH + 1):i + 1]) / (i + 1 - max(0, i - SMOOTH + 1)) for i in range(len(loss))]
        line, = ax.plot(steps, avg, label=("SpecForge" if name == "specforge" else name) + f" ({SMOOTH}-step mean)",
                        linewidth=1.8 if name in ("plain", "specforge") else 0.9)
        ax.plot(steps, loss, color=line.get_color(), linewidth=0.4, alpha=0.25)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")  # D-PACE's loss is on another scale than the DFlash loss
    ax.set_title("Loss per step: ours (dflash run) and SpecForge 0.2.0, same data and steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(images, "quality_loss.png"), dpi=100, metadata={"Software": None})
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [n for n, r in res["variants"].items() if r.get("groups")]
    width = 0.8 / max(1, len(GROUP_TITLES))
    for i, (g, title) in enumerate(GROUP_TITLES.items()):
        ax.bar([x + i * width for x in range(len(names))], [res["variants"][n]["groups"][g]["tau"] for n in names],
               width, label=title)
    ax.set_xticks([x + width * (len(GROUP_TITLES) - 1) / 2 for x in range(len(names))], names)
    ax.set_ylabel("tau (mean acceptance length)")
    ax.set_title("tau per drafter and prompt group")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(images, "quality_tau.png"), dpi=100, metadata={"Software": None})
    plt.close(fig)


def methods_plot(res, out, images):
    """quality_methods_loss.png: one panel per method (its objective's own scale), each seed's loss
    per step as a moving average over SMOOTH steps. False when no successor ran."""
    runs = seed_runs(res)
    if not any(m in runs for m in SUCCESSORS):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = curves(out)
    os.makedirs(images, exist_ok=True)
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.6), squeeze=False)
    for ax, (m, seeds) in zip(axes[0], runs.items()):
        for seed, name in seeds:
            loss = [p["loss"] for p in c.get(name, [])]
            avg = [sum(loss[max(0, i - SMOOTH + 1):i + 1]) / (i + 1 - max(0, i - SMOOTH + 1)) for i in range(len(loss))]
            ax.plot([p["step"] for p in c.get(name, [])], avg, label=f"seed {seed} ({name})", linewidth=1.2)
        ax.set_title(f"{METHOD_TITLES[m]} (its own objective)")
        ax.set_xlabel("optimizer step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"training loss ({SMOOTH}-step mean)")
    fig.tight_layout()
    fig.savefig(os.path.join(images, "quality_methods_loss.png"), dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


def cmd_report(a):
    path = os.path.join(a.out, "results.json")
    if not os.path.isfile(path):
        print(f"ERROR: {path} not found (run `run.py gpu` first)", file=sys.stderr)
        return 2
    res = json.load(open(path))
    doc = open(a.doc, encoding="utf-8").read()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        print(f"ERROR: {a.doc}: expected the markers '{BEGIN}' and '{END}' once each, in order", file=sys.stderr)
        return 2
    plots(res, a.out, a.images)
    methods_plot(res, a.out, a.images)
    copy = a.results_copy or os.path.join(os.path.dirname(os.path.abspath(a.doc)), "quality-results.json")
    with open(copy, "w", encoding="utf-8") as f:
        json.dump(dict(res, decision=decision(res)), f, indent=1)
    rel = os.path.relpath(os.path.abspath(a.images), os.path.dirname(os.path.abspath(a.doc)))
    head, rest = doc.split(BEGIN)
    tail = rest.split(END)[1]
    with open(a.doc, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + block(res, rel, a.out) + "\n" + END + tail)
    print(f"wrote {a.doc}, {copy} and the PNGs in {a.images}")
    return 0
