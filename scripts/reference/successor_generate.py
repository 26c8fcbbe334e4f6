#!/usr/bin/env python3
"""Greedy speculative decoding of a DSpark or DFlash2 drafter with vLLM speculators 0.9.0's own
modules: the reference loop our `dflash eval` (core/eval/spec_decode.h) must equal token for token,
acceptance lengths per round included.

speculators 0.9.0 ships the models but no drafting loop, so the loop is written here, and every
model computation in it is speculators' or HF transformers' own:
  - the drafter: `DSparkDraftModel` / `DFlash2DraftModel` built from our HF export and loaded by name
    exactly as scripts/quality/check_successor_speculators.py does (strict keys), its embedding and
    lm_head the target's; or (--format speculators) our `dflash export --format speculators` folder
    loaded by speculators' own `SpeculatorModel.from_pretrained`, which resolves the class from the
    config and rebuilds the embedding and lm_head from the verifier the export names; each round runs its fc + hidden_norm over the target features of the
    accepted prefix and its decoder layers over [context, block] with no mask (the block attends the
    whole context and itself), from scratch (no cache), then its final norm and lm_head;
  - DSpark's walk: x_k = argmax(U_k + markov_head.block_bias(prev tokens [anchor, x_0..x_{k-1}],
    hidden rows 0..k))[k] (the bias of row k; rnn runs its state over rows 0..k), U_k = the logits of
    block row k; the confidence head does not cut the draft (static verify length);
  - DFlash2's walk: rows 1..V-1; (C_k, s_k) = candidate_selector.select(U_k, h_k, pred) with pred =
    the anchor for row 1, then the previous draft; x_k = C_k[argmax s_k];
  - the target: transformers' model, an uncached full forward each time: over the accepted tokens
    (the captured features hidden_states[l + 1] for l in target_layer_ids: z-lab's convention, ours)
    and over the accepted tokens + the drafts (the verify logits).
Rounds (spec_decode.h): start = index of the last accepted token; V = min(W, max_length - start)
with W = B + 1 (dspark: B drafts) or B (dflash2: B - 1 drafts); block = [seq[start], MASK ...]
(dspark V - 1 rows, dflash2 V rows) at positions start, start + 1, ...; a = the longest prefix of
drafts equal to the target's argmax; produced = min(a + 1, max_length - start - 1), cut after a stop
token; acceptance_lengths gets `produced`. The first token comes from the prompt's forward.
With --compare, our output ids, acceptance lengths and (where ours lists them: "drafts", one list
per round) every round's drafts, rejected ones included, must equal the reference's.

--mutate changes the reference on purpose (must-fail checks): no_markov (DSpark without the Markov
bias), plain_argmax (DFlash2 drafts by the unary argmax, no selector).

Usage: successor_generate.py --target DIR --drafter EXPORT_DIR --input PROMPTS.jsonl --max-new-tokens N
                             [--format hf|speculators] [--block-size B] [--stop-token-ids a,b]
                             [--compare OURS.json] [--mutate no_markov|plain_argmax]
                             [--dtype float32|float64] [--device cpu|cuda]
Prints {"results": [{"output_ids": [...], "acceptance_lengths": [...]}...]} on stdout.
Exit: 0 agreement (or no --compare), 1 disagreement, 2 bad usage / missing file / wrong speculators.
"""
import argparse
import json
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "quality"))
from speculators_ref import import_speculators  # noqa: E402

METHODS = {"Qwen3DSparkModel": "dspark", "DFlash2DraftModel": "dflash2"}
SPECULATORS_METHODS = {"dspark": "dspark", "dflash2": "dflash2"}  # speculators_model_type -> method


def log(*a):
    print(*a, file=sys.stderr)


def load_prompts(path):
    out = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if line.strip():
                ids = json.loads(line).get("input_ids")
                if not isinstance(ids, list) or not ids:
                    raise ValueError(f"{path}:{ln}: no non-empty 'input_ids' list")
                out.append([int(t) for t in ids])
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


class Reference:
    """The drafter (speculators) and the target (transformers) of one export, with the round rule."""

    def __init__(self, target_dir, export_dir, dtype, mutate, fmt="hf", device="cpu"):
        from transformers import AutoModelForCausalLM
        self.mutate, self.device = mutate, torch.device(device)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(self.device).eval()
        if fmt == "speculators":
            self.model = self.load_speculators(export_dir)
        else:
            self.model = self.load_hf(export_dir)
        self.model = self.model.to(device=self.device, dtype=dtype).eval()

    def load_hf(self, export_dir):
        """speculators' model class of our HF export, built and loaded by name; the target's
        embedding and lm_head."""
        from check_successor_speculators import build_reference
        with open(os.path.join(export_dir, "config.json")) as f:
            cfg = json.load(f)
        arch = [a for a in cfg.get("architectures", []) if a in METHODS]
        if not arch:
            raise ValueError(f"{export_dir}/config.json: architectures {cfg.get('architectures')} name no "
                             f"DSpark or DFlash2 drafter")
        self.method = METHODS[arch[0]]
        self.block_size = int(cfg["block_size"])
        self.layer_ids = list(cfg["dflash_config"]["target_layer_ids"])
        self.mask = int(cfg["dflash_config"]["mask_token_id"])
        model = build_reference(export_dir, {"method": self.method, "block_size": self.block_size})
        with torch.no_grad():
            model.embed_tokens.weight.copy_(self.target.get_input_embeddings().weight)
            model.lm_head.weight.copy_(self.target.get_output_embeddings().weight)
        return model

    def load_speculators(self, export_dir):
        """Our speculators-format export through speculators' own loader: the class from the
        config's speculators_model_type, the drafter's tensors (strict: no missing, unexpected or
        mismatched key), the embedding and lm_head from the verifier the export names."""
        from speculators.config import SpeculatorModelConfig
        from speculators.model import SpeculatorModel
        with open(os.path.join(export_dir, "config.json")) as f:
            cfg = json.load(f)
        method = SPECULATORS_METHODS.get(cfg.get("speculators_model_type"))
        if method is None:
            raise ValueError(f"{export_dir}/config.json: speculators_model_type {cfg.get('speculators_model_type')!r} "
                             "is not dspark or dflash2")
        if bool(cfg.get("sample_from_anchor")) != (method == "dspark"):
            raise ValueError(f"{export_dir}/config.json: sample_from_anchor {cfg.get('sample_from_anchor')} is not "
                             f"the {method} convention this loop drafts with")
        self.method, self.block_size = method, int(cfg["block_size"])
        self.layer_ids, self.mask = list(cfg["aux_hidden_state_layer_ids"]), int(cfg["mask_token_id"])
        config = SpeculatorModelConfig.from_pretrained(export_dir)
        config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
        model, info = SpeculatorModel.from_pretrained(export_dir, config=config, output_loading_info=True)
        bad = {k: sorted(map(str, v)) for k, v in info.items() if v}
        if bad:
            raise ValueError(f"{export_dir}: speculators' loading report is not clean: {bad}")
        if torch.isnan(model.lm_head.weight).any() or torch.isnan(model.embed_tokens.weight).any():
            model.load_verifier_weights()  # with output_loading_info the loader leaves this to the caller
        if torch.isnan(model.lm_head.weight).any() or torch.isnan(model.embed_tokens.weight).any():
            raise ValueError(f"{export_dir}: the verifier's embedding / lm_head were not loaded (NaN)")
        return model

    @torch.no_grad()
    def target_forward(self, ids):
        """(logits [S, V], captured features [S, K*H]) of one uncached forward over ids."""
        out = self.target(input_ids=torch.tensor([ids], device=self.device), use_cache=False,
                          output_hidden_states=True)
        feats = torch.cat([out.hidden_states[l + 1][0] for l in self.layer_ids], dim=-1)
        return out.logits[0], feats

    @torch.no_grad()
    def drafter_hidden(self, feats, start, anchor, rows):
        """speculators' drafter over the context features of positions 0..start-1 and the block
        [anchor, MASK x (rows - 1)] at positions start..start+rows-1: final-normed hidden [rows, H]."""
        m = self.model
        ctx = m.hidden_norm(m.fc(feats[:start].unsqueeze(0)))
        x = m.embed_tokens(torch.tensor([[anchor] + [self.mask] * (rows - 1)], device=self.device))
        pos = torch.arange(start + rows, device=self.device).unsqueeze(0)
        pe = m.rotary_emb(x, pos)
        for layer in m.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                      position_embeddings=pe, use_cache=False)
        return m.norm(x)[0]

    @torch.no_grad()
    def walk_dspark(self, h, anchor):
        head = self.model.markov_head
        unary = self.model.lm_head(h)
        prev, drafts = [anchor], []
        for k in range(h.shape[0]):
            s = unary[k]
            if head is not None and self.mutate != "no_markov":
                bias = head.block_bias(prev_token_ids=torch.tensor([prev], device=self.device),
                                       hidden_states=h[: k + 1].unsqueeze(0))
                s = s + bias[0, k].to(s.dtype)
            drafts.append(int(torch.argmax(s)))
            prev.append(drafts[-1])
        return drafts

    @torch.no_grad()
    def walk_dflash2(self, h, anchor):
        sel = self.model.candidate_selector
        unary = self.model.lm_head(h)
        pred, drafts = anchor, []
        for k in range(h.shape[0]):
            if self.mutate == "plain_argmax":
                drafts.append(int(torch.argmax(unary[k])))
            else:
                cand, scores = sel.select(unary[k : k + 1], h[k : k + 1], torch.tensor([pred], device=self.device))
                drafts.append(int(cand[0, torch.argmax(scores[0])]))
            pred = drafts[-1]
        return drafts

    def draft(self, seq, start, V):
        _, feats = self.target_forward(seq[: start + 1])
        if self.method == "dspark":
            return self.walk_dspark(self.drafter_hidden(feats, start, seq[start], V - 1), seq[start])
        return self.walk_dflash2(self.drafter_hidden(feats, start, seq[start], V)[1:], seq[start])

    def generate(self, prompt, max_new, B, stops):
        width = B + 1 if self.method == "dspark" else B
        seq = list(prompt)
        max_length = len(prompt) + max_new
        logits, _ = self.target_forward(seq)
        seq.append(int(torch.argmax(logits[-1])))
        start, done, acc, rounds = len(prompt), seq[-1] in stops, [], []
        while start + 1 < max_length and not done:
            V = min(width, max_length - start)
            drafts = self.draft(seq, start, V) if V > 1 else []
            rounds.append(drafts)
            logits, _ = self.target_forward(seq[: start + 1] + drafts)
            posterior = [int(t) for t in torch.argmax(logits[start:], dim=-1)]
            a = 0
            while a < len(drafts) and drafts[a] == posterior[a]:
                a += 1
            tokens = (drafts[:a] + [posterior[a]])[: max_length - start - 1]
            for i, t in enumerate(tokens):
                if t in stops:
                    tokens, done = tokens[: i + 1], True
                    break
            seq.extend(tokens)
            start += len(tokens)
            acc.append(len(tokens))
        return {"output_ids": seq[len(prompt): min(start + 1, max_length)], "acceptance_lengths": acc,
                "drafts": rounds}


def compare(ours, results):
    ok = len(ours) == len(results)
    if not ok:
        log(f"FAIL: ours has {len(ours)} results, the reference {len(results)}")
    for i, (o, r) in enumerate(zip(ours, results)):
        for key in ("output_ids", "acceptance_lengths", "drafts"):
            if key == "drafts" and key not in o:
                continue
            if list(o.get(key, [])) != r[key]:
                log(f"FAIL prompt {i} {key}: ours {o.get(key)} reference {r[key]}")
                ok = False
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="HF target folder")
    ap.add_argument("--drafter", required=True, help="our HF export of a dspark or dflash2 drafter")
    ap.add_argument("--input", required=True, help="JSONL, one {\"input_ids\": [...]} per line")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=None, help="B (default: the drafter's block_size)")
    ap.add_argument("--stop-token-ids", default=None, help="a,b")
    ap.add_argument("--compare", default=None, help="our results JSON ({\"results\": [...]})")
    ap.add_argument("--mutate", default="", choices=("", "no_markov", "plain_argmax"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--format", default="hf", choices=("hf", "speculators"),
                    help="--drafter is our HF export, or our `dflash export --format speculators` folder")
    ap.add_argument("--device", default="cpu", help="torch device of the target and the drafter (cpu, cuda)")
    args = ap.parse_args(argv)
    for p in (os.path.join(args.target, "config.json"), os.path.join(args.drafter, "config.json"), args.input):
        if not os.path.isfile(p):
            log(f"ERROR: {p} not found")
            return 2
    if args.max_new_tokens < 1 or (args.block_size is not None and args.block_size < 1):
        log("ERROR: --max-new-tokens and --block-size must be >= 1")
        return 2
    try:
        prompts = load_prompts(args.input)
        ours = None
        if args.compare:
            with open(args.compare) as f:
                ours = json.load(f)["results"]
    except (OSError, ValueError, KeyError) as e:
        log(f"ERROR: {e}")
        return 2
    if args.format == "speculators":  # before speculators is imported: its weight loading logs through loguru
        from check_speculators_export import provide_loguru
        provide_loguru()
    _, stubbed = import_speculators()
    log(f"speculators imported; stubbed training-stack modules: {stubbed}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = Reference(args.target, args.drafter, getattr(torch, args.dtype), args.mutate, args.format,
                            args.device)
        except ValueError as e:
            log(f"ERROR: {e}")
            return 2
        B = args.block_size or ref.block_size
        stops = {int(t) for t in args.stop_token_ids.split(",")} if args.stop_token_ids else set()
        results = [ref.generate(p, args.max_new_tokens, B, stops) for p in prompts]
    print(json.dumps({"results": results}))
    sys.stdout.flush()
    if ours is None:
        return 0
    ok = compare(ours, results)
    rounds = sum(len(r["acceptance_lengths"]) for r in results)
    tokens = sum(sum(r["acceptance_lengths"]) for r in results)
    log(f"{ref.method}{' (mutated: ' + args.mutate + ')' if args.mutate else ''}: {len(results)} prompts, "
        f"{rounds} rounds, mean acceptance {tokens / max(rounds, 1):.3f}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
