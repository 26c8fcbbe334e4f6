"""`run.py report OUT`: the quality run's results (OUT/results.json and OUT/curves, as `run.py gpu`
wrote them) into docs/quality.md and two PNGs.

docs/quality.md keeps its prose; only the text between BEGIN and END is replaced (both markers must
be there once, in that order). Images (--images, default docs/images): quality_loss.png (loss per
step of every trainer on one plot: ours per variant and SpecForge's), quality_tau.png (tau per
variant and prompt group). Exit 0 written, 2 missing results.json / markers.
"""
import json
import os
import sys

BEGIN = "<!-- quality-results:begin (written by scripts/quality/run.py report; do not edit by hand) -->"
END = "<!-- quality-results:end -->"
SMOOTH = 25  # steps in the loss plot's moving average
GROUP_TITLES = {"sharegpt_heldout": "held-out ShareGPT", "humaneval": "HumanEval"}


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
    ours = [n for n, r in res["variants"].items()
            if n != "specforge" and n in c and r.get("loss", "dflash") == "dflash"]
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
    lines += loss_windows(out, res)
    lines += ["", "Wall time per step (s): " + ", ".join(f"{n} {w:.0f}" for n, w in res["steps"].items()) + ".",
              "", f"![loss per step, both trainers]({image_rel}/quality_loss.png)",
              f"![tau per variant]({image_rel}/quality_tau.png)"]
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
    rel = os.path.relpath(os.path.abspath(a.images), os.path.dirname(os.path.abspath(a.doc)))
    head, rest = doc.split(BEGIN)
    tail = rest.split(END)[1]
    with open(a.doc, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + block(res, rel, a.out) + "\n" + END + tail)
    print(f"wrote {a.doc} and {a.images}/quality_loss.png, quality_tau.png")
    return 0
